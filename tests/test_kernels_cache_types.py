"""jllama's attention kernels over KV caches of each type (`jllama.model.cache_types`: f32, f16, bf16,
q8_0; keys and values each their own): the rows `rope_write` stores against NumPy's rounding
(float16, ml_dtypes.bfloat16) and llama.cpp's CPU q8_0 quantizer written here in NumPy (and
gguf-py's reference quantizer, which rounds ties the other way), decode attention, the prefill
chunk's and the batched decode's against float64 attention over the widened cache, on the
native, x86-64-v3 and x86-64 builds; the bits independent of the thread count and of the
batch; bad shapes refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jllama import kernels
from jllama.kernels import batched

kernels.load()

PAIRS = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "f16"),
         ("bf16", "q8_0")]
"""(key type, value type): the four alone and two mixed (llama.cpp's -ctk / -ctv)."""
FLOAT_PAIRS = [("f32", "f32"), ("f16", "bf16"), ("bf16", "f32")]
"""Pairs for shapes q8_0 cannot hold (head_dim not a multiple of 32)."""

_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


# ----------------------------------------------------------------------------------------------
# The cache types in NumPy, written from their definitions (ggml-common.h's block_q8_0;
# llama.cpp's CPU `quantize_row_q8_0`, ggml-cpu/arch/x86/quants.c).

def quantize_q8_0(x) -> np.ndarray:
    """x: f32[..., head_dim] as llama.cpp's CPU backend writes q8_0 cache rows: per 32 values
    amax = max|x|, d = float16(amax / 127), q = rint(x * (127 / amax)) (half to even; float32
    arithmetic); bytes [..., head_dim / 32 * 34]: d's two bytes, then the 32 q."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(-1, x.shape[-1] // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8)
    out = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def dequantize_q8_0(b) -> np.ndarray:
    """q8_0 bytes [..., n * 34] as float64 [..., n * 32]: d * q."""
    b = np.ascontiguousarray(b, np.uint8)
    blocks = b.reshape(-1, b.shape[-1] // 34, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float64)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
    return (d * q).reshape(*b.shape[:-1], b.shape[-1] // 34 * 32)


def to_cache(x, kind: str) -> np.ndarray:
    """f32 rows as a cache block of `kind` holds them."""
    return quantize_q8_0(x) if kind == "q8_0" else np.asarray(x, np.float32).astype(_DTYPES[kind])


def widen(block, kind: str) -> np.ndarray:
    """A cache block's values as float64."""
    return dequantize_q8_0(block) if kind == "q8_0" else np.asarray(block).astype(np.float64)


def poison(block, kind: str, where) -> None:
    """Rows `where` (an index of axis 1) made NaN when read: float NaNs, or q8_0 bytes 0xFF
    (d = a float16 NaN)."""
    block[:, where] = 0xFF if kind == "q8_0" else np.nan


def attention64(qg, keys, values) -> np.ndarray:
    """float64 softmax attention of q[g, m, :] over keys[g, t, :] / values[g, t, :]."""
    q = np.asarray(qg, np.float64)
    scores = np.einsum("gmd,gtd->gmt", q, keys) / np.sqrt(q.shape[-1])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("gmt,gtd->gmd", w, values)


def rope64(heads, pos, inv_freq) -> np.ndarray:
    """run.c's RoPE in float64 on the float32 angle pos * inv_freq."""
    angle = (np.float32(pos) * np.asarray(inv_freq, np.float32)).astype(np.float64)
    h = np.asarray(heads, np.float64)
    out = np.empty_like(h)
    out[..., 0::2] = h[..., 0::2] * np.cos(angle) - h[..., 1::2] * np.sin(angle)
    out[..., 1::2] = h[..., 0::2] * np.sin(angle) + h[..., 1::2] * np.cos(angle)
    return out


def step(values64, kind: str, rows) -> np.ndarray:
    """One unit in the last place of each value as `kind` stores it in `rows` (q8_0: its
    block's d), for comparing rows rounded from slightly different float32 inputs."""
    if kind == "q8_0":
        b = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1] // 34, 34)
        d = np.repeat(b[..., :2].copy().view(np.float16).astype(np.float64), 32, axis=-1)
        return d.reshape(values64.shape)
    return np.abs(values64) * 2.0 ** -{"f32": 23, "f16": 10, "bf16": 7}[kind]


# ----------------------------------------------------------------------------------------------
# Decode attention.

def decode_case(rng, kt, vt, n_kv, kv_mul, head_dim, block, n_blocks, pos, cur):
    """Random queries and cache blocks of the types, the float64 expectation over the widened
    cache, then every position after pos (and the slot of block `cur`, given apart) poisoned:
    (args for `kernels.attention`, expected)."""
    qg = rng.standard_normal((n_kv, kv_mul, head_dim), dtype=np.float32) * 1.5
    keys = [to_cache(rng.standard_normal((n_kv, block, head_dim), dtype=np.float32), kt)
            for _ in range(n_blocks)]
    values = [to_cache(rng.standard_normal((n_kv, block, head_dim), dtype=np.float32), vt)
              for _ in range(n_blocks)]
    k64 = np.concatenate([widen(k, kt) for k in keys], axis=1)[:, :pos + 1]
    v64 = np.concatenate([widen(v, vt) for v in values], axis=1)[:, :pos + 1]
    expected = attention64(qg, k64, v64)
    for b in range(n_blocks):
        first = max(0, pos + 1 - b * block)
        poison(keys[b], kt, slice(first, None))
        poison(values[b], vt, slice(first, None))
    if cur is None:
        return (qg, keys, values, pos, -1, keys[0], values[0]), expected
    key_cur, value_cur = keys[cur].copy(), values[cur].copy()
    poison(keys[cur], kt, slice(None))
    poison(values[cur], vt, slice(None))
    return (qg, keys, values, pos, cur, key_cur, value_cur), expected


def call_attention(args, target=kernels.ATTENTION) -> np.ndarray:
    qg, keys, values, pos, cur, key_cur, value_cur = args
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qg.shape, jnp.float32))(
        jnp.asarray(qg), jnp.int32(pos), jnp.int32(cur), jnp.asarray(key_cur),
        jnp.asarray(value_cur), *map(jnp.asarray, keys), *map(jnp.asarray, values))
    return np.asarray(out)


DECODE_SHAPES = [
    (8, 4, 64, 256, 5, 1000, 3),     # Llama 3.2-1B's heads: four spans, block 3 given apart
    (3, 3, 64, 256, 17, 4100, 16),   # SmolLM2's past 4096: 17 spans, the last one 5 positions
    (2, 8, 128, 256, 2, 300, None),  # kv_mul 8, head_dim 128 (the graph mode's form)
    (4, 1, 32, 64, 3, 150, 1),       # kv_mul 1, head_dim 32, blocks of 64
    (1, 3, 96, 100, 6, 599, None),   # blocks of 100: tiles of 16 cross blocks, spans too
]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"pos{s[5]}-kv{s[0]}x{s[1]}-d{s[2]}")
@pytest.mark.parametrize("kt,vt", PAIRS, ids=lambda p: str(p))
def test_decode_attention_equals_float64_over_the_widened_cache(kt, vt, shape):
    args, expected = decode_case(np.random.default_rng(shape[5]), kt, vt, *shape)
    np.testing.assert_allclose(call_attention(args), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [
    (2, 3, 48, 16, 4, 50, 2),        # head_dim 48: one register and a half
    (2, 1, 17, 5, 3, 9, None),       # odd sizes everywhere
    (1, 4, 20, 7, 40, 270, 38),      # 40 blocks of 7 positions, two spans
])
@pytest.mark.parametrize("kt,vt", FLOAT_PAIRS)
def test_decode_attention_takes_any_head_dim_in_float_types(kt, vt, shape):
    args, expected = decode_case(np.random.default_rng(sum(shape[:5])), kt, vt, *shape)
    np.testing.assert_allclose(call_attention(args), expected, atol=2e-5, rtol=1e-5)


def test_decode_attention_by_hand_in_each_type():
    """Two positions, values exact in every type (small integers; q8_0: 32 per block, step 1
    when the row's largest value is 127): scores q.k / 8 = (1, 0), out = (e v0 + v1) / (e + 1)."""
    hd = 64
    q = np.zeros((1, 1, hd), np.float32)
    q[0, 0, 0] = 8.0
    k = np.zeros((1, 2, hd), np.float32)
    k[0, 0, 0] = 1.0
    k[0, 1, 1] = 1.0
    k[0, :, 31] = k[0, :, 63] = 127.0  # where q is 0; q8_0's step 1
    v = np.zeros((1, 2, hd), np.float32)
    v[0, 0, :4], v[0, 1, :4] = [1, 2, 3, 4], [5, 6, 7, 8]
    v[0, :, 31] = v[0, :, 63] = 127.0  # each 32-block's largest: step 1 exactly in q8_0
    e = np.e
    want = (e * v[0, 0] + v[0, 1]) / (e + 1)
    for kt, vt in PAIRS:
        keys, values = to_cache(k, kt), to_cache(v, vt)
        got = call_attention((q, [keys], [values], 1, -1, keys, values))[0, 0]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{kt}/{vt}")


# ----------------------------------------------------------------------------------------------
# RoPE and the cache write.

_rope_write = jax.jit(kernels.rope_write, donate_argnums=(3, 4))


@pytest.mark.parametrize("pos", [0, 300])
@pytest.mark.parametrize("kt,vt", PAIRS)
def test_rope_write_rounds_each_row_to_its_cache_type(kt, vt, pos):
    """The value row is the type's rounding of the value exactly (NumPy's float16 / bfloat16
    round to nearest even, q8_0 as `quantize_q8_0`); at pos 0 (no rotation) the key row too;
    elsewhere the key is the rounding of the float32 rotation, within one step of the type of
    NumPy's float64 one. Every other slot keeps its bits."""
    n_heads, n_kv, hd, block = 9, 3, 64, 256
    rng = np.random.default_rng(pos + len(kt + vt))
    qkv = (rng.standard_normal((n_heads + 2 * n_kv) * hd) * 3).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    keys = to_cache(rng.standard_normal((n_kv, block, hd), dtype=np.float32), kt)
    values = to_cache(rng.standard_normal((n_kv, block, hd), dtype=np.float32), vt)
    q, k2, v2 = _rope_write(jnp.asarray(qkv), jnp.int32(pos), jnp.asarray(inv_freq),
                            jnp.asarray(keys), jnp.asarray(values))
    q, k2, v2 = np.asarray(q), np.asarray(k2), np.asarray(v2)
    assert k2.dtype == keys.dtype and v2.dtype == values.dtype
    at = pos % block
    split = n_heads * hd, (n_heads + n_kv) * hd
    key_in = qkv[split[0]:split[1]].reshape(n_kv, hd)
    value_in = qkv[split[1]:].reshape(n_kv, hd)
    want_q = rope64(qkv[:split[0]].reshape(n_heads, hd), pos, inv_freq)
    assert np.all(np.abs(q - want_q) <= 2e-6 * (1 + np.abs(want_q)))
    np.testing.assert_array_equal(v2[:, at].view(np.uint8), to_cache(value_in, vt).view(np.uint8))
    if pos == 0:
        np.testing.assert_array_equal(k2[:, at].view(np.uint8), to_cache(key_in, kt).view(np.uint8))
    want_k = widen(to_cache(rope64(key_in, pos, inv_freq).astype(np.float32), kt), kt)
    got_k = widen(k2[:, at], kt)
    # A step of the type, float32's rounding of the rotation, and for q8_0 a step of float16
    # in d (the row's largest value may round the other way too).
    bound = 1.01 * step(want_k, kt, k2[:, at]) + 2e-6 * (1 + np.abs(want_k))
    if kt == "q8_0":
        bound += 2.0 ** -10 * np.abs(want_k)
    assert np.all(np.abs(got_k - want_k) <= bound)
    others = np.arange(block) != at
    np.testing.assert_array_equal(k2[:, others].view(np.uint8), keys[:, others].view(np.uint8))
    np.testing.assert_array_equal(v2[:, others].view(np.uint8), values[:, others].view(np.uint8))


def _written_values(rows: np.ndarray, kind: str) -> np.ndarray:
    """rows f32[n, head_dim] written by `rope_write` as the values of n key heads at pos 0:
    the block's slot 0, as stored."""
    n, hd = rows.shape
    qkv = np.concatenate([np.zeros(2 * hd * n, np.float32), rows.reshape(-1)])  # n heads
    empty = to_cache(np.zeros((n, 16, hd), np.float32), kind)
    _, _, v = _rope_write(jnp.asarray(qkv), jnp.int32(0), jnp.ones(hd // 2, jnp.float32),
                          jnp.asarray(empty), jnp.asarray(empty))
    return np.asarray(v)[:, 0]


def test_q8_0_rows_are_llama_cpps_cpu_quantizer_and_gguf_py_differs_only_at_ties():
    """q8_0 rows of many scales against `quantize_q8_0` bit for bit; against gguf-py's
    `quantize` (ggml's reference quantizer: q = roundf(x * (1 / d)), half away from zero) the
    steps are the same bytes and the q differ by at most 1, only where x / d lies within a hair
    of a half; gguf-py's `dequantize` reads our bytes as d * q. By hand: a block whose
    largest value is 127 has d = 1 and q = x for integers; 2.5 and -2.5 and 0.5 are ties:
    llama.cpp's CPU quantizer (and jllama) 2, -2, 0; gguf-py 3, -3, 1."""
    rng = np.random.default_rng(7)
    scales = np.float32(10.0) ** rng.uniform(-4, 3, (64, 1)).astype(np.float32)
    rows = (rng.standard_normal((64, 128)) * scales).astype(np.float32)
    rows[3, :32] = 0.0  # an all-zero block: d = 0, q = 0
    ours = _written_values(rows, "q8_0")
    np.testing.assert_array_equal(ours, quantize_q8_0(rows))
    ref = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    assert ref.shape == ours.shape
    ob, rb = ours.reshape(64, 4, 34), ref.reshape(64, 4, 34)
    np.testing.assert_array_equal(ob[..., :2], rb[..., :2])
    dq = ob[..., 2:].view(np.int8).astype(int) - rb[..., 2:].view(np.int8).astype(int)
    blocks = rows.reshape(64, 4, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(amax != 0, blocks * (np.float32(127) / amax), 0)  # x / d
    near_half = np.abs(np.abs(scaled) % 1 - 0.5) < 1e-4
    assert np.all(np.abs(dq) <= 1) and np.all(near_half[dq != 0])
    np.testing.assert_array_equal(
        gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q8_0), dequantize_q8_0(ours))
    tie = np.zeros((1, 32), np.float32)
    tie[0, :5] = [127, 2.5, -2.5, 0.5, 1.5]
    by_hand = _written_values(tie, "q8_0")[0]
    assert by_hand[:2].view(np.float16)[0] == 1.0
    assert list(by_hand[2:7].view(np.int8)) == [127, 2, -2, 0, 2]
    theirs = gguf.quants.quantize(tie, gguf.GGMLQuantizationType.Q8_0)[0]
    assert list(theirs[2:7].view(np.int8)) == [127, 3, -3, 1, 2]


def test_float16_and_bfloat16_rows_round_to_nearest_even_by_hand():
    """Ties go to the even neighbour: float16 1 + 2^-11 -> 1, 1 + 3 * 2^-11 -> 1 + 2^-9;
    bfloat16 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6; 70000 overflows float16 to inf; a NaN
    stays NaN. q8_0: a NaN in a block makes its step NaN, so the block reads as NaNs."""
    row = np.zeros((1, 32), np.float32)
    row[0, :6] = [1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 70000, np.nan]
    f16 = _written_values(row, "f16")[0].astype(np.float64)
    assert list(f16[:5]) == [1.0, 1 + 2 ** -9, 1 + 2 ** -8, 1 + 3 * 2 ** -8, np.inf]
    assert np.isnan(f16[5])
    bf16 = _written_values(row, "bf16")[0].astype(np.float64)
    assert list(bf16[2:4]) == [1.0, 1 + 2 ** -6] and np.isnan(bf16[5])
    q8 = np.concatenate([row, np.full((1, 32), 127, np.float32)], axis=1)  # d = 1
    read = dequantize_q8_0(_written_values(q8, "q8_0"))[0]
    assert np.all(np.isnan(read[:32])) and np.all(read[32:] == 127.0)


# ----------------------------------------------------------------------------------------------
# The prefill chunk's attention.

def chunk_case(rng, kt, vt, n_kv, kv_mul, head_dim, block, n_blocks, t, pos):
    """Queries of t tokens at pos .. pos + t - 1 and cache blocks of the types; positions after
    the chunk poisoned; expected: each token's float64 attention over the widened cache."""
    n_heads = n_kv * kv_mul
    q = rng.standard_normal((t, n_heads, head_dim), dtype=np.float32) * 2
    keys = [to_cache(rng.standard_normal((n_kv, block, head_dim), dtype=np.float32), kt)
            for _ in range(n_blocks)]
    values = [to_cache(rng.standard_normal((n_kv, block, head_dim), dtype=np.float32), vt)
              for _ in range(n_blocks)]
    k64 = np.concatenate([widen(k, kt) for k in keys], axis=1)
    v64 = np.concatenate([widen(v, vt) for v in values], axis=1)
    expected = np.stack([
        attention64(q[i].reshape(n_kv, kv_mul, head_dim), k64[:, :pos + i + 1],
                    v64[:, :pos + i + 1]).reshape(n_heads * head_dim) for i in range(t)])
    for b in range(n_blocks):
        first = max(0, pos + t - b * block)
        poison(keys[b], kt, slice(first, None))
        poison(values[b], vt, slice(first, None))
    return (q, keys, values, pos), expected


def call_chunk(args, target=kernels.ATTENTION_CHUNK) -> np.ndarray:
    q, keys, values, pos = args
    t, n_heads, hd = q.shape
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, n_heads * hd), jnp.float32))(
        jnp.asarray(q), jnp.int32(pos), *map(jnp.asarray, keys), *map(jnp.asarray, values))
    return np.asarray(out)


CHUNK_SHAPES = [
    (3, 3, 64, 256, 2, 40, 250),    # SmolLM2's heads; the chunk crosses into the second block
    (2, 4, 128, 64, 3, 70, 100),    # head_dim 128
    (2, 2, 32, 32, 4, 17, 0),       # from position 0, a partial tile
]


@pytest.mark.parametrize("shape", CHUNK_SHAPES, ids=lambda s: f"t{s[5]}-pos{s[6]}-d{s[2]}")
@pytest.mark.parametrize("kt,vt", PAIRS)
def test_chunk_attention_equals_float64_over_the_widened_cache(kt, vt, shape):
    args, expected = chunk_case(np.random.default_rng(shape[6] + 1), kt, vt, *shape)
    np.testing.assert_allclose(call_chunk(args), expected, atol=2e-5, rtol=1e-5)


def test_chunk_attention_in_float16_with_head_dim_48():
    args, expected = chunk_case(np.random.default_rng(9), "f16", "bf16", 1, 3, 48, 32, 2, 3, 60)
    np.testing.assert_allclose(call_chunk(args), expected, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# The batched decode.

def test_the_batch_gives_each_sequence_its_bits_alone_in_every_cache_type():
    """Three sequences at positions 1000, 7 and 300 (and a padding row) through
    `rope_attend_batch`, each pair of types: every live row has the bits of `rope_write` then
    `attention` of that sequence alone, the written blocks too, and is float64 attention over
    its widened cache within float32 rounding; the padding row is zeros."""
    n_kv, kv_mul, hd, block, k_blocks = 3, 3, 64, 256, 4
    n_heads = n_kv * kv_mul
    positions = [1000, 7, 300, 0]
    count = 3
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    step_batch = jax.jit(batched.rope_attend_batch, donate_argnums=(4, 5))
    for kt, vt in PAIRS:
        rng = np.random.default_rng(len(kt) * 7 + len(vt))
        qkv = rng.standard_normal((4, (n_heads + 2 * n_kv) * hd), dtype=np.float32)
        keys = [[to_cache(rng.standard_normal((n_kv, block, hd), dtype=np.float32), kt)
                 for _ in range(k_blocks)] for _ in range(4)]
        values = [[to_cache(rng.standard_normal((n_kv, block, hd), dtype=np.float32), vt)
                   for _ in range(k_blocks)] for _ in range(4)]
        cur = [p // block for p in positions]
        att, kc, vc = step_batch(
            jnp.asarray(qkv), jnp.asarray(positions, jnp.int32), jnp.int32(count),
            jnp.asarray(inv_freq), tuple(jnp.asarray(keys[b][cur[b]]) for b in range(4)),
            tuple(jnp.asarray(values[b][cur[b]]) for b in range(4)),
            tuple(jnp.asarray(k) for seq in keys for k in seq),
            tuple(jnp.asarray(v) for seq in values for v in seq))
        att = np.asarray(att)
        np.testing.assert_array_equal(att[count:], 0)
        for b in range(count):
            q, k1, v1 = _rope_write(jnp.asarray(qkv[b]), jnp.int32(positions[b]),
                                    jnp.asarray(inv_freq), jnp.asarray(keys[b][cur[b]]),
                                    jnp.asarray(values[b][cur[b]]))
            alone = np.asarray(kernels.attention(
                q.reshape(n_kv, kv_mul, hd), tuple(map(jnp.asarray, keys[b])),
                tuple(map(jnp.asarray, values[b])), jnp.int32(positions[b]),
                jnp.int32(cur[b]), k1, v1))
            where = f"{kt}/{vt} sequence {b}"
            assert np.array_equal(att[b], alone.reshape(-1)), where
            assert np.array_equal(np.asarray(kc[b]).view(np.uint8), np.asarray(k1).view(np.uint8))
            assert np.array_equal(np.asarray(vc[b]).view(np.uint8), np.asarray(v1).view(np.uint8))
            blocks_k = [np.asarray(k1) if i == cur[b] else keys[b][i] for i in range(k_blocks)]
            blocks_v = [np.asarray(v1) if i == cur[b] else values[b][i] for i in range(k_blocks)]
            p = positions[b]
            expected = attention64(
                np.asarray(q).reshape(n_kv, kv_mul, hd),
                np.concatenate([widen(k, kt) for k in blocks_k], axis=1)[:, :p + 1],
                np.concatenate([widen(v, vt) for v in blocks_v], axis=1)[:, :p + 1])
            np.testing.assert_allclose(att[b], expected.reshape(-1), atol=2e-5, rtol=1e-5,
                                       err_msg=where)


# ----------------------------------------------------------------------------------------------
# Bits that do not depend on the thread count.

def thread_cases() -> list[np.ndarray]:
    """The outputs of a few decode and chunk cases whose work is split over threads (spans of
    long contexts, GQA, mixed types); the same seeds give the same inputs in any process."""
    outs = []
    for seed, (kt, vt), shape in [
        (1, ("q8_0", "f16"), (3, 3, 64, 256, 17, 4100, 16)),
        (2, ("f16", "f16"), (8, 4, 64, 256, 8, 2000, None)),
        (3, ("bf16", "q8_0"), (2, 8, 128, 256, 4, 1000, 2)),
        (4, ("f32", "f32"), (3, 3, 64, 256, 8, 1999, 7)),
    ]:
        args, _ = decode_case(np.random.default_rng(seed), kt, vt, *shape)
        outs.append(call_attention(args))
    args, _ = chunk_case(np.random.default_rng(5), "q8_0", "bf16", 4, 4, 64, 256, 4, 256, 512)
    outs.append(call_chunk(args))
    return outs


def test_the_bits_do_not_depend_on_the_thread_count(tmp_path):
    """The cases of `thread_cases` in this process (XLA's pool has a thread per core) and in
    one pinned to a single core (a pool of one: every unit on the calling thread) give the same
    bits; and the same bits on every call here."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no second thread count to compare with")
    here = thread_cases()
    assert all(np.array_equal(a, b) for a, b in zip(here, thread_cases(), strict=True))
    out = tmp_path / "one_thread.npz"
    script = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import numpy as np\n"
        "import test_kernels_cache_types as t\n"
        f"np.savez({str(out)!r}, *t.thread_cases())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    alone = np.load(out)
    for i, a in enumerate(here):
        assert np.array_equal(alone[f"arr_{i}"], a), i


# ----------------------------------------------------------------------------------------------
# Bad shapes.

def _refused(call, match):
    """The call fails with the kernel's one-line InvalidArgument matching `match`."""
    with pytest.raises(Exception) as info:
        jax.block_until_ready(call())
    first = str(info.value).splitlines()[0]
    assert first.startswith("INVALID_ARGUMENT: jllama "), first
    assert match in first, first


def test_bad_cache_blocks_are_refused_in_one_line():
    z = np.zeros
    q = z((2, 2, 64), np.float32)
    f16 = z((2, 16, 64), np.float16)
    q8 = z((2, 16, 68), np.uint8)

    def attend(keys, values, q=q):
        return call_attention((q, keys, values, 3, -1, keys[0], values[0]))

    _refused(lambda: attend([z((2, 16, 64), np.uint8)], [f16]),
             "[n_kv_heads, B, 68] for head_dim 64")
    _refused(lambda: attend([q8, z((2, 16, 68), np.uint8)], [f16, z((2, 16, 64), np.float32)]),
             "cache blocks of one type and shape")
    _refused(lambda: attend([z((2, 16, 64), np.int32)], [f16]), "(q8_0)")
    _refused(lambda: attend([z((2, 16, 51), np.uint8)], [z((2, 16, 48), np.float16)],
                            q=z((2, 2, 48), np.float32)), "head_dim a multiple of 32, not 48")
    _refused(lambda: attend([f16], [z((2, 8, 64), np.float16)]), "do not agree")
    _refused(lambda: attend([z((3, 16, 64), np.float16)], [z((3, 16, 64), np.float16)]),
             "do not agree")
    qkv = jnp.zeros((2 + 2 * 2) * 48)
    _refused(lambda: kernels.rope_write(qkv, jnp.int32(0), jnp.ones(24),
                                        jnp.zeros((2, 8, 51), jnp.uint8), jnp.zeros((2, 8, 48))),
             "head_dim a multiple of 32")
    _refused(lambda: kernels.rope_write(jnp.zeros(6 * 64), jnp.int32(0), jnp.ones(32),
                                        jnp.asarray(q8), jnp.asarray(z((2, 8, 64), np.float16))),
             "do not agree")
    _refused(lambda: call_chunk((z((4, 4, 64), np.float32), [q8], [z((2, 16, 60), np.float16)], 0)),
             "value blocks of type f16 must be [n_kv_heads, B, 64]")
    qkv = jnp.zeros((2, (4 + 2 * 2) * 64))
    blocks = (jnp.asarray(q8), jnp.asarray(q8))
    _refused(lambda: batched.rope_attend_batch(
        qkv, jnp.zeros(2, jnp.int32), jnp.int32(2), jnp.ones(32), blocks, (jnp.asarray(f16),) * 2,
        blocks, (jnp.asarray(f16), jnp.asarray(z((2, 16, 64), ml_dtypes.bfloat16)))),
        "value blocks: cache blocks of one type and shape")


# ----------------------------------------------------------------------------------------------
# The AVX2 and plain builds.

@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_generic_builds_read_and_write_every_cache_type(march):
    """The x86-64-v3 (AVX2, FMA, F16C) and plain x86-64 libraries (`test_kernels.march_targets`)
    against the same float64 expectations, and their rows as NumPy rounds them."""
    from test_kernels import march_targets

    names, _ = march_targets(march)
    rng = np.random.default_rng(13)
    for kt, vt in PAIRS:
        for shape in [(3, 3, 64, 256, 17, 4100, 16), (2, 8, 128, 256, 2, 300, None),
                      (1, 3, 96, 100, 6, 599, None)]:
            args, expected = decode_case(rng, kt, vt, *shape)
            np.testing.assert_allclose(call_attention(args, names[kernels.ATTENTION]), expected,
                                       atol=2e-5, rtol=1e-5, err_msg=f"{kt}/{vt} {shape}")
        args, expected = chunk_case(rng, kt, vt, 2, 4, 128, 64, 3, 70, 100)
        np.testing.assert_allclose(call_chunk(args, names[kernels.ATTENTION_CHUNK]), expected,
                                   atol=2e-5, rtol=1e-5, err_msg=f"{kt}/{vt} chunk")
        n_kv, hd = 4, 128
        rows = (rng.standard_normal((n_kv, hd)) * 10).astype(np.float32)
        rows[0, :5] = [127 * 4, 2.5 * 4, -2.5 * 4, 1 + 2 ** -11, 1 + 3 * 2 ** -8]  # ties
        qkv = np.concatenate([np.zeros(3 * n_kv * hd, np.float32), rows.reshape(-1)])
        k, v = to_cache(np.zeros((n_kv, 16, hd)), kt), to_cache(np.zeros((n_kv, 16, hd)), vt)
        written = jax.ffi.ffi_call(
            names[kernels.ROPE_WRITE],
            (jax.ShapeDtypeStruct((2 * n_kv, hd), jnp.float32),
             jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype)))(
            jnp.asarray(qkv), jnp.int32(0), jnp.ones(hd // 2, jnp.float32), jnp.asarray(k),
            jnp.asarray(v))
        np.testing.assert_array_equal(np.asarray(written[2])[:, 0].view(np.uint8),
                                      to_cache(rows, vt).view(np.uint8))
