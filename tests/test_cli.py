"""The `jllama` command, run as a user runs it (a subprocess of the installed console script)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import STORIES260K, TOK512, TOKENIZER_32K, load_json

from jllama.model.config import ModelConfig
from jllama.formats.llama2c import write_checkpoint
from jllama.model.weights import random_weights

REPO = Path(__file__).parent.parent

# ../shared/README.md: stories260K.bin + tok512.bin at temperature 0 from the start token,
# 200 steps (run.c's output, which ends with a newline).
STORY = """Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.
Lily's mom said, "Lily, let's go to the park." Lily was sad and didn't know what to do. She said, "I want to play with your ball, but I can't find it."
Lily was sad and didn't know what to do. She said, "I'm sorry, Lily. I didn't know what to do."
Lily didn't want to help her mom, so she
"""


def jllama_command() -> list[str]:
    script = Path(sys.executable).parent / "jllama"
    return [str(script)] if script.exists() else [sys.executable, "-m", "jllama"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        jllama_command() + list(args), capture_output=True, text=True, timeout=timeout,
        cwd=REPO,
    )


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_default_greedy_story(backend):
    result = run("--temperature=0", "--steps=200", f"--backend={backend}")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY
    assert "achieved tok/s" in result.stderr


def test_no_flags_tells_a_sampled_story_and_prints_its_seed():
    result = run()
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) > 200
    seed = int(result.stderr.split("--seed=")[1].split(")")[0])
    again = run(f"--seed={seed}")  # the printed seed repeats the run
    assert again.stdout == result.stdout


def test_json_output_matches_run_c_oracle():
    case = next(
        c for c in load_json("generate_stories260K.json")["cases"]
        if c["prompt"] == "Once upon a time" and c["temperature"] == 1.0 and c["topp"] == 0.9
    )
    args = [
        f"--prompt={case['prompt']}", "--temperature=1.0", "--top_p=0.9",
        f"--seed={case['seed']}", f"--steps={case['steps']}",
    ]
    result = run("--output_format=json", *args)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["generated_ids"] == case["generated_ids"]
    assert out["decode_tok_s"] > 0 and out["prefill_tok_s"] > 0
    # "text" is the continuation alone: the text output is the prompt, then it, then "\n".
    text = run(*args)
    assert text.stdout == case["prompt"] + out["text"] + "\n"


def test_text_output_prints_the_prompt_then_the_continuation():
    result = run("--prompt=Once upon a time", "--temperature=0", "--steps=20")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time, there was a little girl")


def test_flagfile_preset():
    result = run(f"--flagfile={REPO / 'configs' / 'greedy.flags'}", "--steps=200")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY


def test_verify_checkpoint_reports_every_tensor():
    result = run("--verify_checkpoint")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["tensor", "shape"]
    names = [line.split()[0] for line in lines[1:]]
    # a shared classifier is listed once, as the embedding table
    assert names == [
        "token_embedding_table", "rms_att_weight", "wq", "wk", "wv", "wo", "rms_ffn_weight",
        "w1", "w2", "w3", "rms_final_weight",
    ]
    assert all(line.endswith("yes") for line in lines[1:])


def test_verify_checkpoint_fails_on_a_nan(tmp_path):
    data = bytearray(STORIES260K.read_bytes())
    data[28 + 4 * 100 : 28 + 4 * 101] = b"\x00\x00\xc0\x7f"  # a NaN in the embedding table
    bad = tmp_path / "nan.bin"
    bad.write_bytes(bytes(data))
    result = run(f"--checkpoint={bad}", "--verify_checkpoint")
    assert result.returncode == 1
    assert "NO (1 values)" in result.stdout


def _assert_one_line_error(result, *needles):
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jllama: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--temperature=hot"], ["--temperature", "hot"]),
        (["--temperature=-1"], ["--temperature"]),
        (["--temperature=nan"], ["--temperature", "finite"]),
        (["--top_p=1.5"], ["--top_p"]),
        (["--backend=torch"], ["--backend"]),
        (["--output_format=xml"], ["--output_format"]),
        (["--seed=-4"], ["--seed"]),
        (["--threads=999"], ["--threads"]),
        (["--steps=many"], ["--steps"]),
        (["--no_such_flag"], ["no_such_flag"]),
        (["--flagfile=/no/such.flags"], ["/no/such.flags"]),
        (["story"], ["unexpected argument", "story"]),
        (["chat"], ["unexpected argument", "'chat'", "pass --mode=chat"]),
        (["--checkpoint=/no/such/model.bin"], ["/no/such/model.bin", "no such file"]),
        ([f"--tokenizer={TOKENIZER_32K}"], ["tokenizer.bin", "32000", "512"]),
        (["--tokenizer=/no/such/tok.bin"], ["/no/such/tok.bin"]),
    ],
)
def test_bad_flags_and_files_give_one_line_and_exit_1(args, needles):
    _assert_one_line_error(run(*args), *needles)


def test_truncated_checkpoint_gives_one_line(tmp_path):
    bad = tmp_path / "cut.bin"
    bad.write_bytes(STORIES260K.read_bytes()[:5000])
    _assert_one_line_error(run(f"--checkpoint={bad}"), "cut.bin", "truncated")


def test_checkpoint_longer_than_its_header_gives_one_line(tmp_path):
    bad = tmp_path / "long.bin"
    bad.write_bytes(STORIES260K.read_bytes() + bytes(8))
    _assert_one_line_error(run(f"--checkpoint={bad}"), "long.bin", "longer")


@pytest.mark.parametrize("header", [(0, 172, 5, 8, 4, 512, 512), (64, 172, 5, 8, 4, 512, 2**30)])
def test_impossible_header_gives_one_line(tmp_path, header):
    bad = tmp_path / "header.bin"
    bad.write_bytes(struct.pack("<7i", *header) + STORIES260K.read_bytes()[28:])
    _assert_one_line_error(run(f"--checkpoint={bad}"), "header.bin", "bad header")


def test_prompt_longer_than_the_context_gives_one_line():
    _assert_one_line_error(run("--prompt=" + "abc " * 400), "--prompt", "seq_len=512")


def test_help_lists_jllama_flags_and_exits_0():
    for flag in ("--help", "-h"):
        result = run(flag)
        assert result.returncode == 0
        for name in ("--checkpoint", "--temperature", "--top_p", "--backend", "--threads"):
            assert name in result.stdout


def test_steps_equal_to_prompt_length_generates_one_token_without_warning():
    result = run("--steps=1", "--temperature=0", "--output_format=json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["generated_ids"] == [403]  # run.c's first greedy token
    assert "warning" not in result.stderr


def test_vanishing_temperature_is_greedy():
    greedy = run("--temperature=0", "--steps=40").stdout
    result = run("--temperature=1e-45", "--steps=40", "--seed=3")
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy
    assert "Warning" not in result.stderr


def test_flagfile_that_is_not_text_gives_one_line(tmp_path):
    bad = tmp_path / "latin1.flags"
    bad.write_bytes(b"--prompt=caf\xe9\n")
    _assert_one_line_error(run(f"--flagfile={bad}"), "--flagfile", "UTF-8")


def test_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--checkpoint", "--tokenizer", "--flagfile"):
        _assert_one_line_error(run(f"{flag}={fifo}", timeout=60), str(fifo), "not a regular file")


def test_output_write_failure_gives_one_line():
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            jllama_command() + ["--steps=5", "--seed=1"], stdout=full, stderr=subprocess.PIPE,
            text=True, timeout=120,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "jllama: error: cannot write the output: No space left on device"
    )


@pytest.mark.parametrize("value, backend", [(np.nan, "jax"), (3e38, "numpy")])
def test_nan_weights_stop_generation_with_one_line(tmp_path, value, backend):
    # 3e38 is finite but overflows the products: numpy must not warn at each one.
    data = np.frombuffer(STORIES260K.read_bytes()[28:], "<f4").copy()
    data[2000:2100] = value
    bad = tmp_path / "nan" / "model.bin"
    bad.parent.mkdir()
    bad.write_bytes(STORIES260K.read_bytes()[:28] + data.tobytes())
    result = run(f"--checkpoint={bad}", f"--tokenizer={TOK512}", "--seed=1", f"--backend={backend}")
    # The run got as far as the model: its required-memory line comes before the error.
    assert result.stderr.startswith("jllama: required memory: ")
    result.stderr = result.stderr.split("\n", 1)[1]
    _assert_one_line_error(result, "not finite", "--verify_checkpoint")


def test_tokenizer_beside_the_checkpoint_is_chosen_by_size(tmp_path):
    # llama2.c's own folder layout: the model, its tok512.bin and the Llama 2 tokenizer.bin.
    for f in (STORIES260K, TOK512, TOKENIZER_32K):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    result = run(f"--checkpoint={tmp_path / 'stories260K.bin'}", "--temperature=0", "--steps=200")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY


def test_no_fitting_tokenizer_names_what_was_looked_for(tmp_path):
    config = ModelConfig(dim=16, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=1000, seq_len=8)
    write_checkpoint(tmp_path / "m.bin", config, random_weights(config))
    result = run(f"--checkpoint={tmp_path / 'm.bin'}")
    _assert_one_line_error(result, "vocab_size=1000", "tok1000.bin", "tokenizer.bin", "--tokenizer")
    # verifying the weights needs no tokenizer at all
    result = run(f"--checkpoint={tmp_path / 'm.bin'}", "--verify_checkpoint")
    assert result.returncode == 0, result.stderr


def test_versioned_llama2c_file_with_a_bad_header_is_named(tmp_path):
    bad = tmp_path / "v1.bin"
    bad.write_bytes(struct.pack("<Ii", 0x616B3432, 1) + bytes(256))
    _assert_one_line_error(run(f"--checkpoint={bad}"), "v1.bin", "version-1 header", "dim=0")


def test_bfloat16_weights_report_memory_and_agree_across_backends():
    results = [
        run("--temperature=0", "--steps=60", "--dtype=bfloat16", f"--backend={b}")
        for b in ("jax", "numpy")
    ]
    for result in results:
        assert result.returncode == 0, result.stderr
        # stories260K: 260K parameters in bfloat16 (2 bytes each, the shared classifier once)
        # and a 512-token f32 cache: 2 (k, v) * 5 layers * 4 kv heads * 512 * 8 (head_dim)
        # floats * 4 bytes = 655,360 bytes.
        assert "required memory: " in result.stderr and "(bfloat16)" in result.stderr
        assert "KV cache 0.7 MB (512 tokens, f32)" in result.stderr
    assert results[0].stdout == results[1].stdout
    assert results[0].stdout.startswith("Once upon a time")


@pytest.mark.parametrize("version", ["1", "0"])
def test_convert_then_run_tells_run_c_story(tmp_path, version):
    out = tmp_path / "m.bin"
    result = run("convert", f"--checkpoint={STORIES260K}", f"--output={out}",
                 f"--llama2c_version={version}")
    assert result.returncode == 0, result.stderr
    assert f"llama2.c version {version}" in result.stdout and out.is_file()
    result = run(f"--checkpoint={out}", f"--tokenizer={TOK512}", "--temperature=0", "--steps=200")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY


def test_convert_needs_both_paths_and_names_force(tmp_path):
    _assert_one_line_error(run("convert", f"--output={tmp_path / 'x.bin'}"), "--checkpoint")
    config = ModelConfig(dim=16, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=512, seq_len=8, rope_theta=500000.0)
    from gguf_files import write_gguf  # a GGUF can hold rope_theta; llama2.c cannot

    src = write_gguf(tmp_path / "m.gguf", dataclasses.replace(config, vocab_size=259),
                     random_weights(dataclasses.replace(config, vocab_size=259)))
    result = run("convert", f"--checkpoint={src}", f"--output={tmp_path / 'y.bin'}")
    _assert_one_line_error(result, "rope_theta", "--force")
    assert not (tmp_path / "y.bin").exists()


def test_a_seq_len_above_the_models_context_is_capped_with_a_note():
    """stories260K's context is 512 tokens (its header)."""
    result = run("--seq_len=100000", "--steps=3", "--temperature=0")
    assert result.returncode == 0, result.stderr
    assert ("jllama: note: --seq_len=100000 is more than the model's context; using 512"
            in result.stderr.splitlines())
    assert "--seq_len" not in run("--seq_len=512", "--steps=3", "--temperature=0").stderr


def test_a_long_context_is_capped_at_4096_without_seq_len():
    """The Llama 3.2-style test file declares 131072 positions (its llama.context_length):
    without --seq_len the cache holds 4096 (llama.cpp's default), and stderr says how to have
    all of them."""
    gguf_file = "tests/data/llama32_tiny/llama32-tiny-Q4_K_M.gguf"
    result = run(f"--checkpoint={gguf_file}", "--steps=3", "--temperature=0", "--prompt=Hi")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert ("jllama: note: the context is 4096 tokens of the model's 131072; "
            "--seq_len=131072 allocates all of it") in lines
    # A GGUF file's cache is f16 unless asked (`jllama.model.cache_types.DEFAULT_GGUF`).
    assert any("required memory" in line and "(4096 tokens, f16)" in line for line in lines), lines
    asked = run(f"--checkpoint={gguf_file}", "--steps=3", "--temperature=0", "--prompt=Hi",
                "--seq_len=8192").stderr
    assert "note: the context" not in asked and "(8192 tokens" in asked
