// One token's attention over a layer's cache (decode: `jllama_attention_f32`, and each sequence
// of the batched decode, batch.cc), reading every key and value row of the cache once a token.
//
// As llama2.c run.c: query head h = g * kv_mul + m scores q_h . k_t / sqrt(head_dim) against key
// head g for t = 0 .. pos, takes the softmax, and sums the values with those weights. XLA's
// version multiplies q by whole 256-position blocks and masks the positions past pos; this one
// reads positions 0 .. pos only, in one call a layer.
//
// Work comes in units of (key head g, span of kSpan positions). A unit reads its span's key
// rows and value rows once for all kv_mul query heads of g: each key row for kv_mul dot
// products, each value row for kv_mul multiply-adds. (One unit per query head, as before, read
// every row kv_mul times: 4 times a token for Llama 3.2-1B, 3 for SmolLM2.) A unit leaves, per
// query head, its span's partial softmax: the largest score M, the sum of exp(s - M) and the
// sum of exp(s - M) v; when every unit is done the caller merges each head's spans in span
// order (as flash-decoding splits a long context: Dao et al., "Flash-Decoding for long-context
// inference", 2023): with T the largest M, out = sum_c exp(M_c - T) o_c / sum_c exp(M_c - T) l_c.
// Spans have kSpan positions whatever the thread count, so a long context keeps every thread
// busy even with fewer key heads than threads (SmolLM2 has 3 for 2 threads), and since each
// unit runs on one thread in a fixed order and the merge runs in a fixed order, the bits do not
// depend on the thread count nor on which thread took which unit.
//
// Within a unit, tiles of 16 positions: their key rows widened to float32 (cache_rows.h;
// float32 rows in one block are read in place), then for each query head its 16 scores, each
// sum_d q_d k_d in 16 lanes (8 with AVX2) summed by a fixed tree; the span's softmax (exp to
// about 1 ulp, simd.h; std::exp in the plain build); then the tiles' value rows widened, and
// for each query head o[d] += p_t v_t[d] in t order.

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

struct Attention {
  const float* q;  // [n_kv_heads, kv_mul, head_dim]
  float* out;      // the same shape
  Cache keys, values;
  int64_t n_kv, kv_mul, head_dim, pos;
  float* partials = nullptr;  // [n_kv, spans, kv_mul, stride], set by `attend`

  int64_t spans() const { return pos / kSpan + 1; }
  int64_t units() const { return n_kv * spans(); }
  // head_dim rounded up to 16: rows in scratch are zero-padded to whole registers.
  int64_t padded() const { return (head_dim + 15) / 16 * 16; }
  // One query head's partial result for a span: the sum of exp(s - M) v (padded floats), then
  // M and the sum of exp(s - M); a whole number of cache lines.
  int64_t stride() const { return padded() + 16; }
  float* partial(int64_t g, int64_t span, int64_t m) const {
    return partials + ((g * spans() + span) * kv_mul + m) * stride();
  }
  // A unit's scratch: the scaled queries [kv_mul, padded], a tile [16, padded], the scores
  // [kv_mul, kSpan].
  int64_t scratch_floats() const { return (kv_mul + kRowTile) * padded() + kv_mul * kSpan; }
};

// A float32 area of at least `floats`, 64-byte aligned, that this thread keeps for its later
// calls (`slot` 0: a unit's scratch, 1: the partial results): a decode step calls this a few
// times a layer, and a fresh allocation of a long context's partials would fault its pages in
// every call. Throws std::bad_alloc as `new` would.
inline float* thread_area(int slot, int64_t floats) {
  struct Area {
    float* data = nullptr;
    int64_t floats = 0;
    ~Area() { std::free(data); }
  };
  thread_local Area areas[2];
  Area& a = areas[slot];
  if (a.floats < floats) {
    std::free(a.data);
    a.floats = 0;
    const size_t bytes = (sizeof(float) * static_cast<size_t>(floats) + 63) / 64 * 64;
    a.data = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (a.data == nullptr) throw std::bad_alloc();
    a.floats = floats;
  }
  return a.data;
}

// Rows t .. t + k - 1 (k <= 16) of key head g of `cache` as float32 rows of hp floats into
// tile (f32[16 * hp]), zero past head_dim, rows k .. 15 zero; widen(row, out) widens one row.
template <typename Widen>
inline void widen_tile(const Cache& cache, int64_t g, int64_t t, int64_t k, int64_t hd,
                       int64_t hp, float* tile, Widen widen) {
  int64_t b = t / cache.block, o = t % cache.block;
  const uint8_t* row = cache.base(b) + (g * cache.block + o) * cache.row_bytes;
  for (int64_t j = 0; j < k; ++j) {
    widen(row, tile + j * hp);
    if (hd < hp) std::fill(tile + j * hp + hd, tile + (j + 1) * hp, 0.0f);
    if (++o == cache.block) {
      ++b, o = 0;
      row = cache.base(b) + g * cache.block * cache.row_bytes;
    } else {
      row += cache.row_bytes;
    }
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
#if JLLAMA_AVX512
using Vec = __m512;
constexpr int kVec = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfmadd(float a, Vec b, Vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
#else
using Vec = __m256;
constexpr int kVec = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfmadd(float a, Vec b, Vec c) { return _mm256_fmadd_ps(_mm256_set1_ps(a), b, c); }
#endif
// AVX2 has 16 registers: 4 heads by 2 registers of columns.
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
      for (int m = 0; m < M; ++m) acc[m][c] = vfmadd(p[m * kSpan + j], v, acc[m][c]);
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
      for (int64_t d = 0; d < hp; ++d) out[m * out_stride + d] += p[m * kSpan + j] * rows[j * hp + d];
#endif
}

// Unit (g, span) of `a`: its kv_mul partial results (`Attention::partial`). scratch:
// f32[a.scratch_floats()].
void attend_span(const Attention& a, int64_t g, int64_t span, float* scratch) {
  const int64_t hd = a.head_dim, hp = a.padded(), heads = a.kv_mul;
  const int64_t t0 = span * kSpan, n = std::min(kSpan, a.pos + 1 - t0);
  float* q = scratch;                     // [kv_mul, hp], scaled by 1 / sqrt(head_dim)
  float* tile = q + heads * hp;           // [16, hp]
  float* scores = tile + kRowTile * hp;   // [kv_mul, kSpan]
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t m = 0; m < heads; ++m) {
    const float* qm = a.q + (g * heads + m) * hd;
    for (int64_t d = 0; d < hp; ++d) q[m * hp + d] = d < hd ? qm[d] * scale : 0.0f;
  }
  const ScoresTile scores_of = scores_for(hp);
  for (int64_t t = 0; t < n; t += kRowTile) {
    const float* rows = load_tile(a.keys, g, t0 + t, std::min(kRowTile, n - t), hd, hp, tile);
    scores_of(q, heads, rows, hp, scores + t);
  }
  for (int64_t m = 0; m < heads; ++m) {
    float* part = a.partial(g, span, m);
    exp_span(scores + m * kSpan, n, part + hp, part + hp + 1);
    std::fill(part, part + hp, 0.0f);
  }
  for (int64_t t = 0; t < n; t += kRowTile) {
    const int64_t k = std::min(kRowTile, n - t);
    const float* rows = load_tile(a.values, g, t0 + t, k, hd, hp, tile);
    accumulate(scores + t, heads, k, rows, hp, a.partial(g, span, 0), a.stride());
  }
}

// a.out from the partial results, each query head's spans in span order.
void merge_spans(const Attention& a) {
  const int64_t hd = a.head_dim, hp = a.padded(), spans = a.spans();
  for (int64_t g = 0; g < a.n_kv; ++g)
    for (int64_t m = 0; m < a.kv_mul; ++m) {
      float* out = a.out + (g * a.kv_mul + m) * hd;
      float top = -INFINITY;
      for (int64_t c = 0; c < spans; ++c) top = std::max(top, a.partial(g, c, m)[hp]);
      float total = 0.0f;
      std::fill(out, out + hd, 0.0f);
      for (int64_t c = 0; c < spans; ++c) {
        const float* part = a.partial(g, c, m);
        const float w = std::exp(part[hp] - top);
        total += w * part[hp + 1];
        for (int64_t d = 0; d < hd; ++d) out[d] += w * part[d];
      }
      for (int64_t d = 0; d < hd; ++d) out[d] /= total;
    }
}

// The units of several sequences' attention (the batched decode's; one sequence alone
// otherwise): sequence s has units first[s] .. first[s + 1] - 1, unit u = g * spans + span.
struct DecodeWork {
  const Attention* seqs;
  std::vector<int64_t> first;
  int64_t scratch_floats;
};

void decode_units(const Product& p, int64_t begin, int64_t end) {
  const DecodeWork& w = *static_cast<const DecodeWork*>(p.w);
  float* scratch = thread_area(0, w.scratch_floats);
  int64_t s = std::upper_bound(w.first.begin(), w.first.end(), begin) - w.first.begin() - 1;
  for (int64_t u = begin; u < end; ++u) {
    while (u >= w.first[s + 1]) ++s;
    const Attention& a = w.seqs[s];
    const int64_t local = u - w.first[s];
    attend_span(a, local / a.spans(), local % a.spans(), scratch);
  }
}

// The attention of `count` sequences, each over its own cache: their units shared among
// `threads` threads (`run`, kernels.h), then each sequence's spans merged, so a sequence's
// output has the same bits alone or beside others. Sequences of one head_dim and kv_mul.
ffi::Error attend(int64_t threads, Attention* seqs, int64_t count) {
  DecodeWork work{seqs, {0}, 0};
  int64_t partial_floats = 0, longest = 0;
  for (int64_t s = 0; s < count; ++s) {
    const Attention& a = seqs[s];
    work.first.push_back(work.first.back() + a.units());
    partial_floats += a.units() * a.kv_mul * a.stride();
    work.scratch_floats = std::max(work.scratch_floats, a.scratch_floats());
    longest = std::max(longest, a.pos + 1);
  }
  float* partials;
  try {
    partials = thread_area(1, std::max<int64_t>(1, partial_floats));
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jllama attention: out of memory");
  }
  for (int64_t s = 0; s < count; ++s) {
    seqs[s].partials = partials;
    partials += seqs[s].units() * seqs[s].kv_mul * seqs[s].stride();
  }
  if (count > 0) {
    // A unit's work, for `run`'s choice to split: the keys and values of its positions.
    const int64_t n = 2 * std::min(kSpan, longest) * seqs[0].head_dim * seqs[0].kv_mul;
    run(threads, Product{decode_units, &work, nullptr, nullptr, nullptr, n}, work.first.back());
  }
  for (int64_t s = 0; s < count; ++s) merge_spans(seqs[s]);
  return ffi::Error::Success();
}

// Cache blocks blocks[first .. first + n) as the rows of `like` (checked), into ptrs[0 .. n).
ffi::Error block_pointers(const ffi::RemainingArgs& blocks, size_t first, size_t n, int64_t hd,
                          Blocks* like, const char* what, const uint8_t** ptrs) {
  for (size_t i = 0; i < n; ++i) {
    auto b = blocks.get<ffi::AnyBuffer>(first + i);
    if (b.has_error()) return b.error();
    if (ffi::Error e = check_block(*b, hd, like, what); e.failure()) return e;
    ptrs[i] = static_cast<const uint8_t*>(b->untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error AttentionF32(ffi::ThreadPool pool, F32Heads q, S32Scalar pos, S32Scalar cur,
                        ffi::AnyBuffer key_cur, ffi::AnyBuffer value_cur,
                        ffi::RemainingArgs blocks, F32HeadsResult out) {
  const auto qd = q.dimensions();
  const int64_t n_kv = qd[0], kv_mul = qd[1], hd = qd[2];
  if (!same(out->dimensions(), qd) || blocks.size() % 2 != 0 || blocks.size() == 0 ||
      kv_mul < 1 || hd < 1)
    return ffi::Error::InvalidArgument(
        "jllama attention: q[n_kv_heads, kv_mul, head_dim], out of q's shape and an even "
        "number of cache blocks");
  Blocks keys, values;
  if (ffi::Error e = check_block(key_cur, hd, &keys, "jllama attention: key blocks"); e.failure())
    return e;
  if (ffi::Error e = check_block(value_cur, hd, &values, "jllama attention: value blocks");
      e.failure())
    return e;
  if (keys.n_kv != n_kv || values.n_kv != n_kv || values.block != keys.block)
    return ffi::Error::InvalidArgument(
        "jllama attention: q[n_kv_heads, ., .] and blocks [n_kv_heads, B, .] do not agree");
  const size_t n = blocks.size() / 2;
  std::unique_ptr<const uint8_t*[]> ptrs(new const uint8_t*[2 * n]);
  if (ffi::Error e = block_pointers(blocks, 0, n, hd, &keys, "jllama attention: key blocks",
                                    ptrs.get());
      e.failure())
    return e;
  if (ffi::Error e = block_pointers(blocks, n, n, hd, &values, "jllama attention: value blocks",
                                    ptrs.get() + n);
      e.failure())
    return e;
  const int64_t p = *pos.typed_data(), c = *cur.typed_data(), block = keys.block;
  if (p < 0 || p >= static_cast<int64_t>(n) * block)
    return ffi::Error::InvalidArgument("jllama attention: pos outside the blocks given");
  Attention a{q.typed_data(), out->typed_data(),
              Cache{ptrs.get(), static_cast<const uint8_t*>(key_cur.untyped_data()), c, block,
                    row_bytes(keys.type, hd), keys.type},
              Cache{ptrs.get() + n, static_cast<const uint8_t*>(value_cur.untyped_data()), c,
                    block, row_bytes(values.type, hd), values.type},
              n_kv, kv_mul, hd, p};
  return attend(pool.num_threads(), &a, 1);
}

}  // namespace

// Parenthesized: the commas between the template arguments would split the macro's arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_attention_f32, AttentionF32,
    (args<F32Heads, S32Scalar, S32Scalar, ffi::AnyBuffer, ffi::AnyBuffer>(  // q, pos, cur,
         ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())                           // key_cur, value_cur
         .RemainingArgs()  // the cache blocks: k key blocks, then k value blocks
         .Ret<F32Heads>()));

}  // namespace jllama
