"""Compiled program 2 of the decode step: masked causal attention over the first blocks of a
layer's KV cache, and the cache's block layout that the other programs share.

The cache of a layer is a tuple of `n_blocks(seq_len)` separate arrays ("blocks") of
f32[n_kv_heads, block_length(seq_len), head_dim] each, positions `b * B .. (b + 1) * B - 1`
in block b (or of another KV cache type, `jllama.model.cache_types`: f16 / bf16 values, or q8_0's
uint8[n_kv_heads, block_length, head_dim / 32 * 34]; writes round to the block's type and
reads widen to float32, `jllama.graphs.cache_rows`). Attention at `pos` reads the first `attention_blocks(seq_len, pos)` blocks, a
power of two of them, so a context compiles at most 1 + log2(n_blocks) attention programs
and a step reads at most twice the positions in use.

Why blocks, not one array per layer sliced to a window: the matrix products of XLA CPU take
whole buffers, so `cache[:, :window]` became a copy of the window before every product:
60 copies a token for SmolLM2, 5.2 of its ~28 ms (profiled in JAX 0.10 on this 2-core
machine, bench/NOTES.md). A block passed as an argument is a whole buffer: nothing is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama import kernels
from jllama.model.config import ModelConfig
from jllama.graphs.cache_rows import decode, encode, kernel_reads
from jllama.graphs.ops import PRECISION

MIN_WINDOW = 256
"""Positions per cache block (fewer when seq_len is shorter): the smallest attention window."""


def block_length(seq_len: int, min_window: int = MIN_WINDOW) -> int:
    """Positions per cache block: min(MIN_WINDOW, seq_len)."""
    return min(min_window, seq_len)


def n_blocks(seq_len: int) -> int:
    """Blocks in a layer's cache: ceil(seq_len / block_length); the cache holds
    n_blocks * block_length >= seq_len positions (those >= seq_len are never written)."""
    b = block_length(seq_len)
    return -(-seq_len // b)


def attention_blocks(seq_len: int, pos: int) -> int:
    """How many leading cache blocks attention at `pos` reads: the smallest power of two whose
    blocks hold position `pos`, capped at `n_blocks(seq_len)`."""
    needed = pos // block_length(seq_len) + 1
    k = 1
    while k < needed:
        k *= 2
    return min(k, n_blocks(seq_len))


def attention_window(seq_len: int, pos: int) -> int:
    """The cache positions attention at `pos` reads: `attention_blocks * block_length`
    (256, 512, 1024, ... for a long context)."""
    return attention_blocks(seq_len, pos) * block_length(seq_len)


def write_positions(blocks: tuple, rows: tuple, pos: jax.Array) -> tuple:
    """The cache write of every program that writes one (traced): each of `rows`
    (f32[n_kv_heads, T, head_dim], the keys or values of positions pos .. pos+T-1) rounded to
    the type of the block of `blocks` beside it (`cache_rows.encode`; a block [n_kv_heads,
    block_length, row_length] of any cache type) and stored there from pos % block_length on;
    returns the blocks written, in order.

    The caller keeps the T positions in one block: `dynamic_update_slice` would clamp a write
    that crossed its end. In place where the program donates the blocks and reads nothing
    else of them (see `jllama.graphs.qkv`)."""
    zero = jnp.zeros((), jnp.int32)
    offset = pos % blocks[0].shape[1]
    return tuple(
        jax.lax.dynamic_update_slice(block, encode(r, block.dtype), (zero, offset, zero))
        for block, r in zip(blocks, rows, strict=True)
    )


def block_scores(qg: jax.Array, key_blocks, spec: str) -> jax.Array:
    """Scores of queries against each block's keys (widened to float32), concatenated along
    the positions (last axis). spec: the einsum of one block, e.g. "gmd,gsd->gms"."""
    return jnp.concatenate(
        [jnp.einsum(spec, qg, decode(kb), precision=PRECISION) for kb in key_blocks], axis=-1
    )


def block_weighted_sum(weights: jax.Array, value_blocks, spec: str) -> jax.Array:
    """Sum over the blocks of weights (last axis: the positions of all blocks, in order) times
    each block's values (widened to float32). spec: the einsum of one block, e.g.
    "gms,gsd->gmd"."""
    size = value_blocks[0].shape[1]
    out = None
    for b, vb in enumerate(value_blocks):
        part = jnp.einsum(spec, weights[..., b * size:(b + 1) * size], decode(vb),
                          precision=PRECISION)
        out = part if out is None else out + part
    return out


def visible(where: jax.Array, pos: jax.Array, window: int = 0) -> jax.Array:
    """Which cache positions `where` a query at `pos` attends to (broadcast): those <= pos,
    and with a sliding window (`ModelConfig.sliding_window`, static; 0: none) only those
    > pos - window, transformers' sliding mask (Mistral v0.1)."""
    seen = where <= pos
    return seen & (where > pos - window) if window else seen


def windowed(config: ModelConfig) -> bool:
    """Whether the model's sliding window is shorter than its context, so that attention
    must mask the positions before it: jllama's CPU attention kernels have no window, and
    XLA's attention (this module's, `jllama.graphs.prefill`'s, `jllama.graphs.fused`'s) runs
    in their place."""
    return 0 < config.sliding_window < config.seq_len


def causal_softmax(scores: jax.Array, pos: jax.Array, window: int = 0) -> jax.Array:
    """Softmax over the last axis (cache positions) of `scores`, positions after `pos` masked
    out (causal attention), and with a sliding `window` (static) those before its start.
    pos: an int32 scalar (one query), or int32[T], the position of each query on the
    second-to-last axis of scores (a prefill chunk)."""
    seen = visible(jnp.arange(scores.shape[-1]), jnp.expand_dims(pos, -1), window)
    return jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)


def attend(config: ModelConfig, q: jax.Array, key_blocks, value_blocks, pos: jax.Array,
           matvec: str = "xla"):
    """The attention formula over blocks (traced; shared by the programs): q: f32[n_heads,
    head_dim], blocks as in `attention` -> f32[q_dim]. matvec="kernel": jllama's CPU kernel
    (`jllama.kernels.attention`), which reads positions 0 .. pos only, where it takes the
    blocks' type (`cache_rows.kernel_reads`) and the model has no window to mask
    (`windowed`)."""
    c = config
    qg = q.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
    if matvec == "kernel" and not windowed(c) and kernel_reads(key_blocks[0], value_blocks[0]):
        return kernels.attention(qg, key_blocks, value_blocks, pos).reshape(c.q_dim)
    scores = block_scores(qg, key_blocks, "gmd,gsd->gms") / jnp.sqrt(jnp.float32(c.head_dim))
    weights = causal_softmax(scores, pos, c.sliding_window)
    return block_weighted_sum(weights, value_blocks, "gms,gsd->gmd").reshape(c.q_dim)


def attend_current(
    config: ModelConfig, q: jax.Array, key_blocks, value_blocks, cur: jax.Array,
    key_cur: jax.Array, value_cur: jax.Array, pos: jax.Array, matvec: str = "xla",
):
    """`attend` where block `cur` (a traced index) is given separately as key_cur, value_cur
    (written by the same program, e.g. inside the decode loop) and its slot in key_blocks,
    value_blocks holds zeros: its scores and values come from key_cur and value_cur."""
    c = config
    size = key_cur.shape[1]
    qg = q.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
    if matvec == "kernel" and not windowed(c) and kernel_reads(key_cur, value_cur):
        return kernels.attention(
            qg, key_blocks, value_blocks, pos, cur, key_cur, value_cur
        ).reshape(c.q_dim)
    if len(key_blocks) == 1:
        # The current block is the only one (cur is 0): skip the products over its zeros,
        # half of this attention's work (positions < 256, e.g. every stories15M token).
        own = jnp.einsum("gmd,gsd->gms", qg, decode(key_cur), precision=PRECISION)
        weights = causal_softmax(own / jnp.sqrt(jnp.float32(c.head_dim)), pos,
                                 c.sliding_window)
        att = jnp.einsum("gms,gsd->gmd", weights, decode(value_cur), precision=PRECISION)
        return att.reshape(c.q_dim)
    zero = jnp.zeros((), jnp.int32)
    scores = block_scores(qg, key_blocks, "gmd,gsd->gms")
    own = jnp.einsum("gmd,gsd->gms", qg, decode(key_cur), precision=PRECISION)
    scores = jax.lax.dynamic_update_slice(scores, own, (zero, zero, cur * size))
    weights = causal_softmax(scores / jnp.sqrt(jnp.float32(c.head_dim)), pos,
                             c.sliding_window)
    own_weights = jax.lax.dynamic_slice(
        weights, (zero, zero, cur * size), (c.n_kv_heads, c.kv_mul, size)
    )
    att = block_weighted_sum(weights, value_blocks, "gms,gsd->gmd") + jnp.einsum(
        "gms,gsd->gmd", own_weights, decode(value_cur), precision=PRECISION
    )
    return att.reshape(c.q_dim)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def attention(
    config: ModelConfig,
    q: jax.Array,
    key_blocks: tuple,
    value_blocks: tuple,
    pos: jax.Array,
    *,
    matvec: str = "xla",
) -> jax.Array:
    """One layer's attention for the token at `pos`, as llama2.c run.c.

    For each query head h: the scores `q_h . k_t / sqrt(head_dim)` against key head
    `h // kv_mul` for every position t of the blocks given, positions t > pos masked out
    (and with a sliding window those t <= pos - window),
    softmax, and the weighted sum of the values. The mask (not a slice by `pos`) lets one
    compiled program serve every position those blocks hold. The blocks are head-major
    because a [positions, kv_dim] layout makes XLA CPU transpose-copy the cache every step
    (measured in JAX 0.10). They are read only (the `qkv` program writes them).

    Args:
      config: static.
      q: f32[n_heads, head_dim], after RoPE (from the qkv program).
      key_blocks, value_blocks: the layer's first k cache blocks (k =
        `attention_blocks(seq_len, pos)`), each f32[n_kv_heads, block_length, head_dim] or
        of another cache type (read widened to float32), already holding this position's key
        and value. One program is compiled per k (and per cache type).
      pos: int32 scalar, 0 <= pos < k * block_length.
      matvec: static; "kernel" computes it with jllama's CPU kernel (positions 0 .. pos
        only; XLA where the kernel does not take the blocks' type), "xla" as above (`jllama.graphs.ops.matmul` names the same choice).

    Returns:
      att: f32[q_dim], the attention output (heads concatenated).
    """
    with jax.named_scope("attention"):
        return attend(config, q, key_blocks, value_blocks, pos, matvec)
