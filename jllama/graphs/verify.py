"""The speculative verification step's compiled program (matvec="kernel", one CPU device): R
consecutive positions of ONE sequence, one token each, every row's logits bit-identical to
`forward` of that position alone.

  layer_verify  one layer for the R tokens: the stacked QKV product for all of them (each
                weight row read once for the R vectors, each row's sum the single-vector
                kernel's), then row by row, in position order, RoPE + cache write + attention
                on the sequence's blocks (row r sees the keys and values rows 0 .. r-1 wrote,
                by the single-sequence kernels' code: `jllama.kernels.batched.rope_attend_batch`
                with one row), then wo + residual and the FFN for all R rows

Why this is exact where the peers' verification is not: a verification pass elsewhere runs the
R positions as a prefill (one matrix product over R rows, attention of R queries at once),
whose sums are ordered otherwise than decoding one position at a time, so greedy output with
speculation drifts from greedy output without it. Here every sum is the decode kernels' sum:
the batched products are batch-invariant per row (tests/test_batch_decode.py), and attention
runs once per row over exactly the positions decode would read (0 .. pos), with the keys
written before it as decode would have written them.

The R positions lie in one cache block (the backend splits a run that crosses a block
boundary); rows from `count` on are padding (not computed, nothing written). Compiled once per
R in `VERIFY_SIZES` and per count K of cache blocks read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama.kernels import batched
from jllama.model.config import ModelConfig

VERIFY_SIZES = (2, 4, 8, 16)
"""The row counts the verification program is compiled for: R positions run in the smallest
that holds them (more than 16: in parts)."""


@functools.partial(
    jax.jit, static_argnums=0, donate_argnames=("key_current", "value_current")
)
def layer_verify(
    config: ModelConfig,
    x: jax.Array,
    count: jax.Array,
    pos: jax.Array,
    rms_att_weight: jax.Array,
    wqkv,
    wo,
    rms_ffn_weight: jax.Array,
    w1,
    w2,
    w3,
    inv_freq: jax.Array,
    key_current: jax.Array,
    value_current: jax.Array,
    key_blocks: tuple,
    value_blocks: tuple,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer of the verification step for R consecutive positions of one sequence.

    Args:
      config: static.
      x: f32[R, dim], the residual streams of the R tokens.
      count: int32 scalar, the real rows (the rest is padding).
      pos: int32[R], the rows' positions (consecutive, all in the block `key_current` is).
      rms_att_weight, wqkv, wo, rms_ffn_weight, w1, w2, w3: the layer's arrays
        (`jllama.model.weights.LayerWeights`; f32, bf16, `Int8Matrix` or GGML blocks).
      inv_freq: f32[head_dim // 2].
      key_current, value_current: the sequence's block holding the R positions; donated
        (written in place, row by row).
      key_blocks, value_blocks: K blocks each, the sequence's blocks 0 .. K - 1 (the slot of
        the current block, and any past it, not read).

    Returns:
      (x f32[R, dim] leaving the layer, key_current, value_current written).
    """
    eps = config.norm_eps
    rows = x.shape[0]
    with jax.named_scope("qkv_verify"):
        qkv = batched.matvec_batch(wqkv, x, count, norm=rms_att_weight, eps=eps)
    atts = []
    with jax.named_scope("attention_verify"):
        for r in range(rows):
            # One row through the single-row kernel: rows before it have written their keys.
            live = jnp.clip(count - r, 0, 1).astype(jnp.int32)
            att, (key_current,), (value_current,) = batched.rope_attend_batch(
                qkv[r:r + 1], pos[r:r + 1], live, inv_freq, (key_current,), (value_current,),
                key_blocks, value_blocks,
            )
            atts.append(att)
    att = jnp.concatenate(atts, axis=0)
    with jax.named_scope("wo_verify"):
        x = batched.matvec_batch(wo, att, count, add=x)
    with jax.named_scope("ffn_verify"):
        up = batched.matvec_batch(w1, x, count, norm=rms_ffn_weight, eps=eps)
        gate = batched.matvec_batch(w3, x, count, norm=rms_ffn_weight, eps=eps)
        x = batched.matvec_batch(w2, up, count, gate=gate, add=x)
    return x, key_current, value_current
