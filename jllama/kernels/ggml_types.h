// GGML's block types as jllama's kernels read them (the blocks of a GGUF tensor, as stored):
// ggml's type ids, each type's block layout, its float16 fields and the K-quants' packed scales.
// The products (ggml_dot.h, ggml_x8.h), the activations they run on (ggml_quantize.h) and the
// dequantizers (ggml_dequantize.h) all build on this file.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// The build has the 256-bit integer and float16 instructions the SIMD loops of ggml_dot.h,
// ggml_quantize.h and ggml_x8.h are written in (x86-64-v3 and up).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JLLAMA_Q_AVX2 1
#endif

namespace ggml {

// ggml's `enum ggml_type` ids, as stored in a GGUF tensor-info record.
enum Type : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// From a type id to the code compiled for its type: f(std::integral_constant<int32_t, T>{}) for
// the T of Types that `type` is, and true; false (f not called) when it is none of them.
template <int32_t... Types, typename F>
inline bool with_type(int32_t type, F&& f) {
  return ((type == Types ? (f(std::integral_constant<int32_t, Types>{}), true) : false) || ...);
}

// `with_type` over the types with an x8 layout (ggml_x8.h).
template <typename F>
inline bool with_x8_type(int32_t type, F&& f) {
  return with_type<Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K>(type, f);
}

inline bool has_x8(int32_t type) {
  return with_x8_type(type, [](auto) {});
}

// Elements and bytes per block of a type the kernels read; {0, 0} for any other id.
struct Layout {
  int64_t elements, bytes;
};
inline Layout layout(int32_t type) {
  if (type >= 256)  // an x8 layout (ggml_x8.h): the same blocks, eight rows repacked
    return has_x8(type - 256) ? layout(type - 256) : Layout{0, 0};
  struct Entry {
    int32_t type;
    Layout layout;
  };
  static constexpr Entry kLayouts[] = {
      {F32, {1, 4}},     {F16, {1, 2}},      {BF16, {1, 2}},     {Q4_0, {32, 18}},
      {Q4_1, {32, 20}},  {Q5_0, {32, 22}},   {Q5_1, {32, 24}},   {Q8_0, {32, 34}},
      {Q2_K, {256, 84}}, {Q3_K, {256, 110}}, {Q4_K, {256, 144}}, {Q5_K, {256, 176}},
      {Q6_K, {256, 210}},
  };
  for (const Entry& e : kLayouts)
    if (e.type == type) return e.layout;
  return {0, 0};
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

// float32 -> float16's bits, rounding to nearest even (F16C's `_cvtss_sh(x, 0)`, which ggml's
// GGML_CPU_FP32_TO_FP16 is on x86); a NaN stays a (quiet) NaN.
inline uint16_t fp16_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
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
  return h;
#endif
}

// float32 -> float16 -> float32, rounding to nearest even (`fp16_bits`).
inline float round_fp16(float f) { return fp16(fp16_bits(f)); }

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

}  // namespace ggml
