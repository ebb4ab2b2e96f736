"""jllama.model.convert: the embedded stories260K and a GGUF file to llama2.c versions 1 and 2 and
back, compared with the original arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import STORIES260K
from gguf_files import write_gguf

from jllama.model.config import ModelConfig
from jllama.model.convert import convert
from jllama.errors import ConfigError
from jllama.formats.llama2c import read_checkpoint, read_checkpoint_header
from jllama.model.weights import random_weights

FIELDS = ["token_embedding_table", "rms_att_weight", "wq", "wk", "wv", "wo", "rms_ffn_weight",
          "w1", "w2", "w3", "rms_final_weight", "wcls"]
MATRICES = [f for f in FIELDS if not f.startswith("rms_")]
# vocab_size at most 259: write_gguf's byte-level vocabulary.
TINY = ModelConfig(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                   seq_len=32, shared_weights=False)


def _assert_same(got, want, fields=FIELDS):
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and np.array_equal(a, b), name


def test_stories260k_to_version_1_and_back(tmp_path, stories260k):
    config, weights = stories260k
    report = convert(STORIES260K, tmp_path / "v1.bin")
    assert report.version == 1 and report.source_format == "llama2c"
    assert report.config == config
    assert report.destination == tmp_path / "v1.bin"
    assert report.nbytes == (tmp_path / "v1.bin").stat().st_size
    # header + norms + the matrices of a shared-classifier model, no RoPE tables
    assert report.nbytes == 256 + 4 * (config.n_params())
    assert (report.group_size, report.max_quantization_error) == (0, 0.0)
    config1, weights1 = read_checkpoint(tmp_path / "v1.bin")
    assert config1 == config
    _assert_same(weights1, weights)
    # ... and back to version 0: the original file, but for the RoPE tables run.c skips
    # (regenerated with float64 angles; see test_checkpoint_llama2c).
    back = convert(tmp_path / "v1.bin", tmp_path / "v0.bin", version=0)
    tables = 2 * config.seq_len * config.head_dim // 2 * 4
    original = STORIES260K.read_bytes()
    copy = (tmp_path / "v0.bin").read_bytes()
    assert back.nbytes == len(copy) == len(original)
    assert copy[:-tables] == original[:-tables]


def test_stories260k_to_version_2_and_back(tmp_path, stories260k):
    config, weights = stories260k
    report = convert(STORIES260K, tmp_path / "v2.bin", version=2)
    assert report.version == 2 and report.config == config
    assert report.group_size == 4  # 64 backs off to divide hidden_dim 172
    assert read_checkpoint_header(tmp_path / "v2.bin").group_size == 4
    config2, weights2 = read_checkpoint(tmp_path / "v2.bin")
    assert config2 == config
    _assert_same(weights2, weights, ["rms_att_weight", "rms_ffn_weight", "rms_final_weight"])
    errors = {name: float(np.abs(getattr(weights2, name) - getattr(weights, name)).max())
              for name in MATRICES}
    # The report's error is what the file holds against the original.
    assert report.max_quantization_error == max(errors.values())
    assert report.quantization_errors == {k: v for k, v in errors.items() if k != "wcls"}
    # Version 2 back to version 1: exactly the dequantized weights.
    convert(tmp_path / "v2.bin", tmp_path / "v1.bin", version=1)
    _, weights1 = read_checkpoint(tmp_path / "v1.bin")
    _assert_same(weights1, weights2)
    # and quantizing the dequantized weights again changes nothing
    again = convert(tmp_path / "v1.bin", tmp_path / "v2b.bin", version=2)
    assert (tmp_path / "v2b.bin").read_bytes() == (tmp_path / "v2.bin").read_bytes()
    assert again.max_quantization_error < 1e-6


@pytest.mark.parametrize("shared", [False, True])
def test_gguf_f32_to_version_1_keeps_every_weight(tmp_path, shared):
    config = dataclasses.replace(TINY, shared_weights=shared)
    weights = random_weights(config, seed=5, scale=0.1)
    src = write_gguf(tmp_path / "m.gguf", config, weights)
    report = convert(src, tmp_path / "m.bin")
    assert report.source_format == "gguf" and report.version == 1
    # GGUF keeps norm_eps as a float32; llama2.c's readers use 1e-5 again.
    assert dataclasses.replace(report.config, norm_eps=1e-5) == config
    config1, weights1 = read_checkpoint(tmp_path / "m.bin")
    assert config1 == config
    _assert_same(weights1, weights)
    assert (weights1.wcls is weights1.token_embedding_table) == shared


def test_gguf_to_version_2(tmp_path):
    weights = random_weights(TINY, seed=6, scale=0.1)
    src = write_gguf(tmp_path / "m.gguf", TINY, weights)
    report = convert(src, tmp_path / "m.bin", version=2)
    assert report.group_size == 64
    _, weights2 = read_checkpoint(tmp_path / "m.bin")
    for name in MATRICES:
        original = getattr(weights, name).reshape(-1, 64)
        step = np.abs(original).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(getattr(weights2, name).reshape(-1, 64) - original)
                      <= step / 2 * (1 + 1e-5)), name


def test_settings_llama2c_cannot_hold_are_refused_unless_forced(tmp_path):
    config = dataclasses.replace(TINY, rope_theta=50000.0)
    weights = random_weights(config, seed=7, scale=0.1)
    src = write_gguf(tmp_path / "m.gguf", config, weights)
    with pytest.raises(ConfigError, match="rope_theta=50000.0"):
        convert(src, tmp_path / "m.bin")
    assert not (tmp_path / "m.bin").exists()
    report = convert(src, tmp_path / "m.bin", force=True)
    assert report.config.rope_theta == 50000.0  # what was read; the file cannot record it
    assert read_checkpoint(tmp_path / "m.bin")[0].rope_theta == 10000.0


def test_bad_version_is_refused_before_reading(tmp_path):
    with pytest.raises(ConfigError, match="version=5"):
        convert(tmp_path / "does-not-exist.gguf", tmp_path / "x.bin", version=5)


def test_cli_names_the_output_flag_when_it_cannot_write(tmp_path):
    from test_cli import run

    target = tmp_path / "a_folder.bin"
    target.mkdir()
    done = run("convert", f"--checkpoint={STORIES260K}", f"--output={target}")
    assert done.returncode == 1
    assert done.stderr == f"jllama: error: --output={target}: exists and is not a regular file\n"
