"""Hugging Face folders end to end: bf16 weights kept in bf16, HF -> llama2.c v1 / v2 with the
same logits, and bad folders at the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_models import Spec, build, hf_logits, save
from test_cli import run

from jllama.backends import make_backend
from jllama.model.convert import convert
from jllama.formats.llama2c import read_checkpoint
from jllama.model.loading import open_model

# Llama 2 style with llama2.c's fixed settings (rope_theta 1e4, eps 1e-5, head_dim = dim /
# n_heads, no scaling), so a llama2.c file can hold it whole; GQA 2:1.
LLAMA2 = Spec("llama2c-able", {
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}, seed=11)
BF16 = Spec("bf16-tied", {
    "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 64, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}, seed=12, save_dtype="bfloat16")
TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 300, size=48)]


def _logits(config, weights, backend="numpy"):
    b = make_backend(backend)
    b.prepare(config, weights)
    return np.stack([b.forward(t, pos) for pos, t in enumerate(TOKENS)])


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    model = build(LLAMA2)
    folder = save(model, LLAMA2, tmp_path_factory.mktemp("hf"))
    return folder, hf_logits(model, TOKENS)


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_bf16_folder_stays_bf16_and_matches_transformers(tmp_path, backend):
    model = build(BF16)  # the oracle's weights are rounded to bf16, its arithmetic is f32
    folder = save(model, BF16, tmp_path)
    ours = open_model(folder, need_tokenizer=False)
    assert ours.file_format == "hf"
    assert ours.weights.wq.dtype.name == "bfloat16"
    assert ours.weights.rms_att_weight.dtype == np.float32
    assert ours.weights.wcls is ours.weights.token_embedding_table
    diff = np.abs(_logits(ours.config, ours.weights, backend) - hf_logits(model, TOKENS)).max()
    assert diff < 1e-4, diff


def test_hf_to_llama2c_v1_gives_the_same_logits(tmp_path, llama2):
    folder, oracle = llama2
    report = convert(folder, tmp_path / "m.bin", version=1)
    assert report.source_format == "hf" and report.version == 1
    config, weights = read_checkpoint(tmp_path / "m.bin")
    direct = open_model(folder, need_tokenizer=False)
    via_v1 = _logits(config, weights)
    assert np.array_equal(via_v1, _logits(direct.config, direct.weights))
    assert np.abs(via_v1 - oracle).max() < 1e-4


def test_hf_to_llama2c_v2_within_the_quantization_error(tmp_path, llama2):
    folder, oracle = llama2
    report = convert(folder, tmp_path / "m.bin", version=2)
    config, weights = read_checkpoint(tmp_path / "m.bin")
    diff = float(np.abs(_logits(config, weights) - oracle).max())
    spread = float(np.abs(oracle).max())
    # Q8_0 with group size 64: each weight within max|w|/254 of the original
    # (report.max_quantization_error); on this model the logits move by a few percent of
    # their range. The bound is the measured 0.02 with room.
    assert report.max_quantization_error < 0.02
    assert diff < 0.05 * spread, (diff, spread)


def _one_line(result, needle):
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, lines


def test_bad_folders_at_the_command_line(tmp_path, llama2):
    import shutil

    folder, _ = llama2
    # An unknown rope_scaling type.
    yarn = tmp_path / "yarn"
    shutil.copytree(folder, yarn)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (yarn / "config.json").write_text(json.dumps(config))
    _one_line(run(f"--checkpoint={yarn}"), "yarn")
    # A shape that does not fit the config.
    wide = tmp_path / "wide"
    shutil.copytree(folder, wide)
    config = json.loads((wide / "config.json").read_text())
    config["intermediate_size"] = 128
    (wide / "config.json").write_text(json.dumps(config))
    _one_line(run(f"--checkpoint={wide}"), "has shape [64, 160], expected [64, 128]")
    # An index naming a shard that is not there.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(folder / "config.json", sharded / "config.json")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line(run(f"--checkpoint={sharded}"), "model-00001-of-00002.safetensors")


def test_convert_refuses_to_overwrite_its_source(tmp_path, llama2):
    import shutil

    folder, _ = llama2
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    before = (copy / "model.safetensors").read_bytes()
    _one_line(run("convert", f"--checkpoint={copy}", f"--output={copy / 'model.safetensors'}"),
              "would overwrite the checkpoint being converted")
    assert (copy / "model.safetensors").read_bytes() == before
    v1 = tmp_path / "m.bin"
    assert run("convert", f"--checkpoint={copy}", f"--output={v1}").returncode == 0
    _one_line(run("convert", f"--checkpoint={v1}", f"--output={v1}", "--llama2c_version=2"),
              "would overwrite")


def test_convert_group_size_is_exact_when_given(tmp_path, llama2):
    folder, _ = llama2
    _one_line(run("convert", f"--checkpoint={folder}", f"--output={tmp_path / 'a.bin'}",
                  "--llama2c_version=2", "--group_size=7"), "group_size=7 does not divide")
    _one_line(run("convert", f"--checkpoint={folder}", f"--output={tmp_path / 'b.bin'}",
                  "--group_size=32"), "version 2 files only")
    assert not any(tmp_path.iterdir())


def test_files_of_a_folder_and_lying_headers(tmp_path, llama2):
    import shutil
    import struct

    folder, _ = llama2
    _one_line(run(f"--checkpoint={folder / 'model.safetensors'}"), f"pass the folder {folder}")
    _one_line(run(f"--checkpoint={folder / 'config.json'}"), "file of a Hugging Face model folder")
    # Offsets that make one tensor read another's bytes.
    lie = tmp_path / "lie"
    shutil.copytree(folder, lie)
    data = (lie / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k.endswith("q_proj.weight"))
    other = next(k for k in header if k.endswith("k_proj.weight"))
    size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    start = header[other]["data_offsets"][0]
    header[name]["data_offsets"] = [start, start + size]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    (lie / "model.safetensors").write_bytes(data[:8] + text + data[8 + n:])
    _one_line(run(f"--checkpoint={lie}"), "overlap")
