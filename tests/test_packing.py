"""`jllama.packing`: the decode step's matrices end to end in one buffer, in reading order, and
the jax backend's device arrays over that same memory (the addresses worked out by hand from
the shapes: each matrix starts where the one before ends, rounded up to 64 bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from test_backends import GQA_UNSHARED

from jllama.backends import make_backend
from jllama.packing import ALIGN, DECODE_ORDER, pack_in_decode_order
from jllama.quant import Int8Matrix
from jllama.weights import cast_weights, random_weights, to_graph_weights


def _address(a) -> int:
    return np.asarray(a.q if isinstance(a, Int8Matrix) else a).ctypes.data


def _nbytes(a) -> int:
    return (a.q if isinstance(a, Int8Matrix) else np.asarray(a)).nbytes


def _in_order(layers, wcls):
    return [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]


def _assert_end_to_end(matrices):
    start = _address(matrices[0])
    assert start % ALIGN == 0
    for before, after in zip(matrices, matrices[1:], strict=False):
        padded = -(-_nbytes(before) // ALIGN) * ALIGN
        assert _address(after) == _address(before) + padded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_packed_matrices_are_the_same_values_end_to_end_in_reading_order(dtype):
    host = to_graph_weights(cast_weights(random_weights(GQA_UNSHARED, seed=3), dtype))
    layers, wcls = pack_in_decode_order(host.layers, host.wcls)
    before, after = _in_order(host.layers, host.wcls), _in_order(layers, wcls)
    for old, new in zip(before, after, strict=True):
        if isinstance(old, Int8Matrix):
            np.testing.assert_array_equal(new.q, old.q)
            assert new.scale is old.scale
        else:
            assert new.dtype == old.dtype and new.shape == old.shape
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    _assert_end_to_end(after)
    for old, new in zip(host.layers, layers, strict=True):  # norms are not copied
        assert new.rms_att_weight is old.rms_att_weight and new.rms_ffn_weight is old.rms_ffn_weight


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_cpu_backend_reads_its_weights_from_one_buffer(stories260k, dtype):
    config, weights = stories260k
    b = make_backend("jax")
    b.prepare(config, cast_weights(weights, dtype))
    # device_put aliased the packed buffer: the device arrays lie end to end as packed
    _assert_end_to_end(_in_order(b.layers, b.wcls))
