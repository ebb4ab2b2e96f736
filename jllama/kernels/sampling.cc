// Picking the next token from the logits: drawn as llama2.c run.c's sampler does
// (`jllama_sample_f32`), or greedily, with the check that every logit is finite
// (`jllama_argmax_f32`).

#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

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
      // run.c sorts every candidate (a stable sort by descending probability), but only the
      // prefix up to where the running sum passes top_p is ever read: sort a prefix that grows
      // until it holds that point. Ties go to the lower id, so the order is the stable sort's.
      // (A broad distribution has tens of thousands of candidates: the full sort took ~3 ms a
      // row of SmolLM2's 49152.)
      int64_t* sorted = ids.get();
      auto before = [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
      auto prob = [p, sorted](int64_t j) { return p[sorted[j]]; };
      float cumulative = 0.0f;
      int64_t last = 0;
      for (int64_t m = std::min<int64_t>(k, 256);; m = std::min<int64_t>(k, 4 * m)) {
        std::partial_sort(sorted, sorted + m, sorted + k, before);
        last = first_sum_over(m, prob, top_p, &cumulative);
        if (cumulative > top_p || m == k) break;  // the sum passed top_p, or no prefix does
      }
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

// ---------------------------------------------------------------------------------------------
// The next token of every row of a batched decode step (`jllama.kernels.sample_batch`): row b <
// count is `sample_token` of logits[b] with its own temperature, top_p and coin, or run.c's
// argmax where its temperature is 0, and finite[b] says whether every logit of the row is
// finite (the token means nothing where not). Rows are shared among the threads (a row's draw
// is ~49152 exps in double for SmolLM2); rows from count on get 0.

struct SampleRows {
  const float *logits, *temperature, *top_p, *coin;
  int64_t vocab;
  int32_t *token, *finite;
};

void sample_rows(const Product& p, int64_t begin, int64_t end) {
  const SampleRows& s = *static_cast<const SampleRows*>(p.w);
  for (int64_t b = begin; b < end; ++b) {
    const float* row = s.logits + b * s.vocab;
    bool finite = true;
    for (int64_t i = 0; i < s.vocab && finite; ++i) finite = std::isfinite(row[i]);
    s.finite[b] = finite ? 1 : 0;
    if (!finite) s.token[b] = 0;
    else if (s.temperature[b] == 0.0f) s.token[b] = static_cast<int32_t>(first_max(row, s.vocab));
    else s.token[b] = static_cast<int32_t>(
        sample_token(row, s.vocab, s.temperature[b], s.top_p[b], s.coin[b]));
  }
}

ffi::Error SampleBatchF32(ffi::ThreadPool pool, F32Matrix logits, F32Vector temperature,
                          F32Vector top_p, F32Vector coin, S32Scalar count,
                          S32VectorResult token, S32VectorResult finite) {
  const int64_t batch = logits.dimensions()[0], vocab = logits.dimensions()[1];
  const int64_t live = *count.typed_data();
  if (vocab < 1) return ffi::Error::InvalidArgument("jllama sample_batch: no logits");
  if (temperature.dimensions()[0] != batch || top_p.dimensions()[0] != batch ||
      coin.dimensions()[0] != batch)
    return ffi::Error::InvalidArgument("jllama sample_batch: one temperature, top_p, coin a row");
  if (live < 0 || live > batch)
    return ffi::Error::InvalidArgument("jllama sample_batch: count outside 0 .. batch");
  SampleRows s{logits.typed_data(), temperature.typed_data(), top_p.typed_data(),
               coin.typed_data(), vocab, token->typed_data(), finite->typed_data()};
  for (int64_t b = live; b < batch; ++b) s.token[b] = 0, s.finite[b] = 1;
  run(pool.num_threads(), Product{sample_rows, &s, nullptr, nullptr, nullptr, vocab}, live);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_sample_batch_f32, SampleBatchF32,
    (args<F32Matrix, F32Vector, F32Vector, F32Vector, S32Scalar>(  // logits, T, top_p, coin, count
         ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
         .Ret<S32Vector>()  // token
         .Ret<S32Vector>()));  // finite
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_argmax_f32, ArgmaxF32,
                              (rets<S32Scalar, S32Scalar>(ffi::Ffi::Bind().Arg<F32Vector>())));
// Parenthesized: the commas between the template arguments would split the macro's arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_sample_f32, SampleF32,
    (args<F32Vector, F32Scalar, F32Scalar, F32Scalar>(ffi::Ffi::Bind())  // logits, T, top_p, coin
         .Ret<S32Scalar>()));

}  // namespace jllama
