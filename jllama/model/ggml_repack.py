"""GGML blocks repacked eight rows at a time ("x8"), the layouts of jllama's fast decode
kernels (`jllama/kernels/ggml_x8.h`, whose header comment draws each one).

Block b of rows 8g .. 8g + 7 become one tile: the same bytes in another order, so a repacked
matrix has its stored size and exactly its stored values. `repack` and `unpack` are byte
permutations (NumPy fancy indexing with `tile_sources`; Q5_0's and Q5_1's high bits also
transposed within each row's 4 bytes); a repacked matrix is a `GGMLMatrix`
whose `type_id` is the ggml type plus `X8`, whose data keeps the shape [rows, row_bytes] (the
rows of a group hold the group's tiles end to end).

This is the reference: a model's weights are repacked at load by the kernel library
(`jllama/kernels/repack.cc`, through `jllama.model.packing.place_weights`: Llama-3.2-1B's 0.8 GB in
0.3-1.7 s where this took 11 s, with no intermediate arrays); the tests check that the two give
the same bytes for every type.
`unpack` serves `GGMLMatrix.stored_data` (dequantizing, converting).
"""

from __future__ import annotations

import functools

import numpy as np

from jllama.formats import ggml_quants as gq

X8 = 256
"""Added to a ggml type id for its x8 layout (ggml_x8.h's kX8)."""

TYPES = frozenset({gq.Q8_0, gq.Q4_0, gq.Q4_1, gq.Q5_0, gq.Q5_1, gq.Q4_K, gq.Q5_K, gq.Q6_K})
"""The ggml types with an x8 layout."""


def base_type(type_id: int) -> int:
    """The ggml type of a type id, x8 or not."""
    return type_id - X8 if type_id >= X8 else type_id


def _chunks(block_bytes: int, start: int, count: int) -> list[int]:
    """Sources of `count` chunks of 32 bytes: chunk c holds bytes start + 4c .. start + 4c + 3
    of each of the 8 rows (row r at 4r .. 4r + 3)."""
    return [r * block_bytes + start + 4 * c + i for c in range(count) for r in range(8)
            for i in range(4)]


def _per_row(block_bytes: int, start: int, width: int) -> list[int]:
    """Sources of bytes start .. start + width - 1 of row 0, then of row 1, ... (row-major)."""
    return [r * block_bytes + start + i for r in range(8) for i in range(width)]


def _planes(block_bytes: int, start: int, count: int) -> list[int]:
    """Sources of `count` planes of 8 bytes: plane p is byte start + p of rows 0 .. 7."""
    return [r * block_bytes + start + p for p in range(count) for r in range(8)]


@functools.cache
def tile_sources(type_id: int) -> np.ndarray:
    """int64[8 * block_bytes]: for each byte of a tile, the byte of the 8 rows' block (row r's
    block at r * block_bytes) it holds. A permutation.

    Raises:
      ValueError: a type without an x8 layout.
    """
    if type_id not in TYPES:
        raise ValueError(f"{gq.type_name(type_id)} has no x8 layout")
    _, nb = gq.BLOCK_SIZES[type_id]
    d = _per_row(nb, 0, 2)
    if type_id == gq.Q8_0:
        src = d + _chunks(nb, 2, 8)
    elif type_id == gq.Q4_0:
        src = d + _chunks(nb, 2, 4)
    elif type_id == gq.Q4_1:
        src = d + _per_row(nb, 2, 2) + _chunks(nb, 4, 4)
    elif type_id == gq.Q5_0:
        src = d + _per_row(nb, 2, 4) + _chunks(nb, 6, 4)
    elif type_id == gq.Q5_1:
        src = d + _per_row(nb, 2, 2) + _per_row(nb, 4, 4) + _chunks(nb, 8, 4)
    elif type_id == gq.Q4_K:
        src = d + _per_row(nb, 2, 2) + _planes(nb, 4, 12) + [
            s for g in range(4) for s in _chunks(nb, 16 + 32 * g, 8)]
    elif type_id == gq.Q5_K:
        src = (d + _per_row(nb, 2, 2) + _planes(nb, 4, 12) + _chunks(nb, 16, 8)
               + [s for g in range(4) for s in _chunks(nb, 48 + 32 * g, 8)])
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        src = (_per_row(nb, 208, 2) + _planes(nb, 192, 16)
               + [s for n in range(2) for s in _chunks(nb, 64 * n, 16)]
               + [s for n in range(2) for s in _chunks(nb, 128 + 32 * n, 8)])
    out = np.asarray(src, np.int64)
    assert np.array_equal(np.sort(out), np.arange(8 * nb)), type_id
    return out


def can_repack(type_id: int, rows: int) -> bool:
    """Whether a matrix of `rows` rows of this type has an x8 layout (rows a multiple of 8)."""
    return type_id in TYPES and rows % 8 == 0


def _tiles(data: np.ndarray, type_id: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """data u8[..., rows, row_bytes] as u8[groups, blocks, 8 * block_bytes] (rows grouped by 8,
    each group's blocks side by side), and the original shape."""
    _, nb = gq.BLOCK_SIZES[type_id]
    shape = data.shape
    rows, row_bytes = shape[-2], shape[-1]
    blocks = row_bytes // nb
    grouped = np.asarray(data).reshape(-1, rows // 8, 8, blocks, nb)
    return grouped.transpose(0, 1, 3, 2, 4).reshape(-1, blocks, 8 * nb), shape


# Q5_0 and Q5_1 tiles hold each row's 32 high bits (qh) transposed: bit 8i + k of the row's
# 4 bytes is the high bit of value 4k + i (bit 4k + i of qh), so that the kernel gets the high
# bits of values 4k .. 4k + 3 of all 8 rows as bit k of one 32-byte load.
_QH_AT = {gq.Q5_0: 16, gq.Q5_1: 32}
_QH_BITS = np.array([4 * (b % 8) + b // 8 for b in range(32)])  # plane bit b <- qh bit


def _transpose_qh(tiles: np.ndarray, type_id: int, inverse: bool) -> None:
    """Q5's high bits in place, tiles u8[..., tile bytes]: to the plane layout, or back."""
    at = _QH_AT[type_id]
    words = tiles[..., at:at + 32].reshape(*tiles.shape[:-1], 8, 4)
    bits = np.unpackbits(words, axis=-1, bitorder="little")
    order = np.argsort(_QH_BITS) if inverse else _QH_BITS
    words = np.packbits(bits[..., order], axis=-1, bitorder="little")
    tiles[..., at:at + 32] = words.reshape(*tiles.shape[:-1], 32)


def repack(data: np.ndarray, type_id: int) -> np.ndarray:
    """u8[..., rows, row_bytes] of ggml type `type_id` (rows a multiple of 8) in its x8 layout:
    a new array of the same shape.

    Raises:
      ValueError: no x8 layout for the type, or rows not a multiple of 8.
    """
    if not can_repack(type_id, data.shape[-2]):
        raise ValueError(f"{gq.type_name(type_id)} with {data.shape[-2]} rows has no x8 layout")
    tiles, shape = _tiles(data, type_id)
    out = np.ascontiguousarray(tiles[..., tile_sources(type_id)])
    if type_id in _QH_AT:
        _transpose_qh(out, type_id, inverse=False)
    return out.reshape(shape)


def unpack(data: np.ndarray, type_id: int) -> np.ndarray:
    """The inverse of `repack`: u8[..., rows, row_bytes] in ggml's own layout."""
    type_id = base_type(type_id)
    _, nb = gq.BLOCK_SIZES[type_id]
    shape = data.shape
    rows, row_bytes = shape[-2], shape[-1]
    blocks = row_bytes // nb
    tiles = np.asarray(data).reshape(-1, rows // 8, blocks, 8 * nb)
    if type_id in _QH_AT:
        tiles = tiles.copy()
        _transpose_qh(tiles, type_id, inverse=True)
    inverse = np.empty_like(tile_sources(type_id))
    inverse[tile_sources(type_id)] = np.arange(inverse.size)
    rows_order = tiles[..., inverse].reshape(-1, rows // 8, blocks, 8, nb)
    return np.ascontiguousarray(rows_order.transpose(0, 1, 3, 2, 4)).reshape(shape)
