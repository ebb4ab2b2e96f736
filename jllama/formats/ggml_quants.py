"""GGML tensor types: dequantization to float32, block by block.

A GGUF file stores each tensor as rows of its innermost dimension, each row a run of blocks.
A block holds a fixed number of elements in a fixed number of bytes (the ids, names and sizes
are `jllama.formats.ggml_types`', re-exported here). The layouts are those of
ggml's `block_*` structs (ggml-common.h) as the GGUF specification (ggml's docs/gguf.md)
describes them. All numbers are little-endian; "bits a..b" count from the least significant:

  F32   1 element in 4 bytes: an IEEE float32.
  F16   1 element in 2 bytes: an IEEE float16.
  BF16  1 element in 2 bytes: the upper 16 bits of a float32 (x = bits << 16).
  Q8_0  32 elements in 34 bytes: f16 scale d, then 32 int8 q. x[j] = d * q[j].
  Q4_0  32 elements in 18 bytes: f16 scale d, then 16 bytes of 4-bit q. Byte j holds element j
        in its low nibble and element j + 16 in its high nibble. x[j] = d * (q[j] - 8).
  Q4_1  32 elements in 20 bytes: f16 scale d, f16 minimum m, then 16 bytes of 4-bit q packed
        as in Q4_0. x[j] = d * q[j] + m.
  Q5_0  32 elements in 22 bytes: f16 scale d, a u32 qh, then 16 bytes of nibbles packed as in
        Q4_0. Bit j of qh is the fifth bit of element j: q[j] = nibble + 16 * bit, 0..31.
        x[j] = d * (q[j] - 16).
  Q5_1  32 elements in 24 bytes: f16 scale d, f16 minimum m, then qh and nibbles as in Q5_0.
        x[j] = d * q[j] + m.

The K-quants hold 256 elements, a super-block, split into sub-blocks of 16 or 32 elements with
a small integer scale sc (and minimum mn) each, which multiply the f16 d (and dmin) of the
super-block. Element e (0..255) lies in sub-block s = e // 16 (or e // 32):

  Q2_K  256 elements in 84 bytes: 16 bytes of scales (byte s: sc in its low nibble, mn in its
        high nibble, for 16 sub-blocks of 16), 64 bytes qs, f16 d, f16 dmin. With e = 128 n +
        32 j + l (n < 2, j < 4, l < 32), q[e] is bits 2j..2j+1 of qs[32 n + l], 0..3.
        x[e] = (d * sc) * q[e] - (dmin * mn).
  Q3_K  256 elements in 110 bytes: 32 bytes hmask, 64 bytes qs, 12 bytes of scales, f16 d.
        With e as in Q2_K, the low two bits of q[e] are bits 2j..2j+1 of qs[32 n + l], its
        third bit is bit 4 n + j of hmask[l], and q[e] = low + 4 * bit - 4, -4..3. The 6-bit
        sc of each of 16 sub-blocks of 16: its low 4 bits are the low nibble of scales byte s
        (s < 8) or the high nibble of byte s - 8 (s >= 8); its high 2 bits are bits
        2 (s // 4)..2 (s // 4) + 1 of byte 8 + s % 4. x[e] = (d * (sc - 32)) * q[e].
  Q4_K  256 elements in 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit sc and mn for 8
        sub-blocks of 32, then 128 bytes qs. Writing b[i] for scales byte i: for s < 4,
        sc = b[s] & 63 and mn = b[s + 4] & 63; for s >= 4, sc = (b[s + 4] & 15) | (b[s - 4] >> 6)
        << 4 and mn = (b[s + 4] >> 4) | (b[s] >> 6) << 4. With e = 64 i + 32 h + l (i < 4, h < 2,
        l < 32), q[e] is the low (h = 0) or high (h = 1) nibble of qs[32 i + l], 0..15.
        x[e] = (d * sc) * q[e] - (dmin * mn).
  Q5_K  256 elements in 176 bytes: f16 d, f16 dmin, 12 bytes of scales as in Q4_K, 32 bytes
        qh, 128 bytes qs. q[e] = Q4_K's nibble + 16 * bit s of qh[l], 0..31 (e, s, l as in
        Q4_K). x[e] = (d * sc) * q[e] - (dmin * mn).
  Q6_K  256 elements in 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 sc (sub-blocks of 16),
        f16 d. With e = 128 n + 32 k + l (n < 2, k < 4, l < 32), the low 4 bits of q[e] are
        the low (k < 2) or high (k >= 2) nibble of ql[64 n + 32 (k % 2) + l], its high 2 bits
        are bits 2k..2k+1 of qh[32 n + l], and q[e] = that 6-bit value - 32, -32..31.
        x[e] = (d * sc) * q[e].

The arithmetic follows ggml's reference dequantizers (`dequantize_row_*` in ggml-quants.c):
the f16 scales (and minimums) are widened to f32 exactly, the integers converted to f32
exactly, then f32 products in the order shown, and for Q4_1, Q5_1, Q2_K, Q4_K and Q5_K one
f32 addition or subtraction after them. Every product is exact: an f16 significand has 11
bits and the integer factors at most 7 + 5 bits more (Q6_K's sc and q), 23 bits in all, within
f32's 24, and a finite f16 times such integers neither overflows nor underflows an f32. So only
the final addition rounds, a fused multiply-add in a compiled ggml gives the same bits, and the
result is bit-identical to ggml and to the `gguf` package's `gguf.quants.dequantize`.

Every function is vectorised over all blocks of a tensor at once (no Python loop per block).
"""

from __future__ import annotations

import numpy as np

from jllama.errors import CheckpointError
from jllama.formats.ggml_types import (  # noqa: F401 (re-exported: names of this module)
    BF16,
    BLOCK_SIZES,
    F16,
    F32,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    SUPPORTED,
    block_layout,
    row_nbytes,
    type_name,
)

_F16 = np.dtype("<f2")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")


def _as_bytes(raw) -> np.ndarray:
    """u8[n]: the bytes of `raw` (an ndarray, bytes, memoryview or other buffer), without a copy
    when they are contiguous."""
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return np.frombuffer(raw, dtype=np.uint8)


def _checked_bytes(raw, type_id: int, shape) -> tuple[tuple[int, ...], np.ndarray]:
    """(shape as ints, u8[n] the bytes of raw) of a tensor of `type_id`, checked as `dequantize`
    says: a supported type, a shape with dimensions none negative, rows a multiple of the block
    size, and exactly the bytes the shape takes.

    Raises:
      CheckpointError: one of those does not hold (the type and the numbers named).
    """
    name = type_name(type_id)
    block_layout(type_id)
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
    return shape, buf


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


def _scaled(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """f32[n_blocks, n]: q (u8 or int8[n_blocks, n]) times scale (f32[n_blocks, n_sub]), each
    scale over its run of n // n_sub elements: one exact conversion and one product each."""
    # Converting first and multiplying in place is several times faster in numpy than one
    # mixed-type multiply, which casts through small buffers around the broadcast scale.
    x = q.astype(np.float32)
    n_sub = scale.shape[1]
    runs = x.reshape(x.shape[0], n_sub, x.shape[1] // n_sub)
    runs *= scale[:, :, None]
    return x


def _minus(x: np.ndarray, low: np.ndarray) -> np.ndarray:
    """x (f32[n_blocks, n]) minus low (f32[n_blocks, n_sub]) over runs as in `_scaled`, in
    place; returns x."""
    n_sub = low.shape[1]
    runs = x.reshape(x.shape[0], n_sub, x.shape[1] // n_sub)
    runs -= low[:, :, None]
    return x


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 34] -> f32[n_blocks, 32]: d * q."""
    return _scaled(blocks[:, 2:].view(np.int8), _scale(blocks, 0))


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 18] -> f32[n_blocks, 32]: d * (q - 8)."""
    q = _nibbles(blocks[:, 2:]).view(np.int8)
    q -= 8
    return _scaled(q, _scale(blocks, 0))


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 20] -> f32[n_blocks, 32]: d * q + m (product rounded, then the sum)."""
    x = _scaled(_nibbles(blocks[:, 4:]), _scale(blocks, 0))
    x += _scale(blocks, 2)
    return x


# Entry b has byte i (little-endian) equal to 16 times bit i of b: a table that spreads a byte
# of Q5_0/Q5_1's qh into the fifth bits of 8 elements at once.
_FIFTH_BITS = np.array(
    [sum(((b >> i) & 1) << (8 * i + 4) for i in range(8)) for b in range(256)], dtype="<u8"
)


def _five_bits(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 32]: Q5_0/Q5_1's q, the nibbles in the last 16 bytes of each block with
    bit j of the u32 qh just before them as element j's fifth bit."""
    start = blocks.shape[1] - 16
    q = _nibbles(blocks[:, start:])
    q |= np.take(_FIFTH_BITS, blocks[:, start - 4 : start]).view(np.uint8)
    return q


def _dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 22] -> f32[n_blocks, 32]: d * (q - 16)."""
    q = _five_bits(blocks).view(np.int8)
    q -= 16
    return _scaled(q, _scale(blocks, 0))


def _dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 24] -> f32[n_blocks, 32]: d * q + m (product rounded, then the sum)."""
    x = _scaled(_five_bits(blocks), _scale(blocks, 0))
    x += _scale(blocks, 2)
    return x


# Shifts that take the four 2-bit fields of a byte, lowest first; and the 8 bits of a byte.
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
_BIT_SHIFTS = np.arange(8, dtype=np.uint8)[:, None]


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 256]: the 2-bit fields of u8[n_blocks, 64] in Q2_K/Q3_K element order,
    e = 128 n + 32 j + l taking bits 2j..2j+1 of byte 32 n + l."""
    q = qs.reshape(-1, 2, 1, 32) >> _CRUMB_SHIFTS  # [block, n, j, l]
    q &= 3
    return q.reshape(-1, 256)


def _bit_planes(qh: np.ndarray, weight: int) -> np.ndarray:
    """u8[n_blocks, 8, 32]: [block, i, l] is `weight` if bit i of qh[block, l] is set, else 0
    (qh: u8[n_blocks, 32]; weight a power of two)."""
    planes = qh[:, None, :] >> _BIT_SHIFTS
    planes &= 1
    planes <<= weight.bit_length() - 1
    return planes


def _dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 84] -> f32[n_blocks, 256]: (d * sc) * q - (dmin * mn) per sub-block of 16."""
    scales = blocks[:, :16]
    x = _scaled(_crumbs(blocks[:, 16:80]), _scale(blocks, 80) * (scales & 15))
    return _minus(x, _scale(blocks, 82) * (scales >> 4))


def _dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 110] -> f32[n_blocks, 256]: (d * (sc - 32)) * q per sub-block of 16."""
    q = _crumbs(blocks[:, 32:96])
    # Bit 4 n + j of hmask[l] adds 4 to q; then q - 4 leaves -4..3.
    q |= _bit_planes(blocks[:, :32], 4).reshape(-1, 256)
    q = q.view(np.int8)
    q -= 4
    b = blocks[:, 96:108]
    low4 = np.concatenate([b[:, :8] & 15, b[:, :8] >> 4], axis=1)  # s < 8, then s >= 8
    high2 = b[:, None, 8:12] >> _CRUMB_SHIFTS  # [block, s // 4, s % 4]
    high2 &= 3
    high2 <<= 4
    sc = (low4 | high2.reshape(-1, 16)).view(np.int8)
    sc -= 32
    return _scaled(q, _scale(blocks, 108) * sc)


def _scale_min_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sc, mn) u8[n_blocks, 8]: the 6-bit scales and minimums in Q4_K/Q5_K's 12 bytes b."""
    sc = np.empty((b.shape[0], 8), dtype=np.uint8)
    mn = np.empty((b.shape[0], 8), dtype=np.uint8)
    np.bitwise_and(b[:, 0:4], 63, out=sc[:, :4])
    np.bitwise_and(b[:, 4:8], 63, out=mn[:, :4])
    sc[:, 4:] = (b[:, 8:12] & 15) | ((b[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)
    return sc, mn


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 256]: Q4_K/Q5_K's 4-bit values of u8[n_blocks, 128], element
    e = 64 i + 32 h + l the low (h = 0) or high (h = 1) nibble of byte 32 i + l."""
    qs = qs.reshape(-1, 4, 1, 32)
    q = np.empty((qs.shape[0], 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, :1])
    np.right_shift(qs, 4, out=q[:, :, 1:])
    return q.reshape(-1, 256)


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 144] -> f32[n_blocks, 256]: (d * sc) * q - (dmin * mn) per sub-block of 32."""
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    x = _scaled(_nibbles_k(blocks[:, 16:144]), _scale(blocks, 0) * sc)
    return _minus(x, _scale(blocks, 2) * mn)


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 176] -> f32[n_blocks, 256]: (d * sc) * q - (dmin * mn) per sub-block of 32."""
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    q = _nibbles_k(blocks[:, 48:176])
    q |= _bit_planes(blocks[:, 16:48], 16).reshape(-1, 256)  # bit s of qh[l]: [block, s, l]
    x = _scaled(q, _scale(blocks, 0) * sc)
    return _minus(x, _scale(blocks, 2) * mn)


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """u8[n_blocks, 210] -> f32[n_blocks, 256]: (d * sc) * (q - 32) per sub-block of 16."""
    ql = blocks[:, :128].reshape(-1, 2, 1, 64)
    q = np.empty((ql.shape[0], 2, 2, 64), dtype=np.uint8)  # [block, n, k // 2, 32 (k % 2) + l]
    np.bitwise_and(ql, 15, out=q[:, :, :1])
    np.right_shift(ql, 4, out=q[:, :, 1:])
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _CRUMB_SHIFTS  # [block, n, k, l]
    high &= 3
    high <<= 4
    q = q.reshape(-1, 256)
    q |= high.reshape(-1, 256)
    q = q.view(np.int8)
    q -= 32
    return _scaled(q, _scale(blocks, 208) * blocks[:, 192:208].view(np.int8))


_BLOCK_DEQUANTIZERS = {
    Q8_0: _dequantize_q8_0, Q4_0: _dequantize_q4_0, Q4_1: _dequantize_q4_1,
    Q5_0: _dequantize_q5_0, Q5_1: _dequantize_q5_1, Q2_K: _dequantize_q2_k,
    Q3_K: _dequantize_q3_k, Q4_K: _dequantize_q4_k, Q5_K: _dequantize_q5_k,
    Q6_K: _dequantize_q6_k,
}


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
    shape, buf = _checked_bytes(raw, type_id, shape)
    if type_id == F32:
        return buf.view(_F32).astype(np.float32, copy=False).reshape(shape)
    if type_id == F16:
        return buf.view(_F16).astype(np.float32).reshape(shape)
    if type_id == BF16:
        bits = buf.view(_U16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32).reshape(shape)
    blocks = buf.reshape(-1, block_layout(type_id)[1])
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
    shape, buf = _checked_bytes(raw, type_id, shape)
    blocks = buf.reshape(-1, block_layout(type_id)[1])
    scale = _scale(blocks, 0).reshape(*shape[:-1], shape[-1] // 32)
    if type_id == Q8_0:
        q = blocks[:, 2:].view(np.int8)
    else:
        q = _nibbles(blocks[:, 2:]).view(np.int8)
        q -= 8
    return np.ascontiguousarray(q).reshape(shape), scale
