"""Which of `jllama.backends.base`'s protocols each backend satisfies (the capabilities a
Session checks with isinstance), the notes `Described` asks for, and the typed program set
`jllama.graphs.Programs` the jax backend runs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jllama import graphs
from jllama.backends.base import (
    Backend,
    CompilePlanning,
    Described,
    DeviceLoop,
    Prefill,
    PrefillLogits,
)
from jllama.backends.jax_graph import LOOP_CHUNK, JaxGraphBackend
from jllama.backends.numpy_ref import NumpyBackend
from jllama.model.config import ModelConfig
from jllama.model.weights import cast_weights, random_weights

PROTOCOLS = (Backend, Prefill, PrefillLogits, DeviceLoop, CompilePlanning, Described)


class CountingBackend:
    """docs/python.md's example of adding a backend: `name`, `prepare` and `forward` only."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, f"counting-{inner.name}", 0

    def prepare(self, config, weights):
        self.inner.prepare(config, weights)

    def forward(self, token, pos):
        self.calls += 1
        return self.inner.forward(token, pos)


def satisfied(backend) -> set[str]:
    return {p.__name__ for p in PROTOCOLS if isinstance(backend, p)}


@pytest.mark.parametrize("decode", ["graph", "fused", "loop"])
def test_the_jax_backend_satisfies_every_protocol(decode):
    assert satisfied(JaxGraphBackend(decode=decode)) == {p.__name__ for p in PROTOCOLS}


def test_the_numpy_backend_satisfies_backend_prefill_logits_and_described():
    assert satisfied(NumpyBackend()) == {"Backend", "PrefillLogits", "Described"}


def test_a_minimal_backend_satisfies_only_backend():
    assert satisfied(CountingBackend(NumpyBackend())) == {"Backend"}


def test_the_jax_backend_describes_its_device_and_loop():
    b = JaxGraphBackend()
    assert b.platform == jax.devices()[0].platform
    assert b.loop_chunk == LOOP_CHUNK
    assert b.notes() == []


def test_jax_notes_are_the_cli_lines_without_their_prefix():
    b = JaxGraphBackend()
    b.matvec_note = "no C++ compiler (CXX=nothing)"
    b.weights_note = "XLA's products take GGML blocks as grouped int8"
    b.sharding_notes = ["wcls is replicated", "n_kv_heads is replicated"]
    assert b.notes() == [
        "using XLA's products (matvec=xla): no C++ compiler (CXX=nothing)",
        "XLA's products take GGML blocks as grouped int8",
        "wcls is replicated",
        "n_kv_heads is replicated",
    ]


def test_numpy_notes_say_how_weights_were_widened():
    config = ModelConfig(dim=32, hidden_dim=64, n_layers=1, n_heads=4, n_kv_heads=4,
                         vocab_size=40, seq_len=16)
    b = NumpyBackend()
    assert b.platform == "cpu" and b.notes() == []
    b.prepare(config, random_weights(config))
    assert b.notes() == []
    b.prepare(config, cast_weights(random_weights(config), "int8"))
    assert b.notes() == [b.weights_note] and "dequantized to float32" in b.weights_note


def test_one_device_programs_are_the_graphs_functions():
    fields = [f.name for f in dataclasses.fields(graphs.Programs)]
    assert fields == [
        "qkv", "attention", "block", "classifier", "qkv_chunk", "attention_chunk",
        "block_chunk", "classifier_last", "classifier_rows", "decode_step", "write_caches",
        "decode_loop", "decode_batch_step", "write_rows",
    ]
    for name in fields:
        assert vars(graphs.ONE_DEVICE)[name] is vars(graphs)[name], name
    with pytest.raises(dataclasses.FrozenInstanceError):
        graphs.ONE_DEVICE.qkv = None
    assert JaxGraphBackend()._programs is graphs.ONE_DEVICE


def test_sharded_programs_are_a_programs():
    from jax.sharding import Mesh

    from jllama.graphs.sharded import sharded_programs
    from jllama.platform.sharding import AXIS

    programs = sharded_programs(Mesh(np.array(jax.devices()[:1]), (AXIS,)))
    assert isinstance(programs, graphs.Programs)
    assert all(callable(program) for program in vars(programs).values())
