// The vector work of the decode attention's units (attention_decode.cc) on tiles of 16
// positions of one key head: the tile's rows widened to float32 (`load_tile`), their scores
// against each query head (`scores_tile`), a span's softmax (`exp_span`) and the weighted sum
// of the value rows (`accumulate`), each with AVX-512, AVX2 and plain loops, each in a fixed
// order of operations.

#pragma once

#include <array>
#include <utility>

#include "cache_rows.h"
#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

constexpr int64_t kSpan = 256;     // positions per unit of work
constexpr int64_t kRowTile = 16;   // positions per tile of a unit

// One layer's cache as blocks of `block` positions: block b is blocks[b], except block `cur`,
// which is given apart (the decode loop writes it in the same program). Rows of `type`.
struct Cache {
  const uint8_t* const* blocks;  // [n_blocks] of [n_kv_heads, block, row_length]
  const uint8_t* current;
  int64_t cur, block, row_bytes;
  RowType type;

  const uint8_t* base(int64_t b) const { return b == cur ? current : blocks[b]; }
};

// Rows t .. t + k - 1 (k <= 16) of key head g of `cache` as float32 rows of hp floats into
// tile (f32[16 * hp]), zero past head_dim, rows k .. 15 zero; widen(row, out) widens one row.
template <typename Widen>
inline void widen_tile(const Cache& cache, int64_t g, int64_t t, int64_t k, int64_t hd,
                       int64_t hp, float* tile, Widen widen) {
  int64_t b = t / cache.block, o = t % cache.block;
  const uint8_t* row = cache.base(b) + (g * cache.block + o) * cache.row_bytes;
  for (int64_t j = 0; j < k; ++j) {
    if (j > 0 && ++o == cache.block) {  // the next block (only when a row lies in it)
      ++b, o = 0;
      row = cache.base(b) + g * cache.block * cache.row_bytes;
    } else if (j > 0) {
      row += cache.row_bytes;
    }
    widen(row, tile + j * hp);
    if (hd < hp) std::fill(tile + j * hp + hd, tile + (j + 1) * hp, 0.0f);
  }
  if (k < kRowTile) std::fill(tile + k * hp, tile + kRowTile * hp, 0.0f);
}

// widen_tile of `cache`'s type; float32 rows of hp values in one block are read in place.
inline const float* load_tile(const Cache& cache, int64_t g, int64_t t, int64_t k, int64_t hd,
                              int64_t hp, float* tile) {
  switch (cache.type) {
    case RowType::kF32: {
      const int64_t o = t % cache.block;
      if (hd == hp && k == kRowTile && o + k <= cache.block)
        return reinterpret_cast<const float*>(cache.base(t / cache.block) +
                                              (g * cache.block + o) * cache.row_bytes);
      widen_tile(cache, g, t, k, hd, hp, tile, [hd](const uint8_t* row, float* out) {
        std::memcpy(out, row, sizeof(float) * hd);
      });
      break;
    }
    case RowType::kF16:
      widen_tile(cache, g, t, k, hd, hp, tile, [hd](const uint8_t* row, float* out) {
        widen_values(reinterpret_cast<const Half*>(row), 0, hd, out);
      });
      break;
    case RowType::kBF16:
      widen_tile(cache, g, t, k, hd, hp, tile, [hd](const uint8_t* row, float* out) {
        widen_values(reinterpret_cast<const uint16_t*>(row), 0, hd, out);
      });
      break;
    case RowType::kQ8_0:
      widen_tile(cache, g, t, k, hd, hp, tile,
                 [hd](const uint8_t* row, float* out) { widen_q8_0(row, 0, hd, out); });
      break;
  }
  return tile;
}

#if JLLAMA_AVX512
// Lane j of the result: the sum of a[j]'s 16 lanes, as a fixed tree (pairs of registers
// interleaved and added, then pairs of pairs, then the 128-bit quarters).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // c[i]: rows 4i .. 4i + 3 in each 128-bit quarter, each quarter a partial sum.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif JLLAMA_AVX2
// Lane j of the result: the sum of a[j]'s 8 lanes, as a fixed tree.
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// s_m[j] = q_m . rows[j] for the 16 rows of a tile (f32[16, hp]) and the query heads m <
// heads (q_m = q + m * hp, s_m = s + m * kSpan). HP: hp when known at compile time (the
// addresses of the 16 rows are then constant offsets, not 16 pointers), else 0.
template <int64_t HP>
void scores_tile(const float* q, int64_t heads, const float* rows, int64_t hp_given, float* s) {
  const int64_t hp = HP ? HP : hp_given;
  for (int64_t m = 0; m < heads; ++m, q += hp, s += kSpan) {
#if JLLAMA_AVX512
    __m512 acc[kRowTile];
    for (int j = 0; j < kRowTile; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hp; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < kRowTile; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(rows + j * hp + d), qv, acc[j]);
    }
    _mm512_storeu_ps(s, sum_lanes16(acc));
#elif JLLAMA_AVX2
    for (int half = 0; half < 2; ++half) {
      const float* r = rows + 8 * half * hp;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < hp; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(r + j * hp + d), qv, acc[j]);
      }
      _mm256_storeu_ps(s + 8 * half, sum_lanes8(acc));
    }
#else
    for (int j = 0; j < kRowTile; ++j) s[j] = dot_head(q, rows + j * hp, hp);
#endif
  }
}

using ScoresTile = void (*)(const float*, int64_t, const float*, int64_t, float*);

// scores_tile for rows of hp floats.
inline ScoresTile scores_for(int64_t hp) {
  static constexpr ScoresTile kKnown[8] = {scores_tile<16>, scores_tile<32>, scores_tile<48>,
                                           scores_tile<64>, scores_tile<80>, scores_tile<96>,
                                           scores_tile<112>, scores_tile<128>};
  return hp <= 128 ? kKnown[hp / 16 - 1] : scores_tile<0>;
}

// s[t] = exp(s[t] - M) for t < n, M = max_t s[t]; *top = M, *sum = sum_t s[t] (in 16 lanes,
// t mod 16, then halve16's tree).
inline void exp_span(float* s, int64_t n, float* top, float* sum) {
#if JLLAMA_AVX512
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 keep = n - t >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (n - t)) - 1);
    m = _mm512_mask_max_ps(m, keep, m, _mm512_maskz_loadu_ps(keep, s + t));
  }
  const float most = _mm512_reduce_max_ps(m);
  const __m512 most_v = _mm512_set1_ps(most);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 keep = n - t >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + t), most_v));
    _mm512_mask_storeu_ps(s + t, keep, e);
    total = _mm512_mask_add_ps(total, keep, total, e);
  }
  *top = most;
  *sum = halve16(total);
#else
  float most = -INFINITY;
  int64_t t = 0;
#if JLLAMA_AVX2
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  float lanes8[8];
  _mm256_storeu_ps(lanes8, m);
  for (float v : lanes8) most = std::max(most, v);
#endif
  for (; t < n; ++t) most = std::max(most, s[t]);
  float lanes[16] = {0};
  t = 0;
#if JLLAMA_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const __m256 most_v = _mm256_set1_ps(most);
  for (; t + 16 <= n; t += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), most_v));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), most_v));
    _mm256_storeu_ps(s + t, e0);
    _mm256_storeu_ps(s + t + 8, e1);
    lo = _mm256_add_ps(lo, e0);
    hi = _mm256_add_ps(hi, e1);
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - most);
    lanes[t % 16] += s[t];
  }
  *top = most;
  *sum = halve16(lanes);
#endif
}

// For the query heads m < heads: out_m[d] += sum_{j < k} p_m[j] rows[j, d] for d < hp, j in
// order (p_m = p + m * kSpan, out_m = out + m * out_stride); rows: f32[16, hp]. In blocks of
// up to 4 heads by 4 registers of columns, whose sums stay in registers for the k rows: the
// multiply-adds of a sum depend on each other, so a block keeps up to 16 chains going at once.
#if JLLAMA_AVX512 || JLLAMA_AVX2
// Registers of kVec floats (simd.h's `Vec`). AVX2 has 16 registers: 4 heads by 2 registers of
// columns.
constexpr int kVec = kVectorWidth;
constexpr int kBlockHeads = 4, kBlockCols = kVec == 16 ? 4 : 2;

template <int M, int C>
void accumulate_block(const float* p, int64_t k, const float* rows, int64_t hp, float* out,
                      int64_t out_stride) {
  Vec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = vload(out + m * out_stride + c * kVec);
  for (int64_t j = 0; j < k; ++j)
    for (int c = 0; c < C; ++c) {
      const Vec v = vload(rows + j * hp + c * kVec);
      for (int m = 0; m < M; ++m) acc[m][c] = fmadd(splat(v, p[m * kSpan + j]), v, acc[m][c]);
    }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) vstore(out + m * out_stride + c * kVec, acc[m][c]);
}

template <int M, int... C>
constexpr auto block_row(std::integer_sequence<int, C...>) {
  using Block = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
  return std::array<Block, sizeof...(C)>{accumulate_block<M, C + 1>...};
}
#endif

inline void accumulate(const float* p, int64_t heads, int64_t k, const float* rows, int64_t hp,
                       float* out, int64_t out_stride) {
#if JLLAMA_AVX512 || JLLAMA_AVX2
  using Cols = std::make_integer_sequence<int, kBlockCols>;
  static constexpr auto kBlocks = std::array{block_row<1>(Cols{}), block_row<2>(Cols{}),
                                             block_row<3>(Cols{}), block_row<4>(Cols{})};
  static_assert(kBlocks.size() == kBlockHeads);
  for (int64_t m0 = 0; m0 < heads; m0 += kBlockHeads) {
    const int64_t mh = std::min<int64_t>(kBlockHeads, heads - m0);
    for (int64_t d0 = 0; d0 < hp; d0 += kBlockCols * kVec) {
      const int64_t cols = std::min<int64_t>(kBlockCols, (hp - d0) / kVec);
      kBlocks[mh - 1][cols - 1](p + m0 * kSpan, k, rows + d0, hp, out + m0 * out_stride + d0,
                                out_stride);
    }
  }
#else
  for (int64_t m = 0; m < heads; ++m)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t d = 0; d < hp; ++d)
        out[m * out_stride + d] += p[m * kSpan + j] * rows[j * hp + d];
#endif
}

}  // namespace
}  // namespace jllama
