// jllama's CPU matrix-vector products, called from the compiled JAX programs as XLA FFI custom
// calls (jllama/kernels/__init__.py builds this file and registers the handlers).
//
//   jllama_matvec_f32   y[i] = sum_j w[i, j] * x[j]                w: f32[m, n]
//   jllama_matvec_bf16  the same with w: bf16[m, n], each weight widened to f32 exactly
//   jllama_matvec_int8  y[i] = scale[i] * sum_j q[i, j] * x[j]     q: int8[m, n], scale: f32[m]
//   jllama_matvec_int8_groups  y[i] = sum_k scale[i, k] * sum_{j in group k} q[i, j] * x[j]
//                       scale: f32[m, G], groups of n / G weights (GGUF's Q8_0 / Q4_0: 32)
//
// x: f32[n], y: f32[m]; rows are "out x in" as in llama2.c run.c's matmul. Sums are f32 in
// 64 interleaved partial sums per row (lane j sums the elements j, j + 64, j + 128, ...), then
// the lanes as a fixed tree (`finish`), then the tail: a fixed order, so a product gives the
// same bits every call and on every thread count (one thread computes each row). 64 lanes are
// four AVX-512 registers: four independent multiply-add chains.
//
// Why our own kernel: XLA CPU (JAX 0.10) widens int8/bf16 weights at ~1.6 G elements/s per
// core inside its products, so narrow weights decoded slower than f32. These loops read int8
// and bf16 at about the bytes/s of f32, and f32 at least as fast as XLA's dot (memory-bound;
// bench/NOTES.md has the measurements).
//
// Threads: the rows are cut into chunks that the caller and tasks on XLA's intra-op thread pool
// claim from a shared counter. The caller works too and waits only for chunks another thread
// has already claimed, so a product never waits for a task that has not started: two products
// running side by side on a pool of two threads cannot deadlock.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases: a comma inside a template argument would split the handler macros' arguments.
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Result = ffi::ResultBuffer<ffi::F32, 1>;

namespace {

constexpr int kLanes = 64;
// Below this many weights a product runs on the calling thread alone: scheduling a task costs
// a few microseconds, more than such a product takes.
constexpr int64_t kMinParallelWeights = 1 << 16;
// Chunks per thread: uneven progress between threads then costs at most a fraction of a chunk.
constexpr int64_t kChunksPerThread = 4;

// Halves 16 partial sums as a tree (k with k + 8, then + 4, + 2, + 1) into s[0].
inline float halve16(float* s) {
  for (int half = 8; half >= 1; half /= 2)
    for (int k = 0; k < half; ++k) s[k] += s[k + half];
  return s[0];
}

// The 64 lanes as a tree: lane k with k + 16, k + 32, k + 48 as (a + b) + (c + d), then the
// 16 partial sums halved: six additions deep, where a left-to-right sum would be 64 deep and
// cost more than a short row's loads.
inline float finish(const float* acc, float tail) {
  float s[16];
  for (int k = 0; k < 16; ++k) s[k] = (acc[k] + acc[k + 16]) + (acc[k + 32] + acc[k + 48]);
  return halve16(s) + tail;
}

// One weight as float32: exact for every stored type.
inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t h) {  // bfloat16: the upper half of a float32
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
// 16 consecutive weights from w as one register of float32.
inline __m512 widen16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 widen16(const uint16_t* w) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* w) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#endif

// sum_j w[j] * x[j] in the 64-lane order above; T: float, uint16_t (bfloat16) or int8_t.
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  int64_t i = 0;
  float acc[kLanes] = {0};
#if defined(__AVX512F__)
  // Four 16-float registers are the 64 lanes.
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    a0 = _mm512_fmadd_ps(widen16(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(widen16(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(widen16(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(widen16(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  _mm512_storeu_ps(acc, a0);
  _mm512_storeu_ps(acc + 16, a1);
  _mm512_storeu_ps(acc + 32, a2);
  _mm512_storeu_ps(acc + 48, a3);
#else
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += widen(w[i + j]) * x[i + j];
#endif
  float tail = 0.0f;
  for (; i < n; ++i) tail += widen(w[i]) * x[i];
  return finish(acc, tail);
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
};

template <typename T>
void rows(const Product& p, int64_t begin, int64_t end) {
  const T* w = static_cast<const T*>(p.w);
  for (int64_t r = begin; r < end; ++r) p.y[r] = dot(w + r * p.n, p.x, p.n);
}

// Groups: each group's 16 lanes summed from zero, then multiplied by the group's scale into 16
// running lanes, then those halved as a tree (8, 4, 2, 1). A fixed order, as above.
inline float dot_int8_groups(const int8_t* q, const float* scale, const float* x, int64_t n,
                             int64_t size) {
  float acc[16] = {0};
  int64_t k = 0;
#if defined(__AVX512F__)
  if (size % 16 == 0) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t g = 0; g < n; g += size, ++k) {
      __m512 part = _mm512_setzero_ps();
      for (int64_t i = g; i < g + size; i += 16)
        part = _mm512_fmadd_ps(widen16(q + i), _mm512_loadu_ps(x + i), part);
      a = _mm512_fmadd_ps(part, _mm512_set1_ps(scale[k]), a);
    }
    _mm512_storeu_ps(acc, a);
    k = n / size;  // all groups done
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
  for (int64_t r = begin; r < end; ++r)
    p.y[r] = dot_int8_groups(q + r * p.n, p.scale + r * groups, p.x, p.n, size);
}

void rows_int8(const Product& p, int64_t begin, int64_t end) {
  const int8_t* q = static_cast<const int8_t*>(p.w);
  for (int64_t r = begin; r < end; ++r) p.y[r] = dot(q + r * p.n, p.x, p.n) * p.scale[r];
}
// Shared between the caller and the pool tasks; a task may start after the product is done,
// so the state lives as long as its last holder.
struct Work {
  Product product;
  int64_t m, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs chunks until none is left.
  void help() {
    for (;;) {
      int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      int64_t begin = c * chunk;
      product.rows(product, begin, std::min(m, begin + chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void run(ffi::ThreadPool& pool, const Product& product, int64_t m) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || m * product.n < kMinParallelWeights || m < 2) {
    product.rows(product, 0, m);
    return;
  }
  auto work = std::make_shared<Work>();
  work->product = product;
  work->m = m;
  work->chunks = std::min<int64_t>(m, threads * kChunksPerThread);
  work->chunk = (m + work->chunks - 1) / work->chunks;
  work->chunks = (m + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work->help(); });
  work->help();
  // Every chunk is claimed by now; wait for the ones other threads are still running.
  // Spin briefly (the other chunks finish within microseconds), then yield: on fewer cores
  // than pool threads the thread we wait for may need this core.
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->chunks; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

ffi::Error check(int64_t m, int64_t n, const ffi::AnyBuffer::Dimensions& x,
                 const ffi::AnyBuffer::Dimensions& y) {
  if (x.size() != 1 || x[0] != n || y.size() != 1 || y[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec: w[m, n], x[n] and y[m] do not agree");
  return ffi::Error::Success();
}

ffi::Error MatvecF32(ffi::ThreadPool pool, F32Matrix w, F32Vector x,
                     F32Result y) {
  int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  if (ffi::Error e = check(m, n, x.dimensions(), y->dimensions()); e.failure()) return e;
  run(pool, Product{rows<float>, w.typed_data(), nullptr, x.typed_data(), y->typed_data(), n}, m);
  return ffi::Error::Success();
}

ffi::Error MatvecBf16(ffi::ThreadPool pool, Bf16Matrix w,
                      F32Vector x, F32Result y) {
  int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  if (ffi::Error e = check(m, n, x.dimensions(), y->dimensions()); e.failure()) return e;
  run(pool, Product{rows<uint16_t>, w.untyped_data(), nullptr, x.typed_data(), y->typed_data(), n},
      m);
  return ffi::Error::Success();
}

ffi::Error MatvecInt8(ffi::ThreadPool pool, Int8Matrix q,
                      F32Vector scale, F32Vector x,
                      F32Result y) {
  int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  if (ffi::Error e = check(m, n, x.dimensions(), y->dimensions()); e.failure()) return e;
  if (scale.dimensions().size() != 1 || scale.dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec_int8: scale must be f32[m]");
  run(pool, Product{rows_int8, q.typed_data(), scale.typed_data(), x.typed_data(),
                    y->typed_data(), n}, m);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_f32, MatvecF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Ret<F32Vector>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_bf16, MatvecBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<F32Vector>()
                                  .Ret<F32Vector>());

ffi::Error MatvecInt8Groups(ffi::ThreadPool pool, Int8Matrix q, F32Matrix scale, F32Vector x,
                            F32Result y) {
  int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  if (ffi::Error e = check(m, n, x.dimensions(), y->dimensions()); e.failure()) return e;
  int64_t groups = scale.dimensions()[1];
  if (scale.dimensions()[0] != m || groups < 1 || n % groups != 0)
    return ffi::Error::InvalidArgument(
        "jllama matvec_int8_groups: scale must be f32[m, G] with G dividing n");
  run(pool, Product{rows_int8_groups, q.typed_data(), scale.typed_data(), x.typed_data(),
                    y->typed_data(), n, groups}, m);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8_groups, MatvecInt8Groups,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Ret<F32Vector>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8, MatvecInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<F32Vector>()
                                  .Ret<F32Vector>());
