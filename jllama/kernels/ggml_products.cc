// Products of GGML-typed weights as stored in a GGUF file (`jllama_matvec_ggml`): the weights
// are up to kMaxParts matrices of any types in `ggml::layout`, stacked along their rows (a
// layer's wq, wk and wv may each have another type: Q4_K_M files hold Q5_0, Q8_0, Q4_K and Q6_K
// side by side). Rows of float types (F32, F16, BF16) are `dot`'s 64-lane sums over x; the
// integer types' are `ggml::row_dot` over x quantized once per call (ggml_dot.h). Below them:
// the products with a prefill chunk's tokens (`jllama_matmul_ggml`), the parts dequantized
// (`jllama_dequantize_ggml`) and rows of a table dequantized (`jllama_rows_ggml`).

#include "kernels.h"
#include "simd.h"
#include "ggml_dequantize.h"
#include "ggml_x8.h"
#include "ggml_amx.h"

namespace jllama {
namespace {

constexpr int kMaxParts = 4;
static_assert(kMaxParts <= Product::kMaxSpans, "a GGML product's parts are its spans");

struct GgmlPart {
  const uint8_t* data;  // u8[rows, row_bytes]
  int64_t first, rows, row_bytes;
  int32_t type;
};

struct GgmlProduct {
  GgmlPart parts[kMaxParts];
  int n_parts;
  int64_t unit;  // rows per unit of work: 8 when a part is in an x8 layout (a group), else 1
  int64_t m, bytes;  // the rows of all parts, and their weights' bytes
  bool integer;      // whether some part has an integer type (x is quantized for it)
  int64_t n;
  const float* x;  // f32[n], after the prologue
  // x quantized as llama.cpp quantizes it for each part's type (`ggml::activation_kind`), the
  // kinds some part needs.
  ggml::Activations qx[ggml::kActivationKinds];
  float* y;
};

template <int32_t T, bool Stream>
void ggml_rows(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = rows + r * part.row_bytes;
    if constexpr (T == ggml::F32) {
      g.y[r] = dot<float, Stream>(reinterpret_cast<const float*>(row), g.x, g.n);
    } else if constexpr (T == ggml::F16) {
      g.y[r] = dot<Half, Stream>(reinterpret_cast<const Half*>(row), g.x, g.n);
    } else if constexpr (T == ggml::BF16) {
      g.y[r] = dot<uint16_t, Stream>(reinterpret_cast<const uint16_t*>(row), g.x, g.n);
    } else {
      if (Stream) prefetch_stream(row, part.row_bytes);
      g.y[r] = ggml::row_dot<T>(row, g.qx[ggml::activation_kind(T)]);
    }
  }
}

// Groups of 8 rows in an x8 layout: rows [begin, end), both multiples of 8. A product that
// reuses its tiles (not Stream) takes two groups at a time in 512-bit registers where the build
// has them (ggml_x8.h's Z16: the same bits as one group at a time). Decode's streaming products
// (Stream) take one group at a time: a core then reads one run of memory, not two interleaved,
// and on the 2-core AMD EPYC VM (2026-12-05) that decoded Llama-3.1-8B Q4_K_M at 14.8-15.2 tok/s
// against 11.5-11.7 two at a time, Llama-3.2-1B Q4_K_M 62 against 50, SmolLM2 374-379 against
// 322-329 (bench/NOTES.md).
template <int32_t T, bool Stream>
void ggml_groups(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
#if JLLAMA_Q_AVX2
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  const int64_t group_bytes = 8 * part.row_bytes;
  const ggml::Activations& qx = g.qx[ggml::activation_kind(T)];
  int64_t r = begin;
#if JLLAMA_Q_Z16
  for (; !Stream && r + 16 <= end; r += 16) {
    const uint8_t* group = rows + r * part.row_bytes;
    float* const ys[1] = {g.y + r};
    ggml::x16_dot_n<T, 1, Stream>(group, group_bytes, &qx, ys);
  }
#endif
  for (; r < end; r += 8) {
    const uint8_t* group = rows + r * part.row_bytes;
    ggml::x8_dot<T, Stream>(group, qx, g.y + r);
  }
#endif
}

// Rows [begin, end) of a part: in groups where it has an x8 layout, else row by row (an id of
// neither kind is refused by the handler before any row runs).
template <bool Stream>
void ggml_part_rows(const GgmlProduct& g, const GgmlPart& part, int64_t begin, int64_t end) {
  using namespace ggml;
  if (x8_type(part.type)) {
    with_x8_type(part.type - kX8, [&](auto t) {
      ggml_groups<decltype(t)::value, Stream>(g, part, begin, end);
    });
    return;
  }
  with_type<F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(
      part.type, [&](auto t) { ggml_rows<decltype(t)::value, Stream>(g, part, begin, end); });
}

// Calls f(part, lo, hi) for each part with rows in [begin, end): [lo, hi) are those rows.
template <typename F>
void each_part(const GgmlPart* parts, int n_parts, int64_t begin, int64_t end, F f) {
  for (int k = 0; k < n_parts; ++k) {
    const GgmlPart& part = parts[k];
    const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
    if (lo < hi) f(part, lo, hi);
  }
}

void rows_ggml(const Product& p, int64_t begin, int64_t end) {
  const GgmlProduct& g = *static_cast<const GgmlProduct*>(p.w);
  each_part(g.parts, g.n_parts, begin * g.unit, end * g.unit,
            [&](const GgmlPart& part, int64_t lo, int64_t hi) {
              if (p.stream) ggml_part_rows<true>(g, part, lo, hi);
              else ggml_part_rows<false>(g, part, lo, hi);
            });
}

// Checks the parts (args[0 .. types.size() - 1], u8[rows, row_bytes] each) against x's length n
// and fills g.parts, g.unit (8 rows when a part is in an x8 layout: then every part's rows must
// be a multiple of 8), g.m, g.bytes, g.integer and g.n.
ffi::Error ggml_parts(ffi::RemainingArgs& args, ffi::Span<const int32_t> types, int64_t n,
                      GgmlProduct& g) {
  const int64_t n_parts = static_cast<int64_t>(types.size());
  if (n_parts < 1 || n_parts > kMaxParts || args.size() < static_cast<size_t>(n_parts))
    return ffi::Error::InvalidArgument("jllama matvec_ggml: 1 to 4 weight parts");
  g.m = 0, g.bytes = 0, g.integer = false, g.n = n;
  for (int64_t k = 0; k < n_parts; ++k) {
    // A part is its bytes, u8[rows, row_bytes]; an F32 or BF16 part may come as the typed
    // matrix itself, f32/bf16[rows, n] (`jllama.model.ggml_matrix.FloatRows`: no byte view to make).
    auto w = args.get<ffi::AnyBuffer>(k);
    if (w.has_error()) return w.error();
    const ggml::Layout layout = ggml::layout(types[k]);
    if (layout.elements == 0 || n % layout.elements != 0)
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: a part's type is unknown or its blocks do not divide x's length");
    const int64_t row_bytes = n / layout.elements * layout.bytes;
    const auto dims = w->dimensions();
    const ffi::DataType dtype = w->element_type();
    const bool typed = (dtype == ffi::DataType::F32 && types[k] == ggml::F32) ||
                       (dtype == ffi::DataType::BF16 && types[k] == ggml::BF16);
    if (dims.size() != 2 || (dtype != ffi::DataType::U8 && !typed))
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: a part must be u8[rows, row_bytes] (or f32/bf16[rows, n] for F32/BF16)");
    const int64_t rows = dims[0];
    if (dims[1] != (typed ? n : row_bytes))
      return ffi::Error::InvalidArgument("jllama matvec_ggml: a part's rows are not x's length");
    if (ggml::x8_type(types[k]) && (rows % 8 != 0 || g.m % 8 != 0 || kVectorWidth < 8))
      return ffi::Error::InvalidArgument(
          "jllama matvec_ggml: an x8 part needs rows a multiple of 8 and an AVX2 build");
    g.parts[k] = GgmlPart{static_cast<const uint8_t*>(w->untyped_data()), g.m, rows, row_bytes,
                          types[k]};
    g.m += rows;
    g.bytes += rows * row_bytes;
    g.integer = g.integer || ggml::integer_type(types[k]);
  }
  g.n_parts = static_cast<int>(n_parts);
  g.unit = 1;
  for (int k = 0; k < g.n_parts; ++k)
    if (ggml::x8_type(g.parts[k].type)) g.unit = 8;
  if (g.unit == 8)
    for (int k = 0; k < g.n_parts; ++k)
      if (g.parts[k].rows % 8 != 0)
        return ffi::Error::InvalidArgument(
            "jllama ggml product: with an x8 part, every part's rows must be a multiple of 8");
#if JLLAMA_Q_Z16
  // Two groups per unit where every part has whole pairs (the 512-bit kernels' 16 rows; a
  // unit of 8 would leave each thread's blocks a group at a time).
  if (g.unit == 8) {
    bool pairs = true;
    for (int k = 0; k < g.n_parts; ++k) pairs = pairs && g.parts[k].rows % 16 == 0;
    if (pairs) g.unit = 16;
  }
#endif
  return ffi::Error::Success();
}

// What `run` weighs a unit of g's rows by when it sizes its blocks and decides to split (per
// token): a byte of a quantized row costs about what a float32 weight does (decoding it is most
// of the work).
int64_t unit_cost(const GgmlProduct& g) {
  return std::max<int64_t>(1, g.bytes / std::max<int64_t>(1, g.m)) * g.unit;
}

// ggml_parts for a handler whose remaining arguments are the parts and nothing else (`handler`
// names it in the error).
ffi::Error parts_only(const char* handler, ffi::RemainingArgs& args,
                      ffi::Span<const int32_t> types, int64_t n, GgmlProduct& g) {
  if (args.size() != types.size())
    return ffi::Error::InvalidArgument(std::string("jllama ") + handler + ": one type per part");
  return ggml_parts(args, types, n, g);
}

ffi::Error MatvecGgml(ffi::ThreadPool pool, F32Vector x, ffi::RemainingArgs args, F32Result y,
                      ffi::Span<const int32_t> types, int32_t prologue, float eps,
                      int32_t residual) {
  const int64_t n = x.dimensions()[0];
  GgmlProduct g{};
  if (ffi::Error e = ggml_parts(args, types, n, g); e.failure()) return e;
  const int64_t m = g.m;
  if (y->dimensions().size() != 1 || y->dimensions()[0] != m)
    return ffi::Error::InvalidArgument("jllama matvec_ggml: y must be f32[rows of all parts]");
  std::unique_ptr<float[]> prepared;
  const float* add;
  if (ffi::Error e = inputs(m, n, x, args, types.size(), prologue, eps, residual, prepared, &g.x,
                            &add);
      e.failure())
    return e;
  std::unique_ptr<uint8_t[]> scratch[ggml::kActivationKinds];
  if (g.integer) {
    for (int k = 0; k < g.n_parts; ++k) {
      if (!ggml::integer_type(g.parts[k].type)) continue;
      const int kind = ggml::activation_kind(g.parts[k].type);
      if (scratch[kind]) continue;
      scratch[kind].reset(new uint8_t[ggml::activation_bytes(n)]);
      g.qx[kind] = ggml::quantize(g.x, n, scratch[kind].get(), kind);
    }
  }
  g.y = y->typed_data();
  Product p{rows_ggml, &g, nullptr, nullptr, g.y, unit_cost(g)};
  for (int k = 0; k < g.n_parts; ++k)
    p.spans[k] = Product::Span{reinterpret_cast<const char*>(g.parts[k].data), g.parts[k].first,
                               g.parts[k].rows, g.parts[k].row_bytes};
  p.n_spans = g.n_parts;
  p.unit = g.unit;
  run(pool.num_threads(), p, m / g.unit);
  if (add != nullptr)
    for (int64_t i = 0; i < m; ++i) g.y[i] = add[i] + g.y[i];
  return ffi::Error::Success();
}

// Products of GGML parts with the T tokens of a prefill chunk (`jllama_matmul_ggml`): x f32[T, n]
// -> y f32[T, m], y[t] = W x[t] with each token's activations quantized as in a decode step, so a
// prompt token's values are those a decode step computes for it. Work comes in units of 8 rows
// (a group, for x8 parts) over all tokens, 4 tokens at a time: a group's weights are decoded
// once for 4 tokens (`ggml::x8_dot_n`) and stay in L1 while the tokens' activations stream.

struct GgmlMatmul {
  GgmlPart parts[kMaxParts];
  int n_parts;
  int64_t unit, n, m, tokens;
  const float* x;                                               // f32[T, n]
  std::vector<ggml::Activations> qx[ggml::kActivationKinds];   // per kind: one per token
  float* y;                                                     // f32[T, m]
};

template <int32_t T, int NT>
void matmul_group(const GgmlMatmul& g, const GgmlPart& part, const uint8_t* group, int64_t r,
                  int64_t t0) {
#if JLLAMA_Q_AVX2
  const ggml::Activations* xs = &g.qx[ggml::activation_kind(T)][t0];
  float* ys[NT];
  for (int t = 0; t < NT; ++t) ys[t] = g.y + (t0 + t) * g.m + r;
  ggml::x8_dot_n<T, NT>(group, xs, ys);
#endif
}

#if JLLAMA_Q_Z16
// Groups r / 8 and r / 8 + 1 with tokens t0 .. t0 + NT - 1.
template <int32_t T, int NT>
void matmul_pair(const GgmlMatmul& g, const GgmlPart& part, const uint8_t* group, int64_t r,
                 int64_t t0) {
  const ggml::Activations* xs = &g.qx[ggml::activation_kind(T)][t0];
  float* ys[NT];
  for (int t = 0; t < NT; ++t) ys[t] = g.y + (t0 + t) * g.m + r;
  ggml::x16_dot_n<T, NT>(group, 8 * part.row_bytes, xs, ys);
}
#endif

template <int32_t T>
void matmul_groups(const GgmlMatmul& g, const GgmlPart& part, int64_t begin, int64_t end) {
#if JLLAMA_Q_AVX2
  const uint8_t* rows = part.data - part.first * part.row_bytes;
  int64_t r = begin;
#if JLLAMA_Q_Z16
  int64_t amx_tokens = 0;  // the first tokens, 16 at a time, by tile instructions
#if JLLAMA_Q_AMX
  constexpr int k = ggml::amx_k(T);
  std::unique_ptr<ggml::AmxTiles> tiles;
  const std::vector<ggml::Activations>& xs = g.qx[ggml::activation_kind(T)];
  if (k > 0 && g.tokens >= 16 && r + 16 <= end && ggml::amx_ready()) {
    const int64_t stride = xs[1].q - xs[0].q;  // quantize_tokens lays the tokens out evenly
    amx_tokens = g.tokens / 16 * 16;
    tiles.reset(new ggml::AmxTiles(k));
    thread_local ggml::AmxScratch scratch;
    for (int64_t p = r; p + 16 <= end; p += 16)
      ggml::amx_pair<T>(rows + p * part.row_bytes, 8 * part.row_bytes, xs.data(), stride,
                        amx_tokens / 16, g.y + p, g.m, scratch);
  }
#endif
  // 16 rows by 8 tokens: a pair's weights are decoded once for 8 tokens and stay in L1 while
  // the tokens' activations stream from L2.
  for (; r + 16 <= end; r += 16) {
    const uint8_t* group = rows + r * part.row_bytes;
    int64_t t = amx_tokens;
    for (; t + 8 <= g.tokens; t += 8) matmul_pair<T, 8>(g, part, group, r, t);
    if (g.tokens - t >= 4) matmul_pair<T, 4>(g, part, group, r, t), t += 4;
    if (g.tokens - t >= 2) matmul_pair<T, 2>(g, part, group, r, t), t += 2;
    if (g.tokens - t >= 1) matmul_pair<T, 1>(g, part, group, r, t);
  }
#endif
  for (; r < end; r += 8) {
    const uint8_t* group = rows + r * part.row_bytes;
    int64_t t = 0;
    for (; t + 4 <= g.tokens; t += 4) matmul_group<T, 4>(g, part, group, r, t);
    switch (g.tokens - t) {
      case 3: matmul_group<T, 3>(g, part, group, r, t); break;
      case 2: matmul_group<T, 2>(g, part, group, r, t); break;
      case 1: matmul_group<T, 1>(g, part, group, r, t); break;
      default: break;
    }
  }
#endif
}

// A part in the row layout (or of a float type): one token at a time, as the decode kernel.
void matmul_rows(const GgmlMatmul& g, const GgmlPart& part, int64_t begin, int64_t end) {
  GgmlProduct one{};
  one.parts[0] = part;
  one.n_parts = 1;
  one.unit = 1;
  one.n = g.n;
  for (int64_t t = 0; t < g.tokens; ++t) {
    one.x = g.x + t * g.n;
    for (int k = 0; k < ggml::kActivationKinds; ++k)
      if (!g.qx[k].empty()) one.qx[k] = g.qx[k][t];
    one.y = g.y + t * g.m;
    ggml_part_rows<false>(one, part, begin, end);
  }
}

void rows_matmul(const Product& p, int64_t begin, int64_t end) {
  const GgmlMatmul& g = *static_cast<const GgmlMatmul*>(p.w);
  each_part(g.parts, g.n_parts, begin * g.unit, end * g.unit,
            [&](const GgmlPart& part, int64_t lo, int64_t hi) {
              // A part in an x8 layout a group at a time, any other row by row.
              auto groups = [&](auto t) { matmul_groups<decltype(t)::value>(g, part, lo, hi); };
              if (!ggml::x8_type(part.type) || !ggml::with_x8_type(part.type - ggml::kX8, groups))
                matmul_rows(g, part, lo, hi);
            });
}

// The activations of tokens [begin, end) of a GgmlMatmul, each kind with scratch.
struct QuantizeTokens {
  GgmlMatmul* g;
  uint8_t* scratch[ggml::kActivationKinds];
  int64_t per_token;
};

void quantize_tokens(const Product& p, int64_t begin, int64_t end) {
  const QuantizeTokens& q = *static_cast<const QuantizeTokens*>(p.w);
  GgmlMatmul& g = *q.g;
  for (int kind = 0; kind < ggml::kActivationKinds; ++kind) {
    if (q.scratch[kind] == nullptr) continue;
    for (int64_t t = begin; t < end; ++t)
      g.qx[kind][t] = ggml::quantize(g.x + t * g.n, g.n, q.scratch[kind] + t * q.per_token, kind);
  }
}

// y f32[tokens, m] = the parts in `checked` (from ggml_parts: m rows of n) times x f32[tokens,
// n], each token's row as MatvecGgml computes it alone.
void ggml_matmul(ffi::ThreadPool& pool, const GgmlProduct& checked, int64_t tokens,
                 const float* x, float* y) {
  GgmlMatmul g;
  std::copy(checked.parts, checked.parts + kMaxParts, g.parts);
  g.n_parts = checked.n_parts;
  g.unit = checked.unit;
  const int64_t n = checked.n, m = checked.m;
  g.n = n, g.m = m, g.tokens = tokens, g.x = x, g.y = y;
  std::unique_ptr<uint8_t[]> scratch[ggml::kActivationKinds];
  QuantizeTokens quantizing{&g, {}, ggml::activation_bytes(n)};
  for (int k = 0; k < g.n_parts; ++k) {
    if (!ggml::integer_type(g.parts[k].type)) continue;
    const int kind = ggml::activation_kind(g.parts[k].type);
    if (scratch[kind]) continue;
    scratch[kind].reset(new uint8_t[quantizing.per_token * tokens]);
    g.qx[kind].resize(tokens);
    quantizing.scratch[kind] = scratch[kind].get();
  }
  // The tokens' activations, split over the threads as the product is (a prefill chunk's are
  // a few hundred thousand values: single-threaded, 10-15% of the chunk's products).
  run(pool.num_threads(), Product{quantize_tokens, &quantizing, nullptr, nullptr, nullptr, 8 * n},
      tokens);
  const int64_t cost = unit_cost(checked) * tokens;
  run(pool.num_threads(), Product{rows_matmul, &g, nullptr, nullptr, g.y, cost}, m / g.unit);
}

ffi::Error MatmulGgml(ffi::ThreadPool pool, F32Matrix x, ffi::RemainingArgs args, F32MatrixResult y,
                      ffi::Span<const int32_t> types) {
  const int64_t tokens = x.dimensions()[0], n = x.dimensions()[1];
  GgmlProduct checked{};
  if (ffi::Error e = parts_only("matmul_ggml", args, types, n, checked); e.failure()) return e;
  if (y->dimensions()[0] != tokens || y->dimensions()[1] != checked.m)
    return ffi::Error::InvalidArgument("jllama matmul_ggml: y must be f32[T, rows of all parts]");
  ggml_matmul(pool, checked, tokens, x.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

// Parts dequantized to float32 (`ggml::dequantize_row`, ggml's exact values), y: f32[m, n]: the
// prefill chunk products multiply it with XLA's matrix product.
// Row `r` of a part dequantized into out: f32[n] (an x8 part's row gathered from its tile first).
void dequantize_part_row(const GgmlPart& part, int64_t r, int64_t n, float* out,
                         std::unique_ptr<uint8_t[]>& row, std::unique_ptr<int32_t[]>& pos) {
  const int64_t local = r - part.first;
  if (!ggml::x8_type(part.type)) {
    ggml::dequantize_row(part.type, part.data + local * part.row_bytes, out, n);
    return;
  }
  const int32_t base = part.type - ggml::kX8;
  if (!pos) {
    pos.reset(new int32_t[8 * ggml::layout(base).bytes]);
    ggml::x8_positions(base, pos.get());
    row.reset(new uint8_t[part.row_bytes]);
  }
  ggml::x8_row(base, part.data + (local - local % 8) * part.row_bytes, static_cast<int>(local % 8),
               n, pos.get(), row.get());
  ggml::dequantize_row(base, row.get(), out, n);
}

void rows_dequantize(const Product& p, int64_t begin, int64_t end) {
  const GgmlProduct& g = *static_cast<const GgmlProduct*>(p.w);
  each_part(g.parts, g.n_parts, begin, end, [&](const GgmlPart& part, int64_t lo, int64_t hi) {
    std::unique_ptr<uint8_t[]> row;
    std::unique_ptr<int32_t[]> pos;
    for (int64_t r = lo; r < hi; ++r) dequantize_part_row(part, r, g.n, g.y + r * g.n, row, pos);
  });
}

ffi::Error DequantizeGgml(ffi::ThreadPool pool, ffi::RemainingArgs args, F32MatrixResult y,
                          ffi::Span<const int32_t> types) {
  const int64_t n = y->dimensions()[1];
  GgmlProduct g{};
  if (ffi::Error e = parts_only("dequantize_ggml", args, types, n, g); e.failure()) return e;
  if (y->dimensions()[0] != g.m)
    return ffi::Error::InvalidArgument("jllama dequantize_ggml: y must be f32[rows of all parts, n]");
  g.y = y->typed_data();
  // Writing float32 costs more than reading the blocks: weigh a row by its output.
  run(pool.num_threads(), Product{rows_dequantize, &g, nullptr, nullptr, g.y, n}, g.m);
  return ffi::Error::Success();
}

// Rows `index` of a table of one GGML type dequantized (the embedding rows of tokens).
ffi::Error RowsGgml(U8Matrix table, S32Vector index, F32MatrixResult y,
                    int32_t type) {
  const int64_t n = y->dimensions()[1], k = index.dimensions()[0], vocab = table.dimensions()[0];
  const ggml::Layout layout = ggml::layout(type);
  if (layout.elements == 0 || n % layout.elements != 0 || y->dimensions()[0] != k ||
      table.dimensions()[1] != n / layout.elements * layout.bytes)
    return ffi::Error::InvalidArgument("jllama rows_ggml: table u8[V, row_bytes] and y f32[k, n] "
                                       "do not agree with the type");
  const int64_t row_bytes = table.dimensions()[1];
  if (ggml::x8_type(type) && vocab % 8 != 0)
    return ffi::Error::InvalidArgument("jllama rows_ggml: an x8 table needs rows a multiple of 8");
  const GgmlPart part{table.typed_data(), 0, vocab, row_bytes, type};
  std::unique_ptr<uint8_t[]> row;
  std::unique_ptr<int32_t[]> pos;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = index.typed_data()[i];
    if (r < 0 || r >= vocab) return ffi::Error::InvalidArgument("jllama rows_ggml: index out of range");
    dequantize_part_row(part, r, n, y->typed_data() + i * n, row, pos);
  }
  return ffi::Error::Success();
}

// `binding` with what every handler of GGML parts takes last: the parts (the remaining
// arguments), the result R, and the parts' ggml `types`.
template <typename R, typename Binding>
auto with_parts(Binding binding) {
  return std::move(binding)
      .RemainingArgs()
      .template Ret<R>()
      .template Attr<ffi::Span<const int32_t>>("types");
}

}  // namespace

// The x8 layout of a ggml type as `ggml::x8_positions` builds it (the tests compare it with
// jllama.model.ggml_repack's): pos int32[8 * block bytes]. Returns 0, or -1 for a type without one.
extern "C" int jllama_x8_positions(int32_t type, int32_t* pos) {
  if (!ggml::has_x8(type)) return -1;
  ggml::x8_positions(type, pos);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_matvec_ggml, MatvecGgml,
    prologue_attrs(
        with_parts<F32Vector>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32Vector>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jllama_matmul_ggml, MatmulGgml,
    with_parts<F32Matrix>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32Matrix>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_dequantize_ggml, DequantizeGgml,
                              with_parts<F32Matrix>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jllama_rows_ggml, RowsGgml,
                              (args<U8Matrix, S32Vector>(ffi::Ffi::Bind())
                                   .Ret<F32Matrix>()
                                   .Attr<int32_t>("type")));

}  // namespace jllama
