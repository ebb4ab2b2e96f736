"""The batched decode step in XLA (matvec="xla": any platform, one device or a mesh): B
sequences, each at its own position on its own KV cache, one token each, in one program.

  decode_batch_step  every layer and the classifier for the B tokens: each product one
                     matrix product of the B rows [B, in] by the weight (each weight read once
                     for all B, where the single step reads it B times), RoPE at each row's
                     position, each row's attention over its own cache blocks (masked by its
                     position, its own key and value entered directly as the `fused` mode
                     does, `jllama.graphs.fused.attend_new_position`); the new keys and values
                     come back as small arrays
  write_rows         stores R sequences' new keys and values, their blocks donated (the only
                     way XLA CPU updates a cache block in place is a program that writes it
                     and reads nothing else of it, see `jllama.graphs.qkv`); the backend cuts
                     the B sequences into groups of powers of two (7 = 4 + 2 + 1), so a few
                     compiled sizes serve every B in few calls

Compiled once per batch size (the backend pads B up to one of `jllama.graphs.batch.
BATCH_SIZES`: the padding rows read blocks of zeros and their results are dropped) and per
count K of cache blocks read (the largest `attention_blocks` among the rows; a row whose own
window is smaller gets blocks of zeros after its own, which its mask hides), so slots filling
and emptying never compile anything.

The rows' attention runs one of two ways (`ATTENTION`, static): on a CPU each row's own
(unrolled, B * n_layers of them, reading the blocks where they lie); elsewhere the rows'
blocks stacked into one array per layer and one batched attention. On XLA CPU the stacked
form compiled 4-5x faster (SmolLM2 at B = 8: 4-5 s against 18-26 s) but stepped 1.6-2x slower
(200-300 ms against 118-195 ms, a busy 2-core machine); on a GPU each small op of the unrolled
form is a kernel launch of its own (about ten per row and layer).

Its arithmetic is the prefill chunk's (`jllama.graphs.prefill`: matrix-matrix products of
XLA) for the products and the `fused` mode's for attention, so a row's logits equal `forward`'s
up to float rounding (the sums of a matrix product run in another order than a
matrix-vector product's), not bit for bit; tests/test_batch_xla.py states what it measured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.graphs.attention import write_positions
from jllama.graphs.cache_rows import decode, round_trip
from jllama.graphs.fused import attend_new_position
from jllama.graphs.ops import PRECISION, qkv_extras, split_qkv
from jllama.graphs.prefill import _rmsnorm_rows, _rope_rows, _rows_matmul
from jllama.model.config import ModelConfig


ATTENTION = ("rows", "stacked")
"""How `decode_batch_step` runs the rows' attention: "rows", one attention per row over its
blocks where they lie (unrolled: B * n_layers of them; the faster step on XLA CPU, the slower
compile); "stacked", the rows' blocks stacked into one array per layer and one batched
attention (`attend_rows`: a copy of the blocks read, a handful of kernels per layer whatever
B is, the choice for an accelerator, where each small op of the unrolled form is a kernel
launch)."""


def attend_rows(
    config: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, key_blocks: tuple,
    value_blocks: tuple, pos: jax.Array,
) -> jax.Array:
    """`jllama.graphs.fused.attend_new_position` for B rows at once (traced): each row's K
    blocks stacked (a copy), then batched products over (row, KV head).

    Args:
      config: the model's config.
      q: f32[B, n_heads, head_dim] after RoPE; k, v: f32[B, n_kv_heads, head_dim], the rows'
        own keys (after RoPE) and values, read as the cache will hold them.
      key_blocks, value_blocks: B tuples of K blocks [n_kv_heads, block_length, row_length]
        (any KV cache type), row b's holding its positions < pos[b].
      pos: int32[B].

    Returns:
      f32[B, q_dim].
    """
    c = config
    rows = q.shape[0]
    # [B, n_kv_heads, K, size, head_dim]: the batch axes (row, head) first, as the products
    # take them.
    keys = jnp.stack([jnp.stack([decode(blk) for blk in row], 1) for row in key_blocks])
    values = jnp.stack([jnp.stack([decode(blk) for blk in row], 1) for row in value_blocks])
    n_blocks, size = keys.shape[2], keys.shape[3]
    scale = jnp.sqrt(jnp.float32(c.head_dim))
    k_read = round_trip(k, key_blocks[0][0].dtype)
    v_read = round_trip(v, value_blocks[0][0].dtype)
    qg = q.reshape(rows, c.n_kv_heads, c.kv_mul, c.head_dim)
    scores = jnp.einsum("bgmd,bgksd->bgmks", qg, keys, precision=PRECISION)
    scores = scores.reshape(rows, c.n_kv_heads, c.kv_mul, n_blocks * size) / scale
    where = jnp.arange(n_blocks * size, dtype=jnp.int32)[None, :]
    here = (where == pos[:, None])[:, None, None, :]  # [B, 1, 1, K * size]
    own = jnp.einsum("bgmd,bgd->bgm", qg, k_read, precision=PRECISION) / scale
    scores = jnp.where(here, own[..., None], scores)
    visible = (where <= pos[:, None])[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    own_weight = jnp.sum(jnp.where(here, weights, 0), axis=-1)  # [B, g, m]
    others = jnp.where(here, 0, weights).reshape(rows, c.n_kv_heads, c.kv_mul, n_blocks, size)
    att = (jnp.einsum("bgmks,bgksd->bgmd", others, values, precision=PRECISION)
           + own_weight[..., None] * v_read[:, :, None, :])
    return att.reshape(rows, c.q_dim)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("shards", "attention"))
def decode_batch_step(
    config: ModelConfig,
    x: jax.Array,
    pos: jax.Array,
    layers: tuple,
    key_blocks: tuple,
    value_blocks: tuple,
    inv_freq: jax.Array,
    rms_final_weight: jax.Array,
    wcls,
    *,
    shards: int = 1,
    attention: str = "rows",
) -> tuple[jax.Array, tuple, tuple]:
    """B tokens, each at its own position on its own cache, through all layers and the
    classifier (llama2.c run.c's `forward` per row).

    Args:
      config: static.
      x: f32[B, dim], the tokens' embedding rows.
      pos: int32[B], each row's position (0 <= pos[b] < K * block_length).
      layers: n_layers `LayerWeights` (f32, bf16 or `Int8Matrix` matrices, out x in).
      key_blocks, value_blocks: per layer, per row, that row's first K cache blocks
        (n_layers tuples of B tuples of K arrays [n_kv_heads, block_length, row_length] of a
        KV cache type, `jllama.graphs.attention`), holding the row's positions < pos[b];
        read only. A row's blocks after its own window may be any block (zeros): the mask
        hides them.
      inv_freq: f32[head_dim // 2]; rms_final_weight: f32[dim]; wcls: [vocab_size, dim].
      shards: static; wqkv's row groups (1, or the device count under tensor parallelism,
        `jllama.graphs.ops.split_qkv`).
      attention: static; one of `ATTENTION`.

    Returns:
      (logits f32[B, vocab_size], new_k, new_v): new_k and new_v per row, per layer, the
      row's key and value f32[n_kv_heads, 1, head_dim] (B tuples of n_layers arrays, each
      separate: `write_rows` takes them).
    """
    c = config
    rows = x.shape[0]
    angle = pos.astype(jnp.float32)[:, None] * inv_freq  # [B, head_dim // 2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    new_k = [[] for _ in range(rows)]
    new_v = [[] for _ in range(rows)]
    for l, layer in enumerate(layers):
        with jax.named_scope(f"layer{l}"):
            out = _rows_matmul(_rmsnorm_rows(x, layer.rms_att_weight, c.norm_eps), layer.wqkv)
            out = qkv_extras(c, out, layer.bqkv, layer.q_norm, layer.k_norm, shards)
            q, k, v = split_qkv(c, out, shards)  # [B, heads, head_dim]
            q, k = _rope_rows(q, cos, sin), _rope_rows(k, cos, sin)
            if attention == "stacked":
                att = attend_rows(c, q, k, v, key_blocks[l], value_blocks[l], pos)
            else:
                att = jnp.stack([
                    attend_new_position(c, q[b], k[b], v[b], key_blocks[l][b],
                                        value_blocks[l][b], pos[b])
                    for b in range(rows)
                ])  # [B, q_dim]
            for b in range(rows):
                new_k[b].append(k[b][:, None, :])
                new_v[b].append(v[b][:, None, :])
            x = x + _rows_matmul(att, layer.wo)
            h = _rmsnorm_rows(x, layer.rms_ffn_weight, c.norm_eps)
            up, gate = _rows_matmul(h, layer.w1), _rows_matmul(h, layer.w3)
            x = x + _rows_matmul(jax.nn.silu(up) * gate, layer.w2)
    with jax.named_scope("classifier_batch"):
        logits = _rows_matmul(_rmsnorm_rows(x, rms_final_weight, c.norm_eps), wcls)
    return logits, tuple(map(tuple, new_k)), tuple(map(tuple, new_v))


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("key_blocks", "value_blocks"))
def write_rows(
    config: ModelConfig, key_blocks: tuple, value_blocks: tuple, new_k: tuple, new_v: tuple,
    pos: jax.Array,
) -> tuple[tuple, tuple]:
    """Store each of R sequences' new keys and values at its position, in place
    (`jllama.graphs.fused.write_caches` for R sequences in one call).

    Args:
      config: static.
      key_blocks, value_blocks: R tuples of n_layers blocks, row r's blocks holding pos[r]
        (any KV cache type: the rows are rounded to it); donated, use the returned ones.
      new_k, new_v: R tuples of n_layers arrays f32[n_kv_heads, 1, head_dim] (as
        `decode_batch_step` returns them).
      pos: int32[R].

    Returns:
      (key_blocks, value_blocks) written, as given.
    """
    keys, values = [], []
    for r, (kb, vb) in enumerate(zip(key_blocks, value_blocks, strict=True)):
        n = len(kb)
        written = write_positions(tuple(kb) + tuple(vb), tuple(new_k[r]) + tuple(new_v[r]),
                                  pos[r])
        keys.append(written[:n])
        values.append(written[n:])
    return tuple(keys), tuple(values)
