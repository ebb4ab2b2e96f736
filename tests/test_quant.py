"""int8 weights with per-row scales (`jllama.model.quant`, `--dtype=int8`).

References: values worked out by hand, the dequantized float32 matrices run through the NumPy
reference backend, and the float32 model's logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from jllama.backends import make_backend
from jllama.errors import ConfigError
from jllama.generation.generate import Generation
from jllama.model.loading import open_model
from jllama.model.quant import Int8Matrix, concatenate_rows, dequantize, quantize_int8
from jllama.sampling import Sampler
from jllama.model.weights import cast_weights, to_graph_weights, weights_dtype, weights_nbytes


def test_quantize_by_hand():
    w = np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [0.25, 0.125, -0.0625, 0.03125]],
                 np.float32)
    m = quantize_int8(w)
    # Row 0: step 2/127; 1 / (2/127) = 63.5 rounds to even 64, 0.5 -> 31.75 -> 32.
    # Row 1: all zeros, step 1. Row 2: step 0.25/127; 0.125 -> 63.5 -> 64; -0.0625 -> -31.75
    # -> -32; 0.03125 -> 15.875 -> 16.
    np.testing.assert_array_equal(m.q, [[64, -127, 32, 0], [0, 0, 0, 0], [127, 64, -32, 16]])
    np.testing.assert_array_equal(
        m.scale, np.array([2 / 127, 1.0, 0.25 / 127], np.float32)
    )
    assert m.q.dtype == np.int8 and m.scale.dtype == np.float32
    assert m.shape == (3, 4) and m.dtype == np.int8 and m.nbytes == 12 + 12
    np.testing.assert_array_equal(np.asarray(m), m.q.astype(np.float32) * m.scale[:, None])


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
              elements=st.floats(-1e4, 1e4, width=32)))
def test_error_is_at_most_half_a_step(w):
    m = quantize_int8(w)
    err = np.abs(dequantize(m) - w)
    # Half a step, plus float32 rounding of w / scale and of q * scale.
    bound = m.scale[:, None] * 0.5 * (1 + 1e-5) + np.abs(w) * 2e-7
    assert np.all(err <= bound)
    assert np.all(np.abs(m.q) <= 127)


def test_a_row_of_one_subnormal_stays_within_half_a_step():
    # Found by hypothesis: 4.4140902e-43 / 127 rounds down to a subnormal step so coarse that
    # w / step was 157, clipped to 127 (error 8.5e-44, far over half a step).
    w = np.zeros((2, 6), np.float32)
    w[0, 0], w[1, 2] = 4805.0186, 4.4140902e-43
    m = quantize_int8(w)
    assert np.all(np.abs(m.q.astype(np.int32)) <= 127)
    err = np.abs(dequantize(m) - w)
    assert np.all(err <= m.scale[:, None] * 0.5 * (1 + 1e-5) + np.abs(w) * 2e-7)


def test_quantize_refuses_non_finite_and_vectors():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int8(np.array([[1.0, np.inf]], np.float32))
    with pytest.raises(ValueError, match="needs a matrix"):
        quantize_int8(np.ones(4, np.float32))


def test_stacking_rows_equals_quantizing_the_stack():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(
        np.float32)
    both = concatenate_rows([quantize_int8(a), quantize_int8(b)])
    want = quantize_int8(np.concatenate([a, b]))
    np.testing.assert_array_equal(both.q, want.q)
    np.testing.assert_array_equal(both.scale, want.scale)


def test_cast_weights_int8_keeps_norms_and_shared_classifier(stories260k):
    config, weights = stories260k
    q = cast_weights(weights, "int8")
    assert weights_dtype(q) == "int8"
    assert isinstance(q.wq, Int8Matrix) and q.wq.shape == weights.wq.shape
    assert q.wcls is q.token_embedding_table  # stories260K shares it: quantized once
    assert q.rms_att_weight is weights.rms_att_weight
    # About a quarter of the float32 bytes (plus 4 bytes a row).
    assert weights_nbytes(q) < 0.3 * weights_nbytes(weights)
    layer = to_graph_weights(q).layers[1]
    assert isinstance(layer.wqkv, Int8Matrix)
    np.testing.assert_array_equal(layer.wqkv.q[: config.q_dim], q.wq.q[1])
    back = cast_weights(q, "float32")
    assert np.abs(back.w1 - weights.w1).max() <= np.abs(weights.w1).max() / 127
    with pytest.raises(ConfigError, match="int4"):
        cast_weights(weights, "int4")


def test_jax_int8_logits_equal_the_numpy_reference_on_dequantized_weights(stories260k):
    """The jax programs multiply int8 rows by the scale after the sum; the reference widens
    the weights first (`q * scale`) and runs float32: the same model, sums in another order."""
    config, weights = stories260k
    q = cast_weights(weights, "int8")
    jax_b, ref = make_backend("jax"), make_backend("numpy")
    jax_b.prepare(config, q)
    ref.prepare(config, q)
    tokens = [1, 403, 407, 261, 378, 300, 45, 9, 17, 230, 5]
    for pos, t in enumerate(tokens):
        want = ref.forward(t, pos)
        np.testing.assert_allclose(jax_b.forward(t, pos), want, atol=1e-4)
    # Batched prefill on int8 weights too (one 8-token chunk, then 3 decode steps).
    fresh = make_backend("jax")
    fresh.prepare(config, q)
    np.testing.assert_allclose(fresh.prefill(tokens, 0), want, atol=1e-4)


def test_int8_stays_close_to_float32_on_stories260k(stories260k):
    """Accuracy against float32 (measured: max |logit difference| 0.31 of logits up to 22 over
    the 128 positions after the prompt; teacher-forced greedy agreement 126/128)."""
    config, weights = stories260k
    f32, i8 = make_backend("jax"), make_backend("jax")
    f32.prepare(config, weights)
    i8.prepare(config, cast_weights(weights, "int8"))
    gen = Generation(f32.forward, [1, 403, 407, 261, 378], Sampler(0.0), steps=132, stop_ids=())
    tokens = [1] + [t.id for t in gen]
    diffs, agree = [], 0
    for pos, t in enumerate(tokens[:-1]):
        a, b = f32.forward(t, pos), i8.forward(t, pos)
        diffs.append(np.abs(a - b).max())
        agree += int(np.argmax(a) == np.argmax(b))
    assert max(diffs) < 0.5
    assert agree >= 0.95 * len(diffs)


def test_cli_dtype_int8(tmp_path):
    """`--dtype=int8` end to end: the memory line says int8, the story is told."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "jllama", "--dtype=int8", "--temperature=0", "--steps=40"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "(int8)" in r.stderr
    assert len(r.stdout.split()) > 10


def test_open_model_int8():
    m = open_model(dtype="int8")
    assert weights_dtype(m.weights) == "int8"
    assert dataclasses.is_dataclass(m.weights)


def test_group_scales_by_hand():
    from jllama.model.quant import concatenate_rows, dequantize, group_scales

    g = Int8Matrix(q=np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int8),
                   scale=np.array([[0.5, 2.0], [1.0, 0.25]], np.float32))
    assert g.grouped and g.group_size == 2
    assert dequantize(g).tolist() == [[0.5, 1.0, 6.0, 8.0], [5.0, 6.0, 1.75, 2.0]]
    assert dequantize(g[1]).tolist() == [5.0, 6.0, 1.75, 2.0]  # one row, as an embedding
    r = Int8Matrix(q=np.array([[2, -4, 6, 8]], np.int8), scale=np.array([0.5], np.float32))
    assert group_scales(r, 2).scale.tolist() == [[0.5, 0.5]]
    both = concatenate_rows([g, r])  # the per-row matrix spread over groups of 2: exact
    assert both.scale.shape == (3, 2)
    assert dequantize(both).tolist() == dequantize(g).tolist() + [[1.0, -2.0, 3.0, 4.0]]
    with pytest.raises(ValueError, match="groups of 3"):
        group_scales(r, 3)
