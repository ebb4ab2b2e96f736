"""The decode step's weight matrices side by side in one host buffer, in the order it reads them.

A decode step streams every matrix once: per layer wqkv, wo, w1, w3, w2, then the classifier.
On XLA CPU `jax.device_put` of a 64-byte aligned NumPy array makes a device array over the
same memory (no copy), so the device arrays of `pack_in_decode_order`'s result lie end to end
in one allocation. On this project's 2-core AMD machine that read 2-6% more bytes per second in
the machine's fast minutes than the same matrices as separate XLA allocations (stories110M
f32 decode, alternated in one process, the same tokens; bench/NOTES.md), and the same in its
slow ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.quant import Int8Matrix
from jllama.weights import LayerWeights

ALIGN = 64
"""Bytes: each matrix starts on a cache line, and XLA CPU aliases only 64-byte aligned arrays."""

DECODE_ORDER = ("wqkv", "wo", "w1", "w3", "w2")
"""A layer's matrices in the order a decode step reads them (then the next layer's, then wcls)."""


def _streamed(matrix):
    """The array a product streams: the matrix itself, or an `Int8Matrix`'s int8 values (its
    per-row or per-group scales are small and stay where they are)."""
    return matrix.q if isinstance(matrix, Int8Matrix) else matrix


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_in_decode_order(
    layers: tuple[LayerWeights, ...], wcls
) -> tuple[tuple[LayerWeights, ...], object]:
    """Copies of `layers`' matrices and of `wcls`, placed end to end (each 64-byte aligned) in
    one new host buffer in the decode step's reading order.

    Args:
      layers: per-layer weights on the host (`jllama.weights.to_graph_weights`); matrices
        float32, bfloat16 or `Int8Matrix`.
      wcls: the classifier [vocab_size, dim], same kinds.

    Returns:
      (layers, wcls) of the same shapes, dtypes and values; the norm weights and int8 scales
      are the given arrays. Memory: one buffer of the matrices' bytes (plus at most 63 bytes
      of padding each); the inputs are not changed.
    """
    order = [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]
    arrays = [np.ascontiguousarray(_streamed(m)) for m in order]
    buffer = np.empty(sum(_padded(a.nbytes) for a in arrays) + ALIGN, np.uint8)
    offset = -buffer.ctypes.data % ALIGN
    placed = []
    for a in arrays:
        view = buffer[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        placed.append(view)
        offset += _padded(a.nbytes)

    def like(matrix, view):
        return Int8Matrix(q=view, scale=matrix.scale) if isinstance(matrix, Int8Matrix) else view

    it = iter(zip(order, placed, strict=True))
    packed = tuple(
        dataclasses.replace(layer, **{name: like(*next(it)) for name in DECODE_ORDER})
        for layer in layers
    )
    return packed, like(*next(it))
