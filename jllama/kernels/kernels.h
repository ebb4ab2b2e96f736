// What jllama's CPU kernels share. They are one library (library.cc includes the parts; see
// `jllama.kernels.library`): matvec.cc (float and int8 products and their prologues),
// ggml_products.cc (products of GGML blocks), attention.cc (attention and RoPE), sampling.cc
// (drawing a token) and threads.cc (splitting a product over threads). Here: the FFI buffer
// aliases, a product's rows as `Product`, `run`, which computes them on the threads, `inputs`, a
// product's x after its prologue, and the pieces of the handlers' bindings (`args`, `rets`,
// `prologue_attrs`). `run` and `inputs` are hidden: not part of the library's interface, so the
// compiler may inline them (it may not inline a function of a shared library that another
// library could interpose).

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jllama {

namespace ffi = xla::ffi;

// Aliases: a comma inside a template argument would split the handler macros' arguments.
// Arguments:
using F32Scalar = ffi::Buffer<ffi::F32, 0>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Heads = ffi::Buffer<ffi::F32, 3>;  // [n_kv_heads, positions or kv_mul, head_dim]
using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using U8Matrix = ffi::Buffer<ffi::U8, 2>;
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
// Results:
using F32Result = ffi::ResultBuffer<ffi::F32, 1>;
using F32MatrixResult = ffi::ResultBuffer<ffi::F32, 2>;
using F32HeadsResult = ffi::ResultBuffer<ffi::F32, 3>;
using S32Result = ffi::ResultBuffer<ffi::S32, 0>;
using S32VectorResult = ffi::ResultBuffer<ffi::S32, 1>;

// The rows [begin, end) of one product. A std::function would allocate per call; a plain
// struct with a function pointer keeps the shared state in one allocation.
struct Product {
  void (*rows)(const Product&, int64_t begin, int64_t end);
  const void* w;
  const float* scale;
  const float* x;
  float* y;
  int64_t n;
  int64_t groups;  // scales per row, for rows_int8_groups
  bool stream;     // prefetch the weights ahead (`stream_ahead`): set by `run` for big products
  // Where the weights lie, for a helper to warm its L2 with before the product comes
  // (`Helpers::warm`): rows [first, first + rows) of the product at data + (r - first) *
  // row_bytes, up to kMaxSpans matrices (a GGML product's parts); work comes in units of
  // `unit` rows. No spans: nothing to warm.
  struct Span {
    const char* data;
    int64_t first, rows, row_bytes;
  };
  static constexpr int kMaxSpans = 4;
  Span spans[kMaxSpans] = {};
  int n_spans = 0;
  int64_t unit = 1;
  // A batched product (batch.cc): x is f32[batch, n], y f32[batch, stride]; each row of the
  // weights is read once for the batch's vectors, each vector's sum computed as alone.
  int64_t batch = 1, stride = 0;

  void weights(const void* data, int64_t m, int64_t row_bytes) {
    spans[0] = Span{static_cast<const char*>(data), 0, m, row_bytes};
    n_spans = 1;
  }
};

// Computes rows [0, m) of `product`: on the calling thread alone when the product is small,
// else shared with jllama's helper threads (threads.cc), `threads` in all (the size of XLA's
// intra-op pool). Each row is computed on one thread, so the results do not depend on how the
// rows were shared.
__attribute__((visibility("hidden"))) void run(int64_t threads, const Product& product,
                                                  int64_t m);

// Waits until done() holds: spins briefly (the work waited for finishes within microseconds),
// then yields, since on fewer cores than threads the thread we wait for may need this core.
template <typename Done>
void wait_for(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// The input of a product, x: f32[n] after the prologue (in `prepared` when there is one), and
// the residual's vector (f32[m], or null), from extra[first], extra[first + 1] as the
// attributes say (matvec.cc).
__attribute__((visibility("hidden"))) ffi::Error inputs(
    int64_t m, int64_t n, F32Vector& x, ffi::RemainingArgs& extra, size_t first, int32_t prologue,
    float eps, int32_t residual, std::unique_ptr<float[]>& prepared, const float** in,
    const float** add);

// `binding` with the arguments Args, in order (`args<F32Vector, S32Scalar>(ffi::Ffi::Bind())`);
// `rets` the same for results.
template <typename First, typename... Rest, typename Binding>
auto args(Binding binding) {
  if constexpr (sizeof...(Rest) == 0) return std::move(binding).template Arg<First>();
  else return args<Rest...>(std::move(binding).template Arg<First>());
}
template <typename First, typename... Rest, typename Binding>
auto rets(Binding binding) {
  if constexpr (sizeof...(Rest) == 0) return std::move(binding).template Ret<First>();
  else return rets<Rest...>(std::move(binding).template Ret<First>());
}

// `binding` with the attributes of a product's prologue and residual (`inputs`), as
// `jllama.kernels.matvec` passes them.
template <typename Binding>
auto prologue_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("prologue")
      .template Attr<float>("eps")
      .template Attr<int32_t>("residual");
}

}  // namespace jllama
