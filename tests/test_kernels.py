"""jllama's CPU matrix-vector kernels (`jllama.kernels`): products against float64 NumPy and
hand-worked values, the decode programs with the kernels against the full-sequence reference
and against XLA's products, the build's errors, and the CLI's --matvec."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import STORIES260K
from hypothesis import given, settings
from hypothesis import strategies as st
from test_backends import GQA_UNSHARED, full_sequence_logits

from jllama import kernels
from jllama.backends import make_backend
from jllama.generation.generate import Generation
from jllama.graphs.ops import matmul
from jllama.kernels import library
from jllama.model.quant import Int8Matrix, quantize_int8
from jllama.sampling import Sampler
from jllama.model.weights import random_weights

kernels.load()
_matvec = jax.jit(kernels.matvec)


def _reference(w, x) -> np.ndarray:
    """float64 `w @ x` of what the kernel reads: f32, widened bf16, or q * scale."""
    if isinstance(w, Int8Matrix):
        scale = np.asarray(w.scale, np.float64)
        scale = np.repeat(scale, w.group_size, axis=-1) if w.grouped else scale[:, None]
        dense = np.asarray(w.q, np.float64) * scale
    else:
        dense = np.asarray(w, np.float64)
    return dense @ np.asarray(x, np.float64)


_PLAIN = {"prologue": np.int32(0), "eps": np.float32(0), "residual": np.int32(0)}
"""The matvec handlers' attributes for a plain product (calls by symbol, not `kernels.matvec`)."""


def _rmsnorm64(x, weight, eps) -> np.ndarray:
    """RMSNorm in float64 (llama2.c run.c's formula)."""
    x = np.asarray(x, np.float64)
    return np.asarray(weight, np.float64) * x / np.sqrt(np.mean(x * x) + eps)


def _silu64(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / (1 + np.exp(-x))


def _bound(w, x) -> np.ndarray:
    """Rounding bound of a float32 sum of n products: n * eps * sum |w_ij x_j| per row."""
    dense = np.abs(np.asarray(w, np.float64))
    n = dense.shape[1]
    return (n + 2) * np.finfo(np.float32).eps * (dense @ np.abs(np.asarray(x, np.float64))) + 1e-30


def _as(kind: str, w: np.ndarray):
    if kind == "float32":
        return w
    if kind == "bfloat16":
        return w.astype(ml_dtypes.bfloat16)
    return quantize_int8(w)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(
    "m,n",
    # 1 row; shorter than one 64-lane step; a tail after whole steps; the 64-lane steps only;
    # big enough to be split over threads (>= 65536 weights), with uneven chunks (4099 rows).
    [(1, 1), (3, 5), (7, 63), (5, 64), (9, 130), (288, 288), (4099, 97), (32000, 288)],
)
def test_matvec_equals_float64_numpy_within_rounding(kind, m, n):
    rng = np.random.default_rng(m * 1000 + n)
    w = _as(kind, rng.standard_normal((m, n), dtype=np.float32))
    x = rng.standard_normal(n, dtype=np.float32)
    got = np.asarray(_matvec(jax.device_put(w), jnp.asarray(x)))
    assert got.dtype == np.float32 and got.shape == (m,)
    ref = _reference(w, x)
    assert np.all(np.abs(got - ref) <= _bound(np.asarray(w, np.float32), x))


@pytest.mark.parametrize("m,n,group", [(3, 32, 32), (700, 576, 32), (4099, 96, 32),
                                         (7, 48, 24), (9, 40, 8)])
def test_grouped_int8_equals_float64_numpy_within_rounding(m, n, group):
    """One scale per `group` weights (GGUF's Q8_0 / Q4_0 have 32); 24 and 8 take the loop
    that does not assume whole 16-lane steps."""
    rng = np.random.default_rng(m + n + group)
    w = Int8Matrix(q=rng.integers(-127, 128, (m, n), dtype=np.int8),
                   scale=rng.random((m, n // group), dtype=np.float32))
    x = rng.standard_normal(n, dtype=np.float32)
    for product in (_matvec, jax.jit(lambda w, x: matmul(w, x, "xla"))):
        got = np.asarray(product(jax.device_put(w), jnp.asarray(x)))
        assert np.all(np.abs(got - _reference(w, x)) <= _bound(np.asarray(w, np.float32), x))


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 200),
    kind=st.sampled_from(["float32", "bfloat16", "int8"]),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e15]),
)
def test_matvec_error_bound_property(m, n, kind, seed, scale):
    rng = np.random.default_rng(seed)
    w = _as(kind, (rng.standard_normal((m, n)) * scale).astype(np.float32))
    x = rng.standard_normal(n).astype(np.float32)
    got = np.asarray(_matvec(jax.device_put(w), jnp.asarray(x)))
    assert np.all(np.abs(got - _reference(w, x)) <= _bound(np.asarray(w, np.float32), x))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 1200), extra=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_products_split_over_threads_compute_every_row(n, extra, seed):
    # >= 65536 weights: the rows are shared out in blocks that a thread done with its own share
    # takes from the back of the other's. Fresh weights each example, so a row left unwritten
    # (or written from another row) cannot pass by holding an earlier call's value.
    m = max(2, -(-65536 // n)) + extra
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, n), dtype=np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    got = np.asarray(_matvec(jnp.asarray(w), jnp.asarray(x)))
    assert np.all(np.abs(got - _reference(w, x)) <= _bound(w, x))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rows, n", [(768, 288), (40, 70)])
def test_float_rows_are_both_products_in_one_call(dtype, rows, n):
    """SwiGLU's w1 and w3 in one call (`FloatRows`, the decode block's path): against float64
    NumPy of each after one RMSNorm, and each row the bits a call of its own gives (the same
    64-lane sums), split over threads or not."""
    from jllama.model.ggml_matrix import FloatRows

    rng = np.random.default_rng(rows)
    w1, w3 = (rng.standard_normal((rows, n), dtype=np.float32).astype(dtype) for _ in range(2))
    x = rng.standard_normal(n).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, n).astype(np.float32)
    both = jax.jit(lambda a, b, x, g: kernels.matvec(FloatRows((a, b)), x, norm=g, eps=1e-5))
    got = np.asarray(both(jnp.asarray(w1), jnp.asarray(w3), jnp.asarray(x), jnp.asarray(norm)))
    h = _rmsnorm64(x, norm, 1e-5)
    want = np.concatenate([np.asarray(w1, np.float64) @ h, np.asarray(w3, np.float64) @ h])
    wide = np.concatenate([np.asarray(w1, np.float32), np.asarray(w3, np.float32)])
    assert np.all(np.abs(got - want) <= _bound(wide, h.astype(np.float32)) + 1e-5 * np.abs(want))
    one = jax.jit(lambda w, x, g: kernels.matvec(w, x, norm=g, eps=1e-5))
    alone = [np.asarray(one(jnp.asarray(w), jnp.asarray(x), jnp.asarray(norm))) for w in (w1, w3)]
    assert np.array_equal(got, np.concatenate(alone))


def test_matvec_by_hand():
    w = np.array([[1, 2, 3], [-4, 5, 0.5]], np.float32)
    x = np.array([1, 10, 100], np.float32)
    assert np.asarray(_matvec(jnp.asarray(w), jnp.asarray(x))).tolist() == [321.0, 96.0]
    # int8: rows q = [1, 2, 3] with scale 0.5 and [-127, 0, 127] with scale 2.
    q = Int8Matrix(q=np.array([[1, 2, 3], [-127, 0, 127]], np.int8),
                   scale=np.array([0.5, 2.0], np.float32))
    assert np.asarray(_matvec(jax.device_put(q), jnp.asarray(x))).tolist() == [160.5, 25146.0]
    # bfloat16 1.0078125 = 1 + 2**-7 is exact in bf16: widened exactly.
    b = np.array([[1.0078125, -2.0]], ml_dtypes.bfloat16)
    assert np.asarray(_matvec(jnp.asarray(b), jnp.asarray(x[:2]))).tolist() == [1.0078125 - 20.0]


def test_matvec_gives_the_same_bits_every_call():
    """The rows are split over threads in chunks; each row's sum order is fixed."""
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((6000, 700), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal(700, dtype=np.float32))
    first = np.asarray(_matvec(w, x))
    for _ in range(20):
        assert np.array_equal(np.asarray(_matvec(w, x)), first)


def test_matvec_refuses_what_it_has_no_kernel_for():
    with pytest.raises(ValueError, match="float16"):
        kernels.matvec(jnp.zeros((2, 3), jnp.float16), jnp.zeros(3))
    with pytest.raises(ValueError, match="w\\[m, n\\] and x\\[n\\]"):
        kernels.matvec(jnp.zeros((2, 3)), jnp.zeros(4))


def _attention_reference(qg, key_blocks, value_blocks, pos) -> np.ndarray:
    """float64 softmax attention of each query head over positions 0 .. pos of the blocks
    laid end to end (as llama2.c run.c's loop over t <= pos)."""
    keys = np.concatenate([np.asarray(k, np.float64) for k in key_blocks], axis=1)[:, :pos + 1]
    values = np.concatenate([np.asarray(v, np.float64) for v in value_blocks], axis=1)[:, :pos + 1]
    q = np.asarray(qg, np.float64)
    scores = np.einsum("gmd,gtd->gmt", q, keys) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("gmt,gtd->gmd", weights, values)


def _attention_case(rng, n_kv, kv_mul, head_dim, block, n_blocks, pos, cur):
    """Random q and blocks; with `cur`, block cur is given apart and its slot holds NaNs (the
    kernel must not read it)."""
    qg = rng.standard_normal((n_kv, kv_mul, head_dim), dtype=np.float32)
    keys = [rng.standard_normal((n_kv, block, head_dim), dtype=np.float32)
            for _ in range(n_blocks)]
    values = [rng.standard_normal((n_kv, block, head_dim), dtype=np.float32)
              for _ in range(n_blocks)]
    expected = _attention_reference(qg, keys, values, pos)
    # Positions after pos are never read: poison them.
    for b in range(n_blocks):
        first = max(0, pos + 1 - b * block)
        keys[b][:, first:] = np.nan
        values[b][:, first:] = np.nan
    args = [jnp.asarray(qg), tuple(map(jnp.asarray, keys)), tuple(map(jnp.asarray, values)),
            jnp.int32(pos)]
    if cur is not None:
        key_cur, value_cur = keys[cur].copy(), values[cur].copy()
        keys[cur][:] = np.nan
        values[cur][:] = np.nan
        args = [jnp.asarray(qg), tuple(map(jnp.asarray, keys)), tuple(map(jnp.asarray, values)),
                jnp.int32(pos), jnp.int32(cur), jnp.asarray(key_cur), jnp.asarray(value_cur)]
    return args, expected


_attention = jax.jit(kernels.attention)


@pytest.mark.parametrize(
    "n_kv,kv_mul,head_dim,block,n_blocks,pos,cur",
    [
        (1, 1, 4, 8, 1, 0, None),        # one position: the output is v_0
        (6, 1, 48, 256, 1, 130, None),   # stories15M's heads
        (3, 3, 64, 256, 1, 255, 0),      # SmolLM2's grouped heads, the loop's block given apart
        (3, 3, 64, 256, 2, 256, 1),      # first position of the second block
        (2, 4, 20, 16, 4, 50, 2),        # head_dim not a multiple of 16
        (8, 2, 64, 256, 4, 1000, 3),     # long: split over threads
        (2, 1, 17, 5, 3, 9, None),       # odd sizes everywhere
    ],
)
def test_attention_equals_float64_numpy(n_kv, kv_mul, head_dim, block, n_blocks, pos, cur):
    args, expected = _attention_case(np.random.default_rng(pos), n_kv, kv_mul, head_dim, block,
                                     n_blocks, pos, cur)
    got = np.asarray(_attention(*args))
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_attention_by_hand():
    """One head, two positions, head_dim 4: scores q.k / 2 = (1, 0), softmax (e/(e+1),
    1/(e+1)), output the mix of the two value rows."""
    q = jnp.asarray([[[2.0, 0, 0, 0]]])
    k = jnp.asarray([[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]])
    v = jnp.asarray([[[1.0, 2, 3, 4], [5.0, 6, 7, 8]]])
    e = np.e
    want = (e * np.array([1, 2, 3, 4]) + np.array([5, 6, 7, 8])) / (e + 1)
    np.testing.assert_allclose(np.asarray(_attention(q, (k,), (v,), jnp.int32(1)))[0, 0], want,
                               rtol=1e-6)
    # At pos 0 only the first position counts.
    np.testing.assert_allclose(np.asarray(_attention(q, (k,), (v,), jnp.int32(0)))[0, 0],
                               [1, 2, 3, 4], rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    n_kv=st.integers(1, 4), kv_mul=st.integers(1, 4), head_dim=st.integers(1, 80),
    block=st.sampled_from([1, 7, 16, 64]), n_blocks=st.integers(1, 4), seed=st.integers(0, 99),
    data=st.data(),
)
def test_attention_property(n_kv, kv_mul, head_dim, block, n_blocks, seed, data):
    pos = data.draw(st.integers(0, block * n_blocks - 1))
    cur = data.draw(st.one_of(st.none(), st.integers(0, n_blocks - 1)))
    args, expected = _attention_case(np.random.default_rng(seed), n_kv, kv_mul, head_dim, block,
                                     n_blocks, pos, cur)
    np.testing.assert_allclose(np.asarray(_attention(*args)), expected, atol=2e-5, rtol=1e-5)


def test_attention_gives_the_same_bits_every_call():
    """Key heads are split over threads; each head's sums run on one thread in a fixed order."""
    args, _ = _attention_case(np.random.default_rng(1), 8, 4, 64, 256, 8, 2000, 7)
    first = np.asarray(_attention(*args))
    for _ in range(20):
        assert np.array_equal(np.asarray(_attention(*args)), first)


def test_attention_refuses_a_position_outside_its_blocks():
    args, _ = _attention_case(np.random.default_rng(2), 2, 1, 8, 16, 1, 3, None)
    args[3] = jnp.int32(16)
    with pytest.raises(Exception, match="pos outside the blocks"):
        np.asarray(_attention(*args))


def _chunk_case(rng, n_kv, kv_mul, head_dim, block, n_blocks, t, pos):
    """Random queries of a chunk of t tokens at positions pos .. pos + t - 1 and cache blocks;
    the positions after the chunk hold NaNs (the kernel must not use them), and the expected
    output is `_attention_reference` of each token at its own position."""
    n_heads = n_kv * kv_mul
    q = rng.standard_normal((t, n_heads, head_dim), dtype=np.float32) * 2
    keys = [rng.standard_normal((n_kv, block, head_dim), dtype=np.float32)
            for _ in range(n_blocks)]
    values = [rng.standard_normal((n_kv, block, head_dim), dtype=np.float32)
              for _ in range(n_blocks)]
    expected = np.stack([
        _attention_reference(q[i].reshape(n_kv, kv_mul, head_dim), keys, values, pos + i)
        .reshape(n_heads * head_dim) for i in range(t)
    ])
    for b in range(n_blocks):
        first = max(0, pos + t - b * block)
        keys[b][:, first:] = np.nan
        values[b][:, first:] = np.nan
    args = (jnp.asarray(q), tuple(map(jnp.asarray, keys)), tuple(map(jnp.asarray, values)),
            jnp.int32(pos))
    return args, expected


_attention_chunk = jax.jit(kernels.attention_chunk)


@pytest.mark.parametrize(
    "n_kv,kv_mul,head_dim,block,n_blocks,t,pos",
    [
        (3, 3, 64, 256, 2, 256, 0),      # SmolLM2's first 256-token chunk
        (3, 3, 64, 256, 2, 256, 256),    # its second: the whole first block, then causal
        (3, 3, 64, 256, 4, 8, 600),      # an 8-token chunk late in the context
        (6, 1, 48, 256, 1, 37, 5),       # stories15M's heads; 37 tokens: a partial tile
        (2, 4, 128, 64, 3, 70, 100),     # head_dim 128 (Llama 3); the chunk crosses a block
        (1, 1, 16, 16, 3, 1, 47),        # one token at the last position
        (2, 2, 32, 32, 4, 17, 0),        # 17 tokens from position 0
    ],
)
def test_attention_chunk_equals_float64_numpy(n_kv, kv_mul, head_dim, block, n_blocks, t, pos):
    args, expected = _chunk_case(np.random.default_rng(t + pos), n_kv, kv_mul, head_dim, block,
                                 n_blocks, t, pos)
    got = np.asarray(_attention_chunk(*args))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    n_kv=st.integers(1, 3), kv_mul=st.integers(1, 3), dims=st.integers(1, 8),
    block=st.sampled_from([16, 32, 64]), n_blocks=st.integers(1, 3), seed=st.integers(0, 99),
    data=st.data(),
)
def test_attention_chunk_property(n_kv, kv_mul, dims, block, n_blocks, seed, data):
    pos = data.draw(st.integers(0, block * n_blocks - 1))
    t = data.draw(st.integers(1, min(40, block * n_blocks - pos)))
    args, expected = _chunk_case(np.random.default_rng(seed), n_kv, kv_mul, 16 * dims, block,
                                 n_blocks, t, pos)
    np.testing.assert_allclose(np.asarray(_attention_chunk(*args)), expected, atol=2e-5,
                               rtol=1e-5)


def test_attention_chunk_by_hand():
    """One head, head_dim 16, two tokens from position 0. Token 0 sees key 0 only: its output
    is value 0. Token 1 has scores q.k / 4 = (1, 0) over keys 0 and 1: softmax (e/(e+1),
    1/(e+1)) of the two value rows. A third token at position 2 would see key 2: with pos 1
    and one token, the first two keys only."""
    q = np.zeros((2, 1, 16), np.float32)
    q[:, 0, 0] = 4.0
    k = np.zeros((1, 16, 16), np.float32)
    k[0, 0, 0] = 1.0
    k[0, 1, 1] = 1.0
    k[0, 2, 0] = 100.0  # position 2: never seen
    v = np.zeros((1, 16, 16), np.float32)
    v[0, 0, :4], v[0, 1, :4], v[0, 2, :4] = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    got = np.asarray(_attention_chunk(jnp.asarray(q), (jnp.asarray(k),), (jnp.asarray(v),),
                                      jnp.int32(0)))
    e = np.e
    np.testing.assert_allclose(got[0, :4], [1, 2, 3, 4], rtol=1e-6)
    np.testing.assert_allclose(got[1, :4], (e * np.array([1, 2, 3, 4]) + [5, 6, 7, 8]) / (e + 1),
                               rtol=1e-6)
    np.testing.assert_array_equal(got[:, 4:], 0)
    one = np.asarray(_attention_chunk(jnp.asarray(q[1:]), (jnp.asarray(k),), (jnp.asarray(v),),
                                      jnp.int32(1)))
    np.testing.assert_array_equal(one[0], got[1])


def test_attention_chunk_gives_the_same_bits_every_call():
    """Tiles are split over the pool's threads; each tile runs on one thread in a fixed order."""
    args, _ = _chunk_case(np.random.default_rng(5), 4, 4, 64, 256, 4, 256, 512)
    first = np.asarray(_attention_chunk(*args))
    for _ in range(20):
        assert np.array_equal(np.asarray(_attention_chunk(*args)), first)


def test_attention_chunk_refuses_bad_arguments():
    args, _ = _chunk_case(np.random.default_rng(3), 2, 1, 16, 16, 1, 4, 3)
    with pytest.raises(Exception, match="positions outside the blocks"):
        np.asarray(_attention_chunk(args[0], args[1], args[2], jnp.int32(13)))
    with pytest.raises(Exception, match="positions outside the blocks"):
        np.asarray(_attention_chunk(args[0], args[1], args[2], jnp.int32(-1)))
    with pytest.raises(Exception, match="even number of cache blocks"):
        np.asarray(jax.ffi.ffi_call(kernels.ATTENTION_CHUNK,
                                    jax.ShapeDtypeStruct((4, 32), jnp.float32))(
            args[0], jnp.int32(0), args[1][0]))
    fits = functools.partial(kernels.attention_chunk_fits, fast_only=False)
    assert not fits(8, 256) and not fits(64, 250) and not fits(144, 256)
    assert fits(64, 256) and fits(16, 16) and fits(128, 32)
    # Chosen by the prefill program only where the library has its AVX-512 or AVX2 loops.
    assert kernels.attention_chunk_fits(64, 256) is (kernels.vector_width() >= 8)
    with pytest.raises(ValueError, match="no kernel for head_dim 8"):
        kernels.attention_chunk(jnp.zeros((2, 1, 8)), (jnp.zeros((1, 16, 8)),),
                                (jnp.zeros((1, 16, 8)),), jnp.int32(0))


def test_the_prefill_attention_calls_the_kernel_only_when_asked_and_it_fits():
    from jllama import graphs
    from jllama.model.config import ModelConfig

    for head_dim, fits in ((16, kernels.vector_width() >= 8), (8, False)):
        config = ModelConfig(dim=4 * head_dim, hidden_dim=32, n_layers=1, n_heads=4,
                             n_kv_heads=2, vocab_size=10, seq_len=64)
        blocks = (jnp.zeros((2, 64, head_dim)),)
        for matvec in ("kernel", "xla"):
            hlo = graphs.attention_chunk.lower(config, jnp.zeros((8, 4, head_dim)), blocks, blocks,
                                               jnp.int32(0), matvec=matvec).as_text()
            assert ("jllama_attention_chunk_f32" in hlo) is (fits and matvec == "kernel")
            assert ("exponential" in hlo) is not (fits and matvec == "kernel")


def test_kernel_decode_crosses_cache_blocks_like_the_full_sequence_forward():
    """270 positions: the attention kernel reads the first cache block whole and the second
    in part (graph mode; the loop's block-apart form is checked against the other modes in
    test_decode_loop)."""
    from jllama.model.config import ModelConfig

    config = ModelConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2,
                         vocab_size=64, seq_len=300, shared_weights=False)
    weights = random_weights(config, seed=5, scale=0.1)
    tokens = list(np.random.default_rng(6).integers(0, 64, 270))
    b, got = _decode_logits(config, weights, tokens, matvec="kernel")
    np.testing.assert_allclose(got, full_sequence_logits(config, weights, tokens), atol=1e-4,
                               rtol=0)


_sample = jax.jit(kernels.sample)


def _host_draw(logits, temperature, top_p, coin) -> int:
    """The host sampler's token for this coin (`Sampler.sample` draws its coin from its own
    generator: replace it with one that returns `coin`)."""
    sampler = Sampler(temperature, top_p=top_p, seed=1)
    sampler.rng = type("Coin", (), {"random_f32": staticmethod(lambda: np.float32(coin))})()
    return sampler.sample(logits)


@pytest.mark.parametrize("n", [1, 2, 7, 512, 32000, 49152])
def test_sample_draws_the_host_samplers_token(n):
    """Random logits of several spreads, temperatures and top_p values, many coins: the kernel
    returns `jllama.sampling.Sampler`'s token (run.c's arithmetic) every time."""
    rng = np.random.default_rng(n)
    for trial in range(12):
        logits = (rng.standard_normal(n) * [0.3, 2.0, 8.0][trial % 3]).astype(np.float32)
        if trial % 4 == 3:
            logits[rng.integers(0, n, 3)] = logits.max()  # ties for the maximum
        for temperature, top_p in [(0.8, 1.0), (1.0, 0.9), (0.3, 0.5), (1.7, 0.99), (1.0, 0.0)]:
            coins = rng.random(6, dtype=np.float32)
            for coin in [*coins, np.float32(0.0), np.float32(1 - 2**-24)]:
                want = _host_draw(logits, temperature, top_p, coin)
                assert int(_sample(logits, temperature, top_p, coin)) == want, (trial, coin)


def test_sample_edge_cases_by_hand():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    # sample_mult: the cdf is 0.1, 0.3, 0.6, 1.0; the first entry above the coin.
    for coin, want in [(0.0, 0), (0.05, 0), (0.1001, 1), (0.59, 2), (0.61, 3), (0.9999, 3)]:
        assert int(_sample(logits, 1.0, 1.0, coin)) == want
    # top_p 0.5: candidates sorted 0.4, 0.3 (0.7 > 0.5 ends the nucleus); r = coin * 0.7.
    assert int(_sample(logits, 1.0, 0.5, 0.5)) == 3  # r = 0.35 < 0.4
    assert int(_sample(logits, 1.0, 0.5, 0.6)) == 2  # r = 0.42 >= 0.4
    # top_p so small that no token passes the cutoff (1 - p) / (n - 1): the most likely one.
    assert int(_sample(logits, 1.0, 1e-9, 0.99)) == 3
    # A vanishing temperature: the maxima share the mass (first half to the first maximum).
    tied = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert int(_sample(tied, 1e-45, 1.0, 0.25)) == 1
    assert int(_sample(tied, 1e-45, 1.0, 0.75)) == 3


def _decode_logits(config, weights, tokens, **options):
    b = make_backend("jax", **options)
    b.prepare(config, weights)
    return b, np.stack([b.forward(t, pos) for pos, t in enumerate(tokens)])


@pytest.mark.parametrize("decode", ["graph", "fused"])
def test_kernel_decode_equals_the_full_sequence_forward(decode):
    rng = np.random.default_rng(3)
    weights = random_weights(GQA_UNSHARED, seed=1, scale=0.08)
    tokens = list(rng.integers(0, 300, 48))
    b, got = _decode_logits(GQA_UNSHARED, weights, tokens, decode=decode, matvec="kernel")
    assert b.matvec == "kernel"
    np.testing.assert_allclose(got, full_sequence_logits(GQA_UNSHARED, weights, tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_kernel_and_xla_agree_on_narrow_weights(dtype):
    """Both read the same narrow values; only the order of the float32 sums differs."""
    from jllama.model.weights import cast_weights

    weights = cast_weights(random_weights(GQA_UNSHARED, seed=2, scale=0.08), dtype)
    tokens = list(np.random.default_rng(4).integers(0, 300, 32))
    _, kernel = _decode_logits(GQA_UNSHARED, weights, tokens, matvec="kernel")
    _, xla = _decode_logits(GQA_UNSHARED, weights, tokens, matvec="xla")
    np.testing.assert_allclose(kernel, xla, atol=1e-4, rtol=0)


def test_kernel_and_xla_generate_the_same_story(stories260k):
    """All three decode modes, greedy, 200 tokens of stories260K."""
    stories = {}
    for matvec in ("kernel", "xla"):
        for mode in ("graph", "fused", "loop"):
            b = make_backend("jax", decode=mode, matvec=matvec)
            b.prepare(*stories260k)
            sampler = Sampler(0.0)
            loop = None
            if mode == "loop":
                from jllama.generation.device_loop import loop_decoder

                loop = loop_decoder(b, sampler, ())
            gen = Generation(b.forward, [1], sampler, steps=200, stop_ids=(),
                             prefill=b.prefill, decode_loop=loop)
            stories[matvec, mode] = [t.id for t in gen]
    assert len(set(map(tuple, stories.values()))) == 1
    assert len(stories["kernel", "loop"]) == 200


def test_the_compiled_programs_call_the_kernel_only_when_asked(stories260k):
    """With matvec="kernel" the programs call the kernels, and hold no RMSNorm (`rsqrt`), no
    SwiGLU (its `exponential`) and no RoPE or cache update of XLA's: those run inside the
    kernels' calls. With "xla" there is no kernel, and XLA's are there."""
    config, weights = stories260k
    x = jnp.zeros(config.dim)
    for matvec, expected in (("kernel", True), ("xla", False)):
        b = make_backend("jax", matvec=matvec)
        b.prepare(config, weights)
        layer = b.layers[0]
        from jllama import graphs

        hlo = graphs.block.lower(
            config, x, jnp.zeros(config.q_dim), layer.wo, layer.rms_ffn_weight, layer.w1,
            layer.w2, layer.w3, matvec=b.matvec,
        ).as_text()
        assert ("jllama_matvec_f32" in hlo) is expected
        assert ("rsqrt" in hlo, "exponential" in hlo) == (not expected, not expected)
        cache = jnp.zeros((config.n_kv_heads, b.block_length, config.head_dim))
        hlo = graphs.qkv.lower(config, x, layer.rms_att_weight, layer.wqkv, cache, cache,
                               jnp.int32(0), b.inv_freq, matvec=b.matvec).as_text()
        # RoPE and the cache write: one kernel call, or XLA's cosine and update
        assert ("jllama_rope_write_f32" in hlo) is expected
        assert ("cosine" in hlo, "dynamic_update_slice" in hlo) == (not expected, not expected)
        head = graphs.classifier.lower(config, x, b.rms_final_weight, b.wcls,
                                       matvec=b.matvec).as_text()
        assert ("rsqrt" in head) is not expected
        keys = (jnp.zeros((config.n_kv_heads, b.block_length, config.head_dim)),)
        hlo = graphs.attention.lower(config, jnp.zeros((config.n_heads, config.head_dim)), keys,
                                     keys, jnp.int32(0), matvec=b.matvec).as_text()
        assert ("jllama_attention_f32" in hlo) is expected


def test_auto_falls_back_to_xla_when_the_kernels_do_not_build(stories260k, monkeypatch):
    def fail():
        raise kernels.KernelBuildError("no C++ compiler (c++) to build jllama's CPU kernels")

    monkeypatch.setattr(kernels, "load", fail)
    b = make_backend("jax")
    b.prepare(*stories260k)
    assert b.matvec == "xla" and "no C++ compiler" in b.matvec_note
    with pytest.raises(kernels.KernelBuildError, match="^matvec=kernel: no C\\+\\+ compiler"):
        make_backend("jax", matvec="kernel").prepare(*stories260k)


def test_matvec_option_is_checked():
    with pytest.raises(ValueError, match="matvec='fast'"):
        make_backend("jax", matvec="fast")


def test_an_unbalanced_quote_in_cxx_is_no_compiler_not_an_internal_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", 'g++ "x')
    assert library.compiler() is None
    with pytest.raises(library.KernelBuildError, match="no C\\+\\+ compiler \\(CXX=g\\+\\+ \"x is"):
        library.build()


def test_cxx_is_split_like_a_shell_line_and_empty_means_unset(monkeypatch):
    monkeypatch.setenv("CXX", "env c++")
    assert library.compiler()[1:] == ["c++"] and library.compiler()[0].endswith("/env")
    monkeypatch.setenv("CXX", "")
    assert library.compiler()[0].endswith("/c++") and len(library.compiler()) == 1


def test_a_library_without_the_handlers_is_refused_and_not_cached(tmp_path, monkeypatch):
    """`true` "compiles" without writing anything: a 0-byte file, which must not be cached."""
    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "true")
    with pytest.raises(library.KernelBuildError, match="made no usable library: file too short"):
        library.build()
    # No library cached, only the remembered failure.
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".failed"]
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"")
    with pytest.raises(library.KernelBuildError, match="broken.so is not a usable kernel library"):
        library.check_library(broken)


def test_stale_temporaries_of_killed_builds_are_removed(tmp_path):
    old, young = tmp_path / "tmpold.so", tmp_path / "tmpyoung.so"
    old.write_bytes(b"x")
    young.write_bytes(b"x")
    past = old.stat().st_mtime - 3 * library.BUILD_TIMEOUT_S
    os.utime(old, (past, past))
    library._remove_stale_temporaries(tmp_path)
    assert not old.exists() and young.exists()  # a build running now keeps its file


def test_a_failing_compiler_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(library.KernelBuildError, match="^building jllama's CPU kernels with "
                       ".*false failed: exit status 1, no message$") as info:
        library.build()
    assert "\n" not in str(info.value)
    # No library; the failure is remembered beside where it would be.
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".failed"]


def test_a_failed_build_is_remembered_until_its_file_is_deleted(tmp_path, monkeypatch):
    """A compiler that fails (or hangs until the timeout) is not run again on every start:
    the next build fails at once with the same message and says how to retry."""
    runs = tmp_path / "runs"
    fake = tmp_path / "fake-c++"
    fake.write_text(f"#!/bin/sh\necho run >> {runs}\necho 'x.cc:1: error: no luck' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(library.KernelBuildError, match="failed: x.cc:1: error: no luck$"):
        library.build()
    assert library.is_built()  # build() would return at once: the CLI says no "building"
    with pytest.raises(library.KernelBuildError,
                       match="failed: x.cc:1: error: no luck \\(remembered from an earlier "
                             "build; delete .*\\.failed to try again\\)$") as info:
        library.build()
    assert "\n" not in str(info.value)
    assert runs.read_text().count("run") == 1  # the compiler ran once
    memo = library.failure_path(library.library_path(library.compiler()))
    memo.unlink()
    with pytest.raises(library.KernelBuildError, match="no luck$"):
        library.build()
    assert runs.read_text().count("run") == 2


def _cli(args, env_extra, tmp_path):
    env = {**os.environ, "JLLAMA_HOME": str(tmp_path), **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "jllama", f"--checkpoint={STORIES260K}", "--steps=12",
         "--seed=1", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )


def test_cli_matvec_kernel_without_a_compiler_is_one_line(tmp_path):
    done = _cli(["--matvec=kernel"], {"CXX": "/nonexistent/c++"}, tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("jllama: error: --matvec=kernel: no C++ compiler "
                           "(CXX=/nonexistent/c++ is not a program here)")
    assert "Traceback" not in done.stderr


def test_cli_matvec_kernel_on_split_devices_is_one_line_naming_the_flag(tmp_path):
    done = _cli(["--matvec=kernel", "--devices=2"],
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "jllama: error: --matvec=kernel runs on one CPU device only, not split over devices"
    )


def test_a_fresh_home_builds_once_and_the_command_notes_a_missing_compiler(tmp_path,
                                                                          monkeypatch):
    """One build from an empty JLLAMA_HOME (each costs a whole compile): without a compiler
    the command notes it and tells the story on XLA's products; --matvec=kernel builds the
    library once (into the home's kernels folder, no temporary left) and tells the same story;
    then neither the command nor `library.build` compiles again; a missing compiler is named."""
    done = _cli([], {"CXX": "/nonexistent/c++"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "jllama: note: using XLA's products (--matvec=xla):" in done.stderr
    with_kernel = _cli(["--matvec=kernel"], {}, tmp_path)
    assert with_kernel.returncode == 0 and with_kernel.stdout == done.stdout
    assert "jllama: building jllama's CPU kernels (once" in with_kernel.stderr  # an empty cache
    again = _cli(["--matvec=kernel"], {}, tmp_path)
    assert "building" not in again.stderr and again.stdout == done.stdout

    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    path = library.build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    stamp = path.stat().st_mtime_ns
    assert library.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(library.KernelBuildError, match="no C\\+\\+ compiler .*no-such-compiler"):
        library.build()


_rope_write = jax.jit(kernels.rope_write, donate_argnums=(3, 4))


def _rope64(heads, pos, inv_freq) -> np.ndarray:
    """run.c's RoPE in float64 on the float32 angle pos * inv_freq (as run.c forms it)."""
    angle = (np.float32(pos) * np.asarray(inv_freq, np.float32)).astype(np.float64)
    h = np.asarray(heads, np.float64)
    v0, v1 = h[..., 0::2], h[..., 1::2]
    out = np.empty_like(h)
    out[..., 0::2] = v0 * np.cos(angle) - v1 * np.sin(angle)
    out[..., 1::2] = v0 * np.sin(angle) + v1 * np.cos(angle)
    return out


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim,block,pos",
    # stories15M's heads; GQA (SmolLM2's 3 query heads a key head) at a block's last slot,
    # the next block's first and far on; head_dim 2; position 0 (no rotation).
    [(6, 6, 48, 256, 77), (9, 3, 64, 256, 255), (9, 3, 64, 256, 256), (4, 2, 6, 8, 8 * 40 + 5),
     (2, 1, 2, 4, 3), (6, 6, 48, 256, 0)],
)
def test_rope_write_agrees_with_numpy_and_writes_only_its_slot(n_heads, n_kv, head_dim, block,
                                                                pos):
    rng = np.random.default_rng(pos + head_dim)
    qkv = rng.standard_normal((n_heads + 2 * n_kv) * head_dim).astype(np.float32)
    keys = rng.standard_normal((n_kv, block, head_dim)).astype(np.float32)
    values = rng.standard_normal((n_kv, block, head_dim)).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    q, k2, v2 = _rope_write(jnp.asarray(qkv), jnp.int32(pos), jnp.asarray(inv_freq),
                            jnp.asarray(keys), jnp.asarray(values))
    q, k2, v2 = np.asarray(q), np.asarray(k2), np.asarray(v2)
    split = n_heads * head_dim, (n_heads + n_kv) * head_dim
    want_q = _rope64(qkv[: split[0]].reshape(n_heads, head_dim), pos, inv_freq)
    want_k = _rope64(qkv[split[0] : split[1]].reshape(n_kv, head_dim), pos, inv_freq)
    assert np.all(np.abs(q - want_q) <= 2e-6 * (1 + np.abs(want_q)))
    at = pos % block
    assert np.all(np.abs(k2[:, at] - want_k) <= 2e-6 * (1 + np.abs(want_k)))
    np.testing.assert_array_equal(v2[:, at], qkv[split[1] :].reshape(n_kv, head_dim))
    others = np.arange(block) != at
    np.testing.assert_array_equal(k2[:, others], keys[:, others])
    np.testing.assert_array_equal(v2[:, others], values[:, others])


def test_rope_write_by_hand():
    # head_dim 2, one head of each: inv_freq pi/2 at pos 1 turns by a quarter: (1, 0) -> (0, 1),
    # (0, 1) -> (-1, 0); the value is stored as given. At pos 2, half a turn.
    inv_freq = jnp.asarray([np.pi / 2], jnp.float32)
    qkv = jnp.asarray([1.0, 0.0, 0.0, 1.0, 5.0, -7.0], jnp.float32)
    for pos, q_want, k_want in ((1, [0, 1], [-1, 0]), (2, [-1, 0], [0, -1])):
        cache = jnp.zeros((1, 4, 2), jnp.float32)
        q, k, v = _rope_write(qkv, jnp.int32(pos), inv_freq, cache, jnp.zeros((1, 4, 2)))
        np.testing.assert_allclose(np.asarray(q), [q_want], atol=1e-6)
        np.testing.assert_allclose(np.asarray(k)[0, pos], k_want, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(v)[0, pos], [5.0, -7.0])


def test_rope_write_refuses_bad_arguments():
    def cache():  # donated by each call
        return jnp.zeros((2, 8, 4), jnp.float32)

    with pytest.raises(Exception, match="negative pos"):
        jax.block_until_ready(_rope_write(jnp.zeros(24), jnp.int32(-1), jnp.ones(2), cache(),
                                          cache()))
    # inv_freq of the wrong length: head_dim 6, the blocks' rows are 4
    with pytest.raises(Exception, match=r"must be \[n_kv_heads, B, 6\] for head_dim 6"):
        jax.block_until_ready(_rope_write(jnp.zeros(24), jnp.int32(0), jnp.ones(3), cache(),
                                          cache()))
    with pytest.raises(Exception, match="do not agree"):  # qkv of the wrong length
        jax.block_until_ready(_rope_write(jnp.zeros(22), jnp.int32(0), jnp.ones(2), cache(),
                                          cache()))


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 32000, 49152])
def test_argmax_is_runs_first_index_of_the_maximum(n):
    """`kernels.argmax` against NumPy's argmax (the first index of the maximum, as run.c's
    strict `>` scan): random logits, the maximum repeated later (and in the scalar tail), all
    equal; and every single inf or NaN, in the vector part or the tail, reported as not
    finite."""
    kernels.load()
    run = jax.jit(kernels.argmax)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    cases = [x, np.zeros(n, np.float32), np.full(n, -3e38, np.float32)]
    tied = x.copy()
    tied[[n // 3, n - 1]] = x.max() + 1  # the first of them wins
    cases.append(tied)
    for logits in cases:
        token, finite = run(logits)
        assert int(token) == int(np.argmax(logits)) and bool(finite) is True
    for where in {0, n // 2, n - 1}:
        for bad in (np.inf, -np.inf, np.nan):
            logits = x.copy()
            logits[where] = bad
            assert bool(run(logits)[1]) is False


def test_products_from_several_threads_at_once_finish_with_the_same_bits():
    """Three Python threads run parallel-sized products (and attention-free chains of them)
    at the same time, 50 times each: every call returns, within a minute, the bits of the same
    product run alone. The kernels' helper threads take whichever product was offered last; a
    caller claims what is left of its own, so concurrent products neither deadlock nor mix."""
    import threading

    kernels.load()
    rng = np.random.default_rng(5)
    mats = [jnp.asarray(rng.standard_normal((m, 576), dtype=np.float32)) for m in (700, 1536, 4099)]
    x = jnp.asarray(rng.standard_normal(576, dtype=np.float32))
    chain = jax.jit(lambda w, x: kernels.matvec(w, kernels.matvec(w, x, add=None)[:576] + x))
    alone = [np.asarray(chain(w, x)) for w in mats]
    failures = []

    def work(i):
        for _ in range(50):
            if not np.array_equal(np.asarray(chain(mats[i], x)), alone[i]):
                failures.append(i)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and failures == []


_SHAPES = [(1, 1), (3, 5), (300, 288), (4099, 576), (70, 1536)]


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(d, s) for d in ("float32", "bfloat16", "int8") for s in _SHAPES]
    + [("int8_groups", s) for s in _SHAPES if s[1] % 32 == 0],  # groups of 32, as GGUF's Q8_0
)
def test_the_prologues_and_the_residual_agree_with_numpy(dtype, shape):
    """`matvec(w, x, norm=...)` is `w @ rmsnorm(x)`, `matvec(w, a, gate=b, add=r)` is `r + w @
    (silu(a) * b)`, against float64 NumPy within the float32 rounding bound (a few ulps more
    for the prologue's own rounding), for each weight dtype; the residual is exactly `r + the
    plain product` (one IEEE addition)."""
    m, n = shape
    rng = np.random.default_rng(m * 7919 + n)
    w = rng.standard_normal((m, n), dtype=np.float32)
    if dtype == "int8_groups":
        wk = Int8Matrix(q=rng.integers(-127, 128, (m, n), dtype=np.int8),
                        scale=rng.random((m, n // 32), dtype=np.float32))
    else:
        wk = _as(dtype, w)
    x, norm, gate = (rng.standard_normal(n, dtype=np.float32) * 3 for _ in range(3))
    add = rng.standard_normal(m, dtype=np.float32)
    kernels.load()

    @jax.jit
    def run(wk, x, norm, gate, add):
        return (kernels.matvec(wk, x, norm=norm, eps=1e-5),
                kernels.matvec(wk, x, gate=gate, add=add),
                kernels.matvec(wk, x, add=add), kernels.matvec(wk, x))

    normed, swiglu, plus, plain = map(np.asarray, run(jax.device_put(wk), x, norm, gate, add))
    dense = np.asarray(wk, np.float32)
    xn = _rmsnorm64(x, norm, 1e-5)
    assert np.all(np.abs(normed - _reference(wk, xn)) <= 4 * _bound(dense, xn))
    xs = _silu64(x) * gate
    expected = add + _reference(wk, xs)
    assert np.all(np.abs(swiglu - expected) <= 4 * _bound(dense, xs) + 2e-7 * np.abs(expected))
    assert np.array_equal(plus, add + plain)


def test_the_prologues_by_hand():
    """Worked by hand: x = (3, 4), eps = 0: mean(x^2) = 12.5, rmsnorm(x) = x / sqrt(12.5), so
    (1, 1) . rmsnorm(x) * (2, 1) = (6 + 4) / sqrt(12.5) = 2 * sqrt(2); silu(ln 3) = ln 3 /
    (1 + 1/3) = 0.75 ln 3, times the gate 4 is 3 ln 3, plus the residual 1."""
    kernels.load()
    w = jnp.ones((1, 2), jnp.float32)
    got = jax.jit(lambda w, x, g: kernels.matvec(w, x, norm=g, eps=0.0))(
        w, jnp.array([3.0, 4.0]), jnp.array([2.0, 1.0]))
    np.testing.assert_allclose(np.asarray(got), [2 * np.sqrt(2)], rtol=2e-7)
    got = jax.jit(lambda w, x, g, r: kernels.matvec(w, x, gate=g, add=r))(
        jnp.ones((1, 1), jnp.float32), jnp.array([np.log(3.0)], jnp.float32),
        jnp.array([4.0]), jnp.array([1.0]))
    np.testing.assert_allclose(np.asarray(got), [1 + 3 * np.log(3.0)], rtol=2e-7)


def test_the_prologues_reject_bad_arguments():
    kernels.load()
    w, x = jnp.zeros((2, 3)), jnp.zeros(3)
    with pytest.raises(ValueError, match="norm or gate, not both"):
        kernels.matvec(w, x, norm=x, gate=x)
    with pytest.raises(ValueError, match="x's shape"):
        kernels.matvec(w, x, norm=jnp.zeros(2))
    with pytest.raises(ValueError, match="add must be"):
        kernels.matvec(w, x, add=jnp.zeros(3))


@functools.cache
def march_targets(march: str) -> tuple[dict[str, str], int]:
    """The kernels built with -march=MARCH (once per process; in JLLAMA_HOME's cache, whose
    file name hashes the source and the flags, so a machine compiles each level once per
    source, as the native library), every handler registered with JAX as `<symbol>_<march>`:
    ({symbol: its name there}, the library's vector width). Skips off x86-64."""
    import ctypes
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 -march levels")
    lib = ctypes.CDLL(str(library.build(march=march)))
    names = {}
    for symbol in library.SYMBOLS:
        names[symbol] = f"{symbol}_{march.replace('-', '_')}"
        jax.ffi.register_ffi_target(names[symbol], jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return names, int(lib.jllama_vector_width())


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_generic_paths_agree_with_numpy(march):
    """Machines without AVX-512 (the issue's AVX2 machine kind) compile the other branches of
    matvec.cc: built here with -march=x86-64-v3 (AVX2 + FMA) and plain x86-64, registered
    under their own names, and checked like the native build."""
    targets, width = march_targets(march)
    # AVX2 + FMA: the prefill attention's 8-lane loops; plain x86-64: none (prefill then
    # keeps XLA's attention).
    assert width == {"x86-64-v3": 8, "x86-64": 1}[march]
    symbols = {**kernels.TARGETS, "int8_groups": kernels.GROUPED_INT8,
               "attention": kernels.ATTENTION, "argmax": kernels.ARGMAX,
               "attention_chunk": kernels.ATTENTION_CHUNK}
    names = {dtype: targets[symbol] for dtype, symbol in symbols.items()}
    rng = np.random.default_rng(11)
    for m, n in [(3, 5), (9, 130), (4099, 97), (700, 576)]:
        w = rng.standard_normal((m, n), dtype=np.float32)
        x = rng.standard_normal(n, dtype=np.float32)
        out = jax.ShapeDtypeStruct((m,), jnp.float32)
        for dtype in ("float32", "bfloat16", "int8"):
            wk = _as(dtype, w)
            args = (wk.q, wk.scale, x) if dtype == "int8" else (wk, x)
            got = np.asarray(jax.ffi.ffi_call(names[dtype], out)(*map(jnp.asarray, args),
                                                                 **_PLAIN))
            assert np.all(np.abs(got - _reference(wk, x)) <= _bound(np.asarray(wk, np.float32), x))
            # The prologues and the residual (std::exp and the scalar norm on these builds).
            norm, add = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(m)
            call = jax.ffi.ffi_call(names[dtype], out)
            got = np.asarray(call(*map(jnp.asarray, args), jnp.asarray(norm),
                                  **{**_PLAIN, "prologue": np.int32(kernels.PROLOGUE_RMSNORM),
                                     "eps": np.float32(1e-5)}))
            xn = _rmsnorm64(x, norm, 1e-5)
            assert np.all(np.abs(got - _reference(wk, xn)) <= 4 * _bound(np.asarray(wk, np.float32), xn))
            got = np.asarray(call(*map(jnp.asarray, args), jnp.asarray(norm),
                                  jnp.asarray(add, np.float32),
                                  **{**_PLAIN, "prologue": np.int32(kernels.PROLOGUE_SWIGLU),
                                     "residual": np.int32(1)}))
            xs = _silu64(x) * norm
            expected = np.float32(add) + _reference(wk, xs)
            assert np.all(np.abs(got - expected) <= 4 * _bound(np.asarray(wk, np.float32), xs) + 1e-6)
        if n % 32 == 0:  # one scale per 32 weights, as GGUF's Q8_0
            wg = Int8Matrix(q=rng.integers(-127, 128, (m, n), dtype=np.int8),
                            scale=rng.random((m, n // 32), dtype=np.float32))
            got = np.asarray(jax.ffi.ffi_call(names["int8_groups"], out)(
                jnp.asarray(wg.q), jnp.asarray(wg.scale), jnp.asarray(x), **_PLAIN))
            assert np.all(np.abs(got - _reference(wg, x)) <= _bound(np.asarray(wg, np.float32), x))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    for n in (1, 17, 32000):
        logits = rng.standard_normal(n).astype(np.float32)
        logits[n // 2] = logits[n - 1] = logits.max() + 1
        token, finite = jax.ffi.ffi_call(names["argmax"], (scalar, scalar))(jnp.asarray(logits))
        assert (int(token), int(finite)) == (int(np.argmax(logits)), 1)
        logits[n - 1] = np.nan
        assert int(jax.ffi.ffi_call(names["argmax"], (scalar, scalar))(jnp.asarray(logits))[1]) == 0
    for case in [(3, 3, 64, 256, 2, 300, 1), (2, 4, 20, 16, 4, 50, None)]:
        args, expected = _attention_case(rng, *case)
        if case[-1] is None:  # the graph mode's form: no block given apart
            args = args[:4] + [jnp.int32(-1), args[1][0], args[2][0]]
        q, keys, values, pos, cur, key_cur, value_cur = args
        got = jax.ffi.ffi_call(names["attention"], jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, pos, cur, key_cur, value_cur, *keys, *values)
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=1e-5)
    for case in [(3, 3, 64, 256, 2, 40, 250), (2, 1, 16, 16, 3, 17, 0),
                 (2, 2, 128, 64, 3, 29, 100), (1, 3, 48, 32, 2, 3, 60)]:
        (q, keys, values, pos), expected = _chunk_case(rng, *case)
        got = jax.ffi.ffi_call(names["attention_chunk"],
                               jax.ShapeDtypeStruct(expected.shape, jnp.float32))(
            q, pos, *keys, *values)
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=1e-5)
