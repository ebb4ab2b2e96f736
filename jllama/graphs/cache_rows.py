"""The KV cache's types in the XLA programs (traced): rows rounded to a block's type as they are
written, widened to float32 as they are read (`jllama.model.cache_types` names the types and their
block formats; its NumPy `encode` / `decode` are the reference these match bit for bit).

A block's dtype says its type: float32, float16, bfloat16, or uint8 for q8_0 (rows of
head_dim / 32 ggml block_q8_0's of 34 bytes). Everything around the cache stays float32: the
scores and weighted sums read `decode(block)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jllama.model.cache_types import Q8_0_BLOCK_BYTES, QK8_0, of_dtype

KERNEL_CACHE_DTYPES = tuple(
    np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16, np.uint8))
"""The block dtypes jllama's CPU kernels (`jllama.kernels`: rope_write, attention,
attention_chunk, the batched rope_attend) read and write: every cache type. Programs given
blocks of another dtype would compute their cache writes and attention with XLA (the products
keep the kernels)."""


def kernel_reads(*blocks) -> bool:
    """Whether jllama's CPU kernels take cache blocks of these arrays' dtypes."""
    return all(np.dtype(b.dtype) in KERNEL_CACHE_DTYPES for b in blocks)


def encode(rows: jax.Array, dtype) -> jax.Array:
    """rows: f32[..., head_dim] -> as stored in a block of `dtype`: f16 / bf16 rounded to
    nearest even; q8_0 (uint8) quantized as `quantize_q8_0`; f32 unchanged."""
    dtype = np.dtype(dtype)
    if of_dtype(dtype).quantized:
        return quantize_q8_0(rows)
    return rows.astype(dtype)


def decode(block: jax.Array) -> jax.Array:
    """A block's rows (any cache type) as f32[..., head_dim]."""
    if of_dtype(block.dtype).quantized:
        return dequantize_q8_0(block)
    return block.astype(jnp.float32)


def round_trip(rows: jax.Array, dtype) -> jax.Array:
    """rows f32[..., head_dim] as a read of them after a write to a block of `dtype` would see
    them (what attention must use for a position it has not written yet)."""
    if np.dtype(dtype) == np.float32:
        return rows
    return decode(encode(rows, dtype))


def quantize_q8_0(x: jax.Array) -> jax.Array:
    """x: f32[..., n] (n a multiple of 32) -> uint8[..., n / 32 * 34], ggml's block_q8_0 per 32
    values as llama.cpp's CPU quantizer writes its KV cache (`jllama.model.cache_types.quantize_q8_0`
    states the rule): step d = amax / 127 as float16, q = round-half-even(x * (127 / amax)),
    d's two bytes then the 32 int8 (little-endian, the layout of every device jax runs on)."""
    groups = x.reshape(*x.shape[:-1], -1, QK8_0)
    amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    d = (amax / jnp.float32(127)).astype(jnp.float16)
    inv = jnp.where(amax == 0, jnp.float32(0), jnp.float32(127) / amax)
    q = jnp.clip(jnp.round(groups * inv), -127, 127).astype(jnp.int8)
    d_bytes = jax.lax.bitcast_convert_type(d[..., 0], jnp.uint8)  # [..., groups, 2]
    q_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8)
    return jnp.concatenate([d_bytes, q_bytes], axis=-1).reshape(*x.shape[:-1], -1)


def dequantize_q8_0(blocks: jax.Array) -> jax.Array:
    """uint8[..., m] (m a multiple of 34) of block_q8_0's -> f32[..., m / 34 * 32]: d * q in
    float32 (ggml's `dequantize_row_q8_0`)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, Q8_0_BLOCK_BYTES)
    d = jax.lax.bitcast_convert_type(b[..., :2], jnp.float16).astype(jnp.float32)
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return (q * d[..., None]).reshape(*blocks.shape[:-1], -1)
