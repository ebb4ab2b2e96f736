// The activations of the integer products of GGML blocks (ggml_dot.h, ggml_x8.h). x: f32[n] is
// quantized once per product, block by block as ggml's reference `quantize_row_q8_0_ref`: d =
// max|x_j| / 127, q_j = roundf(x_j / d) (round half away from zero, via x_j * (1 / d) in
// float32), but d stays float32 (Q8_0 stores it as float16). Beside q: the sum of q over each
// 16 (Q6_K, Q3_K and Q2_K scale each 16 weights) and d times the sum over each 32. llama.cpp
// quantizes activations the same way for its integer dot products (Q8_0 per 32 for
// Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K per 256 for the K-quants); here one form of 32
// serves every type, which is at least as precise.

#pragma once

#include "ggml_types.h"

namespace ggml {

// x quantized: q int8[n], d f32[n / 32] (each block's step), s16 int16[n / 16] (sum of q over
// each 16), ds f32[n / 32] (d times the sum of q over each 32, for offsets and minimums). n a
// multiple of 32 (of 256 for the K kind).
struct Activations {
  const int8_t* q;
  const float* d;
  const int16_t* s16;
  const float* ds;
  const int16_t* s32;  // sum(q) per 32 (s16's pairs added): the K-quants' minimums take pairs
  int64_t n;
};

// The three ways llama.cpp's CPU backend quantizes activations for its integer dot products
// (ggml-cpu/arch/x86/quants.c and ggml-quants.c), which jllama's kernels repeat so that their
// products agree with llama.cpp's up to float rounding (its `vec_dot_type` of each weight type):
//   Q8_0 (for Q4_0, Q5_0, Q8_0 weights): per 32, id = 127 / max|x|, q = x * id rounded half to
//     even; the step d = max|x| / 127 stored as float16 (the products use the rounded d);
//   Q8_1 (for Q4_1, Q5_1): Q8_0's q and d, and s = d * sum(q) stored as float16 (the minimum's
//     term uses the rounded s);
//   Q8_K (for the K-quants): per 256, m = the value of largest magnitude (the first such, with
//     its sign), iscale = -127 / m, q = min(127, iscale * x rounded half to even), d = 1 / iscale
//     in float32 (negative when m is positive).
enum ActivationKind : int { kQ8_0 = 0, kQ8_1 = 1, kQ8_K = 2 };
constexpr int kActivationKinds = 3;

inline int activation_kind(int32_t type) {
  const int32_t base = type >= 256 ? type - 256 : type;
  switch (base) {
    case Q4_1: case Q5_1: return kQ8_1;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return kQ8_K;
    default: return kQ8_0;
  }
}

// `n` bytes rounded up to a whole number of cache lines: each array of the scratch starts on one.
inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// Bytes of scratch `quantize` needs for n activations (all four arrays, 64-byte aligned).
inline int64_t activation_bytes(int64_t n) {
  return align64(n) + align64(n / 32 * 4) + align64(n / 16 * 2) + align64(n / 32 * 4) +
         align64(n / 32 * 2);
}

// Rounds y * mul to nearest even (the MXCSR's default mode) into int8 q, `count` values (a
// multiple of 8); `cap`: at most 127 (Q8_K's MIN(127, v)).
inline void round_to_int8(const float* y, float mul, int8_t* q, int64_t count, bool cap) {
  int64_t j = 0;
#if JLLAMA_Q_AVX2
  const __m256 m = _mm256_set1_ps(mul);
  for (; j + 32 <= count; j += 32) {
    __m256i r[4];
    for (int k = 0; k < 4; ++k) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(y + j + 8 * k), m),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (cap) v = _mm256_min_ps(v, _mm256_set1_ps(127.0f));
      r[k] = _mm256_cvtps_epi32(v);
    }
    // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute undoes it.
    const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), p8);
  }
#endif
  for (; j < count; ++j) {
    float v = std::nearbyint(y[j] * mul);
    if (cap) v = std::fmin(v, 127.0f);
    q[j] = static_cast<int8_t>(v);
  }
}

// max |x_j| over `count` values (a multiple of 8), or NaN when one of them is NaN or infinite:
// such a block's step is then NaN, so the products it enters are NaN and the logits' check
// reports it (maxps would drop a NaN and rounding would turn it into a finite -128).
inline float max_abs(const float* x, int64_t count) {
#if JLLAMA_Q_AVX2
  const __m256 sign_bit = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 a = _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + j));
    m = _mm256_max_ps(m, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinite
  }
  if (_mm256_movemask_ps(bad)) return NAN;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
#else
  float a = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    if (!(std::fabs(x[j]) < INFINITY)) return NAN;
    a = std::fmax(a, std::fabs(x[j]));
  }
  return a;
#endif
}

// Quantizes x: f32[n] as `kind` (n a multiple of 32, of 256 for kQ8_K) into `scratch`
// (activation_bytes(n)) and returns the view of it.
inline Activations quantize(const float* x, int64_t n, uint8_t* scratch, int kind) {
  int8_t* q = reinterpret_cast<int8_t*>(scratch);
  float* d = reinterpret_cast<float*>(scratch + align64(n));
  int16_t* s16 = reinterpret_cast<int16_t*>(scratch + align64(n) + align64(n / 32 * 4));
  float* ds =
      reinterpret_cast<float*>(scratch + align64(n) + align64(n / 32 * 4) + align64(n / 16 * 2));
  int16_t* s32 = reinterpret_cast<int16_t*>(scratch + align64(n) + align64(n / 32 * 4) +
                                            align64(n / 16 * 2) + align64(n / 32 * 4));
  if (kind == kQ8_K) {
    for (int64_t s = 0; s < n / 256; ++s) {
      const float* xs = x + 256 * s;
      const float amax = max_abs(xs, 256);
      float step = 0.0f;
      if (std::isnan(amax)) {  // a NaN or infinite value: the block's products are NaN
        std::memset(q + 256 * s, 0, 256);
        step = NAN;
      } else if (amax != 0.0f) {
        int64_t first = 0;
        while (std::fabs(xs[first]) != amax) ++first;
        const float iscale = -127.0f / xs[first];
        round_to_int8(xs, iscale, q + 256 * s, 256, true);
        step = 1.0f / iscale;
      } else {
        std::memset(q + 256 * s, 0, 256);
      }
      for (int b = 0; b < 8; ++b) d[8 * s + b] = step;
    }
  } else {
    for (int64_t b = 0; b < n / 32; ++b) {
      const float amax = max_abs(x + 32 * b, 32);
      d[b] = round_fp16(amax / 127.0f);  // NaN for a block with a NaN or infinite value
      const float id = amax != 0.0f && !std::isnan(amax) ? 127.0f / amax : 0.0f;
      round_to_int8(x + 32 * b, id, q + 32 * b, 32, false);
    }
  }
  for (int64_t b = 0; b < n / 32; ++b) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 16; ++j) {
      lo += q[32 * b + j];
      hi += q[32 * b + 16 + j];
    }
    s16[2 * b] = static_cast<int16_t>(lo);
    s16[2 * b + 1] = static_cast<int16_t>(hi);
    s32[b] = static_cast<int16_t>(lo + hi);
    if (kind == kQ8_1) {  // s = d * sum(q) in float16, d before its own rounding
      const float amax = max_abs(x + 32 * b, 32);
      ds[b] = round_fp16(amax / 127.0f * static_cast<float>(lo + hi));
    } else {
      ds[b] = d[b] * static_cast<float>(lo + hi);
    }
  }
  return Activations{q, d, s16, ds, s32, n};
}

}  // namespace ggml
