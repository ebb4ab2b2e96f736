"""Bytes a model's weights would occupy once `jllama.model.weights.cast_weights` converted them,
worked out from shapes and types without converting anything: what the required-memory line
counts for a self-draft (`--draft=self:q4`, `self:int8`, `self:bfloat16`) before it is made.

The rules are `cast_weights`' (`_cast_matrix`'s), matrix by matrix: a float dtype is the
element count times 4 or 2 bytes; int8 is one byte a weight and a float32 scale a row
(`Int8Matrix`), or Q8_0 blocks for GGML weights; q4 is Q4_0 blocks except the types it keeps,
rows not a multiple of 32 long (kept as they are), and the classifier (and the embedding
it is tied to) at 8 bits. `tests/test_memory.py` checks them against the cast's own bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.formats import ggml_quants as gq
from jllama.model.weights import _MATRICES, DTYPES, Q4_KEEP, Q4_TYPE, matrix_kinds

SELF_TYPES = {"self:q4": "q4", "self:int8": "int8", "self:bfloat16": "bfloat16"}
"""`--draft` values that draft with the target's own weights at a narrower type, and that type
(`jllama.generation.draft_model` makes the draft; here so that the memory plan, below the
generation package, reads them too)."""

_Q8_KEEP = frozenset({gq.Q8_0, *Q4_KEEP, gq.Q5_0, gq.Q5_1, gq.Q4_K, gq.Q5_K, gq.Q6_K})
"""The types q4's 8-bit classifier keeps (`_cast_matrix`'s "int8q8")."""


def _elements(m) -> int:
    return int(np.prod(m.shape, dtype=np.int64))


def _blocks_nbytes(m, type_id: int, keep) -> int:
    """`_cast_matrix`'s `blocks(m, type_id, keep)`, in bytes."""
    from jllama.model.ggml_matrix import GGMLMatrix

    if isinstance(m, GGMLMatrix) and m.type_id in keep:
        return m.nbytes
    if isinstance(m, GGMLMatrix) and m.type_id == gq.Q4_0 and type_id == gq.Q8_0:
        type_id = gq.Q8_0  # q4_0_as_q8_0: the same blocks, 8 bits
    elif m.shape[-1] % 32:
        return m.nbytes
    elements, nbytes = gq.block_layout(type_id)
    return _elements(m) // elements * nbytes


def _matrix_nbytes(array, dtype: str) -> int:
    from jllama.model.ggml_matrix import LayerStack, is_ggml

    kinds = matrix_kinds(array)
    if dtype in ("float32", "bfloat16"):
        width = 4 if dtype == "float32" else 2
        return array.nbytes if kinds == {dtype} else _elements(array) * width
    if dtype == "int8" and not is_ggml(array):
        if kinds == {"int8"}:
            return array.nbytes
        rows = _elements(array) // array.shape[-1]
        return _elements(array) + 4 * rows  # int8 values, a float32 scale a row
    type_id, keep = {"int8": (gq.Q8_0, {gq.Q8_0}), "int8q8": (gq.Q8_0, _Q8_KEEP),
                     "q4": (Q4_TYPE, Q4_KEEP)}[dtype]
    if isinstance(array, LayerStack):
        return sum(_blocks_nbytes(m, type_id, keep) for m in array.layers)
    return _blocks_nbytes(array, type_id, keep)


def cast_nbytes(weights, dtype: str) -> int:
    """Bytes `cast_weights(weights, dtype)` would hold, as `weights_nbytes` counts them (a
    classifier shared with the embedding once; RMSNorm gains and biases as they are).

    Args:
      weights: a `jllama.model.weights.TransformerWeights`.
      dtype: one of `DTYPES`.

    Raises:
      ValueError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    seen, total = set(), 0
    for field in dataclasses.fields(weights):
        array = getattr(weights, field.name)
        if array is None or id(array) in seen:
            continue
        seen.add(id(array))
        if field.name not in _MATRICES:
            total += array.nbytes
            continue
        kind = dtype
        if dtype == "q4" and field.name in ("token_embedding_table", "wcls"):
            kind = "int8q8"  # q4 keeps the classifier (and a tied embedding) at 8 bits
        total += _matrix_nbytes(array, kind)  # a tied classifier: the embedding's, once
    return total
