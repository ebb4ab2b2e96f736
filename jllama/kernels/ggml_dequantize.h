// GGML blocks dequantized to float32, exactly as ggml's reference dequantizers
// (`dequantize_row_*` in ggml-quants.c: the same float32 operations in the same order, so the
// same bits; `jllama/formats/ggml_quants.py` is the NumPy twin the tests compare with): the
// prefill chunks' weights for XLA's matrix products and the embedding rows of GGUF models.

#pragma once

#include "ggml_types.h"

namespace ggml {

// Q4_0 and Q5_0 (w = d * (v - Offset), Offset 8 or 16) or Q4_1 and Q5_1 (Offset 0: w = d * v +
// m); Five: each value has a fifth, high bit.
template <int Offset, bool Five>
inline void dequantize_q4_5(const uint8_t* w, float* y, int64_t n) {
  constexpr int64_t qh = Offset ? 2 : 4, qs = qh + (Five ? 4 : 0);  // after d (and m)
  for (int64_t b = 0; b < n / 32; ++b, w += qs + 16) {
    const float d = fp16(load_u16(w)), m = Offset ? 0.0f : fp16(load_u16(w + 2));
    uint32_t high = 0;
    if (Five) std::memcpy(&high, w + qh, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (w[qs + j] & 0xF) | (((high >> j) & 1) << 4);
      const int hi = (w[qs + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
      if (Offset) {
        y[32 * b + j] = static_cast<float>(lo - Offset) * d;
        y[32 * b + j + 16] = static_cast<float>(hi - Offset) * d;
      } else {
        y[32 * b + j] = static_cast<float>(lo) * d + m;
        y[32 * b + j + 16] = static_cast<float>(hi) * d + m;
      }
    }
  }
}

// Q3_K or Q2_K: 16 sub-blocks of 16 per 256; sub-block 8 h + 2 j + half is the 2-bit plane j of
// half h of the values, elements 16 half .. 16 half + 15, with its own scale (and, in Q2_K,
// minimum).
template <int32_t T>
inline void dequantize_k16(const uint8_t* w, float* y, int64_t n) {
  constexpr bool q3 = T == Q3_K;
  for (int64_t s = 0; s < n / 256; ++s, w += q3 ? 110 : 84) {
    const float d = fp16(load_u16(w + (q3 ? 108 : 80))), dmin = q3 ? 0.0f : fp16(load_u16(w + 82));
    int sc[16];
    if (q3) scales_q3_k(w + 96, sc);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int half = 0; half < 2; ++half) {
          const int k = 8 * h + 2 * j + half;
          const float dl = d * static_cast<float>(q3 ? sc[k] : w[k] & 0xF);
          const float ml = dmin * static_cast<float>(w[k] >> 4);  // Q2_K's minimum
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            float* out = y + 256 * s + 128 * h + 32 * j + l;
            if (q3) {
              const int low = (w[32 + 32 * h + l] >> (2 * j)) & 3;
              *out = dl * static_cast<float>(low - (((w[l] >> (4 * h + j)) & 1) ? 0 : 4));
            } else {
              *out = dl * static_cast<float>((w[16 + 32 * h + l] >> (2 * j)) & 3) - ml;
            }
          }
        }
  }
}

// One row of n elements of `type` to float32. Returns false for a type `layout` does not know.
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
    case Q4_0: dequantize_q4_5<8, false>(w, y, n); return true;
    case Q4_1: dequantize_q4_5<0, false>(w, y, n); return true;
    case Q5_0: dequantize_q4_5<16, true>(w, y, n); return true;
    case Q5_1: dequantize_q4_5<0, true>(w, y, n); return true;
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
    case Q3_K: dequantize_k16<Q3_K>(w, y, n); return true;
    case Q2_K: dequantize_k16<Q2_K>(w, y, n); return true;
    default:
      return false;
  }
}

}  // namespace ggml
