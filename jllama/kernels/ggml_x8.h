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
// `jllama/model/ggml_repack.py` builds the permutations and repacks at load). Tiles follow each other
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

// Types with an x8 layout (`has_x8`): ggml's id plus kX8.
constexpr int32_t kX8 = 256;

// Where byte o of row r's block (r in 0..7) lies in its x8 tile: the inverse of
// `jllama.model.ggml_repack.tile_sources` (the tests compare the two). pos: int32[8 * block bytes].
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
    if (qh >= 0) {  // the tile's high bits are transposed (jllama.model.ggml_repack._transpose_qh)
      uint32_t plane, bits = 0;
      std::memcpy(&plane, block + qh, 4);
      for (int i = 0; i < 4; ++i)
        for (int k = 0; k < 8; ++k) bits |= ((plane >> (8 * i + k)) & 1u) << (4 * k + i);
      std::memcpy(block + qh, &bits, 4);
    }
  }
}

#if JLLAMA_Q_AVX2

// VNNI's dot products on 256-bit registers, AVX512-VNNI's encoding or AVX-VNNI's: dpbusd, u8 x s8
// products summed per 4 in int32 (no 16-bit saturation); dpwssd, int16 x int16 pairs.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define JLLAMA_Q_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
#define JLLAMA_Q_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpwssd_avx_epi32(acc, a, b);
}
#endif

inline __m256i dp(__m256i acc, __m256i u, __m256i s) {
#if JLLAMA_Q_VNNI
  return dpbusd(acc, u, s);
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

// ---------------------------------------------------------------------------------------------
// The kernels, written once over the width they run at: `Y8` holds one x8 group (8 rows) in
// 256-bit registers, `Z16` two neighbouring groups (16 rows: group g in the low half, g + 1 in
// the high half) in 512-bit registers (AVX-512 with VNNI only). Every lane (a row) goes through
// the same operations in the same order in both, so a row's result has the same bits whichever
// width computes it: decode, prefill and the batched step may pair groups differently (a
// thread's rows may start at an odd group) and still agree bit for bit.
//
// Why 16 rows: a 512-bit dpbusd advances 16 rows by 4 values where a 256-bit one advances 8, and
// the work around the dot products (a block's scale per row, the weights' unpacking, the token's
// broadcasts) is spent once for 16 rows. Per block and token the float work is one conversion
// and one multiply-add into a per-super-block sum whose scales are the rows' own (shared by all
// tokens); the token's step and the K-quants' minimums (an exact integer dot of the rows'
// minimums with the token's sums per 32, int16 pairs) come in once per super-block.

// The float32 operations of `Y8` (256-bit registers) and `Z16` (512-bit: Wide), the same
// instruction at either width: cvt (int32 lanes to float32), fzero, fset1 (v in every lane), mul,
// fma (a * b + c), fnma (c - a * b), store (unaligned).
template <bool Wide>
struct FloatLanes {
  using I = std::conditional_t<Wide, __m512i, __m256i>;
  using F = std::conditional_t<Wide, __m512, __m256>;
  static F cvt(I a) {
    if constexpr (Wide) return _mm512_cvtepi32_ps(a);
    else return _mm256_cvtepi32_ps(a);
  }
  static F fzero() {
    if constexpr (Wide) return _mm512_setzero_ps();
    else return _mm256_setzero_ps();
  }
  static F fset1(float v) {
    if constexpr (Wide) return _mm512_set1_ps(v);
    else return _mm256_set1_ps(v);
  }
  static F mul(F a, F b) {
    if constexpr (Wide) return _mm512_mul_ps(a, b);
    else return _mm256_mul_ps(a, b);
  }
  static F fma(F a, F b, F c) {
    if constexpr (Wide) return _mm512_fmadd_ps(a, b, c);
    else return _mm256_fmadd_ps(a, b, c);
  }
  static F fnma(F a, F b, F c) {
    if constexpr (Wide) return _mm512_fnmadd_ps(a, b, c);
    else return _mm256_fnmadd_ps(a, b, c);
  }
  static void store(float* y, F v) {
    if constexpr (Wide) _mm512_storeu_ps(y, v);
    else _mm256_storeu_ps(y, v);
  }
};

struct Y8 : FloatLanes<false> {
  static constexpr int kGroups = 1;
  static I load(const uint8_t* w, int64_t, int64_t at) { return load256(w + at); }
  // The 8 float16 of each group at byte `at` of its tile, as float32 lanes.
  static F halves(const uint8_t* w, int64_t, int64_t at) { return f16x8(w + at); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I set8(int8_t v) { return _mm256_set1_epi8(v); }
  static I bcast4(const int8_t* p) { return ggml::bcast4(p); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srl4(I a) { return _mm256_srli_epi16(a, 4); }
  static I srl16(I a, int k) { return srli16(a, k); }
  static I sll4(I a) { return _mm256_slli_epi16(a, 4); }
  static I sll2(I a) { return _mm256_slli_epi16(a, 2); }
  static I bit_to_0x10(I bits, int k) { return ggml::bit_to_0x10(bits, k); }
  static I sign(I a, I b) { return _mm256_sign_epi8(a, b); }
  // u8 x s8 products summed per 4 into int32 (VNNI's dpbusd, or maddubs + madd without it:
  // then u must be small enough for the int16 pair sums, as in `Dots`).
  static I dp(I acc, I u, I s) { return ggml::dp(acc, u, s); }
  // int16 pairs: acc + a.lo * b.lo + a.hi * b.hi per int32 lane.
  static I dpw(I acc, I a, I b) {
#if JLLAMA_Q_VNNI
    return dpwssd(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  // Lane r: the int16 pair (a's byte r, b's byte r), bytes unsigned or signed; one u64 of 8 row
  // bytes per group.
  template <bool Signed>
  static I pairs(const uint64_t* a, const uint64_t* b) {
    const __m128i v = _mm_unpacklo_epi8(_mm_cvtsi64_si128(static_cast<int64_t>(a[0])),
                                        _mm_cvtsi64_si128(static_cast<int64_t>(b[0])));
    return Signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
  }
  // The row bytes (one u64 per group) as float32 lanes.
  template <bool Signed>
  static F bytes(const uint64_t* v) { return bytes8<Signed>(v[0]); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define JLLAMA_Q_Z16 1
struct Z16 : FloatLanes<true> {
  static constexpr int kGroups = 2;
  // `pair`: bytes from group g's tile to group g + 1's (8 rows of the matrix).
  static I load(const uint8_t* w, int64_t pair, int64_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(w + at)), load256(w + pair + at), 1);
  }
  static F halves(const uint8_t* w, int64_t pair, int64_t at) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + pair + at));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I set8(int8_t v) { return _mm512_set1_epi8(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srl4(I a) { return _mm512_srli_epi16(a, 4); }
  static I srl16(I a, int k) {
    switch (k) {  // immediates, as srli16
      case 0: return a;
      case 1: return _mm512_srli_epi16(a, 1);
      case 2: return _mm512_srli_epi16(a, 2);
      case 3: return _mm512_srli_epi16(a, 3);
      case 4: return _mm512_srli_epi16(a, 4);
      case 5: return _mm512_srli_epi16(a, 5);
      case 6: return _mm512_srli_epi16(a, 6);
      default: return _mm512_srli_epi16(a, 7);
    }
  }
  static I sll4(I a) { return _mm512_slli_epi16(a, 4); }
  static I sll2(I a) { return _mm512_slli_epi16(a, 2); }
  static I bit_to_0x10(I bits, int k) {
    const I b = _mm512_and_si512(bits, _mm512_set1_epi8(static_cast<char>(1 << k)));
    switch (k) {
      case 0: return _mm512_slli_epi16(b, 4);
      case 1: return _mm512_slli_epi16(b, 3);
      case 2: return _mm512_slli_epi16(b, 2);
      case 3: return _mm512_slli_epi16(b, 1);
      case 4: return b;
      case 5: return _mm512_srli_epi16(b, 1);
      case 6: return _mm512_srli_epi16(b, 2);
      default: return _mm512_srli_epi16(b, 3);
    }
  }
  static I dp(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dpw(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  template <bool Signed>
  static I pairs(const uint64_t* a, const uint64_t* b) {
    const __m256i lo = Y8::pairs<Signed>(a, b), hi = Y8::pairs<Signed>(a + 1, b + 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  template <bool Signed>
  static F bytes(const uint64_t* v) {
    const __m128i b = _mm_set_epi64x(static_cast<int64_t>(v[1]), static_cast<int64_t>(v[0]));
    return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
};
#endif

// Integer dot products of one block and token: with VNNI each chunk goes straight into int32.
// Without it (Y8 only; AVX2's maddubs: u8 x s8 pairs summed into int16, then madd into int32),
// the int16 pair sums of `Every` consecutive chunks are added before they are widened: a pair is
// at most 2 * 15 * 127 = 3810 for 4-bit values (8 chunks fit in int16), 7874 for 5-bit (4),
// 16002 for 6-bit (2). The integer sums are the same either way.
template <class V, int Every>
struct Dots {
  typename V::I s = V::zero();  // int32 lanes
#if !JLLAMA_Q_VNNI
  typename V::I p = V::zero();  // int16 pair sums not yet widened
  int pending = 0;
#endif
  inline void add(typename V::I u, typename V::I a) {
#if JLLAMA_Q_VNNI
    s = V::dp(s, u, a);
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
  inline typename V::I sums() {
    flush();
    return s;
  }
};

#if !JLLAMA_Q_VNNI
// Without VNNI, a K-quant's sub-block scales are applied in integers: the int16 pair sums of
// `Every` chunks are widened by `madd` against the rows' scales (each 32-bit lane the scale of
// its row twice) rather than against ones, and summed over the whole super-block in int32, so a
// super-block costs one conversion to float and one multiply instead of one per sub-block (the
// AVX2 build is bound by its instructions, not by memory: x86-64-v3 Q4_K ran at 15.6 GB/s from
// L2 on one core against 30 with VNNI). The sums are exact: |sum_j sc_j * dot_j| <= 8 * 63 *
// 32 * 15 * 127 (Q4_K), 8 * 63 * 32 * 31 * 127 (Q5_K), 16 * 128 * 16 * 63 * 127 (Q6_K), all
// below 2^31; their conversion to float rounds once, where the float path rounded per sub-block.
template <int Every>
struct ScaledDots {
  __m256i s = _mm256_setzero_si256();  // int32 lanes: sum of scale * dot
  __m256i p = _mm256_setzero_si256();  // int16 pair sums not yet widened
  int pending = 0;
  inline void add(__m256i u, __m256i a, __m256i scale) {
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u, a));
    if (++pending == Every) flush(scale);
  }
  inline void flush(__m256i scale) {
    if (pending) {
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scale));
      p = _mm256_setzero_si256();
      pending = 0;
    }
  }
};

// The 8 rows' bytes (one u64: row r's byte r), unsigned or signed, each as the int16 pair
// (b, b) in 32-bit lane r: the multiplier `ScaledDots` widens with.
template <bool Signed>
inline __m256i scale_pairs(uint64_t bytes) {
  const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(bytes));
  const __m256i w = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(w, 16));
}
#endif

// The 8 row bytes of every group at byte `at` of its tile (`V::kGroups` u64).
template <class V>
inline void row_bytes(const uint8_t* w, int64_t pair, int64_t at, uint64_t* out) {
  for (int g = 0; g < V::kGroups; ++g) out[g] = load_u64(w + g * pair + at);
}

// ggml's get_scale_min_k4 on the 8 rows' bytes at once, per group: the 6-bit scales sc[j] and
// minimums mn[j] of sub-blocks j = 0 .. 7 from the 12 scale planes of a Q4_K / Q5_K tile.
template <class V>
inline void scales_mins(const uint8_t* w, int64_t pair, uint64_t (*sc)[V::kGroups],
                        uint64_t (*mn)[V::kGroups]) {
  constexpr uint64_t m6 = 0x3F3F3F3F3F3F3F3Full, m4 = 0x0F0F0F0F0F0F0F0Full;
  constexpr uint64_t m2 = 0x0303030303030303ull;
  uint64_t p[12][V::kGroups];
  for (int i = 0; i < 12; ++i) row_bytes<V>(w, pair, 32 + 8 * i, p[i]);
  for (int g = 0; g < V::kGroups; ++g)
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        sc[j][g] = p[j][g] & m6;
        mn[j][g] = p[j + 4][g] & m6;
      } else {
        sc[j][g] = (p[j + 4][g] & m4) | (((p[j - 4][g] >> 6) & m2) << 4);
        mn[j][g] = ((p[j + 4][g] >> 4) & m4) | (((p[j][g] >> 6) & m2) << 4);
      }
    }
}

// The int16 pair p[0], p[1] as one int32 (p[0] in the low half), for `dpw` against the rows'
// pairs.
inline int32_t pair32(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The end of a Q4_K / Q5_K super-block `sb` for token x: acc + part * dx - (dmin * float(sum_j
// m_j * bsum_j)) * dx, mins[k] the rows' minimums of sub-blocks 2k and 2k + 1 as int16 pairs
// (`pairs`), bsum_j the token's sum over sub-block j (the integer sum exact in int32).
template <class V, class F = typename V::F, class I = typename V::I>
inline F k4_step(F acc, F part, F dmin, const I* mins, const Activations& x, int64_t sb) {
  const int16_t* s32 = x.s32 + 8 * sb;
  I msum = V::zero();
  for (int k = 0; k < 4; ++k) msum = V::dpw(msum, mins[k], V::set1(pair32(s32 + 2 * k)));
  const F dx = V::fset1(x.d[8 * sb]);
  return V::fnma(V::mul(dmin, V::cvt(msum)), dx, V::fma(part, dx, acc));
}

// The end of a Q6_K super-block `sb` for token x: acc + (part - 32 * float(sum_k sc_k * bsum_k))
// * (d * dx), sc16[k] the rows' scales 2k and 2k + 1 as int16 pairs (`pairs`), bsum_k the
// token's sum over the 16 values of scale k (the integer sum exact in int32).
template <class V, class F = typename V::F, class I = typename V::I>
inline F k6_step(F acc, F part, F d, const I* sc16, const Activations& x, int64_t sb) {
  const int16_t* s16 = x.s16 + 16 * sb;
  I off = V::zero();
  for (int k = 0; k < 8; ++k) off = V::dpw(off, sc16[k], V::set1(pair32(s16 + 2 * k)));
  const F whole = V::fnma(V::cvt(off), V::fset1(32.0f), part);
  return V::fma(whole, V::mul(d, V::fset1(x.d[8 * sb])), acc);
}

constexpr int64_t kTileAhead = 8192;

// A streaming product's steady stream ahead (Ahead: decode's big products, simd.h's
// JLLAMA_PREFETCH): the bytes of this block's tile `kTileAhead` further on in each group's rows,
// asked for with the non-temporal hint as each block starts. Asking for a whole 16-row unit at
// its start instead (up to 190 KB at once for Llama-3.1-8B's ffn_down) ran past what a core keeps
// in flight: Llama-3.1-8B Q4_K_M decoded at 5.8-6.1 tok/s that way, 9.7-11.2 this way, beside
// llama-bench's 9.1-10.9 (2-core AMD EPYC VM, 2026-12-05; 2048 and 16384 bytes ahead measured
// too: 16384 gave 8.0 on the 8B). Once decode read one group at a time (ggml_products.cc's
// ggml_groups), 8192 bytes ahead beat 4096 on the same VM: Llama-3.2-1B Q4_K_M 61-85 tok/s
// (median 79) against 72-81 (median 74), SmolLM2 409-458 against 270-384; 2048 was slower
// (56-72), 16384 no better; the 8B within noise (11.7-15.7 either way).
template <class V, bool Ahead>
inline void tile_ahead(const uint8_t* w, int64_t pair, int64_t bytes) {
#if JLLAMA_PREFETCH && (defined(__x86_64__) || defined(_M_X64))
  if constexpr (Ahead)
    for (int g = 0; g < V::kGroups; ++g)
      for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + g * pair + kTileAhead + b), _MM_HINT_NTA);
#else
  (void)w, (void)pair, (void)bytes;
#endif
}

// The rows of `V::kGroups` groups (group g's tiles at w + g * pair; n / block elements tiles
// each) dotted with NT activation vectors x[t]: y[t][0 .. 8 * kGroups - 1]. The weights are
// decoded once for all NT (a prefill chunk's tokens, or a batch's rows, share them); per token
// the integer dot products are exact (int32) and the float work runs in block order, the same
// operations for any NT and width, so a token's row does not depend on the tokens beside it or on
// which width computed it.
//
// Per token, with dx its step (per 32 for Q8_0-style activations, per 256 for Q8_K):
//   Q8_0 / Q4_0 / Q5_0  acc += float(dot) * (d * dx), then (offsets) acc -= d * (o * dx * sum)
//   Q4_1 / Q5_1         the same, then acc += m * s (Q8_1's float16 s = dx * sum)
//   Q4_K / Q5_K         per super-block: t = sum_j float(dot_j) * (d * sc_j) in sub-block order,
//                       acc += t * dx, acc -= (dmin * float(sum_j m_j * bsum_j)) * dx
//   Q6_K                per super-block: t = sum_k float(dot_k) * float(sc_k) (dot over v =
//                       q + 32), t -= 32 * float(sum_k sc_k * bsum_k), acc += t * (d * dx)
template <class V, int32_t T, int NT, bool Ahead = false>
inline void xdot_n(const uint8_t* w, int64_t pair, const Activations* x, float* const* y) {
  using I = typename V::I;
  using F = typename V::F;
  const I low4 = V::set8(0x0F);
  F acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = V::fzero();
  const int64_t n = x[0].n;
  if constexpr (T == Q8_0) {
    for (int64_t b = 0; b < n / 32; ++b, w += 272) {
      tile_ahead<V, Ahead>(w, pair, 272);
      I s[NT];
      for (int t = 0; t < NT; ++t) s[t] = V::zero();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const I q = V::load(w, pair, 16 + 32 * k);
#if JLLAMA_Q_VNNI
        // q + 128 as unsigned (one xor for all tokens); the 128 * sum(a) it adds is taken off
        // below, in integers.
        const I u = V::xor_(q, V::set8(static_cast<int8_t>(0x80)));
        for (int t = 0; t < NT; ++t) s[t] = V::dp(s[t], u, V::bcast4(x[t].q + 32 * b + 4 * k));
#else
        const I u = V::sign(q, q);
        for (int t = 0; t < NT; ++t)
          s[t] = V::dp(s[t], u, V::sign(V::bcast4(x[t].q + 32 * b + 4 * k), q));
#endif
      }
      const F d = V::halves(w, pair, 0);
      for (int t = 0; t < NT; ++t) {
#if JLLAMA_Q_VNNI
        const int32_t sum = x[t].s16[2 * b] + x[t].s16[2 * b + 1];
        s[t] = V::sub32(s[t], V::set1(128 * sum));
#endif
        acc[t] = V::fma(V::cvt(s[t]), V::mul(d, V::fset1(x[t].d[b])), acc[t]);
      }
    }
  } else if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    constexpr bool min = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1;
    constexpr int64_t qh_at = min ? 32 : 16, qs_at = qh_at + (five ? 32 : 0);
    constexpr int64_t tile = qs_at + 128;
    constexpr float offset = T == Q4_0 ? 8.0f : T == Q5_0 ? 16.0f : 0.0f;
    for (int64_t b = 0; b < n / 32; ++b, w += tile) {
      tile_ahead<V, Ahead>(w, pair, tile);
      Dots<V, five ? 4 : 8> s[NT];
      const I qh = five ? V::load(w, pair, qh_at) : V::zero();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {  // values 4k .. 4k + 3 of the rows
        const I q = V::load(w, pair, qs_at + 32 * (k % 4));
        I v = V::and_(k < 4 ? q : V::srl4(q), low4);
        if (five) v = V::or_(v, V::bit_to_0x10(qh, k));
        for (int t = 0; t < NT; ++t) s[t].add(v, V::bcast4(x[t].q + 32 * b + 4 * k));
      }
      const F d = V::halves(w, pair, 0);
      const F m = min ? V::halves(w, pair, 16) : V::fzero();
      for (int t = 0; t < NT; ++t) {
        acc[t] = V::fma(V::cvt(s[t].sums()), V::mul(d, V::fset1(x[t].d[b])), acc[t]);
        if (min) acc[t] = V::fma(m, V::fset1(x[t].ds[b]), acc[t]);
        else acc[t] = V::fnma(d, V::fset1(offset * x[t].ds[b]), acc[t]);
      }
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr bool five = T == Q5_K;
    constexpr int64_t qs_at = five ? 384 : 128, tile = five ? 1408 : 1152;
    for (int64_t sb = 0; sb < n / 256; ++sb, w += tile) {
      tile_ahead<V, Ahead>(w, pair, tile);
      uint64_t sc[8][V::kGroups], mn[8][V::kGroups];
      scales_mins<V>(w, pair, sc, mn);
      const F d = V::halves(w, pair, 0), dmin = V::halves(w, pair, 16);
      F part[NT];
#if JLLAMA_Q_VNNI
      for (int t = 0; t < NT; ++t) part[t] = V::fzero();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // sub-block j: values 32j .. 32j + 31
        const int g = j / 2, half = j % 2;
        Dots<V, five ? 4 : 8> s[NT];
        for (int c = 0; c < 8; ++c) {
          const I q = V::load(w, pair, qs_at + 256 * g + 32 * c);
          I v = V::and_(half ? V::srl4(q) : q, low4);
          if (five) v = V::or_(v, V::bit_to_0x10(V::load(w, pair, 128 + 32 * c), j));
          for (int t = 0; t < NT; ++t) s[t].add(v, V::bcast4(x[t].q + 256 * sb + 32 * j + 4 * c));
        }
        const F dsc = V::mul(d, V::template bytes<false>(sc[j]));
        for (int t = 0; t < NT; ++t) part[t] = V::fma(V::cvt(s[t].sums()), dsc, part[t]);
      }
#else
      ScaledDots<five ? 4 : 8> s[NT];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // sub-block j: values 32j .. 32j + 31
        const int g = j / 2, half = j % 2;
        const I scale = scale_pairs<false>(sc[j][0]);
        for (int c = 0; c < 8; ++c) {
          const I q = V::load(w, pair, qs_at + 256 * g + 32 * c);
          I v = V::and_(half ? V::srl4(q) : q, low4);
          if (five) v = V::or_(v, V::bit_to_0x10(V::load(w, pair, 128 + 32 * c), j));
          for (int t = 0; t < NT; ++t)
            s[t].add(v, V::bcast4(x[t].q + 256 * sb + 32 * j + 4 * c), scale);
        }
        for (int t = 0; t < NT; ++t) s[t].flush(scale);
      }
      for (int t = 0; t < NT; ++t) part[t] = V::mul(V::cvt(s[t].s), d);
#endif
      I mins[4];
      for (int k = 0; k < 4; ++k) mins[k] = V::template pairs<false>(mn[2 * k], mn[2 * k + 1]);
      for (int t = 0; t < NT; ++t) acc[t] = k4_step<V>(acc[t], part[t], dmin, mins, x[t], sb);
    }
  } else if constexpr (T == Q6_K) {
    const I hi_mask = V::set8(0x30);
    for (int64_t sb = 0; sb < n / 256; ++sb, w += 1680) {
      tile_ahead<V, Ahead>(w, pair, 1680);
      uint64_t scales[16][V::kGroups];
      for (int k = 0; k < 16; ++k) row_bytes<V>(w, pair, 16 + 8 * k, scales[k]);
      F part[NT];
#if JLLAMA_Q_VNNI
      for (int t = 0; t < NT; ++t) part[t] = V::fzero();
#else
      ScaledDots<2> s[NT];
#endif
      for (int nh = 0; nh < 2; ++nh) {      // half of the super-block: values 128 nh ..
        for (int h = 0; h < 2; ++h) {       // 16-value halves of its activation blocks
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {     // values 128 nh + 32 v + 16 h ..: one scale each
#if JLLAMA_Q_VNNI
            Dots<V, 2> s[NT];
#else
            const I scale = scale_pairs<true>(scales[8 * nh + 2 * v + h][0]);
#endif
            for (int c = 4 * h; c < 4 * h + 4; ++c) {
              const I q = V::load(w, pair, 144 + 512 * nh + 32 * (c + 8 * (v % 2)));
              const I H = V::load(w, pair, 1168 + 256 * nh + 32 * c);
              const I lo = V::and_(v < 2 ? q : V::srl4(q), low4);
              // Bits 2v, 2v + 1 of each byte of H moved to bits 4, 5 in one shift (of 16-bit
              // lanes: what crosses into the other byte of a lane lands outside 0x30).
              const I moved = v == 0 ? V::sll4(H) : v == 1 ? V::sll2(H) : v == 2 ? H : V::srl16(H, 2);
              const I val = V::or_(lo, V::and_(moved, hi_mask));
#if JLLAMA_Q_VNNI
              for (int t = 0; t < NT; ++t)
                s[t].add(val, V::bcast4(x[t].q + 256 * sb + 128 * nh + 32 * v + 4 * c));
#else
              for (int t = 0; t < NT; ++t)
                s[t].add(val, V::bcast4(x[t].q + 256 * sb + 128 * nh + 32 * v + 4 * c), scale);
#endif
            }
#if JLLAMA_Q_VNNI
            const F sc = V::template bytes<true>(scales[8 * nh + 2 * v + h]);
            for (int t = 0; t < NT; ++t) part[t] = V::fma(V::cvt(s[t].sums()), sc, part[t]);
#else
            for (int t = 0; t < NT; ++t) s[t].flush(scale);
#endif
          }
        }
      }
#if !JLLAMA_Q_VNNI
      for (int t = 0; t < NT; ++t) part[t] = V::cvt(s[t].s);
#endif
      I sc16[8];
      for (int k = 0; k < 8; ++k) sc16[k] = V::template pairs<true>(scales[2 * k], scales[2 * k + 1]);
      const F d = V::halves(w, pair, 0);
      for (int t = 0; t < NT; ++t) acc[t] = k6_step<V>(acc[t], part[t], d, sc16, x[t], sb);
    }
  }
  for (int t = 0; t < NT; ++t) V::store(y[t], acc[t]);
}

// Rows of the groups at `group` (8 * kGroups rows; `pair` bytes from one group's tiles to the
// next's) with NT tokens' activations: y[t] + 0 .. 8 * kGroups - 1.
template <int32_t T, int NT>
inline void x8_dot_n(const uint8_t* w, const Activations* x, float* const* y) {
  xdot_n<Y8, T, NT>(w, 0, x, y);
}

template <int32_t T, bool Ahead = false>
inline void x8_dot(const uint8_t* w, const Activations& x, float* y) {
  float* const ys[1] = {y};
  xdot_n<Y8, T, 1, Ahead>(w, 0, &x, ys);
}

#if JLLAMA_Q_Z16
// Groups g and g + 1 (16 rows) at once: `pair` = 8 * the row's bytes.
template <int32_t T, int NT, bool Ahead = false>
inline void x16_dot_n(const uint8_t* w, int64_t pair, const Activations* x, float* const* y) {
  xdot_n<Z16, T, NT, Ahead>(w, pair, x, y);
}
#endif

#endif  // JLLAMA_Q_AVX2

}  // namespace ggml
