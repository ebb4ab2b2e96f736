"""GGML tensor types: sizes and dequantization to float32, block by block.

A GGUF file stores each tensor as rows of its innermost dimension, each row a run of blocks.
A block holds a fixed number of elements in a fixed number of bytes. The layouts are those of
ggml's `block_*` structs (ggml-common.h) as the GGUF specification (ggml's docs/gguf.md)
describes them. All numbers are little-endian:

  F32   1 element in 4 bytes: an IEEE float32.
  F16   1 element in 2 bytes: an IEEE float16.
  BF16  1 element in 2 bytes: the upper 16 bits of a float32 (x = bits << 16).
  Q8_0  32 elements in 34 bytes: f16 scale d, then 32 int8 q. x[j] = d * q[j].
  Q4_0  32 elements in 18 bytes: f16 scale d, then 16 bytes of 4-bit q. Byte j holds element j
        in its low nibble and element j + 16 in its high nibble. x[j] = d * (q[j] - 8).
  Q4_1  32 elements in 20 bytes: f16 scale d, f16 minimum m, then 16 bytes of 4-bit q packed
        as in Q4_0. x[j] = d * q[j] + m.

The arithmetic follows ggml's reference dequantizers (`dequantize_row_*`): the f16 scale (and
minimum) are widened to f32 exactly, the integer q converted to f32 exactly, then one f32
product, and for Q4_1 one f32 addition after it. The product of an 11-bit f16 significand and
an integer of at most 8 bits always fits f32's 24 bits, so it is exact and only Q4_1's addition
rounds: a fused multiply-add in a compiled ggml gives the same bits. So the result is
bit-identical to ggml and to the `gguf` package's `gguf.quants.dequantize`.

Every function is vectorised over all blocks of a tensor at once.
"""

from __future__ import annotations

import numpy as np

from jllama.errors import CheckpointError

# Type ids of ggml's `enum ggml_type`, as stored in a GGUF tensor-info record.
F32 = 0
F16 = 1
Q4_0 = 2
Q4_1 = 3
Q8_0 = 8
BF16 = 30

# The names of every id in ggml's `enum ggml_type` (gaps are ids ggml has retired), so an error
# can name a type this module does not read.
_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}

# type id -> (elements per block, bytes per block), for the types `dequantize` reads.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4),
    F16: (1, 2),
    BF16: (1, 2),
    Q8_0: (32, 34),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
}

SUPPORTED: frozenset[int] = frozenset(BLOCK_SIZES)
_SUPPORTED_LIST = ", ".join(_TYPE_NAMES[t] for t in (F32, F16, BF16, Q8_0, Q4_0, Q4_1))

_F16 = np.dtype("<f2")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")


def type_name(type_id: int) -> str:
    """The ggml name of a type id, e.g. 14 -> "Q6_K"; "type <id>" for an id ggml does not have."""
    return _TYPE_NAMES.get(type_id, f"type {type_id}")


def _describe(type_id: int) -> str:
    if type_id in _TYPE_NAMES:
        return f"{_TYPE_NAMES[type_id]} (type {type_id})"
    return f"type {type_id} (not a ggml type)"


def _block(type_id: int) -> tuple[int, int]:
    """(elements, bytes) per block of a supported type.

    Raises:
      CheckpointError: `type_id` is not in `SUPPORTED`.
    """
    try:
        return BLOCK_SIZES[type_id]
    except (KeyError, TypeError):
        raise CheckpointError(
            f"{_describe(type_id)} is not supported; supported: {_SUPPORTED_LIST}"
        ) from None


def row_nbytes(type_id: int, cols: int) -> int:
    """Bytes of one row of `cols` elements of type `type_id`.

    Raises:
      CheckpointError: an unsupported type, a negative `cols`, or `cols` not a multiple of the
        type's block size.
    """
    block, nbytes = _block(type_id)
    if cols < 0:
        raise CheckpointError(f"{type_name(type_id)} row of {cols} elements: negative length")
    if cols % block:
        raise CheckpointError(
            f"{type_name(type_id)} rows of {cols} elements: not a multiple of the block size "
            f"{block}"
        )
    return cols // block * nbytes


def _as_bytes(raw) -> np.ndarray:
    """u8[n]: the bytes of `raw` (an ndarray, bytes, memoryview or other buffer), without a copy
    when they are contiguous."""
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return np.frombuffer(raw, dtype=np.uint8)


def _scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    """f32[n_blocks, 1]: the f16 field at byte `offset` of each block, widened exactly."""
    return blocks[:, offset : offset + 2].view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 32]: the 4-bit values of u8[n_blocks, 16]; byte j gives element j (low
    nibble) and element j + 16 (high nibble)."""
    q = np.empty((qs.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    return q


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 34] -> f32[n_blocks, 32]: d * q."""
    d = _scale(blocks, 0)
    return np.multiply(blocks[:, 2:].view(np.int8), d, dtype=np.float32)


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 18] -> f32[n_blocks, 32]: d * (q - 8)."""
    d = _scale(blocks, 0)
    q = _nibbles(blocks[:, 2:]).view(np.int8)
    q -= 8
    return np.multiply(q, d, dtype=np.float32)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 20] -> f32[n_blocks, 32]: d * q + m (product rounded, then the sum)."""
    d = _scale(blocks, 0)
    m = _scale(blocks, 2)
    x = np.multiply(_nibbles(blocks[:, 4:]), d, dtype=np.float32)
    x += m
    return x


_BLOCK_DEQUANTIZERS = {Q8_0: _dequantize_q8_0, Q4_0: _dequantize_q4_0, Q4_1: _dequantize_q4_1}


def dequantize(raw, type_id: int, shape) -> np.ndarray:
    """Decode a tensor of GGML type `type_id` to float32.

    Args:
      raw: the tensor's bytes, u8[...] of any shape (or bytes, memoryview, mmap): a row-major
        tensor whose innermost dimension is `shape[-1]`, exactly `n_rows * row_nbytes(type_id,
        shape[-1])` bytes where n_rows is the product of `shape[:-1]`.
      type_id: a type id in `SUPPORTED`.
      shape: the tensor's shape, outermost first (GGUF lists its dimensions innermost first:
        reverse them before calling).

    Returns:
      f32[shape]. For F32 this is a view of `raw` (read-only when `raw` is); every other type
      returns a new array. Values are not checked: a NaN or infinite scale gives NaN or
      infinite elements, as in ggml.

    Raises:
      CheckpointError: an unsupported type, a shape with no or negative dimensions, an inner
        dimension that is not a multiple of the block size, or a byte count that does not match
        the shape. The one-line message names the type and the numbers, not the tensor; the
        caller adds the file and the tensor name.
    """
    name = type_name(type_id)
    _, nbytes = _block(type_id)
    shape = tuple(int(n) for n in shape)
    if not shape or min(shape) < 0:
        raise CheckpointError(f"{name} tensor of shape {shape}: not a valid shape")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    expected = rows * row_nbytes(type_id, shape[-1])
    buf = _as_bytes(raw)
    if buf.size != expected:
        raise CheckpointError(
            f"{name} tensor of shape {shape} takes {expected} bytes, got {buf.size}"
        )
    if type_id == F32:
        return buf.view(_F32).astype(np.float32, copy=False).reshape(shape)
    if type_id == F16:
        return buf.view(_F16).astype(np.float32).reshape(shape)
    if type_id == BF16:
        bits = buf.view(_U16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32).reshape(shape)
    blocks = buf.reshape(-1, nbytes)
    with np.errstate(all="ignore"):  # NaN/inf scales give NaN/inf, as in ggml, and no warning
        return _BLOCK_DEQUANTIZERS[type_id](blocks).reshape(shape)


INT8_GROUP_TYPES = frozenset({Q8_0, Q4_0})
"""Types whose values are int8 times one scale per block of 32 (Q4_0: its 4-bit q minus 8),
which `int8_groups` splits without loss."""


def int8_groups(raw, type_id: int, shape) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 or Q4_0 tensor as (q int8[shape], scale f32[*shape[:-1], shape[-1] // 32]) with
    element j of a row equal to `q[j] * scale[j // 32]`, exactly the values `dequantize`
    gives (each float16 scale widens to float32 exactly).

    Raises:
      CheckpointError: another type, or what `dequantize` raises for the shape and bytes.
    """
    if type_id not in INT8_GROUP_TYPES:
        raise CheckpointError(f"{type_name(type_id)} is not int8 with group scales")
    shape = tuple(int(n) for n in shape)
    row_nbytes(type_id, shape[-1] if shape else -1)  # the block-size check
    blocks = _as_bytes(raw)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    expected = rows * row_nbytes(type_id, shape[-1])
    if blocks.size != expected:
        raise CheckpointError(
            f"{type_name(type_id)} tensor of shape {shape} takes {expected} bytes, got "
            f"{blocks.size}"
        )
    _, nbytes = _block(type_id)
    blocks = blocks.reshape(-1, nbytes)
    scale = _scale(blocks, 0).reshape(*shape[:-1], shape[-1] // 32)
    if type_id == Q8_0:
        q = blocks[:, 2:].view(np.int8)
    else:
        q = _nibbles(blocks[:, 2:]).view(np.int8)
        q -= 8
    return np.ascontiguousarray(q).reshape(shape), scale
