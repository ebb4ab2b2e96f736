// A decode step of B sequences at once (`JaxGraphBackend.decode_batch`): the products read each
// weight row once for all B vectors, and each sequence's RoPE, cache write and attention run on
// its own caches. Batch invariant: every (row, vector) sum is `dot`'s (simd.h) over the same
// input as the single-vector kernels' (matvec.cc), and every sequence's attention is
// `attend`'s (attention_decode.cc) after `rope_write_one` (attention.cc), so row b of a batch
// has the bits of that sequence decoded alone, whatever B is and whatever the other rows hold.
//
//   jllama_matvec_batch_f32 / _bf16 / _int8 / _int8_groups
//       y[b, i] = (add[b, i] +) w[i, :] . f(x[b, :])   x: f32[B, n], y: f32[B, m]
//       f: RMSNorm with one weight f32[n] (prologue 1), or silu(x[b]) * gate[b] with gate
//       f32[B, n] (prologue 2); residual: add f32[B, m]. Only rows b < count are computed (the
//       others, padding up to a compiled batch size, are zeros).
//   jllama_matvec_batch_ggml
//       the same for GGML parts (`jllama_matvec_ggml`'s), each row as that handler's product.
//   jllama_rope_attend_batch_f32
//       per sequence b < count: `rope_write` of qkv[b] at pos[b] into its current cache blocks,
//       then `attention` over its blocks (of any KV cache type, cache_rows.h); att: f32[B,
//       n_heads * head_dim].

#include "cache_rows.h"
#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

#if JLLAMA_AVX512 || JLLAMA_AVX2
// `dot` (simd.h) of R rows w, w + n, .. with V vectors x, x + n, .. at once: out[v * out_stride +
// k] = dot(w + k n, x + v n, n). `dot`'s register r (P = kLanes / kVectorWidth of them: 4 with
// AVX-512, 8 with AVX2) sums lanes kVectorWidth r .. of every 64-lane block on its own, so the
// registers are taken one after another (a pass over the row per register), each pass holding R
// * V sums, the R rows' weights and one vector's in registers: R + V loads per R * V
// multiply-adds, where V separate dots load twice per multiply-add (dot_many: 1 + 1 / V). Each
// sum takes `dot`'s multiply-adds in `dot`'s order (the row's last partial register zero-padded
// as `dot` pads it) and ends in `dot`'s tree (`finish`), so it has `dot`'s bits.
template <typename T, int R, int V, bool Stream>
inline void dot_rows(const T* w, const float* x, int64_t n, float* out, int64_t out_stride) {
  constexpr int P = kLanes / kVectorWidth;
  Vec sums[R][V][P];
  const int64_t blocks = n / kLanes * kLanes;
  for (int lane = 0; lane < P; ++lane) {
    Vec a[R][V];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) a[k][v] = Vec{};
    for (int64_t i = 0; i < blocks; i += kLanes) {
      if (Stream && lane == 0)
        for (int k = 0; k < R; ++k) stream_ahead(w + k * n + i);
      const int64_t at = i + kVectorWidth * lane;
      Vec wv[R];
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) wv[k] = vwiden(w + k * n + at);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        Vec xv = vload(x + v * n + at);
        // In a register for the R rows: left alone the compiler folds the load into each
        // row's multiply-add, R loads where one does (AVX2: a tenth slower at R = 3, measured).
        in_register(xv);
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k) a[k][v] = fmadd(wv[k], xv, a[k][v]);
      }
    }
    // The last partial block, as `dot` takes it: register `lane` gets what is left of its lanes.
    const int64_t at = blocks + kVectorWidth * lane, left = n - at;
    if (left > 0) {
      const First part = first(left);
      Vec wv[R];
      for (int k = 0; k < R; ++k) wv[k] = vwiden(w + k * n + at, part);
      for (int v = 0; v < V; ++v) {
        const Vec xv = vload(x + v * n + at, part);
        for (int k = 0; k < R; ++k) a[k][v] = fmadd(wv[k], xv, a[k][v]);
      }
    }
    for (int k = 0; k < R; ++k)
      for (int v = 0; v < V; ++v) sums[k][v][lane] = a[k][v];
  }
  for (int k = 0; k < R; ++k)
    for (int v = 0; v < V; ++v) out[v * out_stride + k] = finish(sums[k][v]);
}
#endif

#if JLLAMA_AVX512
// `dot` (simd.h, AVX-512) of one row w with V vectors x, x + n, ..., x + (V - 1) n at once: each
// vector's four accumulators take exactly `dot`'s multiply-adds in `dot`'s order and end in its
// tree, so out[v] has `dot(w, x + v n, n)`'s bits; the row's weights are widened once for the V
// vectors (half the loads of V separate dots, and V independent chains).
template <typename T, int V, bool Stream>
inline void dot_many(const T* w, const float* x, int64_t n, float* out, int64_t out_stride) {
  Vec a[V][4];
  for (int v = 0; v < V; ++v)
    for (int k = 0; k < 4; ++k) a[v][k] = Vec{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    if (Stream) stream_ahead(w + i);
    for (int k = 0; k < 4; ++k) {
      const Vec wv = vwiden(w + i + 16 * k);
      for (int v = 0; v < V; ++v) a[v][k] = fmadd(wv, vload(x + v * n + i + 16 * k), a[v][k]);
    }
  }
  for (int r = 0; i < n; ++r, i += 16) {
    const First keep = first(n - i);
    const Vec wv = vwiden(w + i, keep);
    for (int v = 0; v < V; ++v) a[v][r] = fmadd(wv, vload(x + v * n + i, keep), a[v][r]);
  }
  for (int v = 0; v < V; ++v) out[v * out_stride] = finish(a[v]);
}
#elif JLLAMA_AVX2
// AVX2: `dot_rows` of the one row.
template <typename T, int V, bool Stream>
inline void dot_many(const T* w, const float* x, int64_t n, float* out, int64_t out_stride) {
  dot_rows<T, 1, V, Stream>(w, x, n, out, out_stride);
}
#endif

// y[b, r] = dot(row r, x[b]) for the vectors b in [b0, b1): with AVX-512 or AVX2 four vectors
// at a time (`dot_many`), else one. The pass with b0 == 0 streams the weights ahead as a single product's
// does; the sums are the same either way.
template <typename T>
inline void row_batch(const Product& p, const T* row, int64_t r, int64_t b0, int64_t b1) {
  int64_t b = b0;
#if JLLAMA_AVX512 || JLLAMA_AVX2
  constexpr int V = 4;
  for (; b + V <= b1; b += V) {
    if (p.stream && b == 0) dot_many<T, V, true>(row, p.x, p.n, p.y + r, p.stride);
    else dot_many<T, V, false>(row, p.x + b * p.n, p.n, p.y + b * p.stride + r, p.stride);
  }
#endif
  for (; b < b1; ++b)
    p.y[b * p.stride + r] = p.stream && b == 0 ? dot<T, true>(row, p.x, p.n)
                                               : dot<T, false>(row, p.x + b * p.n, p.n);
}

// Rows [begin, end) of a batched product, in tiles of kTileRows rows whose weights stay in L1
// while groups of kTileVectors vectors pass over them (a vector group stays in L1 too: every
// row would otherwise read all B vectors from L2). The order of the dots changes nothing of
// any sum.
constexpr int64_t kTileRows = 8, kTileVectors = 4;

#if JLLAMA_AVX512 || JLLAMA_AVX2
// Rows per `dot_rows` call: R * V sums, R weights and a vector in registers (16 ymm with AVX2,
// 32 zmm with AVX-512).
#if JLLAMA_AVX512
constexpr int kRowsAtOnce = 4;
#else
constexpr int kRowsAtOnce = 3;
#endif

// Rows r .. r + R - 1 with the vectors b0 .. b0 + kTileVectors - 1; the group with b0 == 0
// streams the weights ahead as a single product's does.
template <typename T, int R>
inline void rows_group(const Product& p, const T* w, int64_t r, int64_t b0) {
  constexpr int V = kTileVectors;
  float* out = p.y + b0 * p.stride + r;
  if (p.stream && b0 == 0) dot_rows<T, R, V, true>(w + r * p.n, p.x, p.n, out, p.stride);
  else dot_rows<T, R, V, false>(w + r * p.n, p.x + b0 * p.n, p.n, out, p.stride);
}
#endif

template <typename T>
void rows_batch(const Product& p, int64_t begin, int64_t end) {
  const T* w = static_cast<const T*>(p.w);
  for (int64_t r0 = begin; r0 < end; r0 += kTileRows) {
    const int64_t r1 = std::min(end, r0 + kTileRows);
    int64_t r = r0;
#if JLLAMA_AVX512 || JLLAMA_AVX2
    // The whole groups of vectors kRowsAtOnce rows (then two) at a time (`dot_rows`), two groups
    // over the same rows before the next rows: the first group's pass streams them in (and the
    // rows ahead), the second finds them in L1, so the weights stream in while both compute.
    // Two groups only: the vectors of more stop fitting in L1 beside the rows.
    const int64_t whole = p.batch / kTileVectors * kTileVectors;
    if (whole) {
      for (int64_t g0 = 0; g0 < whole; g0 += 2 * kTileVectors) {
        const int64_t g1 = std::min(whole, g0 + 2 * kTileVectors);
        for (r = r0; r + kRowsAtOnce <= r1; r += kRowsAtOnce)
          for (int64_t b0 = g0; b0 < g1; b0 += kTileVectors)
            rows_group<T, kRowsAtOnce>(p, w, r, b0);
        for (; r + 2 <= r1; r += 2)
          for (int64_t b0 = g0; b0 < g1; b0 += kTileVectors) rows_group<T, 2>(p, w, r, b0);
        for (int64_t q = r; q < r1; ++q) row_batch<T>(p, w + q * p.n, q, g0, g1);
      }
      for (int64_t q = r0; q < r1; ++q) row_batch<T>(p, w + q * p.n, q, whole, p.batch);
      continue;
    }
#endif
    for (int64_t b0 = 0; b0 < p.batch; b0 += kTileVectors) {
      const int64_t b1 = std::min(p.batch, b0 + kTileVectors);
      for (r = r0; r < r1; ++r) row_batch<T>(p, w + r * p.n, r, b0, b1);
    }
  }
}

void rows_batch_int8(const Product& p, int64_t begin, int64_t end) {
  rows_batch<int8_t>(p, begin, end);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t r = begin; r < end; ++r) p.y[b * p.stride + r] *= p.scale[r];
}

void rows_batch_int8_groups(const Product& p, int64_t begin, int64_t end) {
  const int8_t* q = static_cast<const int8_t*>(p.w);
  const int64_t groups = p.groups, size = p.n / groups;
  for (int64_t r = begin; r < end; ++r) {
    const int8_t* row = q + r * p.n;
    const float* scale = p.scale + r * groups;
    p.y[r] = p.stream ? dot_int8_groups<true>(row, scale, p.x, p.n, size)
                      : dot_int8_groups<false>(row, scale, p.x, p.n, size);
    for (int64_t b = 1; b < p.batch; ++b)
      p.y[b * p.stride + r] = dot_int8_groups<false>(row, scale, p.x + b * p.n, p.n, size);
  }
}

// *out = extra[k] as f32[rows, cols].
ffi::Error extra_matrix(ffi::RemainingArgs& extra, size_t k, int64_t rows, int64_t cols,
                        const float** out) {
  auto v = extra.get<F32Matrix>(k);
  if (v.has_error()) return v.error();
  if (v->dimensions()[0] != rows || v->dimensions()[1] != cols)
    return ffi::Error::InvalidArgument("jllama matvec_batch: a gate's or residual's shape");
  *out = v->typed_data();
  return ffi::Error::Success();
}

// A batched product's input after its prologue: `live` rows (rows b < count of x, the rest is
// padding) in x, and the residual (null without one).
struct BatchInput {
  int64_t batch, live;
  const float* x;
  const float* add;
  std::unique_ptr<float[]> prepared;
};

// Checks x f32[B, n] and y f32[B, m] and runs the prologue on rows b < count: extra[first ..]
// are the prologue's operand, then the residual (the handler's other remaining arguments, e.g.
// a GGML product's parts, come before `first`).
ffi::Error batch_input(int64_t m, int64_t n, F32Matrix& x, S32Scalar& count,
                       ffi::RemainingArgs& extra, size_t first, F32MatrixResult& y,
                       int32_t prologue, float eps, int32_t residual, BatchInput& in) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  const int64_t batch = xd[0];
  if (xd[1] != n || yd[0] != batch || yd[1] != m)
    return ffi::Error::InvalidArgument("jllama matvec_batch: w[m, n], x[B, n] and y[B, m] do not agree");
  if (prologue < kPlain || prologue > kSwiGlu)
    return ffi::Error::InvalidArgument("jllama matvec_batch: unknown prologue");
  if (extra.size() != first + static_cast<size_t>((prologue != kPlain) + (residual != 0)))
    return ffi::Error::InvalidArgument("jllama matvec_batch: the extra arrays do not match the attributes");
  in.batch = batch;
  in.live = std::clamp<int64_t>(*count.typed_data(), 0, batch);
  in.x = x.typed_data();
  in.add = nullptr;
  if (prologue == kRmsNorm) {
    const float* weight;
    if (ffi::Error e = extra_vector(extra, first, n, &weight); e.failure()) return e;
    in.prepared.reset(new float[std::max<int64_t>(1, in.live) * n]);
    for (int64_t b = 0; b < in.live; ++b)
      rmsnorm(in.x + b * n, weight, eps, n, in.prepared.get() + b * n);
    in.x = in.prepared.get();
  } else if (prologue == kSwiGlu) {
    const float* gate;
    if (ffi::Error e = extra_matrix(extra, first, batch, n, &gate); e.failure()) return e;
    in.prepared.reset(new float[std::max<int64_t>(1, in.live) * n]);
    for (int64_t b = 0; b < in.live; ++b)
      swiglu(in.x + b * n, gate + b * n, n, in.prepared.get() + b * n);
    in.x = in.prepared.get();
  }
  if (residual != 0)
    if (ffi::Error e = extra_matrix(extra, extra.size() - 1, batch, m, &in.add); e.failure())
      return e;
  return ffi::Error::Success();
}

// After the product wrote rows b < live of out (f32[B, m]): the residual added, padding zeroed.
void batch_output(const BatchInput& in, int64_t m, float* out) {
  if (in.add != nullptr)
    for (int64_t i = 0; i < in.live * m; ++i) out[i] = in.add[i] + out[i];
  std::memset(out + in.live * m, 0, sizeof(float) * (in.batch - in.live) * m);
}

// The body of the float and int8 batched handlers: product p (its weights and rows set) on x
// f32[B, n] after the prologue, plus the residual, for rows b < count.
ffi::Error batch_product(ffi::ThreadPool& pool, Product p, int64_t m, F32Matrix& x,
                         S32Scalar& count, ffi::RemainingArgs& extra, F32MatrixResult& y,
                         int32_t prologue, float eps, int32_t residual) {
  BatchInput in;
  if (ffi::Error e = batch_input(m, p.n, x, count, extra, 0, y, prologue, eps, residual, in);
      e.failure())
    return e;
  float* out = y->typed_data();
  if (in.live > 0) {
    p.x = in.x, p.y = out, p.batch = in.live, p.stride = m;
    run(pool.num_threads(), p, m);
  }
  batch_output(in, m, out);
  return ffi::Error::Success();
}

template <typename T, typename Matrix>
ffi::Error MatvecBatchFloat(ffi::ThreadPool pool, Matrix w, F32Matrix x, S32Scalar count,
                            ffi::RemainingArgs extra, F32MatrixResult y, int32_t prologue,
                            float eps, int32_t residual) {
  const int64_t m = w.dimensions()[0], n = w.dimensions()[1];
  Product p{rows_batch<T>, w.untyped_data(), nullptr, nullptr, nullptr, n};
  p.weights(w.untyped_data(), m, n * static_cast<int64_t>(sizeof(T)));
  return batch_product(pool, p, m, x, count, extra, y, prologue, eps, residual);
}
constexpr auto MatvecBatchF32 = MatvecBatchFloat<float, F32Matrix>;
constexpr auto MatvecBatchBf16 = MatvecBatchFloat<uint16_t, Bf16Matrix>;

ffi::Error MatvecBatchInt8(ffi::ThreadPool pool, Int8Matrix q, F32Vector scale, F32Matrix x,
                           S32Scalar count, ffi::RemainingArgs extra, F32MatrixResult y,
                           int32_t prologue, float eps, int32_t residual) {
  const int64_t m = q.dimensions()[0], n = q.dimensions()[1];
  if (scale.dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec_batch_int8: scale must be f32[m]");
  Product p{rows_batch_int8, q.typed_data(), scale.typed_data(), nullptr, nullptr, n};
  p.weights(q.untyped_data(), m, n);
  return batch_product(pool, p, m, x, count, extra, y, prologue, eps, residual);
}

ffi::Error MatvecBatchInt8Groups(ffi::ThreadPool pool, Int8Matrix q, F32Matrix scale,
                                 F32Matrix x, S32Scalar count, ffi::RemainingArgs extra,
                                 F32MatrixResult y, int32_t prologue, float eps,
                                 int32_t residual) {
  Product p{};
  if (ffi::Error e = int8_groups_product("matvec_batch_int8_groups", q, scale,
                                         rows_batch_int8_groups, &p);
      e.failure())
    return e;
  const int64_t m = q.dimensions()[0];
  p.weights(q.untyped_data(), m, p.n);
  return batch_product(pool, p, m, x, count, extra, y, prologue, eps, residual);
}

// y[b] = (add[b] +) W f(x[b]) for W the GGML parts of `jllama_matvec_ggml` (the remaining
// arguments: the parts, then the prologue's operand and the residual), rows b < count: each row
// as that handler computes it for x[b] alone (`ggml_matmul`: activations quantized per row, a
// group's weights decoded once for 4 rows, every row's sums in the single product's order).
ffi::Error MatvecBatchGgml(ffi::ThreadPool pool, F32Matrix x, S32Scalar count,
                           ffi::RemainingArgs args, F32MatrixResult y,
                           ffi::Span<const int32_t> types, int32_t prologue, float eps,
                           int32_t residual) {
  const int64_t n = x.dimensions()[1];
  GgmlProduct g{};
  if (ffi::Error e = ggml_parts(args, types, n, g); e.failure()) return e;
  BatchInput in;
  if (ffi::Error e = batch_input(g.m, n, x, count, args, types.size(), y, prologue, eps, residual,
                                 in);
      e.failure())
    return e;
  float* out = y->typed_data();
  if (in.live > 0) ggml_matmul(pool, g, in.live, in.x, out);
  batch_output(in, g.m, out);
  return ffi::Error::Success();
}

template <typename... Args>
auto batch_binding() {
  return prologue_attrs(args<Args...>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                            .RemainingArgs()
                            .template Ret<F32Matrix>());
}

// ---------------------------------------------------------------------------------------------
// RoPE, cache write and attention of B sequences, each on its own cache (one layer's).

// Arguments: qkv f32[B, (n_heads + 2 n_kv) hd], pos s32[B], count s32, inv_freq f32[hd / 2],
// then the remaining: B current key blocks, B current value blocks (block pos[b] / block_length
// of sequence b, aliased to the results 1 .. 2B), then B * K key blocks (sequence b's blocks
// 0 .. K-1 at b * K ..; the slot of its current block and any it does not reach are not read),
// then B * K value blocks. Key blocks of one cache type, value blocks of one (each its own).
// Results: att f32[B, n_heads * hd], then the 2B current blocks.
ffi::Error RopeAttendBatchF32(ffi::ThreadPool pool, F32Matrix qkv, S32Vector pos,
                              S32Scalar count, F32Vector inv_freq, ffi::RemainingArgs blocks,
                              F32MatrixResult att, ffi::RemainingRets current) {
  const int64_t batch = qkv.dimensions()[0], width = qkv.dimensions()[1];
  const int64_t hd = 2 * inv_freq.dimensions()[0];
  if (pos.dimensions()[0] != batch || att->dimensions()[0] != batch || batch < 1 || hd < 2 ||
      current.size() != static_cast<size_t>(2 * batch) ||
      blocks.size() < static_cast<size_t>(4 * batch) ||
      (blocks.size() - 2 * batch) % (2 * batch) != 0)
    return ffi::Error::InvalidArgument(
        "jllama rope_attend_batch: qkv[B, .], pos[B], 2B current blocks and 2B * K blocks");
  const int64_t k_blocks = static_cast<int64_t>((blocks.size() - 2 * batch) / (2 * batch));
  const int64_t live = std::clamp<int64_t>(*count.typed_data(), 0, batch);
  Blocks keys, values;
  const char* kwhat = "jllama rope_attend_batch: key blocks";
  const char* vwhat = "jllama rope_attend_batch: value blocks";
  std::unique_ptr<const uint8_t*[]> ptrs(new const uint8_t*[2 * batch * k_blocks]);
  if (ffi::Error e = block_pointers(blocks, 2 * batch, batch * k_blocks, hd, &keys, kwhat,
                                    ptrs.get());
      e.failure())
    return e;
  if (ffi::Error e = block_pointers(blocks, 2 * batch + batch * k_blocks, batch * k_blocks, hd,
                                    &values, vwhat, ptrs.get() + batch * k_blocks);
      e.failure())
    return e;
  const int64_t n_kv = keys.n_kv, block = keys.block;
  const int64_t q_dim = att->dimensions()[1], n_heads = q_dim / hd;
  if (values.n_kv != n_kv || values.block != block || n_heads * hd != q_dim ||
      (n_heads + 2 * n_kv) * hd != width || n_heads % n_kv != 0)
    return ffi::Error::InvalidArgument(
        "jllama rope_attend_batch: qkv, att, inv_freq and the blocks' shapes do not agree");
  std::unique_ptr<float[]> q(new float[std::max<int64_t>(1, live) * q_dim]);
  std::vector<Attention> seqs;
  seqs.reserve(live);
  for (int64_t b = 0; b < live; ++b) {
    const int64_t p = pos.typed_data()[b];
    if (p < 0 || p >= k_blocks * block)
      return ffi::Error::InvalidArgument("jllama rope_attend_batch: pos outside the blocks given");
    uint8_t* cur[2];
    for (int kv = 0; kv < 2; ++kv) {
      auto in = blocks.get<ffi::AnyBuffer>(kv * batch + b);
      auto out = current.get<ffi::AnyBuffer>(kv * batch + b);
      if (in.has_error()) return in.error();
      if (out.has_error()) return out.error();
      if (ffi::Error e = check_block(*in, hd, kv ? &values : &keys, kv ? vwhat : kwhat);
          e.failure())
        return e;
      if ((*out)->element_type() != in->element_type() ||
          !same((*out)->dimensions(), in->dimensions()))
        return ffi::Error::InvalidArgument(
            "jllama rope_attend_batch: the current blocks' results must match them");
      cur[kv] = static_cast<uint8_t*>((*out)->untyped_data());
      if (cur[kv] != in->untyped_data()) std::memcpy(cur[kv], in->untyped_data(), in->size_bytes());
    }
    rope_write_one(qkv.typed_data() + b * width, p, inv_freq.typed_data(), n_heads, n_kv, hd,
                   block, q.get() + b * q_dim, cur[0], keys.type, cur[1], values.type);
    const int64_t c = p / block;
    seqs.push_back(Attention{q.get() + b * q_dim, att->typed_data() + b * q_dim,
                             Cache{ptrs.get() + b * k_blocks, cur[0], c, block,
                                   row_bytes(keys.type, hd), keys.type},
                             Cache{ptrs.get() + (batch + b) * k_blocks, cur[1], c, block,
                                   row_bytes(values.type, hd), values.type},
                             n_kv, n_heads / n_kv, hd, p});
  }
  std::memset(att->typed_data() + live * q_dim, 0, sizeof(float) * (batch - live) * q_dim);
  return attend(pool.num_threads(), seqs.data(), live);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_batch_f32, MatvecBatchF32,
                              (batch_binding<F32Matrix, F32Matrix, S32Scalar>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_batch_bf16, MatvecBatchBf16,
                              (batch_binding<Bf16Matrix, F32Matrix, S32Scalar>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_batch_int8, MatvecBatchInt8,
                              (batch_binding<Int8Matrix, F32Vector, F32Matrix, S32Scalar>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_matvec_batch_int8_groups, MatvecBatchInt8Groups,
                              (batch_binding<Int8Matrix, F32Matrix, F32Matrix, S32Scalar>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_matvec_batch_ggml, MatvecBatchGgml,
    prologue_attrs(with_parts<F32Matrix>(
        args<F32Matrix, S32Scalar>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()))));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_rope_attend_batch_f32, RopeAttendBatchF32,
    (args<F32Matrix, S32Vector, S32Scalar, F32Vector>(  // qkv, pos, count, inv_freq
         ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
         .RemainingArgs()  // current blocks, then every sequence's blocks
         .Ret<F32Matrix>()
         .RemainingRets()));  // the current blocks, written

}  // namespace jllama
