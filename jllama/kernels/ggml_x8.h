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
//   Q5_0  d[8] | qh[8] (each row's 32 high bits, transposed: bit 8i + k of its 4 bytes is the
//         high bit of value 4k + i) | 4 nibble chunks                                  176
//   Q5_1  d[8] | m[8] | qh[8] (transposed as Q5_0's) | 4 nibble chunks                 192
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
  const int64_t qh = type == Q5_0 ? 2 : type == Q5_1 ? 4 : -1;  // qh's place in a block
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = group + b * 8 * l.bytes;
    uint8_t* block = out + b * l.bytes;
    for (int64_t o = 0; o < l.bytes; ++o) block[o] = tile[pos[r * l.bytes + o]];
    if (qh >= 0) {  // the tile's high bits are transposed (jllama.ggml_repack._transpose_qh)
      uint32_t plane, bits = 0;
      std::memcpy(&plane, block + qh, 4);
      for (int i = 0; i < 4; ++i)
        for (int k = 0; k < 8; ++k) bits |= ((plane >> (8 * i + k)) & 1u) << (4 * k + i);
      std::memcpy(block + qh, &bits, 4);
    }
  }
}

#if JLLAMA_Q_AVX2

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define JLLAMA_Q_VNNI 1  // dpbusd: u8 x s8 products summed in int32, no 16-bit saturation
#endif

inline __m256i dp(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Without VNNI (AVX2's maddubs: u8 x s8 pairs summed into int16, then madd into int32), the
// int16 pair sums of `Every` consecutive registers are added before they are widened: a pair is
// at most 2 * 15 * 127 = 3810 for 4-bit values (8 registers fit in int16), 7874 for 5-bit (4),
// 16002 for 6-bit (2). With VNNI each register goes straight into int32. The integer sums are
// the same either way.
template <int Every>
struct Dots {
  __m256i s = _mm256_setzero_si256();  // int32 lanes
#if !JLLAMA_Q_VNNI
  __m256i p = _mm256_setzero_si256();  // int16 pair sums not yet widened
  int pending = 0;
#endif
  inline void add(__m256i u, __m256i a) {
#if JLLAMA_Q_VNNI
    s = dp(s, u, a);
#else
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u, a));
    if (++pending == Every) flush();
#endif
  }
  inline void flush() {
#if !JLLAMA_Q_VNNI
    if (pending) {
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
      p = _mm256_setzero_si256();
      pending = 0;
    }
#endif
  }
  inline __m256i sums() {
    flush();
    return s;
  }
};

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

// Bit k (0..7, an immediate) of every byte of `bits`, as 0x10 or 0: the fifth bit of a value.
inline __m256i bit_to_0x10(__m256i bits, int k) {
  const __m256i b = _mm256_and_si256(bits, _mm256_set1_epi8(static_cast<char>(1 << k)));
  switch (k) {  // the bit stays inside its byte: at most 4 places either way
    case 0: return _mm256_slli_epi16(b, 4);
    case 1: return _mm256_slli_epi16(b, 3);
    case 2: return _mm256_slli_epi16(b, 2);
    case 3: return _mm256_slli_epi16(b, 1);
    case 4: return b;
    case 5: return _mm256_srli_epi16(b, 1);
    case 6: return _mm256_srli_epi16(b, 2);
    default: return _mm256_srli_epi16(b, 3);
  }
}

// a >> k on each 16-bit lane, k in 0..7 an immediate (variable counts cost a register move and
// run slower on some CPUs).
inline __m256i srli16(__m256i a, int k) {
  switch (k) {
    case 0: return a;
    case 1: return _mm256_srli_epi16(a, 1);
    case 2: return _mm256_srli_epi16(a, 2);
    case 3: return _mm256_srli_epi16(a, 3);
    case 4: return _mm256_srli_epi16(a, 4);
    case 5: return _mm256_srli_epi16(a, 5);
    case 6: return _mm256_srli_epi16(a, 6);
    default: return _mm256_srli_epi16(a, 7);
  }
}

inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The 8 rows of group `w` (its n / block elements tiles) dotted with NT activation vectors x[t]:
// y[t][0..7]. The weights are decoded once for all NT (a prefill chunk's tokens share them);
// per token and block, the integer dot products are summed in int32, then scaled into 8 float
// lanes, each block's offset or minimum subtracted from the same lanes, in block order: the same
// operations for any NT, so a token's result does not depend on the others beside it.
template <int32_t T, int NT>
inline void x8_dot_n(const uint8_t* w, const Activations* x, float* const* y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t n = x[0].n;
  if constexpr (T == Q8_0) {
    for (int64_t b = 0; b < n / 32; ++b, w += 272) {
      __m256i s[NT];
      for (int t = 0; t < NT; ++t) s[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const __m256i q = load256(w + 16 + 32 * k);
#if JLLAMA_Q_VNNI
        // q + 128 as unsigned (one xor for all tokens); the 128 * sum(a) it adds is taken off
        // below, in integers.
        const __m256i u = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
        for (int t = 0; t < NT; ++t) s[t] = dp(s[t], u, bcast4(x[t].q + 32 * b + 4 * k));
#else
        const __m256i u = _mm256_sign_epi8(q, q);
        for (int t = 0; t < NT; ++t)
          s[t] = dp(s[t], u, _mm256_sign_epi8(bcast4(x[t].q + 32 * b + 4 * k), q));
#endif
      }
      const __m256 d = f16x8(w);
      for (int t = 0; t < NT; ++t) {
#if JLLAMA_Q_VNNI
        const int32_t sum = x[t].s16[2 * b] + x[t].s16[2 * b + 1];
        s[t] = _mm256_sub_epi32(s[t], _mm256_set1_epi32(128 * sum));
#endif
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])),
                                 acc[t]);
      }
    }
  } else if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    constexpr bool min = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1;
    constexpr int64_t qh_at = min ? 32 : 16, qs_at = qh_at + (five ? 32 : 0);
    constexpr int64_t tile = qs_at + 128;
    constexpr float offset = T == Q4_0 ? 8.0f : T == Q5_0 ? 16.0f : 0.0f;
    for (int64_t b = 0; b < n / 32; ++b, w += tile) {
      Dots<five ? 4 : 8> s[NT];
      const __m256i qh = five ? load256(w + qh_at) : _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {  // values 4k .. 4k + 3 of the 8 rows
        const __m256i q = load256(w + qs_at + 32 * (k % 4));
        __m256i v = _mm256_and_si256(k < 4 ? q : _mm256_srli_epi16(q, 4), low4);
        if (five) v = _mm256_or_si256(v, bit_to_0x10(qh, k));
        for (int t = 0; t < NT; ++t) s[t].add(v, bcast4(x[t].q + 32 * b + 4 * k));
      }
      const __m256 d = f16x8(w);
      const __m256 m = min ? f16x8(w + 16) : _mm256_setzero_ps();
      for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t].sums()),
                                 _mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])), acc[t]);
        if (min) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[t].ds[b]), acc[t]);
        else acc[t] = _mm256_fnmadd_ps(d, _mm256_set1_ps(offset * x[t].ds[b]), acc[t]);
      }
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr bool five = T == Q5_K;
    constexpr int64_t qs_at = five ? 384 : 128, tile = five ? 1408 : 1152;
    for (int64_t sb = 0; sb < n / 256; ++sb, w += tile) {
      const __m256 d = f16x8(w), dmin = f16x8(w + 16);
      uint64_t p[12];
      for (int i = 0; i < 12; ++i) p[i] = load_u64(w + 32 + 8 * i);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // sub-block j: values 32j .. 32j + 31
        const int g = j / 2, half = j % 2;
        Dots<five ? 4 : 8> s[NT];
        for (int c = 0; c < 8; ++c) {
          const __m256i q = load256(w + qs_at + 256 * g + 32 * c);
          __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(q, 4) : q, low4);
          if (five) {
            const __m256i h = load256(w + 128 + 32 * c);
            v = _mm256_or_si256(v, bit_to_0x10(h, j));
          }
          for (int t = 0; t < NT; ++t) s[t].add(v, bcast4(x[t].q + 256 * sb + 32 * j + 4 * c));
        }
        // ggml's get_scale_min_k4 on all 8 rows' bytes at once.
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
        const __m256 dsc = _mm256_mul_ps(d, bytes8<false>(sc));
        const __m256 dmn = _mm256_mul_ps(dmin, bytes8<false>(mn));
        const int64_t b = 8 * sb + j;
        for (int t = 0; t < NT; ++t) {
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t].sums()),
                                   _mm256_mul_ps(dsc, _mm256_set1_ps(x[t].d[b])), acc[t]);
          acc[t] = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(x[t].ds[b]), acc[t]);
        }
      }
    }
  } else if constexpr (T == Q6_K) {
    const __m256i two = _mm256_set1_epi8(3);
    for (int64_t sb = 0; sb < n / 256; ++sb, w += 1680) {
      const __m256 d = f16x8(w);
      for (int nh = 0; nh < 2; ++nh) {      // half of the super-block: values 128 nh ..
        for (int h = 0; h < 2; ++h) {       // 16-value halves of its activation blocks
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {     // values 128 nh + 32 v + 16 h ..: one scale each
            const int64_t b = 8 * sb + 4 * nh + v;
            Dots<2> s[NT];
            for (int c = 4 * h; c < 4 * h + 4; ++c) {
              const __m256i q = load256(w + 144 + 512 * nh + 32 * (c + 8 * (v % 2)));
              const __m256i H = load256(w + 1168 + 256 * nh + 32 * c);
              const __m256i lo = _mm256_and_si256(v < 2 ? q : _mm256_srli_epi16(q, 4), low4);
              const __m256i hi = _mm256_and_si256(srli16(H, 2 * v), two);
              const __m256i val = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
              for (int t = 0; t < NT; ++t)
                s[t].add(val, bcast4(x[t].q + 256 * sb + 128 * nh + 32 * v + 4 * c));
            }
            const int k = 8 * nh + 2 * v + h;  // the scale of these 16 values
            const __m256 sc = _mm256_mul_ps(d, bytes8<true>(load_u64(w + 16 + 8 * k)));
            for (int t = 0; t < NT; ++t) {
              acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t].sums()),
                                       _mm256_mul_ps(sc, _mm256_set1_ps(x[t].d[b])), acc[t]);
              acc[t] = _mm256_fnmadd_ps(
                  sc, _mm256_set1_ps(32.0f * x[t].d[b] * static_cast<float>(x[t].s16[2 * b + h])),
                  acc[t]);
            }
          }
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y[t], acc[t]);
}

template <int32_t T>
inline void x8_dot(const uint8_t* w, const Activations& x, float* y) {
  float* const ys[1] = {y};
  x8_dot_n<T, 1>(w, &x, ys);
}

#endif  // JLLAMA_Q_AVX2

}  // namespace ggml
