"""Compiled programs of batched prefill: a chunk of T prompt tokens through one layer at once.

The decode programs (`qkv`, `attention`, `block`) move one token through a layer with
matrix-vector products, reading every weight once per token. Prefill knows all the prompt's
tokens in advance, so a chunk of T tokens goes through each layer as matrix-matrix products:
each weight is read once per chunk instead of once per token. The three programs mirror the
decode ones, with a leading token axis:

  qkv_chunk        RMSNorm + QKV product + RoPE at positions pos..pos+T-1 + the cache write of
                   all T keys and values (caches donated)
  attention_chunk  causal attention: token t sees cache positions <= pos + t, within a window
  block_chunk      wo + residual + FFN RMSNorm + SwiGLU + residual

T is a static shape: the backend cuts a prompt into chunks of a few fixed sizes
(`jllama.backends.jax_prefill.PREFILL_CHUNKS`), so a few compiled shapes serve every prompt
length; tokens left over go through the decode programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama import kernels
from jllama.model.config import ModelConfig
from jllama.graphs.attention import visible as seen
from jllama.graphs.attention import windowed
from jllama.graphs.attention import write_positions
from jllama.graphs.cache_rows import decode, kernel_reads
from jllama.graphs.classifier import classifier
from jllama.graphs.ops import PRECISION, qkv_extras, split_qkv
from jllama.model.ggml_matrix import gate_up, is_ggml
from jllama.model.quant import Int8Matrix


def _rows_matmul(x: jax.Array, w) -> jax.Array:
    """x: f32[T, in], w: [out, in] (f32, or bf16 / `Int8Matrix` widened inside the program)
    -> f32[T, out]: each row times w. A chunk's product is matrix-matrix, so widening the
    weights once per chunk costs little next to the T rows it serves."""
    if is_ggml(w):  # GGML blocks: jllama's kernel, as a decode step computes each token's row
        return kernels.matmul(w, x)
    if isinstance(w, Int8Matrix) and w.grouped:
        out, n = w.q.shape
        dense = w.q.reshape(out, -1, w.group_size).astype(jnp.float32) * w.scale[..., None]
        return jnp.einsum("ti,oi->to", x, dense.reshape(out, n), precision=PRECISION)
    if isinstance(w, Int8Matrix):
        return jnp.einsum("ti,oi->to", x, w.q.astype(jnp.float32), precision=PRECISION) * w.scale
    if w.dtype != jnp.float32:
        w = w.astype(jnp.float32)
    return jnp.einsum("ti,oi->to", x, w, precision=PRECISION)


def _rmsnorm_rows(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of each row of x: f32[T, n] (as `jllama.graphs.ops.rmsnorm`, per token)."""
    ms = jnp.einsum("tn,tn->t", x, x, precision=PRECISION)[:, None] / x.shape[-1] + eps
    return weight * (x * jax.lax.rsqrt(ms))


def _rope_rows(heads: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """heads: f32[T, n, head_dim]; cos, sin: f32[T, head_dim // 2] of each token's angles
    (`jllama.model.rope.rope_cos_sin`) -> the adjacent pairs (2i, 2i+1) of each head of token t
    rotated by token t's angle i (run.c's RoPE)."""
    t, n, head_dim = heads.shape
    pairs = heads.reshape(t, n, head_dim // 2, 2)
    # (v0, v1) -> (v0 cos - v1 sin, v1 cos + v0 sin): the pair reversed times (-sin, sin).
    # Elementwise with a reverse, one loop fusion; stacking the two halves instead made XLA
    # CPU concatenate them (20 ms of a 512-token SmolLM2 prefill, profiled). cos and sin come
    # in as arguments: computed inside, XLA evaluated them once per element of every head
    # (a broadcast inside the fusion), 0.16 ms a SmolLM2 layer of 256 tokens.
    signed = sin[:, None, :, None] * jnp.array([-1, 1], jnp.float32)
    rotated = pairs * cos[:, None, :, None] + pairs[..., ::-1] * signed
    return rotated.reshape(t, n, head_dim)


@functools.partial(
    jax.jit, static_argnums=0, static_argnames=("shards",),
    donate_argnames=("key_block", "value_block"),
)
def qkv_chunk(
    config: ModelConfig, x: jax.Array, rms_att_weight: jax.Array, wqkv: jax.Array,
    key_block: jax.Array, value_block: jax.Array, pos: jax.Array, cos: jax.Array,
    sin: jax.Array, *, bqkv: jax.Array | None = None, q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None, shards: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`jllama.graphs.qkv` for T tokens at positions pos .. pos+T-1.

    Args:
      config: static.
      x: f32[T, dim], the residual streams of the chunk's tokens.
      rms_att_weight: f32[dim]; wqkv: [q_dim + 2 * kv_dim, dim] (f32 or bf16).
      key_block, value_block: f32[n_kv_heads, block_length, head_dim] (or another KV cache
        type, `jllama.model.cache_types`: the rows are rounded to it), the cache blocks that
        hold all of positions pos .. pos+T-1 (the caller's promise: a chunk never crosses a
        block boundary, and `dynamic_update_slice` would clamp one that did); donated,
        updated in place.
      pos: int32 scalar, the first token's position.
      cos, sin: f32[T, head_dim // 2], the RoPE angles of positions pos .. pos+T-1
        (`jllama.model.rope.rope_cos_sin`, the same for every layer).
      bqkv, q_norm, k_norm: as `jllama.graphs.qkv` (None for a Llama layer).
      shards: static; wqkv's row groups (as `jllama.graphs.qkv`).

    Returns:
      (q: f32[T, n_heads, head_dim] after RoPE, key_block, value_block with positions
      pos .. pos+T-1 written).
    """
    c = config
    with jax.named_scope("qkv_chunk"):
        out = _rows_matmul(_rmsnorm_rows(x, rms_att_weight, c.norm_eps), wqkv)
        out = qkv_extras(c, out, bqkv, q_norm, k_norm, shards)
        q, k, v = split_qkv(c, out, shards)
    with jax.named_scope("rope"):
        q = _rope_rows(q, cos, sin)
        k = _rope_rows(k, cos, sin)
    with jax.named_scope("cache_write"):  # [T, heads, d] -> head-major [heads, T, d]
        key_block, value_block = write_positions(
            (key_block, value_block), (k.transpose(1, 0, 2), v.transpose(1, 0, 2)), pos
        )
    return q, key_block, value_block


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def attention_chunk(
    config: ModelConfig, q: jax.Array, key_blocks: tuple, value_blocks: tuple, pos: jax.Array,
    *, matvec: str = "xla",
) -> jax.Array:
    """Causal attention of T tokens at positions pos .. pos+T-1 (`jllama.graphs.attention` per
    token): token t's query head h attends over key head h // kv_mul at cache positions
    s <= pos + t of the blocks given (and s > pos + t - window with a sliding window).

    Args:
      config: static.
      q: f32[T, n_heads, head_dim] after RoPE.
      key_blocks, value_blocks: the layer's first k cache blocks (k = `attention_blocks` of
        the chunk's last position), holding the chunk's keys and values already (read only;
        any KV cache type, widened to float32).
      pos: int32 scalar; pos + T <= k * block_length.
      matvec: static; "kernel": jllama's CPU kernel (`jllama.kernels.attention_chunk`, which
        reads only the keys each token sees) where `jllama.kernels.attention_chunk_fits`
        the shapes and it takes the blocks' type (`jllama.graphs.cache_rows.kernel_reads`)
        and the model has no window to mask (`jllama.graphs.attention.windowed`), else XLA's
        version below.

    Returns:
      att: f32[T, q_dim].

    The softmax runs block by block: `exp(s - max)` of each block's scores, the max and the
    sum taken over all blocks, each block's weights times its own values. Concatenating the
    blocks' scores into one array and slicing the weights back per block (the decode
    program's `causal_softmax` over `block_scores`) copied [heads, T, window] arrays several
    times a layer: attention took 275 ms of a 512-token SmolLM2 prefill (profiled), more than
    the q/k/v products.
    """
    c = config
    t = q.shape[0]
    if (matvec == "kernel" and not windowed(c) and kernel_reads(key_blocks[0], value_blocks[0])
            and kernels.attention_chunk_fits(c.head_dim, key_blocks[0].shape[1])):
        return kernels.attention_chunk(q, key_blocks, value_blocks, pos)
    with jax.named_scope("attention_chunk"):
        # [g, m, T, d]: each KV group's queries as one matrix of kv_mul * T rows, scaled by
        # 1 / sqrt(head_dim) here (T x q_dim values) rather than every score.
        scale = jnp.float32(1) / jnp.sqrt(jnp.float32(c.head_dim))
        qg = q.reshape(t, c.n_kv_heads, c.kv_mul, c.head_dim).transpose(1, 2, 0, 3) * scale
        size = key_blocks[0].shape[1]
        query_pos = pos + jnp.arange(t, dtype=jnp.int32)
        scores, visible = [], []
        for b, kb in enumerate(key_blocks):
            scores.append(jnp.einsum("gmtd,gsd->gmts", qg, decode(kb), precision=PRECISION))
            # token t sees positions <= query_pos[t] (within the window, if any): [T, size]
            where = b * size + jnp.arange(size, dtype=jnp.int32)
            visible.append(seen(where, query_pos[:, None], c.sliding_window))
        top = functools.reduce(jnp.maximum, [
            jnp.max(jnp.where(v, s, -jnp.inf), axis=-1) for s, v in zip(scores, visible)
        ])[..., None]
        probs = [jnp.where(v, jnp.exp(s - top), 0) for s, v in zip(scores, visible)]
        total = functools.reduce(jnp.add, [jnp.sum(p, axis=-1) for p in probs])
        att = functools.reduce(jnp.add, [
            jnp.einsum("gmts,gsd->gmtd", p, decode(vb), precision=PRECISION)
            for p, vb in zip(probs, value_blocks, strict=True)
        ]) / total[..., None]
    return att.transpose(2, 0, 1, 3).reshape(t, c.q_dim)


@functools.partial(jax.jit, static_argnums=0)
def block_chunk(
    config: ModelConfig, x: jax.Array, att: jax.Array, wo: jax.Array, rms_ffn_weight: jax.Array,
    w1: jax.Array, w2: jax.Array, w3: jax.Array,
) -> jax.Array:
    """`jllama.graphs.block` for T tokens: x: f32[T, dim], att: f32[T, q_dim] -> f32[T, dim]."""
    with jax.named_scope("wo_chunk"):
        x = x + _rows_matmul(att, wo)
    with jax.named_scope("ffn_chunk"):
        h = _rmsnorm_rows(x, rms_ffn_weight, config.norm_eps)
        both = gate_up(w1, w3)
        if both is not None:  # GGML blocks: one kernel call, x quantized once
            up = kernels.matmul(both, h)
            a, b = up[:, : config.hidden_dim], up[:, config.hidden_dim :]
        else:
            a, b = _rows_matmul(h, w1), _rows_matmul(h, w3)
        return x + _rows_matmul(jax.nn.silu(a) * b, w2)


@functools.partial(jax.jit, static_argnums=0)
def classifier_last(
    config: ModelConfig, x: jax.Array, rms_final_weight: jax.Array, wcls: jax.Array,
    last: jax.Array,
) -> jax.Array:
    """`jllama.graphs.classifier` of the chunk's last real token only: x: f32[T, dim], last:
    int32 scalar, its row (T - 1, or fewer in a chunk padded to its size) -> logits
    f32[vocab_size] (the prompt's other tokens need no logits)."""
    row = jax.lax.dynamic_index_in_dim(x, last, keepdims=False)
    return classifier.__wrapped__(config, row, rms_final_weight, wcls)


@functools.partial(jax.jit, static_argnums=0)
def classifier_rows(
    config: ModelConfig, x: jax.Array, rms_final_weight: jax.Array, wcls
) -> jax.Array:
    """`jllama.graphs.classifier` of every token of the chunk: x: f32[T, dim] ->
    logits f32[T, vocab_size] (a perplexity scores each position's prediction). wcls as
    `_rows_matmul` takes it: one matrix-matrix product for the T rows."""
    with jax.named_scope("classifier_rows"):
        return _rows_matmul(_rmsnorm_rows(x, rms_final_weight, config.norm_eps), wcls)
