"""Compiled program 2 of the decode step: RoPE, KV-cache write and masked causal attention over
a fixed-size cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.config import ModelConfig
from jllama.graphs.ops import PRECISION, rope


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("key_cache", "value_cache"))
def attention(
    config: ModelConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    pos: jax.Array,
    inv_freq: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention for the token at `pos`, as llama2.c run.c.

    RoPE on q and k, then k and v stored at `pos` in this layer's caches, then for each query
    head h the scores `q_h . k_t / sqrt(head_dim)` against key head `h // kv_mul` for every
    cache position t, positions t > pos masked out, softmax, weighted sum of the values.
    The cache has a fixed size and is masked rather than sliced, so one compiled program
    serves every position; it is head-major because a [seq_len, kv_dim] layout makes XLA CPU
    transpose-copy the whole cache every step (measured in JAX 0.10 on XLA CPU).

    Args:
      config: static.
      q: f32[q_dim]; k, v: f32[kv_dim] (from the qkv program, before RoPE).
      key_cache, value_cache: f32[n_kv_heads, seq_len, head_dim], this layer's caches;
        donated, so they are updated in place and the arguments must not be used afterwards.
      pos: int32 scalar, 0 <= pos < seq_len.
      inv_freq: f32[head_dim // 2], from `jllama.rope.rope_frequencies`.

    Returns:
      (att: f32[q_dim], key_cache, value_cache): the attention output (heads concatenated) and
      the updated caches.
    """
    c = config
    with jax.named_scope("rope"):
        q = rope(q.reshape(c.n_heads, c.head_dim), pos, inv_freq)
        k = rope(k.reshape(c.n_kv_heads, c.head_dim), pos, inv_freq)
    with jax.named_scope("cache_write"):
        zero = jnp.zeros((), jnp.int32)
        key_cache = jax.lax.dynamic_update_slice(key_cache, k[:, None, :], (zero, pos, zero))
        value_cache = jax.lax.dynamic_update_slice(
            value_cache, v.reshape(c.n_kv_heads, 1, c.head_dim), (zero, pos, zero)
        )
    with jax.named_scope("attention"):
        qg = q.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
        scores = jnp.einsum("gmd,gsd->gms", qg, key_cache, precision=PRECISION)
        scores = scores / jnp.sqrt(jnp.float32(c.head_dim))
        visible = jnp.arange(c.seq_len) <= pos
        scores = jnp.where(visible, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        att = jnp.einsum("gms,gsd->gmd", weights, value_cache, precision=PRECISION)
    return att.reshape(c.q_dim), key_cache, value_cache
