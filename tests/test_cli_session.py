"""The command as a new user meets it (issue 19's new-user pass): `tokenize` with a tokenizer
alone, presets from any folder, llama.cpp's `--top_k <= 0`, and chat at a terminal (line
editing, Ctrl-C stopping only the reply)."""

from __future__ import annotations

import ast
import gzip
import os
import pty
import select
import signal
import subprocess
import time

import pytest
from conftest import DATA, TOKENIZER_32K, load_json
from test_cli import REPO, jllama_command, run

ORACLE = load_json("encode_llama2c.json")


def test_tokenize_with_a_tokenizer_file_alone_gives_run_c_ids(tmp_path):
    for case in ORACLE["cases"]["tokenizer.bin"][1:6]:
        done = subprocess.run(
            jllama_command() + ["tokenize", f"--tokenizer={TOKENIZER_32K}",
                                f"--prompt={case['text']}"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        assert ast.literal_eval(done.stdout.strip()) == case["ids"], case["text"]


def test_a_vocab_only_gguf_tokenizes_as_llama_cpp_as_tokenizer_or_checkpoint(tmp_path):
    vocab = tmp_path / "ggml-vocab-llama-bpe.gguf"
    vocab.write_bytes(gzip.decompress((DATA / "ggml-vocab-llama-bpe.gguf.gz").read_bytes()))
    cases = (DATA / "ggml-vocab-llama-bpe.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    wants = (DATA / "ggml-vocab-llama-bpe.gguf.out").read_text().split("\n")
    i = cases.index("Hello world")
    for flag in ("--tokenizer", "--checkpoint"):
        done = run("tokenize", f"{flag}={vocab}", "--prompt=Hello world")
        assert done.returncode == 0, done.stderr
        # llama.cpp's .out lines leave out the BOS (128000) that llama-tokenize adds.
        assert ast.literal_eval(done.stdout.strip()) == [128000] + [int(t) for t in wants[i].split()]


def test_a_preset_flagfile_works_from_any_folder(tmp_path):
    greedy = run("--temperature=0", "--steps=40")
    for form in (["--flagfile=configs/greedy.flags"], ["--flagfile", "configs/greedy.flags"]):
        elsewhere = subprocess.run(
            jllama_command() + form + ["--steps=40"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )
        assert elsewhere.returncode == 0, elsewhere.stderr
        assert elsewhere.stdout == greedy.stdout


def test_top_k_at_or_below_zero_is_off_as_in_llama_cpp():
    off = run("--seed=9", "--steps=60", "--top_k=0")
    minus = run("--seed=9", "--steps=60", "--top_k=-1")
    assert minus.returncode == 0, minus.stderr
    assert minus.stdout == off.stdout


def _read_until(fd, needle: bytes, timeout: float) -> bytes:
    out = b""
    end = time.monotonic() + timeout
    while needle not in out:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not seen in {out[-400:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_terminal_chat_ctrl_c_stops_the_reply_not_the_program(smollm2_gguf):
    """At a terminal: a long reply is cut by Ctrl-C, the prompt comes back, a second message
    is answered, and Ctrl-D ends the chat with status 0. The arrow keys are edited by
    readline, never echoed as ^[[D."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        jllama_command() + [f"--checkpoint={smollm2_gguf}", "--mode=chat", "--seq_len=512",
                            "--temperature=0", "--steps=400"],
        stdin=follower, stdout=follower, stderr=follower, cwd=REPO, start_new_session=True,
    )
    os.close(follower)
    try:
        _read_until(leader, b"> ", 180)
        os.write(leader, b"Write a very long story about a dragon.\r")
        _read_until(leader, b"dragon", 120)  # the reply is under way
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        _read_until(leader, b"> ", 60)  # the reply stopped; the prompt is back
        assert process.poll() is None
        os.write(leader, b"Say hi\x1b[D\x1b[C.\r")  # left, right: edited, not typed
        after = _read_until(leader, b"> ", 120)
        assert b"^[[D" not in after
        os.write(leader, b"\x04")  # Ctrl-D
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)


def test_batch_prints_a_json_line_per_prompt_equal_to_each_alone(tmp_path):
    import json

    from jllama.model.loading import open_model
    from jllama.sampling import SamplerConfig
    from jllama.generation.session import Session

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Once upon a time\n{"prompt": "Tom had a dog", "max_tokens": 6}\n'
                       'Lily went\n\nThe sun\n')
    done = run("batch", f"--file={prompts}", "--steps=24", "--seed=40", "--parallel=3")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Once upon a time", "Tom had a dog",
                                                 "Lily went", "The sun"]
    session = Session.open(seq_len=512)  # the embedded stories260K, as the command
    for i, line in enumerate(lines):
        ids = session.tokenizer.encode(line["prompt"])
        alone = session.text(ids, SamplerConfig(seed=40 + i), max_tokens=6 if i == 1 else 24)
        assert line["text"] == alone and line["seed"] == 40 + i
    bad = tmp_path / "bad.txt"
    bad.write_text('{"prompt": "x", "max_tokens": 0}\n')
    refused = run("batch", f"--file={bad}")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "line 1 (index 0): max_tokens" in refused.stderr
