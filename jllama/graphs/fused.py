"""The `fused` decode mode: one compiled program runs a token through every layer.

The `graph` mode dispatches three programs per layer (37 for a 12-layer model) and the cores
idle between dependent calls. Here one program holds all layers (their arrays passed in, the
layer loop unrolled at trace time) and the classifier. The caches are only read in it: the new
keys and values come out as small arrays and a second program, `write_caches`, stores them
with the caches donated and nothing else reading them, the only way XLA CPU updates a donated
buffer in place (see `jllama.graphs.qkv`). Two dispatches a token.

The layer computations are those of the graph mode's programs (their traced bodies are called
here), so both modes compute the same sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.config import ModelConfig
from jllama.graphs.attention import attention
from jllama.graphs.block import block
from jllama.graphs.classifier import classifier
from jllama.graphs.ops import matmul, rmsnorm, rope


@functools.partial(jax.jit, static_argnums=0, static_argnames=("window",))
def decode_step(
    config: ModelConfig,
    x: jax.Array,
    layers: tuple,
    key_caches: tuple,
    value_caches: tuple,
    pos: jax.Array,
    inv_freq: jax.Array,
    rms_final_weight: jax.Array,
    wcls: jax.Array,
    window: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token through all layers and the classifier, as llama2.c run.c's `forward`.

    Args:
      config: static.
      x: f32[dim], the token's embedding row.
      layers: n_layers `LayerWeights` (see `jllama.weights`).
      key_caches, value_caches: n_layers arrays f32[n_kv_heads, seq_len, head_dim], holding
        positions < pos (read only; this position's key and value are patched in here and
        written afterwards by `write_caches`).
      pos: int32 scalar, 0 <= pos < window.
      inv_freq: f32[head_dim // 2]; rms_final_weight: f32[dim]; wcls: [vocab_size, dim].
      window: static, the cache positions attention reads (`attention_window`).

    Returns:
      (logits f32[vocab_size], new_k, new_v): the keys and values as n_layers arrays
      f32[n_kv_heads, 1, head_dim] each.
    """
    c = config
    here = (jnp.arange(window) == pos)[None, :, None]
    new_k, new_v = [], []
    for l, layer in enumerate(layers):
        with jax.named_scope(f"layer{l}"):
            qkv_out = matmul(layer.wqkv, rmsnorm(x, layer.rms_att_weight, c.norm_eps))
            q = qkv_out[: c.q_dim].reshape(c.n_heads, c.head_dim)
            k = qkv_out[c.q_dim : c.q_dim + c.kv_dim].reshape(c.n_kv_heads, c.head_dim)
            v = qkv_out[c.q_dim + c.kv_dim :].reshape(c.n_kv_heads, c.head_dim)
            q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
            keys = jnp.where(here, k[:, None, :], key_caches[l][:, :window])
            values = jnp.where(here, v[:, None, :], value_caches[l][:, :window])
            att = attention.__wrapped__(c, q, keys, values, pos, window=window)
            x = block.__wrapped__(
                c, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3
            )
            new_k.append(k)
            new_v.append(v)
    logits = classifier.__wrapped__(c, x, rms_final_weight, wcls)
    return logits, tuple(k[:, None, :] for k in new_k), tuple(v[:, None, :] for v in new_v)


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("key_caches", "value_caches"))
def write_caches(
    config: ModelConfig,
    key_caches: tuple,
    value_caches: tuple,
    new_k: jax.Array,
    new_v: jax.Array,
    pos: jax.Array,
) -> tuple[tuple, tuple]:
    """Store each layer's new key and value at `pos`, in place (the caches are donated: use
    the returned ones). new_k, new_v: n_layers arrays f32[n_kv_heads, 1, head_dim] (separate
    arrays: slicing them out of one stacked array inside this program made XLA CPU rewrite
    every cache in full, 34 ms a token for SmolLM2)."""
    zero = jnp.zeros((), jnp.int32)
    keys = tuple(
        jax.lax.dynamic_update_slice(kc, k, (zero, pos, zero))
        for kc, k in zip(key_caches, new_k, strict=True)
    )
    values = tuple(
        jax.lax.dynamic_update_slice(vc, v, (zero, pos, zero))
        for vc, v in zip(value_caches, new_v, strict=True)
    )
    return keys, values
