// Dot products of one row of GGML-quantized weights (the blocks of a GGUF tensor, as stored)
// with activations quantized to int8 in blocks of 32: the products of jllama's decode kernels
// for quantized models (matvec.cc's `jllama_matvec_ggml`, prefill.cc's chunk products).
//
// Activations. x: f32[n] is quantized once per product, block by block as ggml's reference
// `quantize_row_q8_0_ref`: d = max|x_j| / 127, q_j = roundf(x_j / d) (round half away from
// zero, via x_j * (1 / d) in float32), but d stays float32 (Q8_0 stores it as float16). Beside
// q: the sum of q over each 16 (Q6_K, Q3_K and Q2_K scale each 16 weights) and d times the sum
// over each 32. llama.cpp quantizes activations the same way for its integer dot products (Q8_0
// per 32 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K per 256 for the K-quants); here one form
// of 32 serves every type, which is at least as precise.
//
// Weights. Each type's block decodes to unsigned integers v (0..63) that the weight is an affine
// function of, w = a * (v - o) - b, with a per-32 or per-16 scale a, an integer offset o and a
// per-32 minimum b (layouts: ggml-common.h, GGUF's docs; `jllama/formats/ggml_quants.py`):
//
//   Q8_0  w = d * q            q int8 (signed: handled with the sign trick below)
//   Q4_0  w = d * (v - 8)      v = 4 bits         Q4_1  w = d * v + m
//   Q5_0  w = d * (v - 16)     v = 5 bits         Q5_1  w = d * v + m
//   Q4_K  w = d * sc_j * v - dmin * m_j   (8 sub-blocks of 32; 6-bit sc_j, m_j)
//   Q5_K  the same with 5-bit v
//   Q6_K  w = d * sc_k * (v - 32)         (16 sub-blocks of 16; int8 sc_k; 6-bit v)
//   Q3_K  w = d * (sc_k - 32) * (v - 4)   (16 of 16; 6-bit sc_k; v = 2 bits + 4 * high bit)
//   Q2_K  w = d * sc_k * v - dmin * m_k   (16 of 16; 4-bit sc_k and m_k; 2-bit v)
//
// So a block's share of the dot product is an integer dot of v with the activations' q, scaled:
//   sum_j w_j x_j ~= a * dx * (sum_j v_j q_j - o * sum_j q_j) - b * dx * sum_j q_j,
// the integer sums exact (int32), the scaling in float32. Per row the blocks go in order, the
// integer products of a block in 8 int32 lanes that are converted and multiplied into 8 float32
// running lanes, the offsets and minimums in one float32 running sum; at the row's end the lanes
// are summed as a fixed tree and the offsets' sum subtracted. A fixed order: the same row and x
// give the same bits on every thread count.
//
// Three builds of the same arithmetic: AVX2 + FMA + F16C (x86-64-v3; AVX-512 builds use these
// 256-bit loops too, with AVX-512 VNNI's or AVX-VNNI's dpbusd for the integer dot where the
// CPU has it), and plain C++ for everything else (the integer sums are the same; the float
// lanes are summed in another order, so results differ from the SIMD builds by rounding only).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JLLAMA_Q_AVX2 1
#endif

namespace ggml {

// ggml's `enum ggml_type` ids, as stored in a GGUF tensor-info record.
enum Type : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// Elements and bytes per block of a type this file reads; {0, 0} for any other id.
struct Layout {
  int64_t elements, bytes;
};
inline Layout layout(int32_t type) {
  if (type >= 256) {  // an x8 layout (ggml_x8.h): the same blocks, eight rows repacked
    switch (type - 256) {
      case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q4_K: case Q5_K: case Q6_K:
        return layout(type - 256);
      default:
        return {0, 0};
    }
  }
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

// Whether a type's products run on quantized activations (every type but the float ones).
inline bool integer_type(int32_t type) { return type != F32 && type != F16 && type != BF16; }

// Whether a type id is an x8 layout (ggml_x8.h).
inline bool x8_type(int32_t type) { return type >= 256; }

// IEEE float16 -> float32, exact.
inline float fp16(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// x quantized: q int8[n], d f32[n / 32] (each block's step), s16 int16[n / 16] (sum of q over
// each 16), ds f32[n / 32] (d times the sum of q over each 32, for offsets and minimums). n a
// multiple of 32 (of 256 for the K kind).
struct Activations {
  const int8_t* q;
  const float* d;
  const int16_t* s16;
  const float* ds;
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

// float32 -> float16 -> float32, rounding to nearest even (F16C's `_cvtss_sh(x, 0)`, which
// ggml's GGML_CPU_FP32_TO_FP16 is on x86).
inline float round_fp16(float f) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = x & 0x80000000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  uint16_t h;
  if (ax >= 0x7F800000u) {  // inf or NaN
    h = static_cast<uint16_t>((sign >> 16) | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0));
  } else if (ax >= 0x477FF000u) {  // rounds to >= 65520: inf
    h = static_cast<uint16_t>((sign >> 16) | 0x7C00u);
  } else if (ax < 0x38800000u) {  // below float16's normals: a multiple of 2^-24
    float a;
    std::memcpy(&a, &ax, sizeof a);
    const float scaled = std::nearbyint(a * 16777216.0f);  // exact scaling, then RNE
    h = static_cast<uint16_t>((sign >> 16) | static_cast<uint32_t>(scaled));
  } else {
    const uint32_t mant = ax & 0x7FFFFFu, exp = (ax >> 23) - 112;
    uint32_t v = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (v & 1))) ++v;  // carries into the exponent
    h = static_cast<uint16_t>((sign >> 16) | v);
  }
  return fp16(h);
#endif
}

// Bytes of scratch `quantize` needs for n activations (all four arrays, 64-byte aligned).
inline int64_t activation_bytes(int64_t n) {
  auto up = [](int64_t b) { return (b + 63) / 64 * 64; };
  return up(n) + up(n / 32 * 4) + up(n / 16 * 2) + up(n / 32 * 4);
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
  auto up = [](int64_t b) { return (b + 63) / 64 * 64; };
  int8_t* q = reinterpret_cast<int8_t*>(scratch);
  float* d = reinterpret_cast<float*>(scratch + up(n));
  int16_t* s16 = reinterpret_cast<int16_t*>(scratch + up(n) + up(n / 32 * 4));
  float* ds = reinterpret_cast<float*>(scratch + up(n) + up(n / 32 * 4) + up(n / 16 * 2));
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
    if (kind == kQ8_1) {  // s = d * sum(q) in float16, d before its own rounding
      const float amax = max_abs(x + 32 * b, 32);
      ds[b] = round_fp16(amax / 127.0f * static_cast<float>(lo + hi));
    } else {
      ds[b] = d[b] * static_cast<float>(lo + hi);
    }
  }
  return Activations{q, d, s16, ds, n};
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K's 16 6-bit scales, each minus 32.
inline void scales_q3_k(const uint8_t* s, int* out) {
  for (int k = 0; k < 16; ++k) {
    const int low = k < 8 ? s[k] & 0xF : s[k - 8] >> 4;
    const int high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    out[k] = (low | (high << 4)) - 32;
  }
}

#if JLLAMA_Q_AVX2

// 8 int32 lanes, lane i the sum of u[4i .. 4i + 3] * s[4i .. 4i + 3]; u unsigned (at most 128
// where the sign trick is used, 63 otherwise: the 16-bit pair sums of maddubs cannot saturate).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The same with the first 16 products times sc0 and the last 16 times sc1 (int16 scales).
inline __m256i dot_u8s8_scaled16(__m256i u, __m256i s, int sc0, int sc1) {
  const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(sc1)),
                                          _mm_set1_epi16(static_cast<int16_t>(sc0)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales);
}

inline __m256i load32(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// acc += (float) lanes * scale.
inline __m256 scaled(__m256 acc, __m256i lanes, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(scale), acc);
}

// 8 float lanes as a tree: k with k + 4, then + 2, then + 1.
inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// 32 nibbles of 16 bytes: byte j's low nibble is element j, its high nibble element j + 16.
inline __m256i nibbles_32(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

// 32 bits as bytes: byte j = 0x10 where bit j of `bits` is set, else 0.
inline __m256i bits_to_0x10(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline float row_q8_0(const uint8_t* w, const Activations& x) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.n / 32; ++b, w += 34) {
    const __m256i q = load32(w + 2), a = load32(x.q + 32 * b);
    const __m256i lanes = dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    acc = scaled(acc, lanes, fp16(load_u16(w)) * x.d[b]);
  }
  return hsum8(acc);
}

template <int Offset>  // Q4_0: 8; Q4_1: no offset, a minimum
inline float row_q4(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Offset ? 18 : 20, qs = Offset ? 2 : 4;
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t b = 0; b < x.n / 32; ++b, w += bytes) {
    const float d = fp16(load_u16(w));
    acc = scaled(acc, dot_u8s8(nibbles_32(w + qs), load32(x.q + 32 * b)), d * x.d[b]);
    off += Offset ? Offset * d * x.ds[b] : -fp16(load_u16(w + 2)) * x.ds[b];
  }
  return hsum8(acc) - off;
}

template <int Offset>  // Q5_0: 16; Q5_1: no offset, a minimum
inline float row_q5(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Offset ? 22 : 24, qh = Offset ? 2 : 4;
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t b = 0; b < x.n / 32; ++b, w += bytes) {
    const float d = fp16(load_u16(w));
    uint32_t high;
    std::memcpy(&high, w + qh, 4);
    const __m256i v = _mm256_or_si256(nibbles_32(w + qh + 4), bits_to_0x10(high));
    acc = scaled(acc, dot_u8s8(v, load32(x.q + 32 * b)), d * x.d[b]);
    off += Offset ? Offset * d * x.ds[b] : -fp16(load_u16(w + 2)) * x.ds[b];
  }
  return hsum8(acc) - off;
}

template <bool Five>  // Q4_K, or Q5_K with its high bits
inline float row_qk(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Five ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t s = 0; s < x.n / 256; ++s, w += bytes) {
    const float d = fp16(load_u16(w)), dmin = fp16(load_u16(w + 2));
    const uint8_t* scales = w + 4;
    const uint8_t* qs = w + (Five ? 48 : 16);
    __m256i high = Five ? load32(w + 16) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i packed = load32(qs + 32 * g);
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * g + half;
        const int64_t b = 8 * s + j;
        __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4);
        if (Five) {
          v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
          high = _mm256_srli_epi16(high, 1);
        }
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        acc = scaled(acc, dot_u8s8(v, load32(x.q + 32 * b)), d * static_cast<float>(sc) * x.d[b]);
        off += dmin * static_cast<float>(m) * x.ds[b];
      }
    }
  }
  return hsum8(acc) - off;
}

inline float row_q6_k(const uint8_t* w, const Activations& x) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t s = 0; s < x.n / 256; ++s, w += 210) {
    const float d = fp16(load_u16(w + 208));
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int n = 0; n < 2; ++n) {
      const __m256i ql0 = load32(w + 64 * n), ql1 = load32(w + 64 * n + 32);
      const __m256i qh = load32(w + 128 + 32 * n);
      const __m256i v[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low4),
                          _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4)),
      };
      for (int k = 0; k < 4; ++k) {
        const int64_t b = 8 * s + 4 * n + k;  // activation block: elements 32 b .. 32 b + 31
        const int s0 = sc[8 * n + 2 * k], s1 = sc[8 * n + 2 * k + 1];
        const __m256i lanes = dot_u8s8_scaled16(v[k], load32(x.q + 32 * b), s0, s1);
        const float dx = d * x.d[b];
        acc = scaled(acc, lanes, dx);
        off += 32.0f * dx * static_cast<float>(s0 * x.s16[2 * b] + s1 * x.s16[2 * b + 1]);
      }
    }
  }
  return hsum8(acc) - off;
}

inline float row_q3_k(const uint8_t* w, const Activations& x) {
  const __m256i two = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t s = 0; s < x.n / 256; ++s, w += 110) {
    const float d = fp16(load_u16(w + 108));
    int sc[16];
    scales_q3_k(w + 96, sc);
    const __m256i hmask = load32(w);
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(w + 32 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 8 * s + 4 * n + j;
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), two);
        const __m256i hbit = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * n + j), one);
        const __m256i v = _mm256_or_si256(low, _mm256_slli_epi16(hbit, 2));
        const int s0 = sc[8 * n + 2 * j], s1 = sc[8 * n + 2 * j + 1];
        const float dx = d * x.d[b];
        acc = scaled(acc, dot_u8s8_scaled16(v, load32(x.q + 32 * b), s0, s1), dx);
        off += 4.0f * dx * static_cast<float>(s0 * x.s16[2 * b] + s1 * x.s16[2 * b + 1]);
      }
    }
  }
  return hsum8(acc) - off;
}

inline float row_q2_k(const uint8_t* w, const Activations& x) {
  const __m256i two = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  float off = 0.0f;
  for (int64_t s = 0; s < x.n / 256; ++s, w += 84) {
    const uint8_t* scales = w;
    const float d = fp16(load_u16(w + 80)), dmin = fp16(load_u16(w + 82));
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(w + 16 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 8 * s + 4 * n + j;
        const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), two);
        const int k = 8 * n + 2 * j;
        const int s0 = scales[k] & 0xF, s1 = scales[k + 1] & 0xF;
        acc = scaled(acc, dot_u8s8_scaled16(v, load32(x.q + 32 * b), s0, s1), d * x.d[b]);
        off += dmin * x.d[b] *
               static_cast<float>((scales[k] >> 4) * x.s16[2 * b] + (scales[k + 1] >> 4) * x.s16[2 * b + 1]);
      }
    }
  }
  return hsum8(acc) - off;
}

#else  // plain C++

// The values v and the per-16 integer scales of one activation block of 32: *a = the float
// factor of the block (or of each 16, sa[0..1] integers multiplying it), off = what the block
// subtracts per unit of the activations' sums.
inline int32_t idot32(const uint8_t* v, const int8_t* q) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(v[j]) * q[j];
  return s;
}
inline int32_t idot16(const uint8_t* v, const int8_t* q) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += static_cast<int32_t>(v[j]) * q[j];
  return s;
}

inline float row_q8_0(const uint8_t* w, const Activations& x) {
  float acc = 0.0f;
  for (int64_t b = 0; b < x.n / 32; ++b, w += 34) {
    int32_t s = 0;
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(q[j]) * x.q[32 * b + j];
    acc += static_cast<float>(s) * (fp16(load_u16(w)) * x.d[b]);
  }
  return acc;
}

template <int Offset>
inline float row_q4(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Offset ? 18 : 20, qs = Offset ? 2 : 4;
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t b = 0; b < x.n / 32; ++b, w += bytes) {
    for (int j = 0; j < 16; ++j) {
      v[j] = w[qs + j] & 0xF;
      v[j + 16] = w[qs + j] >> 4;
    }
    const float d = fp16(load_u16(w));
    acc += static_cast<float>(idot32(v, x.q + 32 * b)) * (d * x.d[b]);
    off += Offset ? Offset * d * x.ds[b] : -fp16(load_u16(w + 2)) * x.ds[b];
  }
  return acc - off;
}

template <int Offset>
inline float row_q5(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Offset ? 22 : 24, qh = Offset ? 2 : 4;
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t b = 0; b < x.n / 32; ++b, w += bytes) {
    uint32_t high;
    std::memcpy(&high, w + qh, 4);
    for (int j = 0; j < 16; ++j) {
      v[j] = (w[qh + 4 + j] & 0xF) | (((high >> j) & 1) << 4);
      v[j + 16] = (w[qh + 4 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
    }
    const float d = fp16(load_u16(w));
    acc += static_cast<float>(idot32(v, x.q + 32 * b)) * (d * x.d[b]);
    off += Offset ? Offset * d * x.ds[b] : -fp16(load_u16(w + 2)) * x.ds[b];
  }
  return acc - off;
}

template <bool Five>
inline float row_qk(const uint8_t* w, const Activations& x) {
  constexpr int64_t bytes = Five ? 176 : 144;
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t s = 0; s < x.n / 256; ++s, w += bytes) {
    const float d = fp16(load_u16(w)), dmin = fp16(load_u16(w + 2));
    const uint8_t* qh = w + 16;
    const uint8_t* qs = w + (Five ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        v[l] = (j % 2 ? byte >> 4 : byte & 0xF) | (Five ? ((qh[l] >> j) & 1) << 4 : 0);
      }
      int sc, m;
      scale_min_k4(j, w + 4, &sc, &m);
      acc += static_cast<float>(idot32(v, x.q + 32 * b)) * (d * static_cast<float>(sc) * x.d[b]);
      off += dmin * static_cast<float>(m) * x.ds[b];
    }
  }
  return acc - off;
}

inline float row_q6_k(const uint8_t* w, const Activations& x) {
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t s = 0; s < x.n / 256; ++s, w += 210) {
    const float d = fp16(load_u16(w + 208));
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = w + 64 * n;
      const uint8_t* qh = w + 128 + 32 * n;
      for (int k = 0; k < 4; ++k) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t low = k % 2 ? ql[32 + l] : ql[l];
          v[l] = ((k < 2 ? low : low >> 4) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
        }
        const int64_t b = 8 * s + 4 * n + k;
        const int s0 = sc[8 * n + 2 * k], s1 = sc[8 * n + 2 * k + 1];
        const int32_t dot = s0 * idot16(v, x.q + 32 * b) + s1 * idot16(v + 16, x.q + 32 * b + 16);
        const float dx = d * x.d[b];
        acc += static_cast<float>(dot) * dx;
        off += 32.0f * dx * static_cast<float>(s0 * x.s16[2 * b] + s1 * x.s16[2 * b + 1]);
      }
    }
  }
  return acc - off;
}

inline float row_q3_k(const uint8_t* w, const Activations& x) {
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t s = 0; s < x.n / 256; ++s, w += 110) {
    const float d = fp16(load_u16(w + 108));
    int sc[16];
    scales_q3_k(w + 96, sc);
    for (int n = 0; n < 2; ++n) {
      for (int j = 0; j < 4; ++j) {
        for (int l = 0; l < 32; ++l)
          v[l] = ((w[32 + 32 * n + l] >> (2 * j)) & 3) | (((w[l] >> (4 * n + j)) & 1) << 2);
        const int64_t b = 8 * s + 4 * n + j;
        const int s0 = sc[8 * n + 2 * j], s1 = sc[8 * n + 2 * j + 1];
        const int32_t dot = s0 * idot16(v, x.q + 32 * b) + s1 * idot16(v + 16, x.q + 32 * b + 16);
        const float dx = d * x.d[b];
        acc += static_cast<float>(dot) * dx;
        off += 4.0f * dx * static_cast<float>(s0 * x.s16[2 * b] + s1 * x.s16[2 * b + 1]);
      }
    }
  }
  return acc - off;
}

inline float row_q2_k(const uint8_t* w, const Activations& x) {
  float acc = 0.0f, off = 0.0f;
  uint8_t v[32];
  for (int64_t s = 0; s < x.n / 256; ++s, w += 84) {
    const uint8_t* scales = w;
    const float d = fp16(load_u16(w + 80)), dmin = fp16(load_u16(w + 82));
    for (int n = 0; n < 2; ++n) {
      for (int j = 0; j < 4; ++j) {
        for (int l = 0; l < 32; ++l) v[l] = (w[16 + 32 * n + l] >> (2 * j)) & 3;
        const int64_t b = 8 * s + 4 * n + j;
        const int k = 8 * n + 2 * j;
        const int32_t dot = (scales[k] & 0xF) * idot16(v, x.q + 32 * b) +
                            (scales[k + 1] & 0xF) * idot16(v + 16, x.q + 32 * b + 16);
        acc += static_cast<float>(dot) * (d * x.d[b]);
        off += dmin * x.d[b] *
               static_cast<float>((scales[k] >> 4) * x.s16[2 * b] + (scales[k + 1] >> 4) * x.s16[2 * b + 1]);
      }
    }
  }
  return acc - off;
}

#endif

// One row of n elements of `type` to float32, exactly as ggml's reference dequantizers
// (`dequantize_row_*` in ggml-quants.c: the same float32 operations in the same order, so the
// same bits; `jllama/formats/ggml_quants.py` is the NumPy twin the tests compare with).
// Returns false for a type `layout` does not know.
inline bool dequantize_row(int32_t type, const uint8_t* w, float* y, int64_t n) {
  switch (type) {
    case F32:
      std::memcpy(y, w, sizeof(float) * n);
      return true;
    case F16:
      for (int64_t i = 0; i < n; ++i) y[i] = fp16(load_u16(w + 2 * i));
      return true;
    case BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(load_u16(w + 2 * i)) << 16;
        std::memcpy(y + i, &bits, sizeof(float));
      }
      return true;
    case Q8_0:
      for (int64_t b = 0; b < n / 32; ++b, w += 34) {
        const float d = fp16(load_u16(w));
        for (int j = 0; j < 32; ++j) y[32 * b + j] = static_cast<float>(static_cast<int8_t>(w[2 + j])) * d;
      }
      return true;
    case Q4_0:
    case Q4_1: {
      const bool min = type == Q4_1;
      const int64_t bytes = min ? 20 : 18, qs = min ? 4 : 2;
      for (int64_t b = 0; b < n / 32; ++b, w += bytes) {
        const float d = fp16(load_u16(w)), m = min ? fp16(load_u16(w + 2)) : 0.0f;
        for (int j = 0; j < 16; ++j) {
          const int lo = w[qs + j] & 0xF, hi = w[qs + j] >> 4;
          if (min) {
            y[32 * b + j] = static_cast<float>(lo) * d + m;
            y[32 * b + j + 16] = static_cast<float>(hi) * d + m;
          } else {
            y[32 * b + j] = static_cast<float>(lo - 8) * d;
            y[32 * b + j + 16] = static_cast<float>(hi - 8) * d;
          }
        }
      }
      return true;
    }
    case Q5_0:
    case Q5_1: {
      const bool min = type == Q5_1;
      const int64_t bytes = min ? 24 : 22, qh = min ? 4 : 2;
      for (int64_t b = 0; b < n / 32; ++b, w += bytes) {
        const float d = fp16(load_u16(w)), m = min ? fp16(load_u16(w + 2)) : 0.0f;
        uint32_t high;
        std::memcpy(&high, w + qh, 4);
        for (int j = 0; j < 16; ++j) {
          const int lo = (w[qh + 4 + j] & 0xF) | (((high >> j) & 1) << 4);
          const int hi = (w[qh + 4 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
          if (min) {
            y[32 * b + j] = static_cast<float>(lo) * d + m;
            y[32 * b + j + 16] = static_cast<float>(hi) * d + m;
          } else {
            y[32 * b + j] = static_cast<float>(lo - 16) * d;
            y[32 * b + j + 16] = static_cast<float>(hi - 16) * d;
          }
        }
      }
      return true;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      for (int64_t s = 0; s < n / 256; ++s, w += five ? 176 : 144) {
        const float d = fp16(load_u16(w)), dmin = fp16(load_u16(w + 2));
        const uint8_t* qh = w + 16;
        const uint8_t* qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          scale_min_k4(j, w + 4, &sc, &m);
          const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
          for (int l = 0; l < 32; ++l) {
            const uint8_t byte = qs[32 * (j / 2) + l];
            int v = j % 2 ? byte >> 4 : byte & 0xF;
            if (five) v += ((qh[l] >> j) & 1) ? 16 : 0;
            y[256 * s + 32 * j + l] = d1 * static_cast<float>(v) - m1;
          }
        }
      }
      return true;
    }
    case Q6_K:
      for (int64_t s = 0; s < n / 256; ++s, w += 210) {
        const float d = fp16(load_u16(w + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = w + 64 * h;
          const uint8_t* qh = w + 128 + 32 * h;
          float* out = y + 256 * s + 128 * h;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            out[l] = d * static_cast<float>(sc[8 * h + is]) * static_cast<float>(q1);
            out[l + 32] = d * static_cast<float>(sc[8 * h + is + 2]) * static_cast<float>(q2);
            out[l + 64] = d * static_cast<float>(sc[8 * h + is + 4]) * static_cast<float>(q3);
            out[l + 96] = d * static_cast<float>(sc[8 * h + is + 6]) * static_cast<float>(q4);
          }
        }
      }
      return true;
    case Q3_K:
      for (int64_t s = 0; s < n / 256; ++s, w += 110) {
        const float d = fp16(load_u16(w + 108));
        int sc[16];
        scales_q3_k(w + 96, sc);
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j)
            for (int half = 0; half < 2; ++half) {
              const float dl = d * static_cast<float>(sc[8 * h + 2 * j + half]);
              for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int low = (w[32 + 32 * h + l] >> (2 * j)) & 3;
                const int v = low - (((w[l] >> (4 * h + j)) & 1) ? 0 : 4);
                y[256 * s + 128 * h + 32 * j + l] = dl * static_cast<float>(v);
              }
            }
      }
      return true;
    case Q2_K:
      for (int64_t s = 0; s < n / 256; ++s, w += 84) {
        const float d = fp16(load_u16(w + 80)), dmin = fp16(load_u16(w + 82));
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j)
            for (int half = 0; half < 2; ++half) {
              const uint8_t sc = w[8 * h + 2 * j + half];
              const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
              for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int v = (w[16 + 32 * h + l] >> (2 * j)) & 3;
                y[256 * s + 128 * h + 32 * j + l] = dl * static_cast<float>(v) - ml;
              }
            }
      }
      return true;
    default:
      return false;
  }
}

// One row of an integer type (`integer_type`) dotted with quantized activations.
template <int32_t T>
inline float row_dot(const uint8_t* w, const Activations& x) {
  if constexpr (T == Q8_0) return row_q8_0(w, x);
  else if constexpr (T == Q4_0) return row_q4<8>(w, x);
  else if constexpr (T == Q4_1) return row_q4<0>(w, x);
  else if constexpr (T == Q5_0) return row_q5<16>(w, x);
  else if constexpr (T == Q5_1) return row_q5<0>(w, x);
  else if constexpr (T == Q4_K) return row_qk<false>(w, x);
  else if constexpr (T == Q5_K) return row_qk<true>(w, x);
  else if constexpr (T == Q6_K) return row_q6_k(w, x);
  else if constexpr (T == Q3_K) return row_q3_k(w, x);
  else if constexpr (T == Q2_K) return row_q2_k(w, x);
  else return 0.0f;
}

}  // namespace ggml
