"""Crafted files the readers must refuse with one line and exit 1 (issue 21): JSON nested
10^5 deep or holding a 5,000-digit number in config.json, tokenizer.json, a safetensors header
and a `jllama batch` prompts file, and non-finite hyperparameters. Each was "internal error",
exit 2 (deep JSON, long numbers) or accepted (inf) before. The folder is the Llama 3.2-style
test model's Hugging Face copy (tests/data/llama32_tiny/hf)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_cli import _assert_one_line_error, run

HF = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
DEEP = "[" * 100_000 + "]" * 100_000
LONG = "1" + "0" * 5000


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "model"
    shutil.copytree(HF, out)
    return out


def _generate(folder):
    return run(f"--checkpoint={folder}", "--steps=2", "--temperature=0", "--prompt=Hi")


@pytest.mark.parametrize("text, needle", [
    (DEEP, "nested too deeply"),
    ('{"hidden_size": ' + LONG + "}", "4300 digits"),
])
def test_config_json(folder, text, needle):
    (folder / "config.json").write_text(text)
    _assert_one_line_error(_generate(folder), "config.json", needle)


@pytest.mark.parametrize("text, needle", [
    (DEEP, "nested too deeply"),
    ('{"version": ' + LONG + "}", "4300 digits"),
])
def test_tokenizer_json(folder, text, needle):
    (folder / "tokenizer.json").write_text(text)
    _assert_one_line_error(_generate(folder), "tokenizer.json", needle)


def test_safetensors_header(folder):
    header = DEEP.encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    _assert_one_line_error(_generate(folder), "model.safetensors", "nested too deeply")


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_non_finite_hyperparameters(folder, key):
    config = json.loads((folder / "config.json").read_text())
    # Written as Infinity, which Python's json reads back; rope_theta lives in the
    # rope_parameters of a transformers 5 config (as this one), rms_norm_eps at the top.
    (config["rope_parameters"] if key == "rope_theta" else config)[key] = float("inf")
    (folder / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(_generate(folder), "finite")


def test_batch_prompts_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n{" + '"prompt": ' + DEEP + "}\n")
    _assert_one_line_error(run("batch", f"--file={prompts}", "--steps=2"),
                           "line 2 (index 1): not valid JSON", "nested too deeply")


@pytest.mark.parametrize("where, huge", [
    ("vocab", 10**6 + 2**20), ("vocab", 10**12), ("added_tokens", 10**9),
])
def test_token_ids_far_beyond_the_vocabulary(folder, where, huge):
    """A table with an entry per id is not built for an id of 10^12 (it was: > 6 GB at 10^9,
    MemoryError at 10^12): one line naming the id."""
    data = json.loads((folder / "tokenizer.json").read_text())
    if where == "vocab":
        data["model"]["vocab"]["zzz"] = huge
    else:
        data["added_tokens"].append({"id": huge, "content": "<zzz>", "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    _assert_one_line_error(_generate(folder), "tokenizer.json", f"token id {huge}")


def test_a_byte_level_vocabulary_without_a_byte_token(folder):
    """The test model's tokenizer.json is byte-level BPE (all 256 byte characters are tokens);
    with the token for "é"'s second byte 0xa9 ("©") gone, a prompt holding "é" would lose it
    silently: refused, naming the byte."""
    data = json.loads((folder / "tokenizer.json").read_text())
    assert "©" in data["model"]["vocab"]
    del data["model"]["vocab"]["©"]
    data["model"]["merges"] = [m for m in data["model"]["merges"]
                               if "©" not in (m if isinstance(m, str) else " ".join(m))]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    _assert_one_line_error(_generate(folder), "tokenizer.json", "no token for byte 0xa9")
