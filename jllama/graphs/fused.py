"""The `fused` decode mode: one compiled program runs a token through every layer.

The `graph` mode dispatches three programs per layer (37 for a 12-layer model) and the cores
idle between dependent calls. Here one program holds all layers (their arrays passed in, the
layer loop unrolled at trace time) and the classifier. The caches are only read in it: the new
keys and values come out as small arrays and a second program, `write_caches`, stores them
with the caches donated and nothing else reading them, the only way XLA CPU updates a donated
buffer in place (see `jllama.graphs.qkv`). Two dispatches a token.

The caches are read whole block by block (`jllama.graphs.attention`); the position being
decoded is not in them yet, so its own score and its share of the values are computed from the
new key and value and put in place of the cache's stale entry. The sums are the graph mode's
up to float rounding (the tokens are the same; tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.model.config import ModelConfig
from jllama.graphs.attention import (
    block_scores,
    block_weighted_sum,
    causal_softmax,
    write_positions,
)
from jllama.graphs.block import block
from jllama.graphs.cache_rows import round_trip
from jllama.graphs.classifier import classifier
from jllama.graphs.ops import PRECISION, norm_matmul, qkv_extras, rope, split_qkv


def attend_new_position(
    config: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, key_blocks, value_blocks,
    pos: jax.Array,
) -> jax.Array:
    """Attention of one token at `pos` over cache blocks that do not hold its own key and
    value yet (traced; `decode_step`'s, and each row's of `jllama.graphs.batch_xla`).

    Args:
      config: the model's config.
      q: f32[n_heads, head_dim], after RoPE.
      k, v: f32[n_kv_heads, head_dim], this position's key (after RoPE) and value, in
        float32; read as the cache will hold them (rounded to the blocks' type).
      key_blocks, value_blocks: the first k cache blocks of the layer (any KV cache type),
        holding positions < pos; what they hold at pos and after is not read.
      pos: int32 scalar, 0 <= pos < k * block_length.

    Returns:
      f32[q_dim], the heads' outputs concatenated: the cache's entry at pos replaced by this
      position's score and value, positions after pos masked out.
    """
    c = config
    scale = jnp.sqrt(jnp.float32(c.head_dim))
    # This position's key and value as the cache will hold them (a read after the write sees
    # them rounded to the cache's type), as the graph mode reads them.
    k_read = round_trip(k, key_blocks[0].dtype)
    v_read = round_trip(v, value_blocks[0].dtype)
    qg = q.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
    scores = block_scores(qg, key_blocks, "gmd,gsd->gms") / scale
    here = jnp.arange(scores.shape[-1]) == pos
    own = jnp.einsum("gmd,gd->gm", qg, k_read, precision=PRECISION) / scale
    scores = jnp.where(here, own[..., None], scores)
    weights = causal_softmax(scores, pos, c.sliding_window)
    own_weight = jnp.sum(jnp.where(here, weights, 0), axis=-1)  # [g, m]
    att = block_weighted_sum(jnp.where(here, 0, weights), value_blocks,
                             "gms,gsd->gmd") + own_weight[..., None] * v_read[:, None, :]
    return att.reshape(c.q_dim)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("shards", "matvec"))
def decode_step(
    config: ModelConfig, x: jax.Array, layers: tuple, key_blocks: tuple, value_blocks: tuple,
    pos: jax.Array, inv_freq: jax.Array, rms_final_weight: jax.Array, wcls: jax.Array, *,
    shards: int = 1, matvec: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token through all layers and the classifier, as llama2.c run.c's `forward`.

    Args:
      config: static.
      x: f32[dim], the token's embedding row.
      layers: n_layers `LayerWeights` (see `jllama.model.weights`).
      key_blocks, value_blocks: n_layers tuples of each layer's first k cache blocks (k =
        `attention_blocks(seq_len, pos)`; see `jllama.graphs.attention`; any KV cache type),
        holding positions < pos; read only. This position's key and value enter the attention directly (its
        score and its share of the values) and are written afterwards by `write_caches`.
      pos: int32 scalar, 0 <= pos < k * block_length.
      inv_freq: f32[head_dim // 2]; rms_final_weight: f32[dim]; wcls: [vocab_size, dim].
      shards: static; wqkv's row groups (as `jllama.graphs.qkv`).
      matvec: static; "xla" or "kernel" (`jllama.graphs.ops.matmul`).

    Returns:
      (logits f32[vocab_size], new_k, new_v): the keys and values as n_layers arrays
      f32[n_kv_heads, 1, head_dim] each (in float32: `write_caches` rounds them).
    """
    c = config
    new_k, new_v = [], []
    for l, layer in enumerate(layers):
        with jax.named_scope(f"layer{l}"):
            qkv_out = norm_matmul(layer.wqkv, x, layer.rms_att_weight, c.norm_eps, matvec)
            qkv_out = qkv_extras(c, qkv_out, layer.bqkv, layer.q_norm, layer.k_norm, shards)
            q, k, v = split_qkv(c, qkv_out, shards)
            q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
            att = attend_new_position(c, q, k, v, key_blocks[l], value_blocks[l], pos)
            x = block.__wrapped__(
                c, x, att, layer.wo, layer.rms_ffn_weight, layer.w1,
                layer.w2, layer.w3, matvec=matvec,
            )
            new_k.append(k)
            new_v.append(v)
    logits = classifier.__wrapped__(c, x, rms_final_weight, wcls, matvec=matvec)
    return logits, tuple(k[:, None, :] for k in new_k), tuple(v[:, None, :] for v in new_v)


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("key_blocks", "value_blocks"))
def write_caches(
    config: ModelConfig,
    key_blocks: tuple,
    value_blocks: tuple,
    new_k: jax.Array,
    new_v: jax.Array,
    pos: jax.Array,
) -> tuple[tuple, tuple]:
    """Store each layer's new key and value at `pos`, in place. key_blocks, value_blocks: each
    layer's cache block holding `pos` (donated: use the returned ones; any KV cache type, the
    rows rounded to it); new_k, new_v: n_layers arrays f32[n_kv_heads, 1, head_dim] (separate arrays: slicing them out of one stacked
    array inside this program made XLA CPU rewrite every cache in full, 34 ms a token for
    SmolLM2)."""
    n = len(key_blocks)
    written = write_positions(tuple(key_blocks) + tuple(value_blocks),
                              tuple(new_k) + tuple(new_v), pos)
    return written[:n], written[n:]
