"""Compiled program 1 of the decode step: attention RMSNorm, the stacked QKV projection, RoPE,
and the write of this position's key and value into the layer's caches."""

from __future__ import annotations

import functools

import jax

from jllama import kernels
from jllama.model.config import ModelConfig
from jllama.graphs.attention import write_positions
from jllama.graphs.cache_rows import kernel_reads
from jllama.graphs.ops import norm_matmul, qkv_extras, rope, split_qkv


@functools.partial(
    jax.jit, static_argnums=0, static_argnames=("shards", "matvec"),
    donate_argnames=("key_block", "value_block"),
)
def qkv(
    config: ModelConfig,
    x: jax.Array,
    rms_att_weight: jax.Array,
    wqkv: jax.Array,
    key_block: jax.Array,
    value_block: jax.Array,
    pos: jax.Array,
    inv_freq: jax.Array,
    *,
    bqkv: jax.Array | None = None,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    shards: int = 1,
    matvec: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalize the residual stream, project it to queries, keys and values in one product,
    rotate q and k (RoPE, as llama2.c run.c), and store k and v at `pos` in the caches.

    The cache write lives here, in a program that writes the caches and reads nothing else of
    them, because XLA CPU updates a donated buffer in place only then: a program that both
    writes a cache and reads it (as attention must) copies the whole cache every step
    (measured in JAX 0.10: 0.78 ms a layer at seq_len 8192, against 0.03 ms).

    Args:
      config: static; the program is traced once per config and replayed for every layer.
      x: f32[dim], the residual stream.
      rms_att_weight: f32[dim], this layer's attention RMSNorm gains.
      wqkv: f32[q_dim + 2 * kv_dim, dim], this layer's wq, wk, wv rows stacked (out x in).
      key_block, value_block: f32[n_kv_heads, block_length, head_dim] (or another KV cache
        type, `jllama.model.cache_types`: the rows are rounded to it), the layer's cache blocks
        holding `pos` (block pos // block_length, see `jllama.graphs.attention`); donated:
        updated in place, so the arguments must not be used afterwards.
      pos: int32 scalar, the token's position, 0 <= pos < seq_len.
      inv_freq: f32[head_dim // 2], from `jllama.model.rope.rope_frequencies`.
      bqkv, q_norm, k_norm: the layer's q/k/v biases f32[q_dim + 2 * kv_dim] (Qwen2) and
        per-head q / k RMSNorm gains f32[head_dim] (Qwen3), or None
        (`jllama.graphs.ops.qkv_extras`, applied to the product before RoPE, on every path).
      shards: static; the number of groups wqkv's rows come in (`jllama.graphs.ops.split_qkv`):
        1 on one device, the device count under tensor parallelism.
      matvec: static; how the product runs, "xla" or "kernel" (`jllama.graphs.ops.matmul`).
        With "kernel" on one device (shards == 1) RoPE and the cache write are one kernel
        call too (`jllama.kernels.rope_write`: cosf / sinf as run.c, where XLA has its own),
        where the kernel takes the blocks' type (`jllama.graphs.cache_rows.kernel_reads`).

    Returns:
      (q: f32[n_heads, head_dim] after RoPE, key_block, value_block updated at
      pos % block_length).
    """
    c = config
    with jax.named_scope("qkv"):
        qkv_out = norm_matmul(wqkv, x, rms_att_weight, c.norm_eps, matvec)
        qkv_out = qkv_extras(c, qkv_out, bqkv, q_norm, k_norm, shards)
    if matvec == "kernel" and shards == 1 and kernel_reads(key_block, value_block):
        with jax.named_scope("rope_cache_write"):
            return kernels.rope_write(qkv_out, pos, inv_freq, key_block, value_block)
    with jax.named_scope("qkv"):
        q, k, v = split_qkv(c, qkv_out, shards)
    with jax.named_scope("rope"):
        q = rope(q, pos, inv_freq)
        k = rope(k, pos, inv_freq)
    with jax.named_scope("cache_write"):
        key_block, value_block = write_positions(
            (key_block, value_block), (k[:, None, :], v[:, None, :]), pos
        )
    return q, key_block, value_block
