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

// Why our own kernel: XLA CPU (JAX 0.10) widens int8/bf16 weights at ~1.6 G elements/s per
// core inside its products, so narrow weights decoded slower than f32. These loops read int8
// and bf16 at about the bytes/s of f32, and f32 at least as fast as XLA's dot (memory-bound;
// bench/NOTES.md has the measurements).

#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

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
// running lanes, then those halved as a tree (8, 4, 2, 1). A fixed order, as `dot`'s.
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
  run(pool.num_threads(), p, m);
  if (add != nullptr)
    for (int64_t i = 0; i < m; ++i) p.y[i] = add[i] + p.y[i];
  return ffi::Error::Success();
}

// Float weights: T float (f32[m, n]) or uint16_t (bf16[m, n], widened exactly).
template <typename T, typename Matrix>
ffi::Error MatvecFloat(ffi::ThreadPool pool, Matrix w, F32Vector x, ffi::RemainingArgs extra,
                       F32Result y, int32_t prologue, float eps, int32_t residual) {
  const int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  Product p{rows<T>, w.untyped_data(), nullptr, nullptr, nullptr, n};
  p.weights(w.untyped_data(), m, n * static_cast<int64_t>(sizeof(T)));
  return product(pool, p, m, x, extra, y, prologue, eps, residual);
}
constexpr auto MatvecF32 = MatvecFloat<float, F32Matrix>;
constexpr auto MatvecBf16 = MatvecFloat<uint16_t, Bf16Matrix>;

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

// *p = the product of int8 weights q [m, n] with a scale per group of n / G weights of a row
// (scale f32[m, G]), its rows computed by `rows` (no spans set); an error naming `handler` where
// the scales are not f32[m, G] with G dividing n.
ffi::Error int8_groups_product(const char* handler, Int8Matrix& q, F32Matrix& scale,
                               void (*rows)(const Product&, int64_t, int64_t), Product* p) {
  const int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  const int64_t groups = scale.dimensions()[1];
  if (scale.dimensions()[0] != m || groups < 1 || n % groups != 0)
    return ffi::Error::InvalidArgument(std::string("jllama ") + handler +
                                       ": scale must be f32[m, G] with G dividing n");
  *p = Product{rows, q.typed_data(), scale.typed_data(), nullptr, nullptr, n, groups};
  return ffi::Error::Success();
}

ffi::Error MatvecInt8Groups(ffi::ThreadPool pool, Int8Matrix q, F32Matrix scale, F32Vector x,
                            ffi::RemainingArgs extra, F32Result y, int32_t prologue, float eps,
                            int32_t residual) {
  Product p{};
  if (ffi::Error e = int8_groups_product("matvec_int8_groups", q, scale, rows_int8_groups, &p);
      e.failure())
    return e;
  return product(pool, p, q.dimensions()[0], x, extra, y, prologue, eps, residual);
}

// The arguments and attributes every matvec handler takes after its weights and x: the
// prologue's and the residual's vectors, the result, then `prologue`, `eps` and `residual`
// (`jllama.kernels.matvec` passes them; see `product`).
template <typename Binding>
auto with_prologue(Binding binding) {
  return prologue_attrs(std::move(binding).RemainingArgs().template Ret<F32Vector>());
}

// A matvec handler's binding: the thread pool, the buffers Args (the weights', then x), then
// `with_prologue`'s.
template <typename... Args>
auto matvec_binding() {
  return with_prologue(args<Args...>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
}

}  // namespace

// See kernels.h.
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

// Parenthesized: the commas between the template arguments would split the macro's arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_f32, MatvecF32,
                              (matvec_binding<F32Matrix, F32Vector>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_bf16, MatvecBf16,
                              (matvec_binding<Bf16Matrix, F32Vector>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8, MatvecInt8,
                              (matvec_binding<Int8Matrix, F32Vector, F32Vector>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_int8_groups, MatvecInt8Groups,
                              (matvec_binding<Int8Matrix, F32Matrix, F32Vector>()));

}  // namespace jllama
