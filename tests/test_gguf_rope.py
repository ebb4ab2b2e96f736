"""RoPE scaling in GGUF files: llama.cpp's `rope_freqs.weight` tensor (Llama 3.1/3.2) and the
`llama.rope.scaling.*` keys, read as llama.cpp reads them.

References: llama.cpp's rules (src/llama-model.cpp `load_hparams`: type "linear" by default,
factor 0 meaning none, the older rope.scale_linear key; ggml-cpu's rope: frequency i is
theta_i / rope_freqs[i] * freq_scale), worked out here by hand in float64; files written with
the `gguf` package's own writer (tests/gguf_files.py).
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
from gguf_files import write_gguf

from jllama.model.config import ModelConfig, RopeScaling
from jllama.errors import CheckpointError, ConfigError, JllamaError
from jllama.formats.gguf import config_from_metadata, read_gguf, read_metadata
from jllama.model.loading import open_model
from jllama.model.rope import rope_frequencies
from jllama.model.weights import random_weights

Q = gguf.GGMLQuantizationType
TINY = ModelConfig(
    dim=64, hidden_dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=259, seq_len=32,
    rope_theta=500000.0,
)  # head_dim 16: 8 rotated pairs
FACTORS = np.array([1.0, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0], np.float32)


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=5, scale=0.1)


def _by_hand(theta: float, head_dim: int, divisors) -> np.ndarray:
    """theta ** (-2i / head_dim) / divisor_i in float64 (ggml's rope with freq factors)."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    return theta ** (-2.0 * i / head_dim) / np.asarray(divisors, np.float64)


def test_rope_freqs_tensor_becomes_per_frequency_factors(tmp_path, weights):
    path = write_gguf(tmp_path / "m.gguf", TINY, weights,
                      extra_tensors={"rope_freqs.weight": FACTORS})
    model = read_gguf(path)
    scaling = model.config.rope_scaling
    assert scaling == RopeScaling("freq_factors", 1.0, freq_factors=tuple(FACTORS.tolist()))
    hash(model.config)  # still a static argument under jit
    np.testing.assert_allclose(
        rope_frequencies(model.config), _by_hand(500000.0, 16, FACTORS), rtol=1e-6
    )
    assert "rope_freqs.weight" not in model.tensor_types  # not a weight of the model
    # open_model takes the same route (the CLI's)
    assert open_model(path).config.rope_scaling == scaling


def test_rope_freqs_changes_the_forward_pass(tmp_path, weights):
    from jllama.backends import make_backend

    plain = read_gguf(write_gguf(tmp_path / "a.gguf", TINY, weights))
    scaled = read_gguf(write_gguf(tmp_path / "b.gguf", TINY, weights,
                                  extra_tensors={"rope_freqs.weight": FACTORS}))
    out = {}
    for name, model in (("plain", plain), ("scaled", scaled)):
        backend = make_backend("numpy")
        backend.prepare(model.config, model.weights)
        out[name] = [backend.forward(t, pos) for pos, t in enumerate([3, 70, 101, 9, 44])]
    np.testing.assert_array_equal(out["plain"][0], out["scaled"][0])  # position 0: no rotation
    assert np.max(np.abs(out["plain"][-1] - out["scaled"][-1])) > 1e-3


def _metadata(tmp_path, weights, **keys) -> dict:
    meta = read_metadata(gguf.GGUFReader(write_gguf(tmp_path / "k.gguf", TINY, weights)))
    meta.update({"llama." + k: v for k, v in keys.items()})
    return meta


@pytest.mark.parametrize(
    "keys, factor",
    [
        ({}, None),
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, 4.0),
        ({"rope.scaling.factor": 4.0}, 4.0),  # llama.cpp's default type is "linear"
        ({"rope.scale_linear": 2.0}, 2.0),  # the older key
        ({"rope.scaling.factor": 4.0, "rope.scale_linear": 2.0}, 4.0),  # the newer key wins
        ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, None),  # none: never scaled
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}, None),  # 0 means 1
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 1.0}, None),
        ({"rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 8192,
          "rope.scaling.finetuned": True, "rope.scaling.attn_factor": 1.0}, 4.0),
    ],
)
def test_rope_scaling_keys_as_llama_cpp_reads_them(tmp_path, weights, keys, factor):
    config = config_from_metadata(_metadata(tmp_path, weights, **keys), "k.gguf")
    if factor is None:
        assert config.rope_scaling is None
    else:
        assert config.rope_scaling == RopeScaling("linear", factor)
        np.testing.assert_allclose(
            rope_frequencies(config), _by_hand(500000.0, 16, [factor] * 8), rtol=1e-6
        )


def test_linear_factor_applies_on_top_of_rope_freqs(tmp_path, weights):
    config = config_from_metadata(_metadata(tmp_path, weights, **{
        "rope.scaling.type": "linear", "rope.scaling.factor": 4.0}), "k.gguf")
    path = write_gguf(tmp_path / "f.gguf", TINY, weights,
                      extra_tensors={"rope_freqs.weight": FACTORS})
    (tensor,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    from jllama.formats.gguf import with_rope_freqs

    scaled = with_rope_freqs(config, tensor, "f.gguf")
    assert scaled.rope_scaling.factor == 4.0
    np.testing.assert_allclose(
        rope_frequencies(scaled), _by_hand(500000.0, 16, FACTORS * 4.0), rtol=1e-6
    )


@pytest.mark.parametrize(
    "keys, fragments",
    [
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, ["'yarn' is not supported"]),
        ({"rope.scaling.type": "longrope"}, ["'longrope' is not supported"]),
        ({"rope.scaling.type": "llama3"}, ["'llama3' is not a RoPE scaling type llama.cpp knows"]),
        ({"rope.scaling.type": ""}, ["rope.scaling.type=''"]),
        ({"rope.scaling.type": 1}, ["rope.scaling.type", "not a str"]),
        ({"rope.scaling.factor": -2.0}, ["rope.scaling.factor=-2.0", "not negative"]),
        ({"rope.scaling.factor": math.inf}, ["rope.scaling.factor=inf"]),
        ({"rope.scaling.factor": "4"}, ["rope.scaling.factor", "not a float"]),
        ({"rope.scaling.attn_factor": 0.5}, ["attn_factor=0.5 is not supported"]),
        ({"rope.scaling.original_context_length": 1.5}, ["original_context_length", "not an int"]),
    ],
)
def test_bad_rope_scaling_keys_are_one_line(tmp_path, weights, keys, fragments):
    with pytest.raises(CheckpointError) as info:
        config_from_metadata(_metadata(tmp_path, weights, **keys), "/m/k.gguf")
    message = str(info.value)
    assert "\n" not in message and message.startswith("/m/k.gguf: "), message
    for fragment in fragments:
        assert fragment in message, message


def _f16(values) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    return np.asarray(values, np.float16), Q.F16


@pytest.mark.parametrize(
    "tensor, fragments",
    [
        ({"extra_tensors": {"rope_freqs.weight": FACTORS[:7]}},
         ["shape [7], expected [8]", "head_dim=16"]),
        ({"extra_tensors": {"rope_freqs.weight": np.ones((2, 8), np.float32)}},
         ["shape [2, 8], expected [8]"]),
        ({"raw_tensors": {"rope_freqs.weight": _f16(FACTORS)}}, ["is F16", "must be F32"]),
        ({"extra_tensors": {"rope_freqs.weight": np.where(np.arange(8) == 3, np.nan, FACTORS)}},
         ["factor [3] is nan", "finite and positive"]),
        ({"extra_tensors": {"rope_freqs.weight": np.where(np.arange(8) == 0, 0.0, FACTORS)}},
         ["factor [0] is 0.0"]),
        ({"extra_tensors": {"rope_freqs.weight": -FACTORS}}, ["factor [0] is -1.0"]),
        ({"extra_tensors": {"rope_freqs.weight": np.where(np.arange(8) == 7, np.inf, FACTORS)}},
         ["factor [7] is inf"]),
    ],
    ids=["short", "2d", "f16", "nan", "zero", "negative", "inf"],
)
def test_bad_rope_freqs_is_one_line_naming_the_tensor(tmp_path, weights, tensor, fragments):
    path = write_gguf(tmp_path / "bad.gguf", TINY, weights, **tensor)
    with pytest.raises(JllamaError) as info:
        open_model(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}: tensor 'rope_freqs.weight'" in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_rope_freqs_at_the_cli_exits_1(tmp_path, weights):
    from test_cli import run

    path = write_gguf(tmp_path / "bad.gguf", TINY, weights,
                      extra_tensors={"rope_freqs.weight": FACTORS[:7]})
    result = run(f"--checkpoint={path}", "--prompt=hi", "--steps=2")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rope_freqs.weight" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"rope_type": "freq_factors", "factor": 1.0}, "needs at least one factor"),
        ({"rope_type": "freq_factors", "factor": 1.0, "freq_factors": (1.0, math.nan)},
         "freq_factors[1] is nan"),
        ({"rope_type": "freq_factors", "factor": 1.0, "freq_factors": (0.0,)},
         "freq_factors[0] is 0.0"),
        ({"rope_type": "linear", "factor": 2.0, "freq_factors": (1.0,)},
         "freq_factors are given but the type is 'linear'"),
        ({"rope_type": "freq_factors", "factor": 0.0, "freq_factors": (1.0,)}, "factor=0.0"),
    ],
)
def test_rope_scaling_refuses_bad_factors(kwargs, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        RopeScaling(**kwargs)
    assert fragment in str(info.value)


def test_model_config_checks_one_factor_per_rotated_pair():
    scaling = RopeScaling("freq_factors", 1.0, freq_factors=(1.0,) * 7)
    with pytest.raises(ConfigError, match="7 freq_factors; head_dim=16 rotates 8 pairs"):
        dataclasses.replace(TINY, rope_scaling=scaling)
    eight = dataclasses.replace(scaling, freq_factors=(2.0,) * 8)
    ok = dataclasses.replace(TINY, rope_scaling=eight)
    assert ok.rope_scaling.freq_factors == (2.0,) * 8
