"""Compiled program 2 of the decode step: masked causal attention over a window of the
fixed-size cache: its first `window` positions, with `window` one of a few power-of-two length
buckets (`attention_window`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.config import ModelConfig
from jllama.graphs.ops import PRECISION

MIN_WINDOW = 256
"""The smallest attention window, positions: short contexts share one compiled program."""


def attention_window(seq_len: int, pos: int, min_window: int = MIN_WINDOW) -> int:
    """The cache positions the attention step at `pos` reads: the smallest of min_window,
    2 * min_window, 4 * min_window, ... that exceeds `pos`, capped at `seq_len`.

    Each distinct window is one compiled attention program, so a context of seq_len tokens
    compiles at most 1 + log2(seq_len / min_window) of them, while a step reads at most twice
    the positions in use instead of the whole cache.
    """
    window = min_window
    while window <= pos:
        window *= 2
    return min(window, seq_len)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("window",))
def attention(
    config: ModelConfig,
    q: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    pos: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """One layer's attention for the token at `pos`, as llama2.c run.c.

    For each query head h: the scores `q_h . k_t / sqrt(head_dim)` against key head
    `h // kv_mul` for every cache position t < window, positions t > pos masked out, softmax,
    and the weighted sum of the values. The mask (not a slice by `pos`) lets one compiled
    program serve every position of a window. The caches are head-major because a
    [seq_len, kv_dim] layout makes XLA CPU transpose-copy the whole cache every step
    (measured in JAX 0.10 on XLA CPU). They are read only (the `qkv` program writes them).

    Args:
      config: static.
      q: f32[n_heads, head_dim], after RoPE (from the qkv program).
      key_cache, value_cache: f32[n_kv_heads, seq_len, head_dim], this layer's caches, already
        holding this position's key and value.
      pos: int32 scalar, 0 <= pos < window.
      window: static; the cache positions read, pos < window <= seq_len (None: seq_len).
        Positions >= window are not read at all (`attention_window` picks it).

    Returns:
      att: f32[q_dim], the attention output (heads concatenated).
    """
    c = config
    window = c.seq_len if window is None else window
    with jax.named_scope("attention"):
        keys = key_cache[:, :window]
        values = value_cache[:, :window]
        qg = q.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
        scores = jnp.einsum("gmd,gsd->gms", qg, keys, precision=PRECISION)
        scores = scores / jnp.sqrt(jnp.float32(c.head_dim))
        visible = jnp.arange(window) <= pos
        scores = jnp.where(visible, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        att = jnp.einsum("gms,gsd->gmd", weights, values, precision=PRECISION)
    return att.reshape(c.q_dim)
