// KV cache rows in their stored types (`jllama.model.cache_types`): which type a cache block holds
// (its dtype says: float32, float16, bfloat16, or uint8 for q8_0), a row read as float32
// (`widen_row`, `widen_part`) and a float32 row written in the block's type (`store_row`).
//
//   f32   head_dim float32
//   f16   head_dim IEEE float16, written rounding to nearest even (F16C's conversion)
//   bf16  head_dim bfloat16 (the upper half of a float32), written rounding to nearest even
//   q8_0  head_dim / 32 ggml block_q8_0's of 34 bytes: float16 step d, then 32 int8 q; a value
//         is d * q. Written as llama.cpp's CPU backend writes a q8_0 cache row (ggml-cpu's
//         `from_float` of GGML_TYPE_Q8_0, `quantize_row_q8_0` in arch/x86/quants.c, which
//         `set_rows` calls): per 32 values amax = max |x|, d = amax / 127 rounded to float16,
//         q = x * (127 / amax) rounded half to even (amax 0: d = 0, q = 0). That is the Q8_0
//         activation quantizer of ggml_quantize.h, whose pieces are reused here. (ggml's
//         reference `quantize_row_q8_0_ref`, which gguf-py repeats and llama.cpp's builds
//         without AVX use, multiplies by 1 / d and rounds half away from zero: a value at or
//         within an ulp of a half step can round the other way.)
//
// Reads widen each stored value to float32 exactly (d * q is exact: 11 and 8 significant bits).

#pragma once

#include <string>

#include "ggml_quantize.h"
#include "kernels.h"
#include "simd.h"

namespace jllama {
namespace {

enum class RowType : int { kF32, kF16, kBF16, kQ8_0 };

// The row type of a cache block of FFI dtype `dtype`; false for a dtype no cache type has.
inline bool row_type(ffi::DataType dtype, RowType* type) {
  switch (dtype) {
    case ffi::DataType::F32: *type = RowType::kF32; return true;
    case ffi::DataType::F16: *type = RowType::kF16; return true;
    case ffi::DataType::BF16: *type = RowType::kBF16; return true;
    case ffi::DataType::U8: *type = RowType::kQ8_0; return true;
    default: return false;
  }
}

constexpr int64_t kQ8Values = 32, kQ8Bytes = 34;  // ggml's QK8_0 and sizeof(block_q8_0)

// The last axis of a block of rows of head_dim values (head_dim, or q8_0's bytes), or -1
// when this type cannot hold such rows (q8_0 needs head_dim a multiple of 32).
inline int64_t row_length(RowType type, int64_t head_dim) {
  if (type != RowType::kQ8_0) return head_dim;
  return head_dim % kQ8Values == 0 ? head_dim / kQ8Values * kQ8Bytes : -1;
}

// Bytes of one row.
inline int64_t row_bytes(RowType type, int64_t head_dim) {
  switch (type) {
    case RowType::kF32: return 4 * head_dim;
    case RowType::kF16: case RowType::kBF16: return 2 * head_dim;
    default: return head_dim / kQ8Values * kQ8Bytes;
  }
}

inline const char* row_type_name(RowType type) {
  static constexpr const char* kNames[] = {"f32", "f16", "bf16", "q8_0"};
  return kNames[static_cast<int>(type)];
}

// Values [first, first + n) of a row of type T as float32 into out (first a multiple of 16).
template <typename T>
inline void widen_values(const T* row, int64_t first, int64_t n, float* out) {
  const T* w = row + first;
  int64_t i = 0;
#if JLLAMA_AVX512
  for (; i < n; i += 16) {
    const __mmask16 keep =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, keep, widen16(w + i, keep));
  }
#elif JLLAMA_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, widen8(w + i));
#endif
  for (; i < n; ++i) out[i] = widen(w[i]);
}

// Values [first, first + n) of a q8_0 row as float32 into out (first and n multiples of 16).
inline void widen_q8_0(const uint8_t* row, int64_t first, int64_t n, float* out) {
  for (int64_t i = first; i < first + n; i += 16) {
    const uint8_t* block = row + i / kQ8Values * kQ8Bytes;
    const float d = ggml::fp16(ggml::load_u16(block));
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2) + i % kQ8Values;
    float* o = out + (i - first);
#if JLLAMA_AVX512
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(d), widen16(q)));
#elif JLLAMA_AVX2
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(d), widen8(q)));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_set1_ps(d), widen8(q + 8)));
#else
    for (int j = 0; j < 16; ++j) o[j] = d * static_cast<float>(q[j]);
#endif
  }
}

// Values [first, first + n) of a row of `type` as float32 into out: first a multiple of 16,
// and for q8_0 n too.
inline void widen_part(RowType type, const uint8_t* row, int64_t first, int64_t n, float* out) {
  switch (type) {
    case RowType::kF32: widen_values(reinterpret_cast<const float*>(row), first, n, out); break;
    case RowType::kF16: widen_values(reinterpret_cast<const Half*>(row), first, n, out); break;
    case RowType::kBF16:
      widen_values(reinterpret_cast<const uint16_t*>(row), first, n, out);
      break;
    case RowType::kQ8_0: widen_q8_0(row, first, n, out); break;
  }
}

// A row of head_dim values of `type` as float32 into out f32[head_dim].
inline void widen_row(RowType type, const uint8_t* row, int64_t head_dim, float* out) {
  widen_part(type, row, 0, head_dim, out);
}

// float32 -> bfloat16's bits, rounding to nearest even; a NaN stays a quiet NaN (ggml's
// GGML_FP32_TO_BF16).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x: f32[head_dim] written as a row of `type` at out (row_bytes(type, head_dim) bytes). A
// q8_0 block holding a NaN or an infinity gets a NaN step (ggml_quantize.h's max_abs), so
// reading it gives NaNs, not finite values.
inline void store_row(RowType type, const float* x, int64_t head_dim, uint8_t* out) {
  switch (type) {
    case RowType::kF32:
      std::memcpy(out, x, sizeof(float) * head_dim);
      break;
    case RowType::kF16:
      for (int64_t i = 0; i < head_dim; ++i) {
        const uint16_t h = ggml::fp16_bits(x[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      break;
    case RowType::kBF16:
      for (int64_t i = 0; i < head_dim; ++i) {
        const uint16_t h = bf16_bits(x[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      break;
    case RowType::kQ8_0:
      for (int64_t b = 0; b < head_dim / kQ8Values; ++b) {
        const float* xb = x + b * kQ8Values;
        uint8_t* block = out + b * kQ8Bytes;
        const float amax = ggml::max_abs(xb, kQ8Values);
        const uint16_t d = ggml::fp16_bits(amax / 127.0f);
        std::memcpy(block, &d, 2);
        const float id = amax != 0.0f && !std::isnan(amax) ? 127.0f / amax : 0.0f;
        ggml::round_to_int8(xb, id, reinterpret_cast<int8_t*>(block + 2), kQ8Values, false);
      }
      break;
  }
}

// A layer's cache blocks of one type and shape, as a handler's arguments give them.
struct Blocks {
  RowType type = RowType::kF32;
  int64_t n_kv = 0, block = 0;
};

// Checks that `b` is a cache block of rows of head_dim values: a cache type's dtype, rank 3,
// [n_kv_heads, block, row_length], and, when `like` has a block already (like->block > 0),
// the type and the shape of that one; otherwise `like` takes b's. `what` names the argument
// in the one-line error.
inline ffi::Error check_block(const ffi::AnyBuffer& b, int64_t head_dim, Blocks* like,
                              const char* what) {
  RowType type;
  const auto d = b.dimensions();
  if (!row_type(b.element_type(), &type) || d.size() != 3)
    return ffi::Error::InvalidArgument(
        std::string(what) + " must be [n_kv_heads, B, head_dim] float32, float16 or bfloat16 "
        "or [n_kv_heads, B, head_dim / 32 * 34] uint8 (q8_0)");
  const int64_t length = row_length(type, head_dim);
  if (length < 0)
    return ffi::Error::InvalidArgument(std::string(what) + ": a q8_0 cache needs head_dim a "
                                       "multiple of 32, not " + std::to_string(head_dim));
  if (d[2] != length || d[0] < 1 || d[1] < 1)
    return ffi::Error::InvalidArgument(
        std::string(what) + " of type " + row_type_name(type) + " must be [n_kv_heads, B, " +
        std::to_string(length) + "] for head_dim " + std::to_string(head_dim));
  if (like->block > 0 && (type != like->type || d[0] != like->n_kv || d[1] != like->block))
    return ffi::Error::InvalidArgument(std::string(what) + ": cache blocks of one type and shape");
  like->type = type, like->n_kv = d[0], like->block = d[1];
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jllama
