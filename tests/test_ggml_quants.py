"""GGML tensor types: dequantize against the `gguf` package bit for bit, hand-made blocks whose
values are worked out in the comments, and one-line errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jllama.errors import CheckpointError
from jllama.formats import ggml_quants as gq
from jllama.formats.ggml_quants import (
    BF16,
    F16,
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
    SUPPORTED,
    dequantize,
    row_nbytes,
    type_name,
)

GT = gguf.GGMLQuantizationType
ALL_TYPES = [F32, F16, BF16, Q8_0, Q4_0, Q4_1]
BLOCK_TYPES = [Q8_0, Q4_0, Q4_1]


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


# --- constants against the gguf package ---------------------------------------------------------


def test_type_ids_and_block_sizes_match_gguf():
    assert (F32, F16, Q4_0, Q4_1, Q8_0, BF16) == (
        GT.F32, GT.F16, GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.BF16)
    assert SUPPORTED == frozenset(ALL_TYPES)
    for t in SUPPORTED:
        assert gq.BLOCK_SIZES[t] == gguf.GGML_QUANT_SIZES[GT(t)]


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


# --- against the gguf package --------------------------------------------------------------------

SHAPES = [(32,), (1, 64), (1, 576), (17, 96), (2, 3, 64), (4, 1, 5, 32)]


@pytest.mark.parametrize("type_id", ALL_TYPES, ids=type_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantized_random_data_dequantizes_like_gguf(type_id, shape):
    rng = np.random.default_rng(sum(shape) * 100 + type_id)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    x.flat[0] = -0.0  # a negative zero must stay negative through F32/F16/BF16
    raw = gguf_quantize(x, type_id)
    assert raw.nbytes == int(np.prod(shape[:-1])) * row_nbytes(type_id, shape[-1])
    assert_bit_equal(dequantize(raw, type_id, shape), gguf_dequantize(raw, type_id, shape))


@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=type_name)
def test_random_bytes_dequantize_like_gguf(type_id):
    # Arbitrary bytes, so scales include f16 NaN, inf, subnormals and -0.0.
    rng = np.random.default_rng(type_id)
    shape = (64, 256)
    raw = rng.integers(0, 256, size=(64, row_nbytes(type_id, 256)), dtype=np.uint8)
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
    type_id=st.sampled_from(ALL_TYPES),
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


def test_unsupported_type_is_named():
    with pytest.raises(CheckpointError) as e:
        dequantize(b"\x00" * 210, 14, (256,))
    assert str(e.value) == (
        "Q6_K (type 14) is not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1")
    with pytest.raises(CheckpointError, match=r"^type 99 \(not a ggml type\) is not supported"):
        dequantize(b"", 99, (0,))
    with pytest.raises(CheckpointError, match=r"^Q4_K \(type 12\) is not supported"):
        row_nbytes(12, 256)


@pytest.mark.parametrize("delta", [-1, 1, -18])
def test_wrong_byte_count(delta):
    raw = bytes(2 * 36 + delta)
    with pytest.raises(CheckpointError) as e:
        dequantize(raw, Q4_0, (2, 64))
    assert str(e.value) == f"Q4_0 tensor of shape (2, 64) takes 72 bytes, got {72 + delta}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=type_name)
def test_inner_dim_not_a_multiple_of_the_block(type_id):
    name = type_name(type_id)
    with pytest.raises(CheckpointError) as e:
        dequantize(bytes(1000), type_id, (4, 48))
    assert str(e.value) == f"{name} rows of 48 elements: not a multiple of the block size 32"
    with pytest.raises(CheckpointError, match="not a multiple of the block size 32"):
        row_nbytes(type_id, 33)


def test_bad_shapes():
    with pytest.raises(CheckpointError, match=r"^F32 tensor of shape \(\): not a valid shape"):
        dequantize(b"\x00" * 4, F32, ())
    with pytest.raises(CheckpointError, match="not a valid shape"):
        dequantize(b"", F32, (-1, 4))
    with pytest.raises(CheckpointError, match="negative length"):
        row_nbytes(F16, -2)
