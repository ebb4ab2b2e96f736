// jllama's CPU matrix-vector products, called from the compiled JAX programs as XLA FFI custom
// calls (jllama/kernels/__init__.py builds this file and registers the handlers).
//
//   jllama_matvec_f32   y[i] = sum_j w[i, j] * x[j]                w: f32[m, n]
//   jllama_matvec_bf16  the same with w: bf16[m, n], each weight widened to f32 exactly
//   jllama_matvec_int8  y[i] = scale[i] * sum_j q[i, j] * x[j]     q: int8[m, n], scale: f32[m]
//   jllama_matvec_int8_groups  y[i] = sum_k scale[i, k] * sum_{j in group k} q[i, j] * x[j]
//                       scale: f32[m, G], groups of n / G weights (GGUF's Q8_0 / Q4_0: 32)
//
// Each also takes, as attributes and trailing arguments, the small work around a product in a
// llama layer, so that it is not a separate XLA program step:
//   prologue 1: x is rmsnorm(x) * weight first (weight: f32[n], eps), as llama2.c run.c
//   prologue 2: x is silu(x) * gate first (gate: f32[n]), SwiGLU's input to w2
//   residual 1: y[i] is add[i] + (the product's row i) (add: f32[m]), the residual stream
// In XLA each of these was two to four programs on a few hundred floats, ~1 us apiece: about
// a hundred a token for stories15M, more time than its attention.
//
// x: f32[n], y: f32[m]; rows are "out x in" as in llama2.c run.c's matmul. Sums are f32 in
// 64 interleaved partial sums per row (lane j sums the elements j, j + 64, j + 128, ..., the
// last partial block of a row included), then the lanes as a fixed tree (`finish`): a fixed
// order, so a product gives the same bits every call and on every thread count (one thread
// computes each row). 64 lanes are four AVX-512 registers: four independent multiply-add
// chains; a row's last partial block is read with masked loads, so rows whose length is not a
// multiple of 64 (stories15M's 288) have no scalar tail.

// Why our own kernel: XLA CPU (JAX 0.10) widens int8/bf16 weights at ~1.6 G elements/s per
// core inside its products, so narrow weights decoded slower than f32. These loops read int8
// and bf16 at about the bytes/s of f32, and f32 at least as fast as XLA's dot (memory-bound;
// bench/NOTES.md has the measurements).
//
// Threads: each thread (the caller and jllama's helper threads, one fewer than XLA's intra-op
// pool has threads; `Helpers`) owns a contiguous share of the rows, cut into blocks, and takes
// them from the front; a thread whose share is done takes blocks from the back of the others'.
// The caller owns the first share, helpers the others, so a helper idle between two products
// can warm its L2 with its share of the next one (`Helpers::warm`).
// The caller works too and waits only for blocks another thread has already taken, so a
// product never waits for a helper that has not started: two products running side by side
// cannot deadlock, and a product finishes even with no helper at all.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

#include "ggml_dot.h"
#include "ggml_x8.h"

namespace ffi = xla::ffi;

// Aliases: a comma inside a template argument would split the handler macros' arguments.
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Result = ffi::ResultBuffer<ffi::F32, 1>;
using F32MatrixResult = ffi::ResultBuffer<ffi::F32, 2>;
using F32Heads = ffi::Buffer<ffi::F32, 3>;  // [n_kv_heads, positions or kv_mul, head_dim]
using F32HeadsResult = ffi::ResultBuffer<ffi::F32, 3>;
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using F32Scalar = ffi::Buffer<ffi::F32, 0>;
using S32Result = ffi::ResultBuffer<ffi::S32, 0>;

namespace {

constexpr int kLanes = 64;
// Floats per vector register of this build's explicit loops (`jllama_vector_width`).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kVectorWidth = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kVectorWidth = 8;
#else
constexpr int kVectorWidth = 1;
#endif
// Below this many weights a product runs on the calling thread alone: scheduling a task costs
// a few microseconds, more than such a product takes.
constexpr int64_t kMinParallelWeights = 1 << 16;
// Rows are taken in blocks of about this many weights (32 KiB of f32). Each thread owns one
// contiguous share, as OpenMP's static schedule gives run.c, so its weights stream without a
// restart (more chunks per thread decoded stories15M slower: 800 / 780 / 752 / 631 tok/s for
// 1 / 2 / 4 / 16); the blocks only let a thread that finishes first take the last blocks of
// the other's share. In-process A/B against one share per thread (bench/NOTES.md): stories110M
// +1-4% in the machine's fast minutes, SmolLM2 +1%, stories15M even (blocks of 64 KiB and more
// cost it 2-20%).
constexpr int64_t kBlockWeights = 1 << 13;

// Halves 16 partial sums as a tree (k with k + 8, then + 4, + 2, + 1) into s[0].
inline float halve16(float* s) {
  for (int half = 8; half >= 1; half /= 2)
    for (int k = 0; k < half; ++k) s[k] += s[k + half];
  return s[0];
}

// The 64 lanes as a tree: lane k with k + 16, k + 32, k + 48 as (a + b) + (c + d), then the
// 16 partial sums halved: six additions deep, where a left-to-right sum would be 64 deep and
// cost more than a short row's loads.
inline float finish(const float* acc) {
  float s[16];
  for (int k = 0; k < 16; ++k) s[k] = (acc[k] + acc[k + 16]) + (acc[k + 32] + acc[k + 48]);
  return halve16(s);
}

// A float16 weight (GGUF's F16 tensors), stored as its bits.
struct Half {
  uint16_t bits;
};

// One weight as float32: exact for every stored type.
inline float widen(Half h) { return ggml::fp16(h.bits); }
inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t h) {  // bfloat16: the upper half of a float32
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JLLAMA_AVX512 1
// The weights w[j] for the set bits j of `keep` (16 consecutive weights when all are set) as
// one register of float32; the others are zero and are not read.
inline __m512 widen16(const float* w, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, w); }
inline __m512 widen16(const uint16_t* w, __mmask16 keep) {
  __m256i h = _mm256_maskz_loadu_epi16(keep, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* w, __mmask16 keep) {
  __m128i b = _mm_maskz_loadu_epi8(keep, w);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline __m512 widen16(const Half* w, __mmask16 keep) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, w));
}
template <typename T>
inline __m512 widen16(const T* w) { return widen16(w, static_cast<__mmask16>(0xFFFF)); }

// halve16 on one register: the same tree (k with k + 8, + 4, + 2, + 1) with shuffles, not
// sixteen stores and loads.
inline float halve16(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#endif

// exp(x) to about 1 ulp (x <= 88; below -104 it is 0): x = n ln2 + r with |r| <=
// ln2 / 2, exp(r) as its Taylor polynomial of degree 7 (error < 5e-9), times 2^n.
#if JLLAMA_AVX512
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below: exp underflows to 0 anyway
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // and the rest
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if !JLLAMA_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define JLLAMA_AVX2 1
// exp16's steps on 8 lanes (for the prefill attention's AVX2 loops): the same reduction and
// polynomial, 2^n built in the exponent bits. x is clamped at -87 so that 2^n stays a normal
// float (exp(-87) is 1.6e-38; the attention's weights that small add nothing to a sum of at
// least 1).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if JLLAMA_AVX2
// widen16's AVX2 counterparts: 8 consecutive weights as one register of float32.
inline __m256 widen8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 widen8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 widen8(const Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// halve16 of 16 lanes held as two registers (lanes 0-7, 8-15): the same tree.
inline float halve16(__m256 lo, __m256 hi) { return ggml::hsum8(_mm256_add_ps(lo, hi)); }
#endif

// sum_d a[d] * b[d] in 16 lanes then the tree of halve16 (a fixed order).
inline float dot_head(const float* a, const float* b, int64_t n) {
#if JLLAMA_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    __mmask16 keep = n - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - d)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, a + d), _mm512_maskz_loadu_ps(keep, b + d),
                          acc);
  }
  return halve16(acc);
#elif JLLAMA_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
  }
  if (d < n) {  // zero-padded: lanes past the end add 0 * 0
    float at[16] = {0}, bt[16] = {0};
    std::memcpy(at, a + d, sizeof(float) * (n - d));
    std::memcpy(bt, b + d, sizeof(float) * (n - d));
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(at), _mm256_loadu_ps(bt), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(at + 8), _mm256_loadu_ps(bt + 8), hi);
  }
  return halve16(lo, hi);
#else
  float acc[16] = {0};
  for (int64_t d = 0; d < n; ++d) acc[d % 16] += a[d] * b[d];
  return halve16(acc);
#endif
}

// How far ahead of its loads a streaming product asks for its weights, in bytes. Alternated in
// one process (bench/NOTES.md), 8 KiB against 2 KiB: stories110M f32 +9-11%, stories15M +20%,
// SmolLM2 +12%, stories110M int8 +4% in the machine's fast minutes (12, 16 and 32 KiB: less);
// in its slow minutes, memory-bound either way, the same.
constexpr int kStreamAhead = 8192;

// Whether streaming products ask for their weights ahead with non-temporal prefetches
// (`library.flags` sets it from the CPU's vendor, `$JLLAMA_PREFETCH` overrides): 1 on AMD, where
// L3 is a victim cache of L2 and streaming a product's weights that way ran 8-14% more bytes
// per second than plain loads (bench/NOTES.md: the lines are used once per token and do not
// go through L3 on their way out); 0 on Intel, where two threads read 26.6 GB/s with plain
// loads and 10.4 with these prefetches (bench/stream_read.cc on a 2-core Sapphire Rapids VM,
// 2 MiB pages, 2026-12-01): its own prefetchers do better there.
#ifndef JLLAMA_PREFETCH
#define JLLAMA_PREFETCH 1
#endif

// Asks for the `bytes` bytes `kStreamAhead` past p with the non-temporal hint (when
// JLLAMA_PREFETCH). A prefetch never faults, so reading past a matrix's end is harmless.
inline void prefetch_stream(const void* p, int64_t bytes) {
#if JLLAMA_PREFETCH && (defined(__x86_64__) || defined(_M_X64))
  const char* q = static_cast<const char*>(p) + kStreamAhead;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(q + b, _MM_HINT_NTA);
#else
  (void)p, (void)bytes;
#endif
}

template <typename T>
inline void stream_ahead(const T* w) { prefetch_stream(w, kLanes * sizeof(T)); }

// sum_j w[j] * x[j] in the 64-lane order above; T: float, uint16_t (bfloat16) or int8_t.
// Stream: prefetch the weights ahead (`stream_ahead`); the sum is the same either way.
template <typename T, bool Stream = false>
inline float dot(const T* w, const float* x, int64_t n) {
  int64_t i = 0;
#if JLLAMA_AVX512
  // Four 16-float registers are the 64 lanes.
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  for (; i + kLanes <= n; i += kLanes) {
    if (Stream) stream_ahead(w + i);
    a[0] = _mm512_fmadd_ps(widen16(w + i), _mm512_loadu_ps(x + i), a[0]);
    a[1] = _mm512_fmadd_ps(widen16(w + i + 16), _mm512_loadu_ps(x + i + 16), a[1]);
    a[2] = _mm512_fmadd_ps(widen16(w + i + 32), _mm512_loadu_ps(x + i + 32), a[2]);
    a[3] = _mm512_fmadd_ps(widen16(w + i + 48), _mm512_loadu_ps(x + i + 48), a[3]);
  }
  // The last partial block: lanes past the row's end add 0 * 0.
  for (int r = 0; i < n; ++r, i += 16) {
    __mmask16 keep = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    a[r] = _mm512_fmadd_ps(widen16(w + i, keep), _mm512_maskz_loadu_ps(keep, x + i), a[r]);
  }
  return halve16(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#elif JLLAMA_AVX2
  // Eight 8-float registers are the 64 lanes (a<r>: lanes 8r .. 8r + 7). Named, not an
  // array: with a[r] for a variable r in the row's last block the compiler kept the array in
  // memory, zeroed with `rep stos` and stored back every row (AVX2 stories15M spent a tenth of
  // its rows there).
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0;
#define JLLAMA_LANE(r, at) \
  a##r = _mm256_fmadd_ps(widen8(w + (at) + 8 * r), _mm256_loadu_ps(x + (at) + 8 * r), a##r)
  for (; i + kLanes <= n; i += kLanes) {
    if (Stream) stream_ahead(w + i);
    JLLAMA_LANE(0, i); JLLAMA_LANE(1, i); JLLAMA_LANE(2, i); JLLAMA_LANE(3, i);
    JLLAMA_LANE(4, i); JLLAMA_LANE(5, i); JLLAMA_LANE(6, i); JLLAMA_LANE(7, i);
  }
  // The last partial block: whole registers as they come (a switch that falls through), then
  // the last < 8 weights zero-padded (lanes past the row's end add 0 * 0). (Padding the whole
  // block through a buffer cost stories15M's 288-long rows two thirds of their speed.)
  const int64_t whole = (n - i) / 8;
  switch (whole) {
    case 7: JLLAMA_LANE(6, i); [[fallthrough]];
    case 6: JLLAMA_LANE(5, i); [[fallthrough]];
    case 5: JLLAMA_LANE(4, i); [[fallthrough]];
    case 4: JLLAMA_LANE(3, i); [[fallthrough]];
    case 3: JLLAMA_LANE(2, i); [[fallthrough]];
    case 2: JLLAMA_LANE(1, i); [[fallthrough]];
    case 1: JLLAMA_LANE(0, i); [[fallthrough]];
    default: break;
  }
#undef JLLAMA_LANE
  i += 8 * whole;
  if (i < n) {
    T wt[8] = {};
    float xt[8] = {};
    std::memcpy(wt, w + i, sizeof(T) * (n - i));
    std::memcpy(xt, x + i, sizeof(float) * (n - i));
    const __m256 wv = widen8(wt), xv = _mm256_loadu_ps(xt);
#define JLLAMA_LAST(r) a##r = _mm256_fmadd_ps(wv, xv, a##r); break
    switch (whole) {  // lanes 8 * whole ..: register a<whole>
      case 0: JLLAMA_LAST(0);
      case 1: JLLAMA_LAST(1);
      case 2: JLLAMA_LAST(2);
      case 3: JLLAMA_LAST(3);
      case 4: JLLAMA_LAST(4);
      case 5: JLLAMA_LAST(5);
      case 6: JLLAMA_LAST(6);
      default: JLLAMA_LAST(7);
    }
#undef JLLAMA_LAST
  }
  // finish's tree: lane k with k + 16, k + 32, k + 48 as (a + b) + (c + d), then halve16.
  return halve16(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a4, a6)),
                 _mm256_add_ps(_mm256_add_ps(a1, a3), _mm256_add_ps(a5, a7)));
#else
  float acc[kLanes] = {0};
  for (; i + kLanes <= n; i += kLanes) {
    if (Stream) stream_ahead(w + i);
    for (int j = 0; j < kLanes; ++j) acc[j] += widen(w[i + j]) * x[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += widen(w[i + j]) * x[i + j];
  return finish(acc);
#endif
}

// The rows [begin, end) of one product. A std::function would allocate per call; a plain
// struct with a function pointer keeps the shared state in one allocation.
struct Product {
  void (*rows)(const Product&, int64_t begin, int64_t end);
  const void* w;
  const float* scale;
  const float* x;
  float* y;
  int64_t n;
  int64_t groups;  // scales per row, for rows_int8_groups
  bool stream;     // prefetch the weights ahead (`stream_ahead`): set by `run` for big products
  // Where the weights lie, for a helper to warm its L2 with before the product comes
  // (`Helpers::warm`): rows [first, first + rows) of the product at data + (r - first) *
  // row_bytes, up to kMaxSpans matrices (a GGML product's parts); work comes in units of
  // `unit` rows. No spans: nothing to warm.
  struct Span {
    const char* data;
    int64_t first, rows, row_bytes;
  };
  static constexpr int kMaxSpans = 4;
  Span spans[kMaxSpans] = {};
  int n_spans = 0;
  int64_t unit = 1;

  void weights(const void* data, int64_t m, int64_t row_bytes) {
    spans[0] = Span{static_cast<const char*>(data), 0, m, row_bytes};
    n_spans = 1;
  }
};

template <typename T>
void rows(const Product& p, int64_t begin, int64_t end) {
  const T* w = static_cast<const T*>(p.w);
  int64_t r = begin;
  if (p.stream)
    for (; r < end; ++r) p.y[r] = dot<T, true>(w + r * p.n, p.x, p.n);
  else
    for (; r < end; ++r) p.y[r] = dot<T, false>(w + r * p.n, p.x, p.n);
}

// Groups: each group's 16 lanes summed from zero, then multiplied by the group's scale into 16
// running lanes, then those halved as a tree (8, 4, 2, 1). A fixed order, as above.
template <bool Stream>
inline float dot_int8_groups(const int8_t* q, const float* scale, const float* x, int64_t n,
                             int64_t size) {
  float acc[16] = {0};
  int64_t k = 0;
#if JLLAMA_AVX512
  if (size % 16 == 0) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t g = 0; g < n; g += size, ++k) {
      if (Stream && (g & (kLanes - 1)) == 0) stream_ahead(q + g);
      __m512 part = _mm512_setzero_ps();
      for (int64_t i = g; i < g + size; i += 16)
        part = _mm512_fmadd_ps(widen16(q + i), _mm512_loadu_ps(x + i), part);
      a = _mm512_fmadd_ps(part, _mm512_set1_ps(scale[k]), a);
    }
    return halve16(a);
  }
#elif JLLAMA_AVX2
  if (size % 16 == 0) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t g = 0; g < n; g += size, ++k) {
      if (Stream && (g & (kLanes - 1)) == 0) stream_ahead(q + g);
      __m256 part_lo = _mm256_setzero_ps(), part_hi = _mm256_setzero_ps();
      for (int64_t i = g; i < g + size; i += 16) {
        part_lo = _mm256_fmadd_ps(widen8(q + i), _mm256_loadu_ps(x + i), part_lo);
        part_hi = _mm256_fmadd_ps(widen8(q + i + 8), _mm256_loadu_ps(x + i + 8), part_hi);
      }
      const __m256 s = _mm256_set1_ps(scale[k]);
      lo = _mm256_fmadd_ps(part_lo, s, lo);
      hi = _mm256_fmadd_ps(part_hi, s, hi);
    }
    return halve16(lo, hi);
  }
#endif
  for (int64_t g = k * size; g < n; g += size, ++k) {
    float part[16] = {0};
    for (int64_t i = g; i < g + size; ++i) part[(i - g) % 16] += widen(q[i]) * x[i];
    for (int j = 0; j < 16; ++j) acc[j] += part[j] * scale[k];
  }
  return halve16(acc);
}

void rows_int8_groups(const Product& p, int64_t begin, int64_t end) {
  const int8_t* q = static_cast<const int8_t*>(p.w);
  const int64_t groups = p.groups, size = p.n / groups;
  if (p.stream)
    for (int64_t r = begin; r < end; ++r)
      p.y[r] = dot_int8_groups<true>(q + r * p.n, p.scale + r * groups, p.x, p.n, size);
  else
    for (int64_t r = begin; r < end; ++r)
      p.y[r] = dot_int8_groups<false>(q + r * p.n, p.scale + r * groups, p.x, p.n, size);
}

void rows_int8(const Product& p, int64_t begin, int64_t end) {
  const int8_t* q = static_cast<const int8_t*>(p.w);
  if (p.stream)
    for (int64_t r = begin; r < end; ++r) p.y[r] = dot<int8_t, true>(q + r * p.n, p.x, p.n) * p.scale[r];
  else
    for (int64_t r = begin; r < end; ++r) p.y[r] = dot<int8_t, false>(q + r * p.n, p.x, p.n) * p.scale[r];
}
// Shared between the caller and the helpers; a helper may start after the product is done,
// so the state lives as long as its last holder.
struct Work {
  // One thread's share of the blocks: [front, end) packed as end << 32 | front, so its owner
  // (from the front) and the others (from the back) take blocks with one compare-exchange.
  // A cache line each: the owners' updates must not contend.
  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };

  Product product;
  int64_t m = 0, block = 1, shares = 0;
  std::unique_ptr<Share[]> share;
  std::atomic<int64_t> arrived{1};  // which share the next helper to arrive owns
  std::atomic<int64_t> rows_done{0};

  Work(const Product& p, int64_t rows, int64_t threads) : product(p), m(rows) {
    block = block_rows(p.n);
    const int64_t blocks = (m + block - 1) / block;
    shares = std::min(threads, blocks);
    share.reset(new Share[shares]);
    for (int64_t i = 0; i < shares; ++i) {
      const uint64_t front = first_block(blocks, shares, i);
      const uint64_t end = first_block(blocks, shares, i + 1);
      share[i].range.store(end << 32 | front, std::memory_order_relaxed);
    }
  }

  // Share i of `shares` begins at this block (share `shares` "begins" at the end).
  static int64_t first_block(int64_t blocks, int64_t shares, int64_t i) {
    return blocks * i / shares;
  }

  static int64_t block_rows(int64_t n) {
    return std::max<int64_t>(1, kBlockWeights / std::max<int64_t>(1, n));
  }

  // The rows [*begin, *end) of share `id` when m rows of n go to `threads` threads.
  static void share_rows(int64_t m, int64_t n, int64_t threads, int64_t id, int64_t* begin,
                         int64_t* end) {
    const int64_t block = block_rows(n), blocks = (m + block - 1) / block;
    const int64_t shares = std::min(threads, blocks);
    *begin = *end = 0;
    if (id >= shares) return;
    *begin = first_block(blocks, shares, id) * block;
    *end = std::min(m, first_block(blocks, shares, id + 1) * block);
  }

  static int64_t take(std::atomic<uint64_t>& range, bool from_front) {
    uint64_t v = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v & 0xFFFFFFFFu, end = v >> 32;
      if (front >= end) return -1;
      const uint64_t next = from_front ? v + 1 : (end - 1) << 32 | front;
      if (range.compare_exchange_weak(v, next, std::memory_order_relaxed))
        return static_cast<int64_t>(from_front ? front : end - 1);
    }
  }

  int64_t run_block(int64_t b) {
    const int64_t begin = b * block, end = std::min(m, begin + block);
    product.rows(product, begin, end);
    return end - begin;
  }

  // Runs the blocks of share `id` (the caller's is 0; helpers take 1, 2, ... as they arrive,
  // so a helper's share is the one it warmed), then whatever is left of the others'.
  void help(int64_t id) {
    int64_t rows = 0;
    if (id < shares)
      for (int64_t b; (b = take(share[id].range, true)) >= 0;) rows += run_block(b);
    for (int64_t k = 1; k <= shares; ++k)
      for (int64_t b; (b = take(share[(id + k) % shares].range, false)) >= 0;)
        rows += run_block(b);
    // Once per thread, not per block: a first version that updated a shared counter every
    // block (and kept the shares on one cache line) decoded 7% slower.
    if (rows > 0) rows_done.fetch_add(rows, std::memory_order_release);
  }

  bool finished() const { return rows_done.load(std::memory_order_acquire) >= m; }
};

// A lock for a few instructions' worth of shared state: it spins, never sleeps.
class SpinLock {
 public:
  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      }
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// jllama's own helper threads for the products, one fewer than XLA's intra-op pool has (the
// caller is the other). Between products they spin on a counter for a few milliseconds, then
// sleep. Why not XLA's pool: its tasks woke a second, idle pool thread about twice a token,
// which spun while the caller and the task's thread worked, so three threads shared two cores
// and the caller lost its core in the middle of its rows (~2 involuntary context switches a
// token, stalls of tens of microseconds; bench/NOTES.md). A decode keeps exactly as many
// threads busy as there are cores, as OpenMP does for run.c.
//
// A helper may take an offered product late or never; `Work::help` lets whoever comes take
// what is left, and a caller only waits for blocks already taken, so a product finishes even
// with no helper at all (e.g. in a child process after fork).
class Helpers {
 public:
  // The helpers for `threads` threads in all, started on first use; leaked on purpose, as
  // threads that live until the process exits.
  static Helpers& get(int64_t threads) {
    static Helpers* helpers = new Helpers(threads - 1);
    return *helpers;
  }

  // Makes `work` the product helpers pick up next, waking any that sleep.
  void offer(const std::shared_ptr<Work>& work) {
    {
      std::lock_guard<SpinLock> lock(mutex_);
      offered_ = work;
    }
    generation_.fetch_add(1);  // sequentially consistent with `sleeping_` below
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
  }

  // Drops the offer of a finished product (so it does not outlive its caller's wait).
  void withdraw(const Work* work) {
    std::lock_guard<SpinLock> lock(mutex_);
    if (offered_.get() == work) offered_.reset();
  }

  // Whether the next product should run on its caller alone: for kSoloProducts products after
  // two products within kStallWindow of each other whose callers waited kStall or more for a
  // helper's last block. A helper that keeps its caller waiting that long has lost its core to
  // another process (a block is ~1 us of work), and sharing work with it then costs more than
  // it gives: with another program busy on one of two cores, stories110M decoded at 64-67
  // tok/s split, 77 with this (XLA's own products 80-86). One stall alone does not count: on
  // a quiet machine they come a few times a second (~1 in 3000 products), and reacting to
  // each cost 4-10% (bench/NOTES.md).
  bool solo() {
    products_.fetch_add(1, std::memory_order_relaxed);
    int64_t left = solo_left_.load(std::memory_order_relaxed);
    while (left > 0 && !solo_left_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
    }
    return left > 0;
  }

  void waited(std::chrono::steady_clock::duration wait) {
    if (wait < kStall) return;
    const int64_t now = products_.load(std::memory_order_relaxed);
    if (now - last_stall_.exchange(now, std::memory_order_relaxed) <= kStallWindow)
      solo_left_.store(kSoloProducts, std::memory_order_relaxed);
  }

 private:
  explicit Helpers(int64_t count) {
    // A thread that cannot be started leaves fewer helpers: the callers do their rows alone.
    for (int64_t i = 0; i < count; ++i) {
      try {
        std::thread([this] { serve(); }).detach();
      } catch (const std::system_error&) {
        break;
      }
    }
  }

  void serve() {
    uint64_t seen = generation_.load();
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kSpinMs);
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      std::shared_ptr<Work> work;
      {
        std::lock_guard<SpinLock> lock(mutex_);
        work = offered_;
      }
      if (work) {
        const int64_t id = work->arrived.fetch_add(1, std::memory_order_relaxed);
        work->help(id);
        warm(id, seen);
      }
    }
  }

  // Products come in the same order every token, so the product that followed this one last
  // time comes next: while the caller runs what lies between (attention, norms, XLA's own
  // steps), the helper that will own share `id` of it asks its L2 for that share's first
  // kWarmBytes (a core's L2 holds 1-2 MB), stopping as soon as another
  // product is offered. The arithmetic is untouched; only where the weights come from.
  void warm(int64_t id, uint64_t seen) {
#if defined(__x86_64__) || defined(_M_X64)
    Next next;
    {
      // After the last product recorded, not after the work just done: attention's work
      // between two products has no weights to warm.
      std::lock_guard<SpinLock> lock(mutex_);
      if (last_ == nullptr) return;
      const Next& slot = next_[slot_of(last_)];
      if (slot.after != last_) return;
      next = slot;
    }
    int64_t begin, end;  // in units of work, then in rows
    Work::share_rows(next.m, next.n, next.threads, id, &begin, &end);
    begin *= next.unit, end *= next.unit;
    int64_t left = kWarmBytes;
    for (int k = 0; k < next.n_spans && left > 0; ++k) {
      const Product::Span& span = next.spans[k];
      const int64_t from = std::max(begin, span.first), to = std::min(end, span.first + span.rows);
      if (from >= to) continue;
      const char* p = span.data + (from - span.first) * span.row_bytes;
      const int64_t bytes = std::min<int64_t>((to - from) * span.row_bytes, left);
      for (int64_t b = 0; b < bytes; b += 64) {
        if ((b & 4095) == 0 && generation_.load(std::memory_order_relaxed) != seen) return;
        _mm_prefetch(p + b, _MM_HINT_T1);
      }
      left -= bytes;
    }
#else
    (void)id, (void)seen;
#endif
  }

 public:
  // Notes that `p` (m rows, `threads` threads) followed the previous product run through the
  // helpers, for `warm`.
  void record(const Product& p, int64_t m, int64_t threads) {
    if (p.n_spans == 0) return;
    const char* key = p.spans[0].data;
    std::lock_guard<SpinLock> lock(mutex_);
    if (last_ != nullptr) {
      Next& next = next_[slot_of(last_)];
      next.after = last_;
      std::copy(p.spans, p.spans + p.n_spans, next.spans);
      next.n_spans = p.n_spans;
      next.unit = p.unit, next.m = m, next.n = p.n, next.threads = threads;
    }
    last_ = key;
  }

 private:
  struct Next {
    const char* after = nullptr;  // the first weights of the product this one followed
    Product::Span spans[Product::kMaxSpans] = {};
    int n_spans = 0;
    int64_t unit = 1, m = 0, n = 0, threads = 0;  // m in units
  };
  static size_t slot_of(const char* data) {
    return (reinterpret_cast<uintptr_t>(data) >> 6) % kNextSlots;
  }
  // Half a MiB: stories15M decoded 3% faster (1440 -> 1400 us a token, five alternated pairs
  // on the Intel VM, bench/NOTES.md); 1 MiB no better, stories110M even.
  static constexpr int64_t kWarmBytes = 1 << 19;
  static constexpr size_t kNextSlots = 509;  // a prime: products of many models and layers
  Next next_[kNextSlots];
  const char* last_ = nullptr;

  static constexpr int kSpinMs = 5;
  static constexpr std::chrono::microseconds kStall{1000};
  static constexpr int64_t kSoloProducts = 512;
  static constexpr int64_t kStallWindow = 64;  // products
  std::atomic<int64_t> solo_left_{0};
  std::atomic<int64_t> products_{0};  // products offered so far, for kStallWindow
  std::atomic<int64_t> last_stall_{-kStallWindow - 1};
  // The offer and the order of products, held for a few loads and stores: a spin lock, since a
  // std::mutex that a helper and the caller both took every product put one of them to sleep in
  // the kernel now and then (futex waits; a 288 x 288 product took 8 us where its rows take 5).
  SpinLock mutex_;
  std::mutex sleep_mutex_;  // for helpers that sleep after kSpinMs without work
  std::condition_variable wake_;
  std::shared_ptr<Work> offered_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
};

// Waits until done() holds: spins briefly (the work waited for finishes within microseconds),
// then yields, since on fewer cores than threads the thread we wait for may need this core.
template <typename Done>
void wait_for(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

void run(ffi::ThreadPool& pool, const Product& product, int64_t m) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || m * product.n < kMinParallelWeights || m < 2) {
    product.rows(product, 0, m);
    return;
  }
  Product streaming = product;
  // Products this big stream their weights from memory (a small model's whole set of weights
  // fits in L2 and never gets here).
  streaming.stream = true;
  Helpers& helpers = Helpers::get(threads);
  helpers.record(product, m, threads);
  if (helpers.solo()) {
    streaming.rows(streaming, 0, m);
    return;
  }
  auto work = std::make_shared<Work>(streaming, m, threads);
  helpers.offer(work);
  work->help(0);
  const auto own_rows_done = std::chrono::steady_clock::now();
  // Every block is taken by now; wait for the ones a helper is still running.
  wait_for([&] { return work->finished(); });
  helpers.withdraw(work.get());
  helpers.waited(std::chrono::steady_clock::now() - own_rows_done);
}

// RMSNorm as llama2.c run.c: out = weight * (x / sqrt(mean(x^2) + eps)), the sum of squares in
// dot_head's fixed order.
void rmsnorm(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot_head(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// SwiGLU's input to w2 (Shazeer 2020, as run.c): out = silu(a) * gate, silu(a) = a / (1 +
// exp(-a)).
void swiglu(const float* a, const float* gate, int64_t n, float* out) {
  int64_t i = 0;
#if JLLAMA_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(a + i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(out + i,
                     _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_loadu_ps(gate + i)));
  }
#elif JLLAMA_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(a + i);
    // exp8 takes x <= 88 (its 2^n is built in the exponent bits); exp(88) already makes
    // silu(v) = v / (1 + e) a zero of float32 for these v.
    __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), v), _mm256_set1_ps(88.0f)));
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(gate + i)));
  }
#endif
  for (; i < n; ++i) out[i] = a[i] / (1.0f + std::exp(-a[i])) * gate[i];
}

enum Prologue : int32_t { kPlain = 0, kRmsNorm = 1, kSwiGlu = 2 };

ffi::Error check(int64_t m, int64_t n, const ffi::AnyBuffer::Dimensions& x,
                 const ffi::AnyBuffer::Dimensions& y) {
  if (x.size() != 1 || x[0] != n || y.size() != 1 || y[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec: w[m, n], x[n] and y[m] do not agree");
  return ffi::Error::Success();
}

// *out = the vector extra[k], which must be f32[length].
ffi::Error extra_vector(ffi::RemainingArgs& extra, size_t k, int64_t length, const float** out) {
  auto v = extra.get<F32Vector>(k);
  if (v.has_error()) return v.error();
  if (v->dimensions()[0] != length)
    return ffi::Error::InvalidArgument("jllama matvec: a prologue or residual vector's length");
  *out = v->typed_data();
  return ffi::Error::Success();
}

// The input of a product, x: f32[n] after the prologue (in `prepared` when there is one), and
// the residual's vector (f32[m], or null), from extra[first], extra[first + 1] as the
// attributes say.
ffi::Error inputs(int64_t m, int64_t n, F32Vector& x, ffi::RemainingArgs& extra, size_t first,
                  int32_t prologue, float eps, int32_t residual,
                  std::unique_ptr<float[]>& prepared, const float** in, const float** add) {
  if (prologue < kPlain || prologue > kSwiGlu)
    return ffi::Error::InvalidArgument("jllama matvec: unknown prologue");
  if (extra.size() != first + static_cast<size_t>((prologue != kPlain) + (residual != 0)))
    return ffi::Error::InvalidArgument("jllama matvec: the extra vectors do not match the attributes");
  *in = x.typed_data();
  if (prologue != kPlain) {
    const float* aux;
    if (ffi::Error e = extra_vector(extra, first, n, &aux); e.failure()) return e;
    prepared.reset(new float[n]);
    if (prologue == kRmsNorm) rmsnorm(*in, aux, eps, n, prepared.get());
    else swiglu(*in, aux, n, prepared.get());
    *in = prepared.get();
  }
  *add = nullptr;
  if (residual != 0)
    if (ffi::Error e = extra_vector(extra, extra.size() - 1, m, add); e.failure()) return e;
  return ffi::Error::Success();
}

// Product p (its weights set) on x after the prologue, plus the residual: the common body of
// the matvec handlers. extra: the prologue's vector (f32[n]) if any, then the residual's
// (f32[m]) if any.
ffi::Error product(ffi::ThreadPool& pool, Product p, int64_t m, F32Vector& x,
                   ffi::RemainingArgs& extra, F32Result& y, int32_t prologue, float eps,
                   int32_t residual) {
  if (ffi::Error e = check(m, p.n, x.dimensions(), y->dimensions()); e.failure()) return e;
  std::unique_ptr<float[]> prepared;
  const float* add;
  if (ffi::Error e = inputs(m, p.n, x, extra, 0, prologue, eps, residual, prepared, &p.x, &add);
      e.failure())
    return e;
  p.y = y->typed_data();
  run(pool, p, m);
  if (add != nullptr)
    for (int64_t i = 0; i < m; ++i) p.y[i] = add[i] + p.y[i];
  return ffi::Error::Success();
}

ffi::Error MatvecF32(ffi::ThreadPool pool, F32Matrix w, F32Vector x, ffi::RemainingArgs extra,
                     F32Result y, int32_t prologue, float eps, int32_t residual) {
  const int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  Product p{rows<float>, w.typed_data(), nullptr, nullptr, nullptr, n};
  p.weights(w.untyped_data(), m, n * 4);
  return product(pool, p, m, x, extra, y, prologue, eps, residual);
}

ffi::Error MatvecBf16(ffi::ThreadPool pool, Bf16Matrix w, F32Vector x, ffi::RemainingArgs extra,
                      F32Result y, int32_t prologue, float eps, int32_t residual) {
  const int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  Product p{rows<uint16_t>, w.untyped_data(), nullptr, nullptr, nullptr, n};
  p.weights(w.untyped_data(), m, n * 2);
  return product(pool, p, m, x, extra, y, prologue, eps, residual);
}

ffi::Error MatvecInt8(ffi::ThreadPool pool, Int8Matrix q, F32Vector scale, F32Vector x,
                      ffi::RemainingArgs extra, F32Result y, int32_t prologue, float eps,
                      int32_t residual) {
  const int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  if (scale.dimensions().size() != 1 || scale.dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec_int8: scale must be f32[m]");
  Product p{rows_int8, q.typed_data(), scale.typed_data(), nullptr, nullptr, n};
  p.weights(q.untyped_data(), m, n);
  return product(pool, p, m, x, extra, y, prologue, eps, residual);
}

ffi::Error MatvecInt8Groups(ffi::ThreadPool pool, Int8Matrix q, F32Matrix scale, F32Vector x,
                            ffi::RemainingArgs extra, F32Result y, int32_t prologue, float eps,
                            int32_t residual) {
  const int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  const int64_t groups = scale.dimensions()[1];
  if (scale.dimensions()[0] != m || groups < 1 || n % groups != 0)
    return ffi::Error::InvalidArgument(
        "jllama matvec_int8_groups: scale must be f32[m, G] with G dividing n");
  return product(pool, Product{rows_int8_groups, q.typed_data(), scale.typed_data(), nullptr,
                               nullptr, n, groups}, m, x, extra, y, prologue, eps, residual);
}


// ---------------------------------------------------------------------------------------------
// Products of GGML-typed weights as stored in a GGUF file (`jllama_matvec_ggml`): the weights
// are up to kMaxParts matrices of any types in `ggml::layout`, stacked along their rows (a
// layer's wq, wk and wv may each have another type: Q4_K_M files hold Q5_0, Q8_0, Q4_K and Q6_K
// side by side). Rows of float types (F32, F16, BF16) are `dot`'s 64-lane sums over x; the
// integer types' are `ggml::row_dot` over x quantized once per call (ggml_dot.h).

constexpr int kMaxParts = 4;
static_assert(kMaxParts <= Product::kMaxSpans, "a GGML product's parts are its spans");

struct GgmlPart {
  const uint8_t* data;  // u8[rows, row_bytes]
  int64_t first, rows, row_bytes;
  int32_t type;
};

struct GgmlProduct {
  GgmlPart parts[kMaxParts];
  int n_parts;
  int64_t unit;  // rows per unit of work: 8 when a part is in an x8 layout (a group), else 1
  int64_t n;
  const float* x;  // f32[n], after the prologue
  // x quantized as llama.cpp quantizes it for each part's type (`ggml::activation_kind`), the
  // kinds some part needs.
  ggml::Activations qx[ggml::kActivationKinds];
  float* y;
};

template <int32_t T, bool Stream>
void ggml_rows(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = rows + r * part.row_bytes;
    if constexpr (T == ggml::F32) {
      g.y[r] = dot<float, Stream>(reinterpret_cast<const float*>(row), g.x, g.n);
    } else if constexpr (T == ggml::F16) {
      g.y[r] = dot<Half, Stream>(reinterpret_cast<const Half*>(row), g.x, g.n);
    } else if constexpr (T == ggml::BF16) {
      g.y[r] = dot<uint16_t, Stream>(reinterpret_cast<const uint16_t*>(row), g.x, g.n);
    } else {
      if (Stream) prefetch_stream(row, part.row_bytes);
      g.y[r] = ggml::row_dot<T>(row, g.qx[ggml::activation_kind(T)]);
    }
  }
}

// Groups of 8 rows in an x8 layout: rows [begin, end), both multiples of 8.
template <int32_t T, bool Stream>
void ggml_groups(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
#if JLLAMA_Q_AVX2
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  const int64_t group_bytes = 8 * part.row_bytes;
  for (int64_t r = begin; r < end; r += 8) {
    const uint8_t* group = rows + r * part.row_bytes;
    if (Stream) prefetch_stream(group, group_bytes);
    ggml::x8_dot<T>(group, g.qx[ggml::activation_kind(T)], g.y + r);
  }
#endif
}

template <bool Stream>
void ggml_part_rows(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
  constexpr int32_t X = ggml::kX8;
  switch (part.type) {
    case X + ggml::Q8_0: return ggml_groups<ggml::Q8_0, Stream>(g, part, begin, end);
    case X + ggml::Q4_0: return ggml_groups<ggml::Q4_0, Stream>(g, part, begin, end);
    case X + ggml::Q4_1: return ggml_groups<ggml::Q4_1, Stream>(g, part, begin, end);
    case X + ggml::Q5_0: return ggml_groups<ggml::Q5_0, Stream>(g, part, begin, end);
    case X + ggml::Q5_1: return ggml_groups<ggml::Q5_1, Stream>(g, part, begin, end);
    case X + ggml::Q4_K: return ggml_groups<ggml::Q4_K, Stream>(g, part, begin, end);
    case X + ggml::Q5_K: return ggml_groups<ggml::Q5_K, Stream>(g, part, begin, end);
    case X + ggml::Q6_K: return ggml_groups<ggml::Q6_K, Stream>(g, part, begin, end);
    case ggml::F32: return ggml_rows<ggml::F32, Stream>(g, part, begin, end);
    case ggml::F16: return ggml_rows<ggml::F16, Stream>(g, part, begin, end);
    case ggml::BF16: return ggml_rows<ggml::BF16, Stream>(g, part, begin, end);
    case ggml::Q8_0: return ggml_rows<ggml::Q8_0, Stream>(g, part, begin, end);
    case ggml::Q4_0: return ggml_rows<ggml::Q4_0, Stream>(g, part, begin, end);
    case ggml::Q4_1: return ggml_rows<ggml::Q4_1, Stream>(g, part, begin, end);
    case ggml::Q5_0: return ggml_rows<ggml::Q5_0, Stream>(g, part, begin, end);
    case ggml::Q5_1: return ggml_rows<ggml::Q5_1, Stream>(g, part, begin, end);
    case ggml::Q2_K: return ggml_rows<ggml::Q2_K, Stream>(g, part, begin, end);
    case ggml::Q3_K: return ggml_rows<ggml::Q3_K, Stream>(g, part, begin, end);
    case ggml::Q4_K: return ggml_rows<ggml::Q4_K, Stream>(g, part, begin, end);
    case ggml::Q5_K: return ggml_rows<ggml::Q5_K, Stream>(g, part, begin, end);
    case ggml::Q6_K: return ggml_rows<ggml::Q6_K, Stream>(g, part, begin, end);
    default: return;  // refused by the handler before any row runs
  }
}

void rows_ggml(const Product& p, int64_t begin, int64_t end) {
  const GgmlProduct& g = *static_cast<const GgmlProduct*>(p.w);
  begin *= g.unit, end *= g.unit;
  for (int k = 0; k < g.n_parts; ++k) {
    const GgmlPart& part = g.parts[k];
    const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
    if (lo < hi) {
      if (p.stream) ggml_part_rows<true>(g, part, lo, hi);
      else ggml_part_rows<false>(g, part, lo, hi);
    }
  }
}

using U8Matrix = ffi::Buffer<ffi::U8, 2>;

// Checks the parts (args[0 .. types.size() - 1], u8[rows, row_bytes] each) against x's length n
// and fills g.parts and g.unit (8 rows when a part is in an x8 layout: then every part's rows
// must be a multiple of 8); *m gets the rows in all, *bytes the weights' bytes.
ffi::Error ggml_parts(ffi::RemainingArgs& args, ffi::Span<const int32_t> types, int64_t n,
                      GgmlProduct& g, int64_t* m, int64_t* bytes, bool* integer) {
  const int64_t n_parts = static_cast<int64_t>(types.size());
  if (n_parts < 1 || n_parts > kMaxParts || args.size() < static_cast<size_t>(n_parts))
    return ffi::Error::InvalidArgument("jllama matvec_ggml: 1 to 4 weight parts");
  *m = 0, *bytes = 0, *integer = false;
  for (int64_t k = 0; k < n_parts; ++k) {
    // A part is its bytes, u8[rows, row_bytes]; an F32 or BF16 part may come as the typed
    // matrix itself, f32/bf16[rows, n] (`jllama.ggml_matrix.FloatRows`: no byte view to make).
    auto w = args.get<ffi::AnyBuffer>(k);
    if (w.has_error()) return w.error();
    const ggml::Layout layout = ggml::layout(types[k]);
    if (layout.elements == 0 || n % layout.elements != 0)
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: a part's type is unknown or its blocks do not divide x's length");
    const int64_t row_bytes = n / layout.elements * layout.bytes;
    const auto dims = w->dimensions();
    const ffi::DataType dtype = w->element_type();
    const bool typed = (dtype == ffi::DataType::F32 && types[k] == ggml::F32) ||
                       (dtype == ffi::DataType::BF16 && types[k] == ggml::BF16);
    if (dims.size() != 2 || (dtype != ffi::DataType::U8 && !typed))
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: a part must be u8[rows, row_bytes] (or f32/bf16[rows, n] for F32/BF16)");
    const int64_t rows = dims[0];
    if (dims[1] != (typed ? n : row_bytes))
      return ffi::Error::InvalidArgument("jllama matvec_ggml: a part's rows are not x's length");
    if (ggml::x8_type(types[k]) && (rows % 8 != 0 || *m % 8 != 0 || kVectorWidth < 8))
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: an x8 part needs rows a multiple of 8 and an AVX2 build");
    g.parts[k] = GgmlPart{static_cast<const uint8_t*>(w->untyped_data()), *m, rows, row_bytes,
                          types[k]};
    *m += rows;
    *bytes += rows * row_bytes;
    *integer = *integer || ggml::integer_type(types[k]);
  }
  g.n_parts = static_cast<int>(n_parts);
  g.unit = 1;
  for (int k = 0; k < g.n_parts; ++k)
    if (ggml::x8_type(g.parts[k].type)) g.unit = 8;
  if (g.unit == 8)
    for (int k = 0; k < g.n_parts; ++k)
      if (g.parts[k].rows % 8 != 0)
        return ffi::Error::InvalidArgument(
            "jllama ggml product: with an x8 part, every part's rows must be a multiple of 8");
  return ffi::Error::Success();
}

ffi::Error MatvecGgml(ffi::ThreadPool pool, F32Vector x, ffi::RemainingArgs args, F32Result y,
                      ffi::Span<const int32_t> types, int32_t prologue, float eps,
                      int32_t residual) {
  const int64_t n = x.dimensions()[0];
  GgmlProduct g{};
  int64_t m, bytes;
  bool integer;
  if (ffi::Error e = ggml_parts(args, types, n, g, &m, &bytes, &integer); e.failure()) return e;
  if (y->dimensions().size() != 1 || y->dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec_ggml: y must be f32[rows of all parts]");
  std::unique_ptr<float[]> prepared;
  const float* add;
  if (ffi::Error e = inputs(m, n, x, args, types.size(), prologue, eps, residual, prepared, &g.x,
                            &add);
      e.failure())
    return e;
  std::unique_ptr<uint8_t[]> scratch[ggml::kActivationKinds];
  if (integer) {
    for (int k = 0; k < g.n_parts; ++k) {
      if (!ggml::integer_type(g.parts[k].type)) continue;
      const int kind = ggml::activation_kind(g.parts[k].type);
      if (scratch[kind]) continue;
      scratch[kind].reset(new uint8_t[ggml::activation_bytes(n)]);
      g.qx[kind] = ggml::quantize(g.x, n, scratch[kind].get(), kind);
    }
  }
  g.n = n;
  g.y = y->typed_data();
  // `run` sizes its blocks and decides to split by weights per row: a byte of a quantized row
  // costs about what a float32 weight does (decoding it is most of the work).
  const int64_t cost = std::max<int64_t>(1, bytes / std::max<int64_t>(1, m)) * g.unit;
  Product p{rows_ggml, &g, nullptr, nullptr, g.y, cost};
  for (int k = 0; k < g.n_parts; ++k)
    p.spans[k] = Product::Span{reinterpret_cast<const char*>(g.parts[k].data), g.parts[k].first,
                               g.parts[k].rows, g.parts[k].row_bytes};
  p.n_spans = g.n_parts;
  p.unit = g.unit;
  run(pool, p, m / g.unit);
  if (add != nullptr)
    for (int64_t i = 0; i < m; ++i) g.y[i] = add[i] + g.y[i];
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Products of GGML parts with the T tokens of a prefill chunk (`jllama_matmul_ggml`): x f32[T, n]
// -> y f32[T, m], y[t] = W x[t] with each token's activations quantized as in a decode step, so a
// prompt token's values are those a decode step computes for it. Work comes in units of 8 rows
// (a group, for x8 parts) over all tokens, 4 tokens at a time: a group's weights are decoded
// once for 4 tokens (`ggml::x8_dot_n`) and stay in L1 while the tokens' activations stream.

struct GgmlMatmul {
  GgmlPart parts[kMaxParts];
  int n_parts;
  int64_t unit, n, m, tokens;
  const float* x;                                               // f32[T, n]
  std::vector<ggml::Activations> qx[ggml::kActivationKinds];   // per kind: one per token
  float* y;                                                     // f32[T, m]
};

template <int32_t T, int NT>
void matmul_group(const GgmlMatmul& g, const GgmlPart& part, const uint8_t* group, int64_t r,
                  int64_t t0) {
#if JLLAMA_Q_AVX2
  const ggml::Activations* xs = &g.qx[ggml::activation_kind(T)][t0];
  float* ys[NT];
  for (int t = 0; t < NT; ++t) ys[t] = g.y + (t0 + t) * g.m + r;
  ggml::x8_dot_n<T, NT>(group, xs, ys);
#endif
}

template <int32_t T>
void matmul_groups(const GgmlMatmul& g, const GgmlPart& part, int64_t begin, int64_t end) {
#if JLLAMA_Q_AVX2
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  for (int64_t r = begin; r < end; r += 8) {
    const uint8_t* group = rows + r * part.row_bytes;
    int64_t t = 0;
    for (; t + 4 <= g.tokens; t += 4) matmul_group<T, 4>(g, part, group, r, t);
    switch (g.tokens - t) {
      case 3: matmul_group<T, 3>(g, part, group, r, t); break;
      case 2: matmul_group<T, 2>(g, part, group, r, t); break;
      case 1: matmul_group<T, 1>(g, part, group, r, t); break;
      default: break;
    }
  }
#endif
}

// A part in the row layout (or of a float type): one token at a time, as the decode kernel.
void matmul_rows(const GgmlMatmul& g, const GgmlPart& part, int64_t begin, int64_t end) {
  GgmlProduct one{};
  one.parts[0] = part;
  one.n_parts = 1;
  one.unit = 1;
  one.n = g.n;
  for (int64_t t = 0; t < g.tokens; ++t) {
    one.x = g.x + t * g.n;
    for (int k = 0; k < ggml::kActivationKinds; ++k)
      if (!g.qx[k].empty()) one.qx[k] = g.qx[k][t];
    one.y = g.y + t * g.m;
    ggml_part_rows<false>(one, part, begin, end);
  }
}

void rows_matmul(const Product& p, int64_t begin, int64_t end) {
  const GgmlMatmul& g = *static_cast<const GgmlMatmul*>(p.w);
  begin *= g.unit, end *= g.unit;
  constexpr int32_t X = ggml::kX8;
  for (int k = 0; k < g.n_parts; ++k) {
    const GgmlPart& part = g.parts[k];
    const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
    if (lo >= hi) continue;
    switch (part.type) {
      case X + ggml::Q8_0: matmul_groups<ggml::Q8_0>(g, part, lo, hi); break;
      case X + ggml::Q4_0: matmul_groups<ggml::Q4_0>(g, part, lo, hi); break;
      case X + ggml::Q4_1: matmul_groups<ggml::Q4_1>(g, part, lo, hi); break;
      case X + ggml::Q5_0: matmul_groups<ggml::Q5_0>(g, part, lo, hi); break;
      case X + ggml::Q5_1: matmul_groups<ggml::Q5_1>(g, part, lo, hi); break;
      case X + ggml::Q4_K: matmul_groups<ggml::Q4_K>(g, part, lo, hi); break;
      case X + ggml::Q5_K: matmul_groups<ggml::Q5_K>(g, part, lo, hi); break;
      case X + ggml::Q6_K: matmul_groups<ggml::Q6_K>(g, part, lo, hi); break;
      default: matmul_rows(g, part, lo, hi); break;
    }
  }
}

// The activations of tokens [begin, end) of a GgmlMatmul, each kind with scratch.
struct QuantizeTokens {
  GgmlMatmul* g;
  uint8_t* scratch[ggml::kActivationKinds];
  int64_t per_token;
};

void quantize_tokens(const Product& p, int64_t begin, int64_t end) {
  const QuantizeTokens& q = *static_cast<const QuantizeTokens*>(p.w);
  GgmlMatmul& g = *q.g;
  for (int kind = 0; kind < ggml::kActivationKinds; ++kind) {
    if (q.scratch[kind] == nullptr) continue;
    for (int64_t t = begin; t < end; ++t)
      g.qx[kind][t] = ggml::quantize(g.x + t * g.n, g.n, q.scratch[kind] + t * q.per_token, kind);
  }
}

ffi::Error MatmulGgml(ffi::ThreadPool pool, F32Matrix x, ffi::RemainingArgs args, F32MatrixResult y,
                      ffi::Span<const int32_t> types) {
  const int64_t tokens = x.dimensions()[0], n = x.dimensions()[1];
  GgmlProduct checked{};
  int64_t m, bytes;
  bool integer;
  if (args.size() != types.size())
    return ffi::Error::InvalidArgument("jllama matmul_ggml: one type per part");
  if (ffi::Error e = ggml_parts(args, types, n, checked, &m, &bytes, &integer); e.failure()) return e;
  if (y->dimensions()[0] != tokens || y->dimensions()[1] != m)
    return ffi::Error::InvalidArgument("jllama matmul_ggml: y must be f32[T, rows of all parts]");
  GgmlMatmul g;
  std::copy(checked.parts, checked.parts + kMaxParts, g.parts);
  g.n_parts = checked.n_parts;
  g.unit = checked.unit;
  g.n = n, g.m = m, g.tokens = tokens, g.x = x.typed_data(), g.y = y->typed_data();
  std::unique_ptr<uint8_t[]> scratch[ggml::kActivationKinds];
  QuantizeTokens quantizing{&g, {}, ggml::activation_bytes(n)};
  for (int k = 0; k < g.n_parts; ++k) {
    if (!ggml::integer_type(g.parts[k].type)) continue;
    const int kind = ggml::activation_kind(g.parts[k].type);
    if (scratch[kind]) continue;
    scratch[kind].reset(new uint8_t[quantizing.per_token * tokens]);
    g.qx[kind].resize(tokens);
    quantizing.scratch[kind] = scratch[kind].get();
  }
  // The tokens' activations, split over the threads as the product is (a prefill chunk's are
  // a few hundred thousand values: single-threaded, 10-15% of the chunk's products).
  run(pool, Product{quantize_tokens, &quantizing, nullptr, nullptr, nullptr, 8 * n}, tokens);
  const int64_t cost = std::max<int64_t>(1, bytes / std::max<int64_t>(1, m)) * g.unit * tokens;
  run(pool, Product{rows_matmul, &g, nullptr, nullptr, g.y, cost}, m / g.unit);
  return ffi::Error::Success();
}

// Parts dequantized to float32 (`ggml::dequantize_row`, ggml's exact values), y: f32[m, n]: the
// prefill chunk products multiply it with XLA's matrix product.
// Row `r` of a part dequantized into out: f32[n] (an x8 part's row gathered from its tile first).
void dequantize_part_row(const GgmlPart& part, int64_t r, int64_t n, float* out,
                         std::unique_ptr<uint8_t[]>& row, std::unique_ptr<int32_t[]>& pos) {
  const int64_t local = r - part.first;
  if (!ggml::x8_type(part.type)) {
    ggml::dequantize_row(part.type, part.data + local * part.row_bytes, out, n);
    return;
  }
  const int32_t base = part.type - ggml::kX8;
  if (!pos) {
    pos.reset(new int32_t[8 * ggml::layout(base).bytes]);
    ggml::x8_positions(base, pos.get());
    row.reset(new uint8_t[part.row_bytes]);
  }
  ggml::x8_row(base, part.data + (local - local % 8) * part.row_bytes, static_cast<int>(local % 8),
               n, pos.get(), row.get());
  ggml::dequantize_row(base, row.get(), out, n);
}

void rows_dequantize(const Product& p, int64_t begin, int64_t end) {
  const GgmlProduct& g = *static_cast<const GgmlProduct*>(p.w);
  for (int k = 0; k < g.n_parts; ++k) {
    const GgmlPart& part = g.parts[k];
    const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
    std::unique_ptr<uint8_t[]> row;
    std::unique_ptr<int32_t[]> pos;
    for (int64_t r = lo; r < hi; ++r) dequantize_part_row(part, r, g.n, g.y + r * g.n, row, pos);
  }
}

ffi::Error DequantizeGgml(ffi::ThreadPool pool, ffi::RemainingArgs args, F32MatrixResult y,
                          ffi::Span<const int32_t> types) {
  const int64_t n = y->dimensions()[1];
  GgmlProduct g{};
  int64_t m, bytes;
  bool integer;
  if (args.size() != types.size())
    return ffi::Error::InvalidArgument("jllama dequantize_ggml: one type per part");
  if (ffi::Error e = ggml_parts(args, types, n, g, &m, &bytes, &integer); e.failure()) return e;
  if (y->dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama dequantize_ggml: y must be f32[rows of all parts, n]");
  g.n = n;
  g.y = y->typed_data();
  // Writing float32 costs more than reading the blocks: weigh a row by its output.
  run(pool, Product{rows_dequantize, &g, nullptr, nullptr, g.y, n}, m);
  return ffi::Error::Success();
}

// Rows `index` of a table of one GGML type dequantized (the embedding rows of tokens).
ffi::Error RowsGgml(U8Matrix table, S32Vector index, F32MatrixResult y,
                    int32_t type) {
  const int64_t n = y->dimensions()[1], k = index.dimensions()[0], vocab = table.dimensions()[0];
  const ggml::Layout layout = ggml::layout(type);
  if (layout.elements == 0 || n % layout.elements != 0 || y->dimensions()[0] != k ||
      table.dimensions()[1] != n / layout.elements * layout.bytes)
    return ffi::Error::InvalidArgument("jllama rows_ggml: table u8[V, row_bytes] and y f32[k, n] "
                                       "do not agree with the type");
  const int64_t row_bytes = table.dimensions()[1];
  if (ggml::x8_type(type) && vocab % 8 != 0)
    return ffi::Error::InvalidArgument("jllama rows_ggml: an x8 table needs rows a multiple of 8");
  const GgmlPart part{table.typed_data(), 0, vocab, row_bytes, type};
  std::unique_ptr<uint8_t[]> row;
  std::unique_ptr<int32_t[]> pos;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = index.typed_data()[i];
    if (r < 0 || r >= vocab) return ffi::Error::InvalidArgument("jllama rows_ggml: index out of range");
    dequantize_part_row(part, r, n, y->typed_data() + i * n, row, pos);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Attention of one token over a layer's cache (decode), as llama2.c run.c: for each query head
// h, scores q_h . k_t / sqrt(head_dim) against key head h / kv_mul for t = 0 .. pos, softmax,
// and the weighted sum of the values. XLA's version multiplies q by whole 256-position blocks
// and masks the unused positions; this one reads only positions 0 .. pos and is one call per
// layer in place of about fifteen small programs (bench/NOTES.md).


// One layer's cache as blocks of `block` positions: block b is blocks[b], except block `cur`,
// which is given apart (the decode loop writes it in the same program).
struct Cache {
  const float* const* blocks;  // [n_blocks] of f32[n_kv_heads, block, head_dim]
  const float* current;
  int64_t cur, block;

  const float* row(int64_t t, int64_t g, int64_t head_dim) const {
    int64_t b = t / block;
    const float* base = b == cur ? current : blocks[b];
    return base + (g * block + t % block) * head_dim;
  }
};

struct Attention {
  const float* q;  // [n_kv_heads, kv_mul, head_dim]
  float* out;      // the same shape
  Cache keys, values;
  int64_t n_kv, kv_mul, head_dim, pos;
};

// Query heads [begin, end) (head u = g * kv_mul + m attends with key head g): one thread per
// query head, so the result does not depend on the thread count. (One per key head left a
// thread idle a third of the time on SmolLM2's 3 key heads and 2 threads.)
void attention_heads(const Product& p, int64_t begin, int64_t end) {
  const Attention& a = *static_cast<const Attention*>(p.w);
  const int64_t len = a.pos + 1, hd = a.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::unique_ptr<float[]> scores(new float[len]);
  for (int64_t u = begin; u < end; ++u) {
    {
      const int64_t g = u / a.kv_mul, m = u % a.kv_mul;
      const float* q = a.q + (g * a.kv_mul + m) * hd;
      float* out = a.out + (g * a.kv_mul + m) * hd;
      float top = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        scores[t] = dot_head(q, a.keys.row(t, g, hd), hd) * scale;
        top = std::max(top, scores[t]);
      }
      // exp(s - top), summed in 16 lanes then halve16.
      float lanes[16] = {0};
      int64_t t = 0;
#if JLLAMA_AVX512
      __m512 sum = _mm512_setzero_ps();
      for (; t + 16 <= len; t += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(&scores[t]), _mm512_set1_ps(top)));
        _mm512_storeu_ps(&scores[t], e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_storeu_ps(lanes, sum);
#elif JLLAMA_AVX2
      __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
      for (; t + 16 <= len; t += 16) {
        const __m256 lo = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[t]), _mm256_set1_ps(top)));
        const __m256 hi = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[t + 8]), _mm256_set1_ps(top)));
        _mm256_storeu_ps(&scores[t], lo);
        _mm256_storeu_ps(&scores[t + 8], hi);
        sum_lo = _mm256_add_ps(sum_lo, lo);
        sum_hi = _mm256_add_ps(sum_hi, hi);
      }
      _mm256_storeu_ps(lanes, sum_lo);
      _mm256_storeu_ps(lanes + 8, sum_hi);
#endif
      for (; t < len; ++t) {
        scores[t] = std::exp(scores[t] - top);
        lanes[t % 16] += scores[t];
      }
      const float inv = 1.0f / halve16(lanes);
      std::memset(out, 0, sizeof(float) * hd);
      for (t = 0; t < len; ++t) {
        const float w = scores[t] * inv;
        const float* v = a.values.row(t, g, hd);
        for (int64_t d = 0; d < hd; ++d) out[d] += w * v[d];
      }
    }
  }
}

bool same(const ffi::AnyBuffer::Dimensions& a, const ffi::AnyBuffer::Dimensions& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

ffi::Error AttentionF32(ffi::ThreadPool pool, F32Heads q,
                        S32Scalar pos, S32Scalar cur,
                        F32Heads key_cur, F32Heads value_cur,
                        ffi::RemainingArgs blocks, F32HeadsResult out) {
  const auto qd = q.dimensions(), cd = key_cur.dimensions();
  const int64_t n_kv = qd[0], kv_mul = qd[1], hd = qd[2], block = cd[1];
  if (cd[0] != n_kv || cd[2] != hd || !same(value_cur.dimensions(), cd) ||
      !same(out->dimensions(), qd) || blocks.size() % 2 != 0 || blocks.size() == 0)
    return ffi::Error::InvalidArgument(
        "jllama attention: q[g, m, d], caches [g, B, d] and an even number of blocks");
  const int64_t n = static_cast<int64_t>(blocks.size() / 2);
  std::unique_ptr<const float*[]> ptrs(new const float*[2 * n]);
  for (int64_t i = 0; i < 2 * n; ++i) {
    auto b = blocks.get<F32Heads>(i);
    if (b.has_error()) return b.error();
    if (!same(b->dimensions(), cd))
      return ffi::Error::InvalidArgument("jllama attention: blocks must match key_cur's shape");
    ptrs[i] = b->typed_data();
  }
  const int64_t p = *pos.typed_data();
  if (p < 0 || p >= n * block)
    return ffi::Error::InvalidArgument("jllama attention: pos outside the blocks given");
  Attention a{q.typed_data(), out->typed_data(),
              Cache{ptrs.get(), key_cur.typed_data(), *cur.typed_data(), block},
              Cache{ptrs.get() + n, value_cur.typed_data(), *cur.typed_data(), block},
              n_kv, kv_mul, hd, p};
  // One "row" per query head; its work is the positions' keys and values it reads.
  run(pool, Product{attention_heads, &a, nullptr, nullptr, nullptr, 2 * (p + 1) * hd},
      n_kv * kv_mul);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Causal attention of a chunk of T prompt tokens (prefill): token t's query head h attends over
// key head h / kv_mul at cache positions 0 .. pos + t, as `attention` per token. XLA's version
// (`jllama.graphs.prefill.attention_chunk`) multiplies every query by whole 256-position blocks
// and masks the scores, so half of the chunk's own block is computed and thrown away, and the
// softmax is several programs over [heads, T, block] arrays: 0.92 ms a SmolLM2 layer for the
// first 256 tokens, 1.49 ms for the next 256, 17% of a 512-token prefill (bench/NOTES.md).
//
// Work comes in tiles of 16 consecutive tokens of one query head, largest first, taken by the
// caller and one task per other thread of XLA's pool (not jllama's helpers: those spin for
// milliseconds after a product, which would take a core from the XLA products that follow a
// prefill's attention). A tile is one thread's from start to end, in a fixed order, so the
// result does not depend on the thread count:
//   scores  s[j][r] = sum_d (q_r[d] / sqrt(head_dim)) * k_j[d], d = 0, 1, ... in one
//           multiply-add chain, for keys j of the tile's rows (16 rows in the 16 lanes: the
//           keys' rows are read as stored, each element broadcast)
//   softmax per row over its visible keys j <= pos + t0 + r: max, exp(s - max), their sum
//           in j order
//   values  out_r[d] = (sum_j p[j][r] * v_j[d], j = 0, 1, ...) / sum_r

struct ChunkAttention {
  const float* q;  // [T, n_heads, head_dim], after RoPE
  float* out;      // [T, n_heads * head_dim]
  std::unique_ptr<const float*[]> blocks;  // k key blocks, then k value blocks
  int64_t n_blocks, t, n_heads, kv_mul, hd, block, pos;

  const float* key_row(int64_t j, int64_t g) const {
    return blocks[j / block] + (g * block + j % block) * hd;
  }
  const float* value_row(int64_t j, int64_t g) const {
    return blocks[n_blocks + j / block] + (g * block + j % block) * hd;
  }
};

constexpr int64_t kChunkTile = 16;  // tokens per tile: one per lane

// The tile of tokens [16 * tile, ...) of query head h; st: scratch f32[16 * (pos + T)].
template <int D>  // head_dim / 16
void chunk_tile(const ChunkAttention& a, int64_t h, int64_t tile, float* st) {
  constexpr int64_t HD = 16 * D, R = kChunkTile;
  const int64_t g = h / a.kv_mul, t0 = tile * R, rows = std::min(R, a.t - t0);
  const int64_t first = a.pos + t0;  // row r sees keys 0 .. first + r
  const int64_t len = first + rows;  // keys any row sees
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  alignas(64) float qt[HD * R];  // qt[d * 16 + r]: the rows' queries, scaled, transposed
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < HD; ++d)
      qt[d * R + r] = r < rows ? a.q[((t0 + r) * a.n_heads + h) * HD + d] * scale : 0.0f;
  alignas(64) float total[R];
#if JLLAMA_AVX512
  // Scores, 16 keys at a time (a tile of keys never crosses a cache block: block % 16 == 0);
  // a last partial tile computes keys past len that nothing reads.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.key_row(j0, g);
    __m512 acc[R];
    for (int64_t jj = 0; jj < R; ++jj) acc[jj] = _mm512_setzero_ps();
    for (int64_t d = 0; d < HD; ++d) {
      const __m512 qv = _mm512_load_ps(qt + d * R);
      for (int64_t jj = 0; jj < R; ++jj)
        acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(k[jj * HD + d]), qv, acc[jj]);
    }
    for (int64_t jj = 0; jj < R; ++jj) _mm512_store_ps(st + (j0 + jj) * R, acc[jj]);
  }
  // Key j is visible to the rows r >= j - first.
  auto visible = [first](int64_t j) -> __mmask16 {
    return j <= first ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0xFFFF << (j - first));
  };
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; ++j)
    m = _mm512_mask_max_ps(m, visible(j), m, _mm512_load_ps(st + j * R));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const __m512 e =
        _mm512_maskz_mov_ps(visible(j), exp16(_mm512_sub_ps(_mm512_load_ps(st + j * R), m)));
    _mm512_store_ps(st + j * R, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_store_ps(total, sum);
  for (int64_t c = 0; c < D; ++c) {
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += R) {
      const float* v = a.value_row(j0, g) + c * 16;
      const int64_t n = std::min(R, len - j0);
      for (int64_t jj = 0; jj < n; ++jj) {
        const __m512 vv = _mm512_loadu_ps(v + jj * HD);
        const float* p = st + (j0 + jj) * R;
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), vv, acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(a.out + (t0 + r) * a.n_heads * HD + h * HD + c * 16,
                       _mm512_div_ps(acc[r], _mm512_set1_ps(total[r])));
  }
#elif JLLAMA_AVX2
  // The same order of operations on AVX2's 16 registers of 8 lanes: the 16 rows as two halves
  // (lo: rows 0-7, hi: 8-15), 4 keys or 4 rows at a time so that the sums stay in registers.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.key_row(j0, g);
    for (int64_t k4 = 0; k4 < R; k4 += 4) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < HD; ++d) {
        const __m256 lo = _mm256_load_ps(qt + d * R), hi = _mm256_load_ps(qt + d * R + 8);
        for (int i = 0; i < 4; ++i) {
          const __m256 kv = _mm256_broadcast_ss(k + (k4 + i) * HD + d);
          acc[i][0] = _mm256_fmadd_ps(kv, lo, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(kv, hi, acc[i][1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_store_ps(st + (j0 + k4 + i) * R, acc[i][0]);
        _mm256_store_ps(st + (j0 + k4 + i) * R + 8, acc[i][1]);
      }
    }
  }
  // Key j is visible to the rows r >= j - first: lanes whose row index is at least that.
  const __m256i lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_hi = _mm256_add_epi32(lane_lo, _mm256_set1_epi32(8));
  auto visible = [&](int64_t j, const __m256i& lane) -> __m256 {
    const int32_t below = static_cast<int32_t>(std::min<int64_t>(j - first, R)) - 1;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(below)));
  };
  __m256 m[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
  for (int64_t j = 0; j < len; ++j)
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m256 sv = _mm256_load_ps(st + j * R + 8 * h2);
      m[h2] = _mm256_blendv_ps(m[h2], _mm256_max_ps(m[h2], sv), visible(j, h2 ? lane_hi : lane_lo));
    }
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t j = 0; j < len; ++j)
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m256 e = _mm256_and_ps(visible(j, h2 ? lane_hi : lane_lo),
                                     exp8(_mm256_sub_ps(_mm256_load_ps(st + j * R + 8 * h2), m[h2])));
      _mm256_store_ps(st + j * R + 8 * h2, e);
      sum[h2] = _mm256_add_ps(sum[h2], e);
    }
  _mm256_store_ps(total, sum[0]);
  _mm256_store_ps(total + 8, sum[1]);
  for (int64_t c = 0; c < D; ++c)
    for (int64_t r4 = 0; r4 < rows; r4 += 4) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < len; j0 += R) {
        const float* v = a.value_row(j0, g) + c * 16;
        const int64_t n = std::min(R, len - j0);
        for (int64_t jj = 0; jj < n; ++jj) {
          const __m256 vlo = _mm256_loadu_ps(v + jj * HD), vhi = _mm256_loadu_ps(v + jj * HD + 8);
          const float* p = st + (j0 + jj) * R + r4;
          for (int i = 0; i < 4; ++i) {
            const __m256 w = _mm256_broadcast_ss(p + i);
            acc[i][0] = _mm256_fmadd_ps(w, vlo, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, vhi, acc[i][1]);
          }
        }
      }
      for (int64_t i = 0; i < 4 && r4 + i < rows; ++i) {
        float* o = a.out + (t0 + r4 + i) * a.n_heads * HD + h * HD + c * 16;
        const __m256 inv = _mm256_set1_ps(total[r4 + i]);
        _mm256_storeu_ps(o, _mm256_div_ps(acc[i][0], inv));
        _mm256_storeu_ps(o + 8, _mm256_div_ps(acc[i][1], inv));
      }
    }
#else
  // The same order of operations in plain loops over 16-float rows, which the compiler
  // vectorizes (AVX2: two registers a row); exp is std::exp.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.key_row(j0, g);
    float acc[R][R] = {};  // [key][row]
    for (int64_t d = 0; d < HD; ++d)
      for (int64_t jj = 0; jj < R; ++jj) {
        const float kv = k[jj * HD + d];
        for (int64_t r = 0; r < R; ++r) acc[jj][r] = std::fma(kv, qt[d * R + r], acc[jj][r]);
      }
    std::memcpy(st + j0 * R, acc, sizeof acc);
  }
  float top[R];
  for (int64_t r = 0; r < R; ++r) {
    top[r] = -INFINITY;
    total[r] = 0.0f;
  }
  for (int64_t j = 0; j < len; ++j)
    for (int64_t r = std::max<int64_t>(0, j - first); r < R; ++r)
      top[r] = std::max(top[r], st[j * R + r]);
  for (int64_t j = 0; j < len; ++j)
    for (int64_t r = 0; r < R; ++r) {
      float& s = st[j * R + r];
      s = r >= j - first ? std::exp(s - top[r]) : 0.0f;
      total[r] += s;
    }
  for (int64_t c = 0; c < D; ++c) {
    float acc[R][16] = {};  // [row][column]
    for (int64_t j = 0; j < len; ++j) {
      const float* v = a.value_row(j, g) + c * 16;
      for (int64_t r = 0; r < R; ++r) {
        const float p = st[j * R + r];
        for (int64_t i = 0; i < 16; ++i) acc[r][i] = std::fma(p, v[i], acc[r][i]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < 16; ++i)
        a.out[(t0 + r) * a.n_heads * HD + h * HD + c * 16 + i] = acc[r][i] / total[r];
  }
#endif
}

// Shared by the caller and its pool tasks; a task may start after the call has returned, so
// the state lives as long as its last holder (it then finds no tile left and reads nothing).
struct ChunkWork {
  ChunkAttention a;
  void (*tile)(const ChunkAttention&, int64_t, int64_t, float*);
  int64_t tiles = 0, units = 0;
  // One scratch area per thread (rows of 16 scores, each a cache line), allocated by the caller
  // so that a failed allocation is an error it can return.
  std::unique_ptr<float, void (*)(void*)> scratch{nullptr, std::free};
  int64_t scratch_floats = 0, threads = 0;
  std::atomic<int64_t> arrived{0}, next{0}, done{0};

  void help() {
    const int64_t id = arrived.fetch_add(1, std::memory_order_relaxed);
    if (id >= threads) return;
    float* st = scratch.get() + id * scratch_floats;
    int64_t n = 0;
    // Largest tiles (latest tokens) first, so the last ones taken are short.
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units; ++n)
      tile(a, u % a.n_heads, tiles - 1 - u / a.n_heads, st);
    if (n > 0) done.fetch_add(n, std::memory_order_release);
  }
};

ffi::Error AttentionChunkF32(ffi::ThreadPool pool, F32Heads q, S32Scalar pos,
                             ffi::RemainingArgs blocks, F32MatrixResult out) {
  const auto qd = q.dimensions();
  const int64_t t = qd[0], n_heads = qd[1], hd = qd[2];
  if (blocks.size() % 2 != 0 || blocks.size() == 0)
    return ffi::Error::InvalidArgument("jllama attention_chunk: an even number of cache blocks");
  auto work = std::make_shared<ChunkWork>();
  ChunkAttention& a = work->a;
  a.n_blocks = static_cast<int64_t>(blocks.size() / 2);
  a.blocks.reset(new const float*[2 * a.n_blocks]);
  ffi::AnyBuffer::Dimensions cd;
  for (int64_t i = 0; i < 2 * a.n_blocks; ++i) {
    auto b = blocks.get<F32Heads>(i);
    if (b.has_error()) return b.error();
    if (i == 0) cd = b->dimensions();
    if (!same(b->dimensions(), cd))
      return ffi::Error::InvalidArgument("jllama attention_chunk: cache blocks of one shape");
    a.blocks[i] = b->typed_data();
  }
  const int64_t n_kv = cd[0];
  a.t = t, a.n_heads = n_heads, a.hd = hd, a.block = cd[1], a.pos = *pos.typed_data();
  if (cd[2] != hd || hd % 16 != 0 || hd < 16 || hd > 128 || n_kv < 1 || n_heads % n_kv != 0 ||
      a.block % kChunkTile != 0 || out->dimensions()[0] != t ||
      out->dimensions()[1] != n_heads * hd)
    return ffi::Error::InvalidArgument(
        "jllama attention_chunk: q[T, n_heads, head_dim] (head_dim 16, 32, ..., 128), blocks "
        "[n_kv_heads, B, head_dim] (B a multiple of 16) and out[T, n_heads * head_dim]");
  if (a.pos < 0 || t < 1 || a.pos + t > a.n_blocks * a.block)
    return ffi::Error::InvalidArgument("jllama attention_chunk: positions outside the blocks");
  a.kv_mul = n_heads / n_kv;
  a.q = q.typed_data();
  a.out = out->typed_data();
  using Tile = void (*)(const ChunkAttention&, int64_t, int64_t, float*);
  static constexpr Tile kTiles[8] = {chunk_tile<1>, chunk_tile<2>, chunk_tile<3>, chunk_tile<4>,
                                     chunk_tile<5>, chunk_tile<6>, chunk_tile<7>, chunk_tile<8>};
  work->tile = kTiles[hd / 16 - 1];
  work->tiles = (t + kChunkTile - 1) / kChunkTile;
  work->units = work->tiles * n_heads;
  work->threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work->units));
  work->scratch_floats = kChunkTile * (a.pos + t + kChunkTile);
  work->scratch.reset(static_cast<float*>(
      std::aligned_alloc(64, sizeof(float) * work->scratch_floats * work->threads)));
  if (!work->scratch)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jllama attention_chunk: out of memory");
  for (int64_t i = 1; i < work->threads; ++i) pool.Schedule([work] { work->help(); });
  work->help();
  // Every tile is taken by now; wait for the ones a pool thread is still running.
  wait_for([&] { return work->done.load(std::memory_order_acquire) >= work->units; });
  return ffi::Error::Success();
}


// RoPE on one token's queries and keys, and its key and value written into the layer's cache
// block, in one call (XLA ran them as three programs a layer, ~11 us of a decode step's
// gaps between products). Rotation as llama2.c run.c: within each head the pair (2i, 2i + 1)
// turns by angle = pos * inv_freq[i], with cosf / sinf of that float angle.

inline void rotate(const float* in, const float* cos, const float* sin, int64_t head_dim,
                   float* out) {
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float v0 = in[2 * i], v1 = in[2 * i + 1];
    out[2 * i] = v0 * cos[i] - v1 * sin[i];
    out[2 * i + 1] = v0 * sin[i] + v1 * cos[i];
  }
}

ffi::Error RopeWriteF32(F32Vector qkv, S32Scalar pos, F32Vector inv_freq, F32Heads key_block,
                        F32Heads value_block, F32MatrixResult q, F32HeadsResult key_out,
                        F32HeadsResult value_out) {
  const auto cd = key_block.dimensions(), qd = q->dimensions();
  const int64_t n_kv = cd[0], block = cd[1], hd = cd[2], n_heads = qd[0];
  if (qd[1] != hd || hd % 2 != 0 || inv_freq.dimensions()[0] != hd / 2 ||
      qkv.dimensions()[0] != (n_heads + 2 * n_kv) * hd || !same(value_block.dimensions(), cd) ||
      !same(key_out->dimensions(), cd) || !same(value_out->dimensions(), cd))
    return ffi::Error::InvalidArgument(
        "jllama rope_write: qkv[(n_heads + 2 n_kv_heads) head_dim], q[n_heads, head_dim], "
        "inv_freq[head_dim / 2] and caches [n_kv_heads, B, head_dim] do not agree");
  const int64_t p = *pos.typed_data();
  if (p < 0) return ffi::Error::InvalidArgument("jllama rope_write: negative pos");
  // The caches are aliased to their results; should XLA ever hand over another buffer, carry
  // the old contents over first.
  const size_t bytes = sizeof(float) * n_kv * block * hd;
  if (key_out->typed_data() != key_block.typed_data())
    std::memcpy(key_out->typed_data(), key_block.typed_data(), bytes);
  if (value_out->typed_data() != value_block.typed_data())
    std::memcpy(value_out->typed_data(), value_block.typed_data(), bytes);
  std::unique_ptr<float[]> cs(new float[hd]);
  float *cos = cs.get(), *sin = cs.get() + hd / 2;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const float angle = static_cast<float>(p) * inv_freq.typed_data()[i];
    cos[i] = std::cos(angle);
    sin[i] = std::sin(angle);
  }
  const float* x = qkv.typed_data();
  for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * hd, cos, sin, hd, q->typed_data() + h * hd);
  const float *k = x + n_heads * hd, *v = k + n_kv * hd;
  const int64_t at = p % block;
  for (int64_t g = 0; g < n_kv; ++g) {
    rotate(k + g * hd, cos, sin, hd, key_out->typed_data() + (g * block + at) * hd);
    std::memcpy(value_out->typed_data() + (g * block + at) * hd, v + g * hd, sizeof(float) * hd);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Sampling one token as llama2.c run.c's `sample` (temperature > 0), bit for bit as the host's
// `jllama.sampling.Sampler`: logits / temperature in float32, softmax with exp computed in
// double and rounded to float (libm's correctly rounded expf, as the host), every sum
// sequential in float32 (run.c's loops), then `sample_mult`, or `sample_topp` when 0 < top_p
// < 1. XLA's cumulative sums are trees: over SmolLM2's 49152 tokens they were off by up to
// 1e-4 and a draw differed from run.c's every ~40 tokens.

// First index of the maximum (run.c's argmax); NaN-free input.
int64_t first_max(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// run.c's sampling loops: the first j < k whose running float32 sum prob(0) + ... + prob(j)
// exceeds r, or k - 1 when none does; *sum (if given) gets the running sum through it.
template <typename Prob>
int64_t first_sum_over(int64_t k, Prob prob, float r, float* sum = nullptr) {
  float cdf = 0.0f;
  int64_t j = 0;
  for (; j < k; ++j) {
    cdf += prob(j);
    if (cdf > r) break;
  }
  if (sum != nullptr) *sum = cdf;
  return std::min(j, k - 1);
}

int64_t sample_token(const float* logits, int64_t n, float temperature, float top_p, float coin) {
  // No flushing of tiny values to zero (XLA's threads may flush), as NumPy on the host.
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x8040u);  // clear FTZ (bit 15) and DAZ (bit 6)
#endif
  std::unique_ptr<float[]> probs(new float[n]);
  float top_scaled = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    probs[i] = logits[i] / temperature;
    top_scaled = std::max(top_scaled, probs[i]);
  }
  if (!std::isfinite(top_scaled)) {  // a vanishing temperature: the maxima share the mass
    const float top = logits[first_max(logits, n)];
    for (int64_t i = 0; i < n; ++i) probs[i] = (logits[i] - top) / temperature;
    top_scaled = probs[first_max(probs.get(), n)];
  }
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    probs[i] = static_cast<float>(std::exp(static_cast<double>(probs[i] - top_scaled)));
    total += probs[i];
  }
  for (int64_t i = 0; i < n; ++i) probs[i] /= total;
  const float* p = probs.get();
  int64_t picked;
  if (!(top_p > 0.0f && top_p < 1.0f)) {  // sample_mult
    picked = first_sum_over(n, [p](int64_t i) { return p[i]; }, coin);
  } else if (n == 1) {
    picked = 0;
  } else {  // sample_topp
    const float cutoff = (1.0f - top_p) / static_cast<float>(n - 1);
    std::unique_ptr<int64_t[]> ids(new int64_t[n]);
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i)
      if (p[i] >= cutoff) ids[k++] = i;
    if (k == 0) {
      picked = first_max(p, n);
    } else {
      std::stable_sort(ids.get(), ids.get() + k, [p](int64_t a, int64_t b) { return p[a] > p[b]; });
      const int64_t* sorted = ids.get();
      auto prob = [p, sorted](int64_t j) { return p[sorted[j]]; };
      float cumulative;
      const int64_t last = first_sum_over(k, prob, top_p, &cumulative);
      picked = sorted[first_sum_over(last + 1, prob, coin * cumulative)];
    }
  }
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(csr);
#endif
  return picked;
}

ffi::Error SampleF32(F32Vector logits, F32Scalar temperature, F32Scalar top_p, F32Scalar coin,
                     S32Result token) {
  const int64_t n = logits.dimensions()[0];
  if (n < 1) return ffi::Error::InvalidArgument("jllama sample: no logits");
  *token->typed_data() = static_cast<int32_t>(
      sample_token(logits.typed_data(), n, *temperature.typed_data(), *top_p.typed_data(),
                   *coin.typed_data()));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Greedy decoding's pick, as run.c's argmax (the first index of the maximum), and whether every
// logit is finite, in two passes over the logits instead of XLA's four or five programs.

ffi::Error ArgmaxF32(F32Vector logits, S32Result token, S32Result finite) {
  const int64_t n = logits.dimensions()[0];
  if (n < 1) return ffi::Error::InvalidArgument("jllama argmax: no logits");
  const float* v = logits.typed_data();
  float top = v[0];
  bool all_finite = true;
  int64_t i = 0;
#if JLLAMA_AVX512
  __m512 best = _mm512_set1_ps(v[0]);
  __mmask16 bad = 0;  // lanes that saw inf or NaN: x - x is NaN exactly there
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_loadu_ps(v + i);
    bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_sub_ps(x, x), _CMP_UNORD_Q);
    best = _mm512_max_ps(best, x);
  }
  all_finite = bad == 0;
  top = _mm512_reduce_max_ps(best);
#elif JLLAMA_AVX2
  // As above in 8 lanes (the scalar loop took SmolLM2's and stories15M's 32000-49152 logits
  // ~1% of a token on the x86-64-v3 build).
  __m256 best = _mm256_set1_ps(v[0]), bad = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i), d = _mm256_sub_ps(x, x);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, x);
  }
  all_finite = _mm256_movemask_ps(bad) == 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  for (float l : lanes) top = std::max(top, l);
#endif
  for (; i < n; ++i) {
    all_finite = all_finite && std::isfinite(v[i]);
    top = std::max(top, v[i]);
  }
  *finite->typed_data() = all_finite ? 1 : 0;
  // With every logit finite, the first one equal to the maximum; otherwise it is not used.
  int64_t pick = 0;
  if (all_finite) {
#if JLLAMA_AVX512
    const __m512 t = _mm512_set1_ps(top);
    for (; pick + 16 <= n; pick += 16) {
      __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + pick), t, _CMP_EQ_OQ);
      if (hit != 0) {
        pick += __builtin_ctz(hit);
        break;
      }
    }
#elif JLLAMA_AVX2
    const __m256 t = _mm256_set1_ps(top);
    for (; pick + 8 <= n; pick += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + pick), t, _CMP_EQ_OQ));
      if (hit != 0) {
        pick += __builtin_ctz(hit);
        break;
      }
    }
#endif
    while (v[pick] != top) ++pick;
  }
  *token->typed_data() = static_cast<int32_t>(pick);
  return ffi::Error::Success();
}

// The arguments and attributes every matvec handler takes after its weights and x: the
// prologue's and the residual's vectors, the result, then `prologue`, `eps` and `residual`
// (`jllama.kernels.matvec` passes them; see `product`).
template <typename Binding>
auto with_prologue(Binding binding) {
  return std::move(binding)
      .RemainingArgs()
      .template Ret<F32Vector>()
      .template Attr<int32_t>("prologue")
      .template Attr<float>("eps")
      .template Attr<int32_t>("residual");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_argmax_f32, ArgmaxF32,
                              ffi::Ffi::Bind()
                                  .Arg<F32Vector>()
                                  .Ret<S32Scalar>()
                                  .Ret<S32Scalar>());

// Floats per vector register of this build's explicit loops: 16 with AVX-512, 8 with AVX2 and
// FMA (the prefill attention's loops only), else 1 (plain loops the compiler may vectorize).
// The prefill attention kernel beats XLA's only with explicit loops: the plain ones with
// std::exp ran 5-8x slower than XLA on this project's machine (bench/NOTES.md), so
// jllama.kernels uses it only where this says 8 or more.
// The x8 layout of a ggml type as `ggml::x8_positions` builds it (the tests compare it with
// jllama.ggml_repack's): pos int32[8 * block bytes]. Returns 0, or -1 for a type without one.
extern "C" int jllama_x8_positions(int32_t type, int32_t* pos) {
  if (!ggml::has_x8(type)) return -1;
  ggml::x8_positions(type, pos);
  return 0;
}

extern "C" int jllama_vector_width() {
#if JLLAMA_AVX512
  return 16;
#elif JLLAMA_AVX2
  return 8;
#else
  return 1;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_f32, MatvecF32,
                              with_prologue(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_bf16, MatvecBf16,
                              with_prologue(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<F32Vector>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8_groups, MatvecInt8Groups,
                              with_prologue(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8, MatvecInt8,
                              with_prologue(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<F32Vector>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_ggml, MatvecGgml,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Vector>()
                                  .RemainingArgs()
                                  .Ret<F32Vector>()
                                  .Attr<ffi::Span<const int32_t>>("types")
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("residual"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matmul_ggml, MatmulGgml,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .RemainingArgs()
                                  .Ret<F32Matrix>()
                                  .Attr<ffi::Span<const int32_t>>("types"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_dequantize_ggml, DequantizeGgml,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<F32Matrix>()
                                  .Attr<ffi::Span<const int32_t>>("types"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_rows_ggml, RowsGgml,
                              ffi::Ffi::Bind()
                                  .Arg<U8Matrix>()
                                  .Arg<S32Vector>()
                                  .Ret<F32Matrix>()
                                  .Attr<int32_t>("type"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_attention_f32, AttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Heads>()
                                  .Arg<S32Scalar>()
                                  .Arg<S32Scalar>()
                                  .Arg<F32Heads>()
                                  .Arg<F32Heads>()
                                  .RemainingArgs()
                                  .Ret<F32Heads>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_attention_chunk_f32, AttentionChunkF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Heads>()
                                  .Arg<S32Scalar>()
                                  .RemainingArgs()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_sample_f32, SampleF32,
                              ffi::Ffi::Bind()
                                  .Arg<F32Vector>()
                                  .Arg<F32Scalar>()
                                  .Arg<F32Scalar>()
                                  .Arg<F32Scalar>()
                                  .Ret<S32Scalar>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_rope_write_f32, RopeWriteF32,
                              ffi::Ffi::Bind()
                                  .Arg<F32Vector>()
                                  .Arg<S32Scalar>()
                                  .Arg<F32Vector>()
                                  .Arg<F32Heads>()
                                  .Arg<F32Heads>()
                                  .Ret<F32Matrix>()
                                  .Ret<F32Heads>()
                                  .Ret<F32Heads>());
