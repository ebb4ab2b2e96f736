// Attention over a layer's cache blocks and the cache writes before it: a prefill chunk's causal
// attention (`jllama_attention_chunk_f32`) and one token's RoPE and cache write
// (`jllama_rope_write_f32`); one token's attention (decode) is attention_decode.cc. The blocks
// are of any KV cache type (cache_rows.h), keys and values each their own.

#include "cache_rows.h"
#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

bool same(const ffi::AnyBuffer::Dimensions& a, const ffi::AnyBuffer::Dimensions& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// ---------------------------------------------------------------------------------------------
// Causal attention of a chunk of T prompt tokens (prefill): token t's query head h attends over
// key head h / kv_mul at cache positions 0 .. pos + t, as `attention` per token. XLA's version
// (`jllama.graphs.prefill.attention_chunk`) multiplies every query by whole 256-position blocks
// and masks the scores, so half of the chunk's own block is computed and thrown away, and the
// softmax is several programs over [heads, T, block] arrays: 0.92 ms a SmolLM2 layer for the
// first 256 tokens, 1.49 ms for the next 256, 17% of a 512-token prefill (bench/NOTES.md).
//
// Work comes in tiles of 16 consecutive tokens of one query head, largest first, taken by the
// caller and one task per other thread of XLA's pool (not jllama's helpers: those spin for
// milliseconds after a product, which would take a core from the XLA products that follow a
// prefill's attention). A tile is one thread's from start to end, in a fixed order, so the
// result does not depend on the thread count:
//   scores  s[j][r] = sum_d (q_r[d] / sqrt(head_dim)) * k_j[d], d = 0, 1, ... in one
//           multiply-add chain, for keys j of the tile's rows (16 rows in the 16 lanes: the
//           keys' rows are read as stored, each element broadcast)
//   softmax per row over its visible keys j <= pos + t0 + r: max, exp(s - max), their sum
//           in j order
//   values  out_r[d] = (sum_j p[j][r] * v_j[d], j = 0, 1, ...) / sum_r

struct ChunkAttention {
  const float* q;  // [T, n_heads, head_dim], after RoPE
  float* out;      // [T, n_heads * head_dim]
  std::unique_ptr<const uint8_t*[]> blocks;  // k key blocks, then k value blocks
  int64_t n_blocks, t, n_heads, kv_mul, hd, block, pos;
  RowType key_type, value_type;
  int64_t key_bytes, value_bytes;  // per row

  // Key rows j .. j + 15 of key head g (j a multiple of 16, so one block's) as f32[16, hd]:
  // the cache's own rows when it is float32, else widened into `tile` (f32[16 * hd]).
  const float* keys16(int64_t j, int64_t g, float* tile) const {
    const uint8_t* row = blocks[j / block] + (g * block + j % block) * key_bytes;
    if (key_type == RowType::kF32) return reinterpret_cast<const float*>(row);
    for (int64_t r = 0; r < 16; ++r) widen_row(key_type, row + r * key_bytes, hd, tile + r * hd);
    return tile;
  }
  // Values 16 c .. 16 c + 15 of value rows j .. j + 15 of key head g as float32, row r at
  // result + r * *stride: the cache's own when float32, else widened into `tile` (f32[256]).
  const float* values16(int64_t j, int64_t g, int64_t c, float* tile, int64_t* stride) const {
    const uint8_t* row = blocks[n_blocks + j / block] + (g * block + j % block) * value_bytes;
    if (value_type == RowType::kF32) {
      *stride = hd;
      return reinterpret_cast<const float*>(row) + 16 * c;
    }
    for (int64_t r = 0; r < 16; ++r)
      widen_part(value_type, row + r * value_bytes, 16 * c, 16, tile + 16 * r);
    *stride = 16;
    return tile;
  }
};

constexpr int64_t kChunkTile = 16;  // tokens per tile: one per lane

// The tile of tokens [16 * tile, ...) of query head h; st: scratch f32[16 * (pos + T)].
template <int D>  // head_dim / 16
void chunk_tile(const ChunkAttention& a, int64_t h, int64_t tile, float* st) {
  constexpr int64_t HD = 16 * D, R = kChunkTile;
  const int64_t g = h / a.kv_mul, t0 = tile * R, rows = std::min(R, a.t - t0);
  const int64_t first = a.pos + t0;  // row r sees keys 0 .. first + r
  const int64_t len = first + rows;  // keys any row sees
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  alignas(64) float qt[HD * R];  // qt[d * 16 + r]: the rows' queries, scaled, transposed
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < HD; ++d)
      qt[d * R + r] = r < rows ? a.q[((t0 + r) * a.n_heads + h) * HD + d] * scale : 0.0f;
  alignas(64) float total[R];
  alignas(64) float kt[R * HD], vt[R * 16];  // rows widened from a narrower cache type
  int64_t vs;                                 // values16's row stride
#if JLLAMA_AVX512
  // Scores, 16 keys at a time (a tile of keys never crosses a cache block: block % 16 == 0);
  // a last partial tile computes keys past len that nothing reads.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.keys16(j0, g, kt);
    __m512 acc[R];
    for (int64_t jj = 0; jj < R; ++jj) acc[jj] = _mm512_setzero_ps();
    for (int64_t d = 0; d < HD; ++d) {
      const __m512 qv = _mm512_load_ps(qt + d * R);
      for (int64_t jj = 0; jj < R; ++jj)
        acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(k[jj * HD + d]), qv, acc[jj]);
    }
    for (int64_t jj = 0; jj < R; ++jj) _mm512_store_ps(st + (j0 + jj) * R, acc[jj]);
  }
  // Key j is visible to the rows r >= j - first.
  auto visible = [first](int64_t j) -> __mmask16 {
    return j <= first ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0xFFFF << (j - first));
  };
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; ++j)
    m = _mm512_mask_max_ps(m, visible(j), m, _mm512_load_ps(st + j * R));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const __m512 e =
        _mm512_maskz_mov_ps(visible(j), exp16(_mm512_sub_ps(_mm512_load_ps(st + j * R), m)));
    _mm512_store_ps(st + j * R, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_store_ps(total, sum);
  for (int64_t c = 0; c < D; ++c) {
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += R) {
      const float* v = a.values16(j0, g, c, vt, &vs);
      const int64_t n = std::min(R, len - j0);
      for (int64_t jj = 0; jj < n; ++jj) {
        const __m512 vv = _mm512_loadu_ps(v + jj * vs);
        const float* p = st + (j0 + jj) * R;
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), vv, acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(a.out + (t0 + r) * a.n_heads * HD + h * HD + c * 16,
                       _mm512_div_ps(acc[r], _mm512_set1_ps(total[r])));
  }
#elif JLLAMA_AVX2
  // The same order of operations on AVX2's 16 registers of 8 lanes: the 16 rows as two halves
  // (lo: rows 0-7, hi: 8-15), 4 keys or 4 rows at a time so that the sums stay in registers.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.keys16(j0, g, kt);
    for (int64_t k4 = 0; k4 < R; k4 += 4) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < HD; ++d) {
        const __m256 lo = _mm256_load_ps(qt + d * R), hi = _mm256_load_ps(qt + d * R + 8);
        for (int i = 0; i < 4; ++i) {
          const __m256 kv = _mm256_broadcast_ss(k + (k4 + i) * HD + d);
          acc[i][0] = _mm256_fmadd_ps(kv, lo, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(kv, hi, acc[i][1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_store_ps(st + (j0 + k4 + i) * R, acc[i][0]);
        _mm256_store_ps(st + (j0 + k4 + i) * R + 8, acc[i][1]);
      }
    }
  }
  // Key j is visible to the rows r >= j - first: lanes whose row index is at least that.
  const __m256i lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_hi = _mm256_add_epi32(lane_lo, _mm256_set1_epi32(8));
  auto visible = [&](int64_t j, const __m256i& lane) -> __m256 {
    const int32_t below = static_cast<int32_t>(std::min<int64_t>(j - first, R)) - 1;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(below)));
  };
  __m256 m[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
  for (int64_t j = 0; j < len; ++j)
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m256 sv = _mm256_load_ps(st + j * R + 8 * h2);
      m[h2] = _mm256_blendv_ps(m[h2], _mm256_max_ps(m[h2], sv), visible(j, h2 ? lane_hi : lane_lo));
    }
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t j = 0; j < len; ++j)
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m256 e = _mm256_and_ps(visible(j, h2 ? lane_hi : lane_lo),
                                     exp8(_mm256_sub_ps(_mm256_load_ps(st + j * R + 8 * h2), m[h2])));
      _mm256_store_ps(st + j * R + 8 * h2, e);
      sum[h2] = _mm256_add_ps(sum[h2], e);
    }
  _mm256_store_ps(total, sum[0]);
  _mm256_store_ps(total + 8, sum[1]);
  for (int64_t c = 0; c < D; ++c)
    for (int64_t r4 = 0; r4 < rows; r4 += 4) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < len; j0 += R) {
        const float* v = a.values16(j0, g, c, vt, &vs);
        const int64_t n = std::min(R, len - j0);
        for (int64_t jj = 0; jj < n; ++jj) {
          const __m256 vlo = _mm256_loadu_ps(v + jj * vs), vhi = _mm256_loadu_ps(v + jj * vs + 8);
          const float* p = st + (j0 + jj) * R + r4;
          for (int i = 0; i < 4; ++i) {
            const __m256 w = _mm256_broadcast_ss(p + i);
            acc[i][0] = _mm256_fmadd_ps(w, vlo, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, vhi, acc[i][1]);
          }
        }
      }
      for (int64_t i = 0; i < 4 && r4 + i < rows; ++i) {
        float* o = a.out + (t0 + r4 + i) * a.n_heads * HD + h * HD + c * 16;
        const __m256 inv = _mm256_set1_ps(total[r4 + i]);
        _mm256_storeu_ps(o, _mm256_div_ps(acc[i][0], inv));
        _mm256_storeu_ps(o + 8, _mm256_div_ps(acc[i][1], inv));
      }
    }
#else
  // The same order of operations in plain loops over 16-float rows, which the compiler
  // vectorizes (AVX2: two registers a row); exp is std::exp.
  for (int64_t j0 = 0; j0 < len; j0 += R) {
    const float* k = a.keys16(j0, g, kt);
    float acc[R][R] = {};  // [key][row]
    for (int64_t d = 0; d < HD; ++d)
      for (int64_t jj = 0; jj < R; ++jj) {
        const float kv = k[jj * HD + d];
        for (int64_t r = 0; r < R; ++r) acc[jj][r] = std::fma(kv, qt[d * R + r], acc[jj][r]);
      }
    std::memcpy(st + j0 * R, acc, sizeof acc);
  }
  float top[R];
  for (int64_t r = 0; r < R; ++r) {
    top[r] = -INFINITY;
    total[r] = 0.0f;
  }
  for (int64_t j = 0; j < len; ++j)
    for (int64_t r = std::max<int64_t>(0, j - first); r < R; ++r)
      top[r] = std::max(top[r], st[j * R + r]);
  for (int64_t j = 0; j < len; ++j)
    for (int64_t r = 0; r < R; ++r) {
      float& s = st[j * R + r];
      s = r >= j - first ? std::exp(s - top[r]) : 0.0f;
      total[r] += s;
    }
  for (int64_t c = 0; c < D; ++c) {
    float acc[R][16] = {};  // [row][column]
    for (int64_t j0 = 0; j0 < len; j0 += R) {
      const float* v16 = a.values16(j0, g, c, vt, &vs);
      for (int64_t j = j0; j < std::min(len, j0 + R); ++j) {
        const float* v = v16 + (j - j0) * vs;
        for (int64_t r = 0; r < R; ++r) {
          const float p = st[j * R + r];
          for (int64_t i = 0; i < 16; ++i) acc[r][i] = std::fma(p, v[i], acc[r][i]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < 16; ++i)
        a.out[(t0 + r) * a.n_heads * HD + h * HD + c * 16 + i] = acc[r][i] / total[r];
  }
#endif
}

// Shared by the caller and its pool tasks; a task may start after the call has returned, so
// the state lives as long as its last holder (it then finds no tile left and reads nothing).
struct ChunkWork {
  ChunkAttention a;
  void (*tile)(const ChunkAttention&, int64_t, int64_t, float*);
  int64_t tiles = 0, units = 0;
  // One scratch area per thread (rows of 16 scores, each a cache line), allocated by the caller
  // so that a failed allocation is an error it can return.
  std::unique_ptr<float, void (*)(void*)> scratch{nullptr, std::free};
  int64_t scratch_floats = 0, threads = 0;
  std::atomic<int64_t> arrived{0}, next{0}, done{0};

  void help() {
    const int64_t id = arrived.fetch_add(1, std::memory_order_relaxed);
    if (id >= threads) return;
    float* st = scratch.get() + id * scratch_floats;
    int64_t n = 0;
    // Largest tiles (latest tokens) first, so the last ones taken are short.
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units; ++n)
      tile(a, u % a.n_heads, tiles - 1 - u / a.n_heads, st);
    if (n > 0) done.fetch_add(n, std::memory_order_release);
  }
};

ffi::Error AttentionChunkF32(ffi::ThreadPool pool, F32Heads q, S32Scalar pos,
                             ffi::RemainingArgs blocks, F32MatrixResult out) {
  const auto qd = q.dimensions();
  const int64_t t = qd[0], n_heads = qd[1], hd = qd[2];
  if (blocks.size() % 2 != 0 || blocks.size() == 0)
    return ffi::Error::InvalidArgument("jllama attention_chunk: an even number of cache blocks");
  auto work = std::make_shared<ChunkWork>();
  ChunkAttention& a = work->a;
  a.n_blocks = static_cast<int64_t>(blocks.size() / 2);
  a.blocks.reset(new const uint8_t*[2 * a.n_blocks]);
  if (hd % 16 != 0 || hd < 16 || hd > 128 || out->dimensions()[0] != t ||
      out->dimensions()[1] != n_heads * hd)
    return ffi::Error::InvalidArgument(
        "jllama attention_chunk: q[T, n_heads, head_dim] (head_dim 16, 32, ..., 128) and "
        "out[T, n_heads * head_dim]");
  Blocks keys, values;
  for (int64_t i = 0; i < 2 * a.n_blocks; ++i) {
    auto b = blocks.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    const bool key = i < a.n_blocks;
    if (ffi::Error e = check_block(*b, hd, key ? &keys : &values,
                                   key ? "jllama attention_chunk: key blocks"
                                       : "jllama attention_chunk: value blocks");
        e.failure())
      return e;
    a.blocks[i] = static_cast<const uint8_t*>(b->untyped_data());
  }
  const int64_t n_kv = keys.n_kv;
  a.t = t, a.n_heads = n_heads, a.hd = hd, a.block = keys.block, a.pos = *pos.typed_data();
  a.key_type = keys.type, a.value_type = values.type;
  a.key_bytes = row_bytes(keys.type, hd), a.value_bytes = row_bytes(values.type, hd);
  if (values.n_kv != n_kv || values.block != keys.block || n_heads % n_kv != 0 ||
      a.block % kChunkTile != 0)
    return ffi::Error::InvalidArgument(
        "jllama attention_chunk: key and value blocks [n_kv_heads, B, .] alike, n_heads a "
        "multiple of n_kv_heads, B a multiple of 16");
  if (a.pos < 0 || t < 1 || a.pos + t > a.n_blocks * a.block)
    return ffi::Error::InvalidArgument("jllama attention_chunk: positions outside the blocks");
  a.kv_mul = n_heads / n_kv;
  a.q = q.typed_data();
  a.out = out->typed_data();
  using Tile = void (*)(const ChunkAttention&, int64_t, int64_t, float*);
  static constexpr Tile kTiles[8] = {chunk_tile<1>, chunk_tile<2>, chunk_tile<3>, chunk_tile<4>,
                                     chunk_tile<5>, chunk_tile<6>, chunk_tile<7>, chunk_tile<8>};
  work->tile = kTiles[hd / 16 - 1];
  work->tiles = (t + kChunkTile - 1) / kChunkTile;
  work->units = work->tiles * n_heads;
  work->threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work->units));
  work->scratch_floats = kChunkTile * (a.pos + t + kChunkTile);
  work->scratch.reset(static_cast<float*>(
      std::aligned_alloc(64, sizeof(float) * work->scratch_floats * work->threads)));
  if (!work->scratch)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jllama attention_chunk: out of memory");
  for (int64_t i = 1; i < work->threads; ++i) pool.Schedule([work] { work->help(); });
  work->help();
  // Every tile is taken by now; wait for the ones a pool thread is still running.
  wait_for([&] { return work->done.load(std::memory_order_acquire) >= work->units; });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// RoPE on one token's queries and keys, and its key and value written into the layer's cache
// block, in one call (XLA ran them as three programs a layer, ~11 us of a decode step's
// gaps between products). Rotation as llama2.c run.c: within each head the pair (2i, 2i + 1)
// turns by angle = pos * inv_freq[i], with cosf / sinf of that float angle.

inline void rotate(const float* in, const float* cos, const float* sin, int64_t head_dim,
                   float* out) {
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float v0 = in[2 * i], v1 = in[2 * i + 1];
    out[2 * i] = v0 * cos[i] - v1 * sin[i];
    out[2 * i + 1] = v0 * sin[i] + v1 * cos[i];
  }
}

// One token's RoPE and cache write (`RopeWriteF32`; also the batched decode's, batch.cc): x,
// its qkv f32[(n_heads + 2 n_kv) hd]; q: f32[n_heads, hd] out; keys, values: the blocks
// [n_kv, block, .] holding p, of types key_type and value_type, written at p % block (the key
// after RoPE and the value, each rounded to its block's type, cache_rows.h's `store_row`).
inline void rope_write_one(const float* x, int64_t p, const float* inv_freq, int64_t n_heads,
                           int64_t n_kv, int64_t hd, int64_t block, float* q, uint8_t* keys,
                           RowType key_type, uint8_t* values, RowType value_type) {
  std::unique_ptr<float[]> cs(new float[2 * hd]);
  float *cos = cs.get(), *sin = cs.get() + hd / 2, *key = cs.get() + hd;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const float angle = static_cast<float>(p) * inv_freq[i];
    cos[i] = std::cos(angle);
    sin[i] = std::sin(angle);
  }
  for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * hd, cos, sin, hd, q + h * hd);
  const float *k = x + n_heads * hd, *v = k + n_kv * hd;
  const int64_t at = p % block, kb = row_bytes(key_type, hd), vb = row_bytes(value_type, hd);
  for (int64_t g = 0; g < n_kv; ++g) {
    rotate(k + g * hd, cos, sin, hd, key);
    store_row(key_type, key, hd, keys + (g * block + at) * kb);
    store_row(value_type, v + g * hd, hd, values + (g * block + at) * vb);
  }
}

ffi::Error RopeWriteF32(F32Vector qkv, S32Scalar pos, F32Vector inv_freq,
                        ffi::AnyBuffer key_block, ffi::AnyBuffer value_block,
                        F32MatrixResult q, ffi::Result<ffi::AnyBuffer> key_out,
                        ffi::Result<ffi::AnyBuffer> value_out) {
  const auto qd = q->dimensions();
  const int64_t hd = 2 * inv_freq.dimensions()[0], n_heads = qd[0];
  Blocks keys, values;
  if (ffi::Error e = check_block(key_block, hd, &keys, "jllama rope_write: key_block");
      e.failure())
    return e;
  if (ffi::Error e = check_block(value_block, hd, &values, "jllama rope_write: value_block");
      e.failure())
    return e;
  const int64_t n_kv = keys.n_kv, block = keys.block;
  if (hd < 2 || qd[1] != hd || qkv.dimensions()[0] != (n_heads + 2 * n_kv) * hd ||
      values.n_kv != n_kv || values.block != block ||
      key_out->element_type() != key_block.element_type() ||
      !same(key_out->dimensions(), key_block.dimensions()) ||
      value_out->element_type() != value_block.element_type() ||
      !same(value_out->dimensions(), value_block.dimensions()))
    return ffi::Error::InvalidArgument(
        "jllama rope_write: qkv[(n_heads + 2 n_kv_heads) head_dim], q[n_heads, head_dim], "
        "inv_freq[head_dim / 2] and caches [n_kv_heads, B, .] do not agree");
  const int64_t p = *pos.typed_data();
  if (p < 0) return ffi::Error::InvalidArgument("jllama rope_write: negative pos");
  // The caches are aliased to their results; should XLA ever hand over another buffer, carry
  // the old contents over first.
  if (key_out->untyped_data() != key_block.untyped_data())
    std::memcpy(key_out->untyped_data(), key_block.untyped_data(), key_block.size_bytes());
  if (value_out->untyped_data() != value_block.untyped_data())
    std::memcpy(value_out->untyped_data(), value_block.untyped_data(), value_block.size_bytes());
  rope_write_one(qkv.typed_data(), p, inv_freq.typed_data(), n_heads, n_kv, hd, block,
                 q->typed_data(), static_cast<uint8_t*>(key_out->untyped_data()), keys.type,
                 static_cast<uint8_t*>(value_out->untyped_data()), values.type);
  return ffi::Error::Success();
}

}  // namespace

// Floats per vector register of this build's explicit loops: 16 with AVX-512, 8 with AVX2 and
// FMA (the prefill attention's loops only), else 1 (plain loops the compiler may vectorize).
// The prefill attention kernel beats XLA's only with explicit loops: the plain ones with
// std::exp ran 5-8x slower than XLA on this project's machine (bench/NOTES.md), so
// jllama.kernels uses it only where this says 8 or more.
extern "C" int jllama_vector_width() {
#if JLLAMA_AVX512
  return 16;
#elif JLLAMA_AVX2
  return 8;
#else
  return 1;
#endif
}

// Parenthesized: the commas between the template arguments would split the macro's arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_attention_chunk_f32, AttentionChunkF32,
    (args<F32Heads, S32Scalar>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())  // q, pos
         .RemainingArgs()  // the cache blocks
         .Ret<F32Matrix>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_rope_write_f32, RopeWriteF32,
    (rets<F32Matrix, ffi::AnyBuffer, ffi::AnyBuffer>(  // q, key_block, value_block
        args<F32Vector, S32Scalar, F32Vector, ffi::AnyBuffer, ffi::AnyBuffer>(ffi::Ffi::Bind()))));

}  // namespace jllama
