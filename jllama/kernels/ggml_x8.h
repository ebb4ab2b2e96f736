// Products of GGML weights repacked eight rows at a time ("x8" layouts): the decode kernels'
// fast path for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K on AVX2 (and AVX-512, whose
// VNNI dpbusd they use for the integer dot products where the CPU has it).
//
// Why. A row at a time (ggml_dot.h), each block of 32 weights costs ~20 instructions around its
// one integer dot product: unpacking its float16 scale, broadcasting it, its high bits, summing
// 8 lanes per row at the end. llama.cpp repacks Q4_0 and Q4_K the same way for its AVX2 gemv
// (`ggml-cpu/repack.cpp`, q4_0_8x8): when the register holds 4 weights of each of 8 rows, a
// broadcast of 4 activations and one dot-product instruction advance 8 rows at once, the 8 rows'
// scales are one vector load, and the 8 results come out as one vector with no horizontal sum.
//
// Layout. A tile is block b of eight consecutive rows 8g .. 8g + 7: the rows' bytes of that
// block, permuted (the same bytes, so the same size and the same dequantized values as stored;
// `jllama/ggml_repack.py` builds the permutations and repacks at load). Tiles follow each other
// in row order of the blocks, so a group of 8 rows streams from memory front to back. In every
// layout, "a chunk" is 32 bytes holding 4 consecutive bytes of each of the 8 rows (row r at bytes
// 4r .. 4r + 3), so one 32-byte load gives 4 quantized values (or 8 nibbles) of each row:
//
//   Q8_0  d[8] f16 | 8 chunks of qs (chunk k: values 4k .. 4k + 3)                    272 bytes
//   Q4_0  d[8] | 4 chunks of qs (chunk c: nibbles of values 4c.. (low) and 16 + 4c.. (high))  144
//   Q4_1  d[8] | m[8] | 4 nibble chunks                                                160
//   Q5_0  d[8] | qh[8] (each row's 32 high bits) | 4 nibble chunks                     176
//   Q5_1  d[8] | m[8] | qh[8] | 4 nibble chunks                                        192
//   Q4_K  d[8] | dmin[8] | 12 scale planes (plane p: byte p of each row's 12 scale bytes, 8
//         bytes) | 32 nibble chunks (64-value group g, chunk c: values 64g + 4c.. low nibbles,
//         64g + 32 + 4c.. high)                                                       1152
//   Q5_K  as Q4_K with 8 chunks of qh (chunk c: qh bytes 4c .. 4c + 3, whose bit j is value
//         32j + 4c + i's fifth bit) before the nibbles                                  1408
//   Q6_K  d[8] | 16 scale planes (int8) | 32 ql chunks (half n, chunk c of its 64 bytes) | 16
//         qh chunks (half n, chunk c of its 32 bytes)                                   1680
//
// The arithmetic is ggml_dot.h's (activations quantized per 32 as Q8_0, integer sums exact,
// float32 scaling per block, offsets in their own running sum), so a row's value differs from
// the row-at-a-time kernel's by float rounding only; each row's sums still run in one fixed
// order, on one thread.

#pragma once

#include "ggml_dot.h"

namespace ggml {

// Types with an x8 layout: ggml's id plus kX8.
constexpr int32_t kX8 = 256;

inline bool has_x8(int32_t type) {
  switch (type) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q4_K: case Q5_K: case Q6_K:
      return true;
    default:
      return false;
  }
}

// Where byte o of row r's block (r in 0..7) lies in its x8 tile: the inverse of
// `jllama.ggml_repack.tile_sources` (the tests compare the two). pos: int32[8 * block bytes].
inline void x8_positions(int32_t type, int32_t* pos) {
  const int64_t nb = layout(type).bytes;
  int64_t t = 0;
  auto per_row = [&](int64_t start, int64_t width) {
    for (int r = 0; r < 8; ++r)
      for (int64_t i = 0; i < width; ++i) pos[r * nb + start + i] = static_cast<int32_t>(t++);
  };
  auto chunks = [&](int64_t start, int64_t count) {
    for (int64_t c = 0; c < count; ++c)
      for (int r = 0; r < 8; ++r)
        for (int i = 0; i < 4; ++i) pos[r * nb + start + 4 * c + i] = static_cast<int32_t>(t++);
  };
  auto planes = [&](int64_t start, int64_t count) {
    for (int64_t p = 0; p < count; ++p)
      for (int r = 0; r < 8; ++r) pos[r * nb + start + p] = static_cast<int32_t>(t++);
  };
  switch (type) {
    case Q8_0: per_row(0, 2); chunks(2, 8); break;
    case Q4_0: per_row(0, 2); chunks(2, 4); break;
    case Q4_1: per_row(0, 2); per_row(2, 2); chunks(4, 4); break;
    case Q5_0: per_row(0, 2); per_row(2, 4); chunks(6, 4); break;
    case Q5_1: per_row(0, 2); per_row(2, 2); per_row(4, 4); chunks(8, 4); break;
    case Q4_K:
      per_row(0, 2); per_row(2, 2); planes(4, 12);
      for (int g = 0; g < 4; ++g) chunks(16 + 32 * g, 8);
      break;
    case Q5_K:
      per_row(0, 2); per_row(2, 2); planes(4, 12); chunks(16, 8);
      for (int g = 0; g < 4; ++g) chunks(48 + 32 * g, 8);
      break;
    case Q6_K:
      per_row(208, 2); planes(192, 16);
      for (int n = 0; n < 2; ++n) chunks(64 * n, 16);
      for (int n = 0; n < 2; ++n) chunks(128 + 32 * n, 8);
      break;
    default: break;
  }
}

// Row r (0..7) of a group of 8 rows in the x8 layout of `type` (n elements a row), in ggml's own
// layout: out u8[row bytes]. pos: `x8_positions` of the type.
inline void x8_row(int32_t type, const uint8_t* group, int r, int64_t n, const int32_t* pos,
                   uint8_t* out) {
  const Layout l = layout(type);
  const int64_t blocks = n / l.elements;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = group + b * 8 * l.bytes;
    for (int64_t o = 0; o < l.bytes; ++o) out[b * l.bytes + o] = tile[pos[r * l.bytes + o]];
  }
}

#if JLLAMA_Q_AVX2

inline __m256i dp(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The 4 activations at p in every 32-bit lane.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes (one per row) widened to float32 lanes; Signed: int8, else uint8.
template <bool Signed>
inline __m256 bytes8(uint64_t v) {
  const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(v));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Bytes 0x10 where bit 4k + i of row r's high bits (lane r of qh) is set, at byte 4r + i.
inline __m256i high_bits_0x10(__m256i qh, int k) {
  const __m256i nib = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(4 * k));
  const __m256i spread = _mm256_shuffle_epi8(
      nib, _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  const __m256i bit = _mm256_setr_epi8(1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8,
                                       1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(0x10));
}

// The 8 rows of group `w` (n / block elements tiles) dotted with x: y[0..7].
template <int32_t T>
inline void x8_dot(const uint8_t* w, const Activations& x, float* y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  if constexpr (T == Q8_0) {
    for (int64_t b = 0; b < x.n / 32; ++b, w += 272) {
      __m256i s = _mm256_setzero_si256();
      const int8_t* a = x.q + 32 * b;
      for (int k = 0; k < 8; ++k) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * k));
        const __m256i v = bcast4(a + 4 * k);
        s = dp(s, _mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q));
      }
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                            _mm256_mul_ps(f16x8(w), _mm256_set1_ps(x.d[b])), acc);
    }
  } else if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    constexpr bool min = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1;
    constexpr int64_t qh_at = min ? 32 : 16, qs_at = qh_at + (five ? 32 : 0);
    constexpr int64_t tile = qs_at + 128;
    constexpr float offset = T == Q4_0 ? 8.0f : T == Q5_0 ? 16.0f : 0.0f;
    for (int64_t b = 0; b < x.n / 32; ++b, w += tile) {
      __m256i s = _mm256_setzero_si256();
      const int8_t* a = x.q + 32 * b;
      const __m256i qh = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + qh_at))
                              : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + qs_at + 32 * c));
        __m256i lo = _mm256_and_si256(q, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if (five) {
          lo = _mm256_or_si256(lo, high_bits_0x10(qh, c));
          hi = _mm256_or_si256(hi, high_bits_0x10(qh, c + 4));
        }
        s = dp(s, lo, bcast4(a + 4 * c));
        s = dp(s, hi, bcast4(a + 16 + 4 * c));
      }
      const __m256 d = f16x8(w);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), acc);
      if (min) off = _mm256_fnmadd_ps(f16x8(w + 16), _mm256_set1_ps(x.ds[b]), off);
      else off = _mm256_fmadd_ps(d, _mm256_set1_ps(offset * x.ds[b]), off);
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr bool five = T == Q5_K;
    constexpr int64_t qs_at = five ? 384 : 128, tile = five ? 1408 : 1152;
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t sb = 0; sb < x.n / 256; ++sb, w += tile) {
      const __m256 d = f16x8(w), dmin = f16x8(w + 16);
      const uint8_t* planes = w + 32;
      uint64_t p[12];
      for (int i = 0; i < 12; ++i) p[i] = load_u64(planes + 8 * i);
      for (int g = 0; g < 4; ++g) {
        __m256i s_lo = _mm256_setzero_si256(), s_hi = _mm256_setzero_si256();
        const int8_t* a = x.q + 256 * sb + 64 * g;
        for (int c = 0; c < 8; ++c) {
          const __m256i q =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + qs_at + 256 * g + 32 * c));
          __m256i lo = _mm256_and_si256(q, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
          if (five) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * c));
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * g)), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * g + 1)), one), 4));
          }
          s_lo = dp(s_lo, lo, bcast4(a + 4 * c));
          s_hi = dp(s_hi, hi, bcast4(a + 32 + 4 * c));
        }
        // Sub-blocks 2g and 2g + 1: ggml's get_scale_min_k4 on all 8 rows' bytes at once.
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * g + half;
          constexpr uint64_t m6 = 0x3F3F3F3F3F3F3F3Full, m4 = 0x0F0F0F0F0F0F0F0Full;
          constexpr uint64_t m2 = 0x0303030303030303ull;
          uint64_t sc, mn;
          if (j < 4) {
            sc = p[j] & m6;
            mn = p[j + 4] & m6;
          } else {
            sc = (p[j + 4] & m4) | (((p[j - 4] >> 6) & m2) << 4);
            mn = ((p[j + 4] >> 4) & m4) | (((p[j] >> 6) & m2) << 4);
          }
          const int64_t b = 8 * sb + j;
          const __m256 scale = _mm256_mul_ps(_mm256_mul_ps(d, bytes8<false>(sc)), _mm256_set1_ps(x.d[b]));
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half ? s_hi : s_lo), scale, acc);
          off = _mm256_fmadd_ps(_mm256_mul_ps(dmin, bytes8<false>(mn)), _mm256_set1_ps(x.ds[b]), off);
        }
      }
    }
  } else if constexpr (T == Q6_K) {
    const __m256i two = _mm256_set1_epi8(3);
    for (int64_t sb = 0; sb < x.n / 256; ++sb, w += 1680) {
      const __m256 d = f16x8(w);
      const uint8_t* planes = w + 16;
      for (int n = 0; n < 2; ++n) {
        for (int h = 0; h < 2; ++h) {
          __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
          const int8_t* a = x.q + 256 * sb + 128 * n;
          for (int c = 4 * h; c < 4 * h + 4; ++c) {
            const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 144 + 512 * n + 32 * c));
            const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 144 + 512 * n + 32 * (c + 8)));
            const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 1168 + 256 * n + 32 * c));
            const __m256i v0 = _mm256_or_si256(_mm256_and_si256(A, low4),
                                               _mm256_slli_epi16(_mm256_and_si256(H, two), 4));
            const __m256i v1 = _mm256_or_si256(
                _mm256_and_si256(B, low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), two), 4));
            const __m256i v2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(A, 4), low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), two), 4));
            const __m256i v3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(B, 4), low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), two), 4));
            s[0] = dp(s[0], v0, bcast4(a + 4 * c));
            s[1] = dp(s[1], v1, bcast4(a + 32 + 4 * c));
            s[2] = dp(s[2], v2, bcast4(a + 64 + 4 * c));
            s[3] = dp(s[3], v3, bcast4(a + 96 + 4 * c));
          }
          for (int v = 0; v < 4; ++v) {
            const int k = 8 * n + 2 * v + h;  // the scale of these 16 values
            const int64_t b = 8 * sb + 4 * n + v;
            const __m256 sc = _mm256_mul_ps(d, bytes8<true>(load_u64(planes + 8 * k)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[v]), _mm256_mul_ps(sc, _mm256_set1_ps(x.d[b])), acc);
            off = _mm256_fmadd_ps(
                sc, _mm256_set1_ps(32.0f * x.d[b] * static_cast<float>(x.s16[2 * b + h])), off);
          }
        }
      }
    }
  }
  _mm256_storeu_ps(y, _mm256_sub_ps(acc, off));
}

#endif  // JLLAMA_Q_AVX2

}  // namespace ggml
