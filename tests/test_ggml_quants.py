"""GGML tensor types: dequantize against the `gguf` package bit for bit (quantized data, and
random blocks with finite scales), hand-made blocks whose values are worked out in the
comments, a GGUF file of every block type through the reader, and one-line errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError
from jllama.formats import ggml_quants as gq
from jllama.formats.ggml_quants import (
    BF16,
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
    dequantize,
    row_nbytes,
    type_name,
)

GT = gguf.GGMLQuantizationType
K_TYPES = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
BLOCK_TYPES = [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, *K_TYPES]
QUANTIZABLE = [F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1]  # what gguf.quants.quantize makes
ALL_TYPES = [F32, F16, BF16, *BLOCK_TYPES]

# Byte offsets of the f16 fields (d, and m or dmin) in each block, from the `block_*` structs of
# ggml-common.h: Q2_K ends with d, dmin after 16 scale bytes and 64 bytes of qs; Q3_K ends with
# d after 32 + 64 + 12 bytes; Q6_K ends with d after 128 + 64 + 16 bytes.
F16_FIELDS = {
    Q8_0: (0,), Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2),
    Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
}


def bits(x: np.ndarray) -> np.ndarray:
    """u32 view of f32 values, so -0.0 != 0.0 and NaN == NaN with the same payload."""
    assert x.dtype == np.float32
    return np.ascontiguousarray(x).view(np.uint32)


def assert_bit_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(bits(ours), bits(theirs.astype(np.float32, copy=False)))


def gguf_quantize(x: np.ndarray, type_id: int) -> np.ndarray:
    """u8[rows, row_bytes] (as a GGUF file stores it) of f32 `x`, by the `gguf` package."""
    with np.errstate(all="ignore"):
        q = quants.quantize(x, GT(type_id))
    return np.ascontiguousarray(q).view(np.uint8)


def gguf_dequantize(raw: np.ndarray, type_id: int, shape) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(raw, GT(type_id)).reshape(shape)


def finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """u16[n]: random finite float16 bit patterns (either sign, subnormals and zeros included);
    a pattern with exponent 31 (inf or NaN) has its top exponent bit cleared."""
    b = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    b[(b & 0x7C00) == 0x7C00] ^= 0x4000
    return b


def random_blocks(rng: np.random.Generator, type_id: int, shape) -> np.ndarray:
    """u8[rows, row bytes] of a tensor of `shape`: random bytes, with finite f16 scales."""
    elements, nbytes = gq.BLOCK_SIZES[type_id]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    n_blocks = rows * shape[-1] // elements
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_id]:
        scale = finite_f16_bits(rng, n_blocks)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


# --- constants against the gguf package ---------------------------------------------------------


def test_type_ids_and_block_sizes_match_gguf():
    assert (F32, F16, Q4_0, Q4_1, Q8_0, BF16) == (
        GT.F32, GT.F16, GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.BF16)
    assert (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) == (
        GT.Q5_0, GT.Q5_1, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K)
    assert SUPPORTED == frozenset(ALL_TYPES)
    for t in SUPPORTED:
        assert gq.BLOCK_SIZES[t] == gguf.GGML_QUANT_SIZES[GT(t)]
        assert block_layout(t) == gq.BLOCK_SIZES[t]


def test_block_sizes_of_the_new_types_by_hand():
    # ggml-common.h: Q5_0 = d + u32 qh + 16 qs; Q5_1 adds m; Q2_K = 16 scales + 64 qs + d + dmin;
    # Q3_K = 32 hmask + 64 qs + 12 scales + d; Q4_K = d + dmin + 12 scales + 128 qs; Q5_K adds
    # 32 qh; Q6_K = 128 ql + 64 qh + 16 scales + d.
    assert {t: block_layout(t) for t in (Q5_0, Q5_1, *K_TYPES)} == {
        Q5_0: (32, 2 + 4 + 16), Q5_1: (32, 2 + 2 + 4 + 16), Q2_K: (256, 16 + 64 + 2 + 2),
        Q3_K: (256, 32 + 64 + 12 + 2), Q4_K: (256, 2 + 2 + 12 + 128),
        Q5_K: (256, 2 + 2 + 12 + 32 + 128), Q6_K: (256, 128 + 64 + 16 + 2)}
    assert {t: block_layout(t) for t in (Q5_0, Q5_1, *K_TYPES)} == {
        Q5_0: (32, 22), Q5_1: (32, 24), Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144),
        Q5_K: (256, 176), Q6_K: (256, 210)}


def test_type_names_match_gguf_for_every_ggml_type():
    for t in GT:
        assert type_name(t.value) == t.name
    assert type_name(4) == "type 4"  # Q4_2, retired by ggml
    assert type_name(1000) == "type 1000"


def test_row_nbytes():
    assert row_nbytes(F32, 576) == 2304
    assert row_nbytes(F16, 7) == 14
    assert row_nbytes(BF16, 3) == 6
    assert row_nbytes(Q8_0, 576) == 18 * 34
    assert row_nbytes(Q4_0, 64) == 36
    assert row_nbytes(Q4_1, 576) == 18 * 20
    assert row_nbytes(Q4_1, 0) == 0
    assert row_nbytes(Q5_0, 64) == 44
    assert row_nbytes(Q5_1, 96) == 72
    assert row_nbytes(Q2_K, 512) == 168
    assert row_nbytes(Q3_K, 256) == 110
    assert row_nbytes(Q4_K, 768) == 432
    assert row_nbytes(Q5_K, 256) == 176
    assert row_nbytes(Q6_K, 4096) == 16 * 210


# --- against the gguf package --------------------------------------------------------------------

SHAPES = [(32,), (1, 64), (1, 576), (17, 96), (2, 3, 64), (4, 1, 5, 32)]


@pytest.mark.parametrize("type_id", QUANTIZABLE, ids=type_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantized_random_data_dequantizes_like_gguf(type_id, shape):
    rng = np.random.default_rng(sum(shape) * 100 + type_id)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    x.flat[0] = -0.0  # a negative zero must stay negative through F32/F16/BF16
    raw = gguf_quantize(x, type_id)
    assert raw.nbytes == int(np.prod(shape[:-1])) * row_nbytes(type_id, shape[-1])
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


@pytest.mark.parametrize("type_id", [Q8_0, Q4_0, Q4_1], ids=type_name)
def test_random_bytes_dequantize_like_gguf(type_id):
    # Arbitrary bytes, so scales include f16 NaN, inf, subnormals and -0.0.
    rng = np.random.default_rng(type_id)
    shape = (64, 256)
    raw = rng.integers(0, 256, size=(64, row_nbytes(type_id, 256)), dtype=np.uint8)
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


K_SHAPES = [(256,), (1, 256), (1, 768), (33, 512), (2, 3, 256), (3, 1, 2, 1024)]


@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=type_name)
@pytest.mark.parametrize("shape", K_SHAPES, ids=str)
def test_random_blocks_with_finite_scales_dequantize_like_gguf(type_id, shape):
    # Every bit of every block random except the f16 scale fields, which are random finite
    # f16 (subnormals, zeros of both signs, up to 65504), so there is no NaN to compare.
    rng = np.random.default_rng([type_id, *shape])
    raw = random_blocks(rng, type_id, shape)
    assert raw.nbytes == int(np.prod(shape[:-1])) * row_nbytes(type_id, shape[-1])
    want = gguf_dequantize(raw, type_id, shape)
    assert np.isfinite(want).all()
    assert_bit_equal(dequantize(raw, type_id, shape), want)


@pytest.mark.parametrize("type_id", K_TYPES, ids=type_name)
def test_many_blocks_dequantize_like_gguf(type_id):
    # 4096 super-blocks (1M elements) of random bits: every scale/min code and q value occurs.
    rng = np.random.default_rng(100 + type_id)
    shape = (256, 4096)
    raw = random_blocks(rng, type_id, shape)
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


@settings(max_examples=40, deadline=None)
@given(type_id=st.sampled_from(BLOCK_TYPES), data=st.data())
def test_property_random_blocks_match_gguf(type_id, data):
    elements, _ = block_layout(type_id)
    lead = data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=2), label="lead")
    shape = (*lead, elements * data.draw(st.integers(1, 3), label="blocks"))
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    raw = random_blocks(np.random.default_rng(seed), type_id, shape)
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


@pytest.mark.parametrize("type_id", [F16, BF16], ids=type_name)
def test_every_16_bit_pattern_dequantizes_like_gguf(type_id):
    raw = np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(256, 512)
    assert_bit_equal(dequantize(raw, type_id, (256, 256)), gguf_dequantize(raw, type_id, (256, 256)))


def test_f16_every_pattern_is_the_ieee_half_value():
    # Independent of gguf: numpy's float16 is IEEE binary16; NaNs are compared as NaN.
    patterns = np.arange(1 << 16, dtype="<u2")
    ours = dequantize(patterns.view(np.uint8), F16, (1 << 16,))
    want = patterns.view(np.float16).astype(np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(ours[finite].astype(np.float64), want[finite])
    assert np.array_equal(np.isnan(ours), np.isnan(want))
    assert np.array_equal(np.isinf(ours) & (ours > 0), np.isinf(want) & (want > 0))


@settings(max_examples=60, deadline=None)
@given(
    type_id=st.sampled_from(QUANTIZABLE),
    data=st.data(),
)
def test_property_quantize_then_dequantize_matches_gguf(type_id, data):
    lead = data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=2), label="lead")
    cols = 32 * data.draw(st.integers(1, 4), label="blocks")
    shape = (*lead, cols)
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(
        width=32, allow_nan=False, allow_infinity=False)), label="x")
    raw = gguf_quantize(x, type_id)
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


# --- hand-made blocks ----------------------------------------------------------------------------


def test_q4_0_block_by_hand():
    # d = 0.5 is f16 0x3800, stored little-endian as 00 38. Byte j of qs = (j << 4) | (15 - j):
    # element j (low nibble) = 15 - j, element j + 16 (high nibble) = j.
    # x = d * (q - 8): element 0 = (15 - 8) * 0.5 = 3.5, element 15 = (0 - 8) * 0.5 = -4.0,
    # element 16 = (0 - 8) * 0.5 = -4.0, element 31 = (15 - 8) * 0.5 = 3.5.
    qs = bytes((j << 4) | (15 - j) for j in range(16))
    block = b"\x00\x38" + qs
    assert len(block) == 18 and block[2] == 0x0F and block[17] == 0xF0
    x = dequantize(block, Q4_0, (32,))
    assert (x[0], x[1], x[7], x[8], x[15]) == (3.5, 3.0, 0.0, -0.5, -4.0)
    assert (x[16], x[17], x[24], x[31]) == (-4.0, -3.5, 0.0, 3.5)
    want = [(7 - j) * 0.5 for j in range(16)] + [(j - 8) * 0.5 for j in range(16)]
    assert x.tolist() == want


def test_q4_0_two_blocks_in_a_row_and_two_rows():
    # Row-major: row 0 = blocks A, B; row 1 = blocks C, D. Every nibble of a block is the same.
    # d = 1.0 (f16 0x3C00 -> 00 3C). Nibble value v gives v - 8.
    def block(v):
        return b"\x00\x3c" + bytes([v | v << 4]) * 16

    raw = block(8) + block(9) + block(0) + block(15)
    x = dequantize(raw, Q4_0, (2, 64))
    assert x[0, :32].tolist() == [0.0] * 32
    assert x[0, 32:].tolist() == [1.0] * 32
    assert x[1, :32].tolist() == [-8.0] * 32
    assert x[1, 32:].tolist() == [7.0] * 32


def test_q4_1_block_by_hand():
    # d = 0.25 is f16 0x3400 (00 34); m = -1.0 is f16 0xBC00 (00 BC). x = d * q + m.
    # qs byte 0 = 0x5C: element 0 = 12 * 0.25 - 1 = 2.0, element 16 = 5 * 0.25 - 1 = 0.25.
    # qs byte 15 = 0xF0: element 15 = 0 * 0.25 - 1 = -1.0, element 31 = 15 * 0.25 - 1 = 2.75.
    # Other bytes 0x21: elements 1..14 = 1 * 0.25 - 1 = -0.75, 17..30 = 2 * 0.25 - 1 = -0.5.
    block = b"\x00\x34\x00\xbc" + b"\x5c" + b"\x21" * 14 + b"\xf0"
    x = dequantize(np.frombuffer(block, np.uint8), Q4_1, (1, 32))
    want = [2.0] + [-0.75] * 14 + [-1.0] + [0.25] + [-0.5] * 14 + [2.75]
    assert x.shape == (1, 32) and x[0].tolist() == want


def test_q4_1_sums_in_float32():
    # d = 2^-14 is f16 0x0400 (00 04); m = 65504 is f16 0x7BFF (FF 7B); every nibble is 1.
    # d * q = 2^-14 is exact; 65504 + 2^-14 needs 30 significant bits, so the f32 sum rounds
    # to 65504.0 (in float64 it would be 65504.00006103515625).
    block = b"\x00\x04\xff\x7b" + b"\x11" * 16
    x = dequantize(block, Q4_1, (32,))
    assert x.tolist() == [65504.0] * 32


def test_q8_0_blocks_by_hand():
    # Block 0: d = 2.0 is f16 0x4000 (00 40); q = -128 .. -97, so x = -256, -254, .., -194.
    # Block 1: d = -0.5 is f16 0xB800 (00 B8); q = 0 .. 31, so x = -0.0, -0.5, .., -15.5:
    # element 0 is -0.0 (a negative scale times zero), which must keep its sign.
    block0 = b"\x00\x40" + bytes(q & 0xFF for q in range(-128, -96))
    block1 = b"\x00\xb8" + bytes(range(32))
    x = dequantize(memoryview(block0 + block1), Q8_0, (64,))
    assert x[:32].tolist() == [2.0 * q for q in range(-128, -96)]
    assert x[0] == -256.0 and x[31] == -194.0
    assert x[32:].tolist() == [-0.5 * q for q in range(32)]
    assert np.signbit(x[32]) and x[33] == -0.5 and x[63] == -15.5


def test_q5_0_blocks_by_hand():
    # Block 0: d = 1.0 (00 3C); qh = 0x0000FFFF (FF FF 00 00): elements 0..15 have their fifth
    # bit. qs byte j = (j << 4) | (15 - j): element j = 15 - j + 16, element j + 16 = j.
    # x = d * (q - 16): x[j] = 15 - j, x[j + 16] = j - 16.
    # Block 1: d = -0.5 (00 B8); qh = 0x80000001 (01 00 00 80): the fifth bit of elements 0
    # and 31 only; nibbles 0. x = -0.5 * -16 = 8.0, but elements 0 and 31 are -0.5 * 0 = -0.0.
    block0 = b"\x00\x3c" + b"\xff\xff\x00\x00" + bytes((j << 4) | (15 - j) for j in range(16))
    block1 = b"\x00\xb8" + b"\x01\x00\x00\x80" + bytes(16)
    x = dequantize(block0 + block1, Q5_0, (2, 32))
    assert x[0].tolist() == [15.0 - j for j in range(16)] + [j - 16.0 for j in range(16)]
    assert x[1].tolist() == [0.0] + [8.0] * 30 + [0.0]
    assert np.signbit(x[1, 0]) and np.signbit(x[1, 31])


def test_q5_1_block_by_hand():
    # d = 0.25 (00 34), m = -1.0 (00 BC); qh = 0x00010000 (00 00 01 00): only element 16 has
    # its fifth bit; qs byte 0 = 0x0F (element 0 = 15, element 16 = 0 + 16), the rest 0.
    # x = d * q + m: x[0] = 15 * 0.25 - 1 = 2.75, x[16] = 16 * 0.25 - 1 = 3.0, the rest -1.0.
    block = b"\x00\x34\x00\xbc" + b"\x00\x00\x01\x00" + b"\x0f" + bytes(15)
    x = dequantize(block, Q5_1, (32,))
    assert x.tolist() == [2.75] + [-1.0] * 15 + [3.0] + [-1.0] * 15


def test_q2_k_block_by_hand():
    # scales byte s = s | (15 - s) << 4: sc = s, mn = 15 - s for sub-block s (16 elements).
    # Every qs byte is 0xE4 = 0b11_10_01_00: bits 2j..2j+1 hold j, so q = j wherever element
    # e = 128 n + 32 j + l; sub-block s = e // 16 = 8 n + 2 j + l // 16 has j = (s % 8) // 2.
    # d = 1.0 (00 3C), dmin = 1.0: x = sc * q - mn. s = 0: 0 - 15; s = 3: 3 * 1 - 12 = -9;
    # s = 7: 7 * 3 - 8 = 13; s = 10: 10 * 1 - 5 = 5; s = 15: 15 * 3 - 0 = 45.
    block = bytes(s | (15 - s) << 4 for s in range(16)) + b"\xe4" * 64 + b"\x00\x3c\x00\x3c"
    x = dequantize(block, Q2_K, (256,)).reshape(16, 16)
    want = [s * ((s % 8) // 2) - (15 - s) for s in range(16)]
    assert (want[0], want[3], want[7], want[10], want[15]) == (-15, -9, 13, 5, 45)
    assert x.tolist() == [[float(v)] * 16 for v in want]


def test_q3_k_block_by_hand():
    # 6-bit codes c[s], scale c - 32: c = 32 (scale 0) except c[0] = 33 (1), c[9] = 0 (-32),
    # c[15] = 63 (31). Low 4 bits: byte s (s < 8) low nibble, byte s - 8 high nibble: byte 0 =
    # 0x01, byte 7 = 0xF0 (c[15] & 15 = 15), others 0. High 2 bits at bits 2 (s // 4) of byte
    # 8 + s % 4, 2 (0b10) for c = 32 or 33: bytes 8, 10 = 0xAA; byte 9 has 0 at bits 4-5
    # (s = 9): 0x8A; byte 11 has 3 at bits 6-7 (s = 15): 0xEA.
    # q: low 2 bits from qs, third bit from hmask (all set: no -4) except three cleared bits.
    #   Sub-block 0 (n 0, j 0, l 0..15): qs[l] = 3 -> x = 1 * 3; hmask[5] bit 0 cleared ->
    #   x[5] = 1 * (3 - 4) = -1.
    #   Sub-block 9 (n 1, j 0, l 16..31): bits 0-1 of qs[32 + l] = 1 -> x = -32 * 1;
    #   hmask[22] bit 4 cleared -> x[128 + 22] = -32 * (1 - 4) = 96.
    #   Sub-block 15 (n 1, j 3, l 16..31): bits 6-7 of qs[32 + l] = 2 -> x = 31 * 2 = 62;
    #   hmask[31] bit 7 cleared -> x[255] = 31 * (2 - 4) = -62.
    #   Every other element has scale 0 and q = 0: x = 0.
    hmask = bytearray(b"\xff" * 32)
    hmask[5] &= ~1
    hmask[22] &= ~(1 << 4)
    hmask[31] &= ~(1 << 7)
    qs = b"\x03" * 16 + bytes(32) + b"\x81" * 16
    scales = b"\x01" + bytes(6) + b"\xf0" + b"\xaa\x8a\xaa\xea"
    block = bytes(hmask) + qs + scales + b"\x00\x3c"
    assert len(block) == 110
    x = dequantize(block, Q3_K, (256,))
    want = np.zeros(256)
    want[0:16] = 3.0
    want[5] = -1.0
    want[144:160] = -32.0
    want[150] = 96.0
    want[240:256] = 62.0
    want[255] = -62.0
    assert x.tolist() == want.tolist()


def test_q4_k_block_by_hand():
    # d = 1.0 (00 3C), dmin = 0.5 (00 38). Sub-block scales sc = 1, 2, 3, 4, 17, 34, 48, 63 and
    # minimums mn = 0, 1, 2, 63, 20, 0, 33, 5. Bytes 0..3 = sc[s] | (sc[s + 4] >> 4) << 6:
    # 1 | 1 << 6 = 65, 2 | 2 << 6 = 130, 3 | 3 << 6 = 195, 4 | 3 << 6 = 196. Bytes 4..7 =
    # mn[s] | (mn[s + 4] >> 4) << 6: 64, 1, 130, 63. Bytes 8..11 = (sc[s + 4] & 15) |
    # (mn[s + 4] & 15) << 4: 0x41, 0x02, 0x10, 0x5F.
    # Every qs byte is 0x73: sub-blocks 0, 2, 4, 6 take the low nibble (3), the odd ones the
    # high nibble (7). x = (d * sc) * q - dmin * mn:
    #   3 - 0, 2 * 7 - 0.5, 3 * 3 - 1, 4 * 7 - 31.5, 17 * 3 - 10, 34 * 7 - 0, 48 * 3 - 16.5,
    #   63 * 7 - 2.5. But qs[32 + 5] = 0xF0: x[64 + 5] = 3 * 0 - 1 = -1 (sub-block 2, low
    #   nibble) and x[96 + 5] = 4 * 15 - 31.5 = 28.5 (sub-block 3, high nibble).
    scales = bytes([65, 130, 195, 196, 64, 1, 130, 63, 0x41, 0x02, 0x10, 0x5F])
    qs = bytearray(b"\x73" * 128)
    qs[37] = 0xF0
    block = b"\x00\x3c\x00\x38" + scales + bytes(qs)
    x = dequantize(block, Q4_K, (1, 256)).reshape(8, 32)
    want = np.repeat([[3.0], [13.5], [8.0], [-3.5], [41.0], [238.0], [127.5], [438.5]], 32, 1)
    want[2, 5] = -1.0
    want[3, 5] = 28.5
    assert x.tolist() == want.tolist()


def test_q5_k_block_by_hand():
    # d = 0.5 (00 38), dmin = 2.0 (00 40). Scale bytes: 0..3 = 2 (sc = 2 for s < 4), 4..7 = 1
    # (mn = 1), 8..11 = 0x13 (sc = 3, mn = 1 for s >= 4; high bits 0).
    # qh[l] = 1 << (l % 8): element 32 s + l gets 16 when l % 8 == s. Every qs byte is 0x21:
    # even sub-blocks take 1, odd ones 2. x = (0.5 * sc) * q - 2.0 * mn:
    #   s < 4:  1 * (1 or 2) - 2 = -1.0 or 0.0; with the 16: 1 * 17 - 2 = 15, 1 * 18 - 2 = 16.
    #   s >= 4: 1.5 * (1 or 2) - 2 = -0.5 or 1.0; with the 16: 1.5 * 17 - 2 = 23.5,
    #   1.5 * 18 - 2 = 25.
    scales = b"\x02" * 4 + b"\x01" * 4 + b"\x13" * 4
    qh = bytes(1 << (l % 8) for l in range(32))
    block = b"\x00\x38\x00\x40" + scales + qh + b"\x21" * 128
    x = dequantize(block, Q5_K, (256,)).reshape(8, 32)
    for s in range(8):
        plain = {0: -1.0, 1: 0.0, 2: -0.5, 3: 1.0}[(s >= 4) * 2 + s % 2]
        high = {0: 15.0, 1: 16.0, 2: 23.5, 3: 25.0}[(s >= 4) * 2 + s % 2]
        assert x[s].tolist() == [high if l % 8 == s else plain for l in range(32)], s


def test_q6_k_block_by_hand():
    # d = 0.5 (00 38); sc[s] = s - 8 (int8). With ql and qh all 0, q = 0 - 32 everywhere and
    # x = 0.5 * (s - 8) * -32 = 128 - 16 s for sub-block s; sub-block 8 (sc = 0) gives -0.0.
    # Then ql[64 + 32 + 3] = 0x5A and qh[32 + 3] = 0xE4 = 0b11_10_01_00 (n = 1, l = 3):
    #   e = 128 + 3       (k 0): low nibble of ql[64 + 3] = 0, high bits 0: q = -32; s = 8: -0.0.
    #   e = 128 + 32 + 3  (k 1): 0xA | 1 << 4 = 26, q = -6; s = 10, sc = 2: 0.5 * 2 * -6 = -6.
    #   e = 128 + 64 + 3  (k 2): high nibble of ql[64 + 3] = 0 | 2 << 4 = 32, q = 0; s = 12: 0.
    #   e = 128 + 96 + 3  (k 3): 5 | 3 << 4 = 53, q = 21; s = 14, sc = 6: 0.5 * 6 * 21 = 63.
    ql = bytearray(128)
    ql[99] = 0x5A
    qh = bytearray(64)
    qh[35] = 0xE4
    sc = bytes((s - 8) & 0xFF for s in range(16))
    block = bytes(ql) + bytes(qh) + sc + b"\x00\x38"
    x = dequantize(block, Q6_K, (256,))
    want = np.repeat([128.0 - 16 * s for s in range(16)], 16)
    want[[131, 163, 195, 227]] = [0.0, -6.0, 0.0, 63.0]
    assert x.tolist() == want.tolist()
    assert np.signbit(x[128:144]).all() and np.signbit(x[131])


def test_f16_by_hand():
    # 0x3C00 = 1.0, 0xC000 = -2.0, 0x7C00 = +inf, 0x8000 = -0.0, 0x0001 = 2^-24 (smallest
    # subnormal), 0x7BFF = 65504 (largest finite), 0x7E00 = a quiet NaN.
    raw = struct.pack("<7H", 0x3C00, 0xC000, 0x7C00, 0x8000, 0x0001, 0x7BFF, 0x7E00)
    x = dequantize(raw, F16, (7,))
    assert x[:6].tolist() == [1.0, -2.0, float("inf"), 0.0, 2.0**-24, 65504.0]
    assert np.signbit(x[3]) and np.isnan(x[6])


def test_bf16_by_hand():
    # BF16 is the top half of an f32: 0x3F80 -> 0x3F800000 = 1.0, 0xC000 -> -2.0,
    # 0x7F80 -> +inf, 0xFF80 -> -inf, 0x8000 -> -0.0, 0x3E20 -> 0x3E200000 = 0.15625,
    # 0x7FC1 -> the NaN 0x7FC10000 (payload kept).
    raw = struct.pack("<7H", 0x3F80, 0xC000, 0x7F80, 0xFF80, 0x8000, 0x3E20, 0x7FC1)
    x = dequantize(raw, BF16, (7,))
    assert x[:6].tolist() == [1.0, -2.0, float("inf"), float("-inf"), 0.0, 0.15625]
    assert np.signbit(x[4])
    assert bits(x).tolist() == [
        0x3F800000, 0xC0000000, 0x7F800000, 0xFF800000, 0x80000000, 0x3E200000, 0x7FC10000]


def test_f32_is_a_view_of_the_bytes():
    values = np.array([[1.5, -0.0], [3.25, 1e-40]], dtype="<f4")
    raw = values.view(np.uint8).reshape(-1)
    x = dequantize(raw, F32, (2, 2))
    assert np.shares_memory(x, raw) and x.dtype == np.float32
    assert_bit_equal(x, values)
    assert not dequantize(values.tobytes(), F32, (2, 2)).flags.writeable  # bytes: read-only


def test_raw_of_any_shape_and_buffer_type():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    raw = gguf_quantize(x, Q8_0)  # u8[6, 68]
    want = dequantize(raw, Q8_0, (6, 64))
    for other in (raw.reshape(-1), raw.reshape(3, 136), raw.tobytes(), memoryview(raw.tobytes()),
                  bytearray(raw.tobytes())):
        assert_bit_equal(dequantize(other, Q8_0, (2, 3, 64)), want.reshape(2, 3, 64))


def test_empty_tensor():
    assert dequantize(b"", Q4_1, (0, 64)).shape == (0, 64)
    assert dequantize(b"", F16, (3, 0)).shape == (3, 0)


# --- errors --------------------------------------------------------------------------------------


SUPPORTED_LIST = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"


def test_unsupported_type_is_named():
    with pytest.raises(CheckpointError) as e:
        dequantize(b"\x00" * 66, 16, (256,))
    assert str(e.value) == f"IQ2_XXS (type 16) is not supported; supported: {SUPPORTED_LIST}"
    with pytest.raises(CheckpointError, match=r"^type 99 \(not a ggml type\) is not supported"):
        dequantize(b"", 99, (0,))
    with pytest.raises(CheckpointError, match=r"^MXFP4 \(type 39\) is not supported"):
        row_nbytes(39, 256)
    with pytest.raises(CheckpointError, match=r"^Q8_K \(type 15\) is not supported"):
        block_layout(15)


UNSUPPORTED = sorted({t.value for t in GT} - set(ALL_TYPES)) + [4, 5, 99, 1000]


@pytest.mark.parametrize("type_id", UNSUPPORTED)
def test_every_other_type_is_one_line_naming_it(type_id):
    assert type_id not in SUPPORTED
    name = GT(type_id).name if type_id in GT._value2member_map_ else None
    for call in (lambda: dequantize(bytes(1024), type_id, (4, 256)),
                 lambda: row_nbytes(type_id, 256), lambda: block_layout(type_id)):
        with pytest.raises(CheckpointError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message
        assert message.endswith(f"is not supported; supported: {SUPPORTED_LIST}")
        if name is None:
            assert message.startswith(f"type {type_id} (not a ggml type) ")
        else:
            assert message.startswith(f"{name} (type {type_id}) ")


@pytest.mark.parametrize("delta", [-1, 1, -18])
def test_wrong_byte_count(delta):
    raw = bytes(2 * 36 + delta)
    with pytest.raises(CheckpointError) as e:
        dequantize(raw, Q4_0, (2, 64))
    assert str(e.value) == f"Q4_0 tensor of shape (2, 64) takes 72 bytes, got {72 + delta}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=type_name)
@pytest.mark.parametrize("delta", [-1, 1, "one block less"])
def test_wrong_byte_count_every_block_type(type_id, delta):
    elements, nbytes = block_layout(type_id)
    shape = (3, 2 * elements)
    want = 3 * 2 * nbytes
    got = want - nbytes if delta == "one block less" else want + delta
    with pytest.raises(CheckpointError) as e:
        dequantize(bytes(got), type_id, shape)
    assert str(e.value) == (
        f"{type_name(type_id)} tensor of shape {shape} takes {want} bytes, got {got}")


@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=type_name)
def test_inner_dim_not_a_multiple_of_the_block(type_id):
    name = type_name(type_id)
    block, _ = block_layout(type_id)
    cols = block + block // 2  # 48 for the 32-element types, 384 for the K-quants
    with pytest.raises(CheckpointError) as e:
        dequantize(bytes(1000), type_id, (4, cols))
    assert str(e.value) == (
        f"{name} rows of {cols} elements: not a multiple of the block size {block}")
    with pytest.raises(CheckpointError, match=f"not a multiple of the block size {block}$"):
        row_nbytes(type_id, block + 1)


@pytest.mark.parametrize("type_id", K_TYPES, ids=type_name)
def test_k_quant_row_of_576_is_refused(type_id):
    # 576 (SmolLM2-135M's dim) is a multiple of 32 but not of 256: llama.cpp falls back to
    # another type for such rows, and jllama must not read them as K-quants.
    with pytest.raises(CheckpointError) as e:
        dequantize(bytes(576 // 256 * 1000), type_id, (576, 576))
    assert str(e.value) == (
        f"{type_name(type_id)} rows of 576 elements: not a multiple of the block size 256")


def test_bad_shapes():
    with pytest.raises(CheckpointError, match=r"^F32 tensor of shape \(\): not a valid shape"):
        dequantize(b"\x00" * 4, F32, ())
    with pytest.raises(CheckpointError, match="not a valid shape"):
        dequantize(b"", F32, (-1, 4))
    with pytest.raises(CheckpointError, match="negative length"):
        row_nbytes(F16, -2)


# --- through the GGUF reader ---------------------------------------------------------------------

# K-quant rows are whole super-blocks of 256: dim and hidden_dim multiples of 256.
K_CONFIG = ModelConfig(
    dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, seq_len=32,
    shared_weights=False,
)


def test_gguf_file_of_every_block_type_reads_like_gguf(tmp_path):
    """A GGUF written by the `gguf` package's writer whose matrices are Q5_0/Q5_1 (quantized by
    gguf.quants) and Q2_K..Q6_K (random blocks, finite scales): `read_gguf` gives each tensor
    exactly as gguf.quants.dequantize decodes its bytes."""
    from gguf_files import write_gguf

    from jllama.formats.gguf import read_gguf
    from jllama.model.weights import expected_shapes, random_weights

    config = K_CONFIG
    weights = random_weights(config, seed=4, scale=0.1)
    shapes = expected_shapes(config)
    layer_tensors = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                     "ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}
    tensors = [("token_embd.weight", "token_embedding_table", None),
               ("output.weight", "wcls", None)]
    tensors += [(f"blk.{i}.{short}.weight", field, i)
                for i in range(config.n_layers) for short, field in layer_tensors.items()]
    cycle = [Q6_K, Q4_K, Q5_0, Q2_K, Q3_K, Q5_K, Q5_1, Q8_0]
    rng = np.random.default_rng(7)
    raw_tensors, wanted = {}, {}
    for k, (name, field, layer) in enumerate(tensors):
        type_id = cycle[k % len(cycle)]
        shape = shapes[field] if layer is None else shapes[field][1:]
        if type_id in QUANTIZABLE:
            original = getattr(weights, field)
            raw = gguf_quantize(original if layer is None else original[layer], type_id)
        else:
            raw = random_blocks(rng, type_id, shape)
        raw_tensors[name] = (raw, GT(type_id))
        wanted[name] = (field, layer, type_id, gguf_dequantize(raw, type_id, shape))
    assert {t for _, _, t, _ in wanted.values()} == set(cycle)
    path = write_gguf(tmp_path / "k.gguf", config, weights, drop_tensors=tuple(raw_tensors),
                      raw_tensors=raw_tensors)

    model = read_gguf(path)
    assert model.config.dim == 256 and model.config.hidden_dim == 512
    for name, (field, layer, type_id, want) in wanted.items():
        assert model.tensor_types[name] == type_name(type_id), name
        got = getattr(model.weights, field)
        got = got if layer is None else got[layer]
        assert np.isfinite(want).all(), name
        assert_bit_equal(np.ascontiguousarray(got), want)
    for field in ("rms_att_weight", "rms_ffn_weight", "rms_final_weight"):  # stored as F32
        assert np.array_equal(getattr(model.weights, field), getattr(weights, field))
