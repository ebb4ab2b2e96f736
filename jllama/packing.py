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
import mmap

import numpy as np

from jllama.ggml_matrix import GGMLMatrix, RowStack
from jllama.quant import Int8Matrix
from jllama.weights import LayerWeights

ALIGN = 64
"""Bytes: each matrix starts on a cache line, and XLA CPU aliases only 64-byte aligned arrays."""

HUGE_PAGE = 2 << 20
"""Bytes: the buffer starts on a 2 MiB boundary and asks Linux for transparent huge pages."""

DECODE_ORDER = ("wqkv", "wo", "w1", "w3", "w2")
"""A layer's matrices in the order a decode step reads them (then the next layer's, then wcls)."""


def _streamed(matrix) -> list[np.ndarray]:
    """The arrays a product streams: the matrix itself, an `Int8Matrix`'s int8 values (its
    per-row or per-group scales are small and stay where they are), or the blocks of GGML
    matrices (`jllama.ggml_matrix`; a RowStack's parts in order)."""
    if isinstance(matrix, Int8Matrix):
        return [matrix.q]
    if isinstance(matrix, GGMLMatrix):
        return [matrix.data]
    if isinstance(matrix, RowStack):
        return [p.data for p in matrix.parts]
    return [matrix]


def _rebuilt(matrix, views: list[np.ndarray]):
    """`matrix` with its streamed arrays replaced by `views` (same shapes and dtypes)."""
    if isinstance(matrix, Int8Matrix):
        return Int8Matrix(q=views[0], scale=matrix.scale)
    if isinstance(matrix, GGMLMatrix):
        return GGMLMatrix(views[0], matrix.type_id, matrix.cols)
    if isinstance(matrix, RowStack):
        return RowStack(tuple(GGMLMatrix(v, p.type_id, p.cols)
                              for p, v in zip(matrix.parts, views, strict=True)))
    return views[0]


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_buffer(nbytes: int, *, huge_pages: bool = True) -> np.ndarray:
    """A new, zeroed uint8[nbytes] host buffer starting on a `HUGE_PAGE` boundary.

    With `huge_pages`, on Linux, the buffer is an anonymous mapping marked `MADV_HUGEPAGE`, so
    the kernel backs it with 2 MiB pages where it can (transparent huge pages in "madvise" or
    "always" mode; in "never" mode the call changes nothing). Why: two threads streaming 438 MB
    with the kernels' prefetches read 3.7-4.7% more bytes per second through 2 MiB pages than
    through 4 KiB ones here, in the machine's slow minutes (bench/NOTES.md). NumPy already asks
    for huge pages for its own allocations of 4 MiB or more, so a NumPy buffer got them for all
    but its unaligned ends; this makes it explicit and whole. Elsewhere, or without
    `huge_pages`, it is a NumPy allocation aligned to `ALIGN` only.
    """
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(region, np.uint8)  # keeps `region` alive as long as any view
        start = -whole.ctypes.data % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        return whole[start : start + nbytes]
    buffer = np.zeros(nbytes + ALIGN, np.uint8)
    start = -buffer.ctypes.data % ALIGN
    return buffer[start : start + nbytes]


def pack_in_decode_order(
    layers: tuple[LayerWeights, ...], wcls, *, huge_pages: bool = True
) -> tuple[tuple[LayerWeights, ...], object]:
    """Copies of `layers`' matrices and of `wcls`, placed end to end (each 64-byte aligned) in
    one new host buffer in the decode step's reading order.

    Args:
      layers: per-layer weights on the host (`jllama.weights.to_graph_weights`); matrices
        float32, bfloat16, `Int8Matrix` or GGML blocks (`jllama.ggml_matrix`).
      wcls: the classifier [vocab_size, dim], same kinds.
      huge_pages: place the buffer on transparent huge pages where Linux offers them
        (`host_buffer`).

    Returns:
      (layers, wcls) of the same shapes, dtypes and values; the norm weights and int8 scales
      are the given arrays. Memory: one buffer of the matrices' bytes (plus at most 63 bytes
      of padding each); the inputs are not changed.
    """
    order = [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]
    streamed = [[np.ascontiguousarray(a) for a in _streamed(m)] for m in order]
    total = sum(_padded(a.nbytes) for arrays in streamed for a in arrays)
    buffer = host_buffer(total, huge_pages=huge_pages)
    offset = 0
    placed = []
    for arrays in streamed:
        views = []
        for a in arrays:
            view = buffer[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            views.append(view)
            offset += _padded(a.nbytes)
        placed.append(views)

    it = iter(zip(order, placed, strict=True))
    packed = tuple(
        dataclasses.replace(layer, **{name: _rebuilt(*next(it)) for name in DECODE_ORDER})
        for layer in layers
    )
    return packed, _rebuilt(*next(it))
