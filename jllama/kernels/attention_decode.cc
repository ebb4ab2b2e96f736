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

#include "attention_tiles.h"
#include "cache_rows.h"
#include "kernels.h"

namespace jllama {
namespace {

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
