"""The speculative verification step's compiled program (matvec="kernel", one CPU device): R
consecutive positions of ONE sequence, one token each, every row's logits bit-identical to
`forward` of that position alone.

  layer_verify  one layer for the R tokens: the stacked QKV product for all of them (each
                weight row read once for the R vectors, each row's sum the single-vector
                kernel's), then row by row, in position order, RoPE + cache write + attention
                on the sequence's blocks (row r sees the keys and values rows 0 .. r-1 wrote,
                by the single-sequence kernels' code: `jllama.kernels.batched.rope_attend_batch`
                with one row: `attend_in_order`), then wo + residual and the FFN for all R
                rows (`jllama.graphs.batch.layer_rows`, as the batched step's layers)

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

from jllama.graphs.batch import layer_rows
from jllama.kernels import batched

VERIFY_SIZES = (2, 4, 8, 16)
"""The row counts the verification program is compiled for: R positions run in the smallest
that holds them (more than 16: in parts)."""


def attend_in_order(
    qkv: jax.Array, pos: jax.Array, count: jax.Array, inv_freq: jax.Array,
    key_current: jax.Array, value_current: jax.Array, key_blocks: tuple, value_blocks: tuple,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE, cache write and attention of R consecutive positions of one sequence, row by row
    in position order, each by the single-sequence kernels' code (row r sees the keys and
    values rows 0 .. r-1 wrote).

    Args:
      qkv: f32[R, (n_heads + 2 * n_kv_heads) * head_dim]; pos: int32[R], consecutive, all in
        the block `key_current` is; count: int32 scalar, the real rows; inv_freq: f32[head_dim
        // 2].
      key_current, value_current: the sequence's block holding the R positions (written row by
        row).
      key_blocks, value_blocks: K blocks each, the sequence's blocks 0 .. K - 1 (the slot of
        the current block, and any past it, not read).

    Returns:
      (att f32[R, n_heads * head_dim], key_current, value_current written).
    """
    atts = []
    for r in range(qkv.shape[0]):
        # One row through the single-row kernel: rows before it have written their keys.
        live = jnp.clip(count - r, 0, 1).astype(jnp.int32)
        att, (key_current,), (value_current,) = batched.rope_attend_batch(
            qkv[r:r + 1], pos[r:r + 1], live, inv_freq, (key_current,), (value_current,),
            key_blocks, value_blocks,
        )
        atts.append(att)
    return jnp.concatenate(atts, axis=0), key_current, value_current


layer_verify = functools.partial(layer_rows, attend=attend_in_order)
"""One layer of the verification step for R consecutive positions of one sequence
(`layer_rows` with `attend_in_order`): x f32[R, dim]; pos int32[R]; key_current, value_current
the sequence's block holding the R positions (donated); key_blocks, value_blocks its blocks
0 .. K - 1."""
