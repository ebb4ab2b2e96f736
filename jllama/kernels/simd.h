// The vector arithmetic jllama's kernels share: weights of each stored type widened to float32
// (`widen`, `widen16`, `widen8`), the fixed trees that sum partial sums (`halve16`, `finish`),
// exp on a register (`exp16`, `exp8`), a short fixed-order dot product (`dot_head`) and a row's
// 64-lane dot product (`dot`) with its prefetches.
//
// `dot` is a product's row i: y[i] = w[i, :] . x (x: f32[n], y: f32[m]; rows are "out x in" as
// in llama2.c run.c's matmul). Sums are f32 in 64 interleaved partial sums per row (lane j sums
// the elements j, j + 64, j + 128, ..., the last partial block of a row included), then the lanes
// as a fixed tree (`finish`): a fixed order, so a product gives the same bits every call and on
// every thread count (one thread computes each row). 64 lanes are four AVX-512 registers: four
// independent multiply-add chains; a row's last partial block is read with masked loads, so rows
// whose length is not a multiple of 64 (stories15M's 288) have no scalar tail.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "ggml_dot.h"  // ggml::fp16 (F16 weights), ggml::hsum8

namespace jllama {
// Internal linkage, as everything of the kernels' but their handlers: not the library's
// interface.
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

// `Vec`, this build's register of kVectorWidth floats, and what the loops written once for both
// widths (batch.cc's `dot_rows`, attention_tiles.h's `accumulate`) do with it: vwiden(w), a
// register of the weights at w as float32 (widen16 / widen8); vload(x) / vstore(y, v), floats
// unaligned; vwiden(w, part) / vload(x, part) with part = first(left), the first `left` (> 0)
// of them, zero past them (here by a mask: nothing past them is read); in_register(v), v held
// in a register (no load folded into each of its uses); finish(a), the 64 lanes of kLanes /
// kVectorWidth registers as `finish`'s tree.
using Vec = __m512;
using First = __mmask16;
inline First first(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
template <typename T>
inline Vec vwiden(const T* w, First keep) { return widen16(w, keep); }
inline Vec vload(const float* x, First keep) { return _mm512_maskz_loadu_ps(keep, x); }
template <typename T>
inline Vec vwiden(const T* w) { return widen16(w); }
inline Vec vload(const float* x) { return _mm512_loadu_ps(x); }
inline void vstore(float* y, Vec v) { _mm512_storeu_ps(y, v); }
inline void in_register(Vec& v) { asm("" : "+v"(v)); }
// `finish` of the 64 lanes in four registers (a<r>: lanes 16r .. 16r + 15).
inline float finish(const Vec* a) {
  return halve16(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#endif

#if !JLLAMA_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define JLLAMA_AVX2 1
#endif

// The vector operations `exp_steps` is written in, on 16 lanes and on 8; splat(like, v): v in
// every lane of a register of like's type.
#if JLLAMA_AVX512 || JLLAMA_AVX2
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif
#if JLLAMA_AVX512
inline __m512 splat(__m512, float v) { return _mm512_set1_ps(v); }
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512 round_nearest(__m512 v) { return _mm512_roundscale_ps(v, kNearest); }
#elif JLLAMA_AVX2
inline __m256 round_nearest(__m256 v) { return _mm256_round_ps(v, kNearest); }
inline __m256 splat(__m256, float v) { return _mm256_set1_ps(v); }
inline __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
#endif

// exp(x) to about 1 ulp (x <= 88; below -104 it is 0): x = n ln2 + r with |r| <= ln2 / 2, exp(r)
// as its Taylor polynomial of degree 7 (error < 5e-9), times 2^n. Here n and the polynomial;
// `exp16` and `exp8` clamp x first and scale by 2^n each in its own way.
#if JLLAMA_AVX512 || JLLAMA_AVX2
template <typename V>
inline V exp_steps(V x, V* n) {
  *n = round_nearest(mul(x, splat(x, 1.44269504088896341f)));
  V r = fnmadd(*n, splat(x, 0.693145751953125f), x);       // ln2, high part
  r = fnmadd(*n, splat(x, 1.428606765330187045e-06f), r);  // and the rest
  V p = splat(x, 1.0f / 5040);
  p = fmadd(p, r, splat(x, 1.0f / 720));
  p = fmadd(p, r, splat(x, 1.0f / 120));
  p = fmadd(p, r, splat(x, 1.0f / 24));
  p = fmadd(p, r, splat(x, 1.0f / 6));
  p = fmadd(p, r, splat(x, 0.5f));
  p = fmadd(p, r, splat(x, 1.0f));
  return fmadd(p, r, splat(x, 1.0f));
}
#endif

#if JLLAMA_AVX512
inline __m512 exp16(__m512 x) {
  __m512 n;
  // Below -104 exp underflows to 0 anyway.
  const __m512 p = exp_steps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), &n);
  return _mm512_scalef_ps(p, n);
}
#endif

#if JLLAMA_AVX2
// exp16 on 8 lanes (for the prefill attention's AVX2 loops), 2^n built in the exponent bits. x is
// clamped at -87 so that 2^n stays a normal float (exp(-87) is 1.6e-38; the attention's weights
// that small add nothing to a sum of at least 1).
inline __m256 exp8(__m256 x) {
  __m256 n;
  const __m256 p = exp_steps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), &n);
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

// The AVX2 `Vec` and its operations (see the AVX-512 ones): the last partial register through a
// zero-padded copy.
using Vec = __m256;
inline void in_register(Vec& v) { asm("" : "+x"(v)); }
template <typename T>
inline Vec vwiden(const T* w) { return widen8(w); }
inline Vec vload(const float* x) { return _mm256_loadu_ps(x); }
inline void vstore(float* y, Vec v) { _mm256_storeu_ps(y, v); }
struct First {
  int64_t count;  // of the register's 8 floats
};
inline First first(int64_t left) { return First{std::min<int64_t>(left, 8)}; }
template <typename T>
inline Vec vwiden(const T* w, First part) {
  T copy[8] = {};
  std::memcpy(copy, w, sizeof(T) * part.count);
  return widen8(copy);
}
inline Vec vload(const float* x, First part) {
  float copy[8] = {};
  std::memcpy(copy, x, sizeof(float) * part.count);
  return _mm256_loadu_ps(copy);
}
// `finish` of the 64 lanes in eight registers (a<r>: lanes 8r .. 8r + 7).
inline float finish(const Vec* a) {
  return halve16(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])),
                 _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7])));
}
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

}  // namespace
}  // namespace jllama
