// Dot products of one row of GGML-quantized weights (the blocks of a GGUF tensor, as stored)
// with activations quantized to int8 in blocks of 32 (ggml_quantize.h): the products of jllama's
// decode kernels for quantized models (ggml_products.cc's `jllama_matvec_ggml`, and its
// `jllama_matmul_ggml` for the prefill chunks).
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
// Each type's row is written once (`row_q8_0` .. `row_q2_k`) in a few primitives each build
// defines: how a block's 32 values are decoded and dotted with the activations, and how the row's
// running float lanes are held and summed.

#pragma once

#include <array>

#include "ggml_quantize.h"

namespace ggml {

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

// A row's running sums are 8 float lanes, a block's integer products 8 int32 lanes, its 32
// values one register.
using Lanes = __m256;
using IntLanes = __m256i;
using Values = __m256i;

inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline float total(Lanes acc) { return hsum8(acc); }
// acc += dot * scale, lane by lane.
inline void add_scaled(Lanes& acc, IntLanes dot, float scale) { acc = scaled(acc, dot, scale); }

// 32 unsigned values dotted with the activations q[0 .. 31]; dot16x2: the first 16 products
// times s0, the last 16 times s1.
inline IntLanes dot32(Values v, const int8_t* q) { return dot_u8s8(v, load32(q)); }
inline IntLanes dot16x2(Values v, const int8_t* q, int s0, int s1) {
  return dot_u8s8_scaled16(v, load32(q), s0, s1);
}

// Q8_0's 32 signed weights qs dotted with q, by the sign trick: |w| times q with w's sign.
inline IntLanes dot_q8_0(const uint8_t* qs, const int8_t* q) {
  const __m256i w = load32(qs), a = load32(q);
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// A Q4_0 / Q4_1 block's 32 values (its nibbles qs), or a Q5_0 / Q5_1 block's with their fifth
// bits `high`.
inline Values q4_values(const uint8_t* qs) { return nibbles_32(qs); }
inline Values q5_values(const uint8_t* qs, uint32_t high) {
  return _mm256_or_si256(nibbles_32(qs), bits_to_0x10(high));
}

// The 8 sub-blocks of 32 values of the Q4_K / Q5_K superblock w: sub-block 2 g + half is the
// low (half 0) or high nibbles of qs[32 g .. 32 g + 31] (and, Five, each value's bit of qh).
// Called for g = 0 .. 3 and half = 0, 1 in that order: the bits of qh are shifted out as used.
template <bool Five>
class QkValues {
 public:
  explicit QkValues(const uint8_t* w)
      : qs_(w + (Five ? 48 : 16)), high_(Five ? load32(w + 16) : _mm256_setzero_si256()) {}

  Values at(int g, int half) {
    if (half == 0) packed_ = load32(qs_ + 32 * g);
    __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(packed_, 4) : packed_,
                                 _mm256_set1_epi8(0x0F));
    if (Five) {
      v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(high_, _mm256_set1_epi8(1)), 4));
      high_ = _mm256_srli_epi16(high_, 1);
    }
    return v;
  }

 private:
  const uint8_t* qs_;
  __m256i high_, packed_;
};

// Half n of the Q6_K superblock w: 4 sub-blocks of 32 values, each value 4 bits of ql and 2 of
// qh. (A struct, not std::array: a template argument would drop __m256i's attributes.)
struct Q6Values {
  Values at[4];
};
inline Q6Values q6_values(const uint8_t* w, int n) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  const __m256i ql0 = load32(w + 64 * n), ql1 = load32(w + 64 * n + 32);
  const __m256i qh = load32(w + 128 + 32 * n);
  return {{
      _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)),
      _mm256_or_si256(_mm256_and_si256(ql1, low4),
                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4)),
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4)),
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4)),
  }};
}

// Sub-block 4 n + j of the Q3_K superblock w: 2 bits of its plane j of qs, plus 4 for each
// value's bit of hmask.
inline Values q3_values(const uint8_t* w, int n, int j) {
  const __m256i hmask = load32(w), q = load32(w + 32 + 32 * n);
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3));
  const __m256i hbit = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * n + j), _mm256_set1_epi8(1));
  return _mm256_or_si256(low, _mm256_slli_epi16(hbit, 2));
}

// Sub-block 4 n + j of the Q2_K superblock w: its 2-bit plane j of qs.
inline Values q2_values(const uint8_t* w, int n, int j) {
  return _mm256_and_si256(_mm256_srli_epi16(load32(w + 16 + 32 * n), 2 * j), _mm256_set1_epi8(3));
}

#else  // plain C++

using Lanes = float;
using IntLanes = int32_t;
using Values = std::array<uint8_t, 32>;

inline Lanes zero_lanes() { return 0.0f; }
inline float total(Lanes acc) { return acc; }
inline void add_scaled(Lanes& acc, IntLanes dot, float scale) {
  acc += static_cast<float>(dot) * scale;
}

inline int32_t idot(const uint8_t* v, const int8_t* q, int count) {
  int32_t s = 0;
  for (int j = 0; j < count; ++j) s += static_cast<int32_t>(v[j]) * q[j];
  return s;
}
inline IntLanes dot32(const Values& v, const int8_t* q) { return idot(v.data(), q, 32); }
inline IntLanes dot16x2(const Values& v, const int8_t* q, int s0, int s1) {
  return s0 * idot(v.data(), q, 16) + s1 * idot(v.data() + 16, q + 16, 16);
}

inline IntLanes dot_q8_0(const uint8_t* qs, const int8_t* q) {
  const int8_t* w = reinterpret_cast<const int8_t*>(qs);
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(w[j]) * q[j];
  return s;
}

inline Values q5_values(const uint8_t* qs, uint32_t high) {
  Values v;
  for (int j = 0; j < 16; ++j) {
    v[j] = (qs[j] & 0xF) | (((high >> j) & 1) << 4);
    v[j + 16] = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
  }
  return v;
}
inline Values q4_values(const uint8_t* qs) { return q5_values(qs, 0); }

template <bool Five>
class QkValues {
 public:
  explicit QkValues(const uint8_t* w) : w_(w) {}

  Values at(int g, int half) const {
    const uint8_t* qs = w_ + (Five ? 48 : 16) + 32 * g;
    const int j = 2 * g + half;
    Values v;
    for (int l = 0; l < 32; ++l)
      v[l] = (half ? qs[l] >> 4 : qs[l] & 0xF) | (Five ? ((w_[16 + l] >> j) & 1) << 4 : 0);
    return v;
  }

 private:
  const uint8_t* w_;
};

struct Q6Values {
  Values at[4];
};
inline Q6Values q6_values(const uint8_t* w, int n) {
  const uint8_t* ql = w + 64 * n;
  const uint8_t* qh = w + 128 + 32 * n;
  Q6Values v;
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 32; ++l) {
      const uint8_t low = k % 2 ? ql[32 + l] : ql[l];
      v.at[k][l] = ((k < 2 ? low : low >> 4) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
    }
  return v;
}

inline Values q3_values(const uint8_t* w, int n, int j) {
  Values v;
  for (int l = 0; l < 32; ++l)
    v[l] = ((w[32 + 32 * n + l] >> (2 * j)) & 3) | (((w[l] >> (4 * n + j)) & 1) << 2);
  return v;
}

inline Values q2_values(const uint8_t* w, int n, int j) {
  Values v;
  for (int l = 0; l < 32; ++l) v[l] = (w[16 + 32 * n + l] >> (2 * j)) & 3;
  return v;
}

#endif

// A row of blocks of `Elements` weights in `Bytes` bytes each: block(w, i, acc, off) adds block
// i's share (w: its bytes) to the running float lanes acc and to off, what the row subtracts at
// its end (the offsets' and minimums' terms); the row is the lanes' tree sum minus off.
template <int64_t Elements, int64_t Bytes, typename Block>
inline float sum_blocks(const uint8_t* w, const Activations& x, Block block) {
  Lanes acc = zero_lanes();
  float off = 0.0f;
  for (int64_t i = 0; i < x.n / Elements; ++i, w += Bytes) block(w, i, acc, off);
  return total(acc) - off;
}

// sum over activation block b of m0 * (its first 16 q) + m1 * (its last 16 q).
inline float sums16(const Activations& x, int64_t b, int m0, int m1) {
  return static_cast<float>(m0 * x.s16[2 * b] + m1 * x.s16[2 * b + 1]);
}

// Activation block b's share of 32 values v whose two 16s have integer scales s0 and s1, in steps
// dx; the values' offset o (Q6_K: 32, Q3_K: 4) times the same scales goes to off.
inline void add_block16(const Values& v, const Activations& x, int64_t b, int s0, int s1,
                        float dx, float o, Lanes& acc, float& off) {
  add_scaled(acc, dot16x2(v, x.q + 32 * b, s0, s1), dx);
  off += o * dx * sums16(x, b, s0, s1);
}

inline float row_q8_0(const uint8_t* row, const Activations& x) {
  return sum_blocks<32, 34>(row, x, [&](const uint8_t* w, int64_t b, Lanes& acc, float&) {
    add_scaled(acc, dot_q8_0(w + 2, x.q + 32 * b), fp16(load_u16(w)) * x.d[b]);
  });
}

template <int Offset, bool Five>  // Q4_0: 8, Q5_0: 16; Q4_1, Q5_1: no offset, a minimum
inline float row_q4_5(const uint8_t* row, const Activations& x) {
  constexpr int64_t qh = Offset ? 2 : 4, qs = qh + (Five ? 4 : 0);  // after d (and m)
  return sum_blocks<32, qs + 16>(row, x, [&](const uint8_t* w, int64_t b, Lanes& acc, float& off) {
    const float d = fp16(load_u16(w));
    Values v;
    if constexpr (Five) {
      uint32_t high;
      std::memcpy(&high, w + qh, 4);
      v = q5_values(w + qs, high);
    } else {
      v = q4_values(w + qs);
    }
    add_scaled(acc, dot32(v, x.q + 32 * b), d * x.d[b]);
    off += Offset ? Offset * d * x.ds[b] : -fp16(load_u16(w + 2)) * x.ds[b];
  });
}

template <bool Five>  // Q4_K, or Q5_K with its high bits
inline float row_qk(const uint8_t* row, const Activations& x) {
  return sum_blocks<256, Five ? 176 : 144>(row, x, [&](const uint8_t* w, int64_t s, Lanes& acc,
                                                        float& off) {
    const float d = fp16(load_u16(w)), dmin = fp16(load_u16(w + 2));
    QkValues<Five> values(w);
    for (int g = 0; g < 4; ++g) {
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * g + half;
        const int64_t b = 8 * s + j;
        int sc, m;
        scale_min_k4(j, w + 4, &sc, &m);
        add_scaled(acc, dot32(values.at(g, half), x.q + 32 * b),
                   d * static_cast<float>(sc) * x.d[b]);
        off += dmin * static_cast<float>(m) * x.ds[b];
      }
    }
  });
}

inline float row_q6_k(const uint8_t* row, const Activations& x) {
  return sum_blocks<256, 210>(row, x, [&](const uint8_t* w, int64_t s, Lanes& acc, float& off) {
    const float d = fp16(load_u16(w + 208));
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int n = 0; n < 2; ++n) {
      const Q6Values v = q6_values(w, n);
      for (int k = 0; k < 4; ++k) {
        const int64_t b = 8 * s + 4 * n + k;  // activation block: elements 32 b .. 32 b + 31
        add_block16(v.at[k], x, b, sc[8 * n + 2 * k], sc[8 * n + 2 * k + 1], d * x.d[b], 32.0f, acc,
                    off);
      }
    }
  });
}

inline float row_q3_k(const uint8_t* row, const Activations& x) {
  return sum_blocks<256, 110>(row, x, [&](const uint8_t* w, int64_t s, Lanes& acc, float& off) {
    const float d = fp16(load_u16(w + 108));
    int sc[16];
    scales_q3_k(w + 96, sc);
    for (int n = 0; n < 2; ++n) {
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 8 * s + 4 * n + j;
        add_block16(q3_values(w, n, j), x, b, sc[8 * n + 2 * j], sc[8 * n + 2 * j + 1],
                    d * x.d[b], 4.0f, acc, off);
      }
    }
  });
}

inline float row_q2_k(const uint8_t* row, const Activations& x) {
  return sum_blocks<256, 84>(row, x, [&](const uint8_t* w, int64_t s, Lanes& acc, float& off) {
    const uint8_t* scales = w;  // per 16: a 4-bit scale (low) and a 4-bit minimum (high)
    const float d = fp16(load_u16(w + 80)), dmin = fp16(load_u16(w + 82));
    for (int n = 0; n < 2; ++n) {
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 8 * s + 4 * n + j;
        const int k = 8 * n + 2 * j;
        add_scaled(acc, dot16x2(q2_values(w, n, j), x.q + 32 * b, scales[k] & 0xF,
                                scales[k + 1] & 0xF),
                   d * x.d[b]);
        off += dmin * x.d[b] * sums16(x, b, scales[k] >> 4, scales[k + 1] >> 4);
      }
    }
  });
}

// One row of an integer type (`integer_type`) dotted with quantized activations.
template <int32_t T>
inline float row_dot(const uint8_t* w, const Activations& x) {
  if constexpr (T == Q8_0) return row_q8_0(w, x);
  else if constexpr (T == Q4_0) return row_q4_5<8, false>(w, x);
  else if constexpr (T == Q4_1) return row_q4_5<0, false>(w, x);
  else if constexpr (T == Q5_0) return row_q4_5<16, true>(w, x);
  else if constexpr (T == Q5_1) return row_q4_5<0, true>(w, x);
  else if constexpr (T == Q4_K) return row_qk<false>(w, x);
  else if constexpr (T == Q5_K) return row_qk<true>(w, x);
  else if constexpr (T == Q6_K) return row_q6_k(w, x);
  else if constexpr (T == Q3_K) return row_q3_k(w, x);
  else if constexpr (T == Q2_K) return row_q2_k(w, x);
  else return 0.0f;
}

}  // namespace ggml
