"""The command line's own surface (issue 34's new-user pass): absl's parse errors as one clean
line each, --version, llama.cpp's short flags (-m -p -n -c -t, --temp) as the long forms, and
an empty --model_name refused."""

from __future__ import annotations

import json

import pytest
from conftest import STORIES260K
from test_cli import run

import jllama


@pytest.mark.parametrize("args, line", [
    # Each expected line written out by hand from the flag's type and the value given.
    (["--parse_special=maybe"], "--parse_special: 'maybe' is not a boolean (true/false)"),
    (["--compile_cache=2"], "--compile_cache: '2' is not a boolean (true/false)"),
    (["--steps=abc"], "--steps: 'abc' is not an integer"),
    (["--top_p=x"], "--top_p: 'x' is not a number"),
    (["--mode=foo"], "--mode: 'foo' is not one of generate, chat"),
    (["--seq_len=-1"], "--seq_len: -1 is not a non-negative integer"),
    (["--port=70000"], "--port: 70000 is not an integer in the range [0, 65535]"),
    (["--noparse_special=1"], "--noparse_special=1: a --no flag takes no value "
                              "(--parse_special=false)"),
    (["--tempature=1"], "unknown flag --tempature (did you mean --temperature?)"),
    (["--steps"], "--steps needs a value (--steps=VALUE)"),
    (["--checkpoint="], "--checkpoint=: is empty"),
])
def test_a_bad_flag_value_is_one_clean_line(args, line):
    done = run(*args)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr == f"jllama: error: {line}\n"


def test_an_empty_model_name_is_refused():
    for value in ("", "  "):
        done = run("serve", f"--model_name={value}", "--port=0")
        assert done.returncode == 1, done.stderr
        assert done.stderr == f"jllama: error: --model_name={value}: is empty\n"


def test_version_prints_the_package_version():
    for flag in ("--version", "-version"):
        done = run(flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "jllama 0.1.0\n" == f"jllama {jllama.__version__}\n"
        assert done.stderr == ""


def test_llama_cpp_short_flags_are_the_long_ones():
    common = ["--output_format=json", "--backend=numpy"]
    short = run("-m", str(STORIES260K), "-p", "Once upon a time", "-n", "12", "--temp", "0",
                "-c", "64", "-t", "1", *common)
    long = run(f"--checkpoint={STORIES260K}", "--prompt=Once upon a time", "--steps=12",
               "--temperature=0", "--seq_len=64", "--threads=1", *common)
    assert short.returncode == 0 == long.returncode, (short.stderr, long.stderr)
    a, b = json.loads(short.stdout), json.loads(long.stdout)
    # By hand: greedy, and --steps=12 counts the prompt's 5 tokens (BOS included).
    assert (a["temperature"], a["steps"], a["seq_len"], len(a["prompt_ids"])) == (0, 12, 64, 5)
    for key in ("prompt_ids", "generated_ids", "text", "temperature", "steps", "seq_len"):
        assert a[key] == b[key], key
    # The text stream too, with the value glued on as absl also takes it (-n=12).
    short_text = run("-m", str(STORIES260K), "-p", "Lily", "-n=12", "--temp=0")
    long_text = run(f"--checkpoint={STORIES260K}", "--prompt=Lily", "--steps=12",
                    "--temperature=0")
    assert short_text.returncode == 0 and short_text.stdout == long_text.stdout
    assert short_text.stdout.startswith("Lily")


def test_help_shows_the_short_names():
    done = run("--help")
    assert done.returncode == 0
    for shown in ("-m,--checkpoint", "-p,--prompt", "-n,--steps", "-c,--seq_len",
                  "-t,--threads", "--temp:", "--version"):
        assert shown in done.stdout, shown


def test_c_is_the_chunk_size_of_perplexity_as_llama_perplexity_s(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play "
                    "outside in the park with her mom and her dog, every single day.\n")
    args = ["perplexity", f"--file={text}", "--output_format=json", "--backend=numpy"]
    short, long = run(*args, "-c", "16"), run(*args, "--ctx=16")
    assert short.returncode == 0 == long.returncode, (short.stderr, long.stderr)
    a, b = json.loads(short.stdout), json.loads(long.stdout)
    assert a["ctx"] == 16 and a["chunks"] >= 1 and a["chunk_ppl"] == b["chunk_ppl"]
    assert "is not used" not in short.stderr
    # Given with --ctx, --ctx wins and -c is named as unused (as before).
    both = run(*args, "--ctx=16", "-c", "32")
    assert json.loads(both.stdout)["ctx"] == 16 and "--seq_len=32 is not used" in both.stderr
    # A -c too large for the text names the flag it came from.
    refused = run(*args, "-c", "64")
    assert refused.returncode == 1 and "--seq_len=64" in refused.stderr, refused.stderr


def test_serve_refuses_the_sampler_flags_it_would_ignore():
    """A request brings its own sampler settings (OpenAI's defaults where absent): the
    command line's would be silently ignored, so serve refuses them before it starts."""
    for args, named in [
        (["--temperature=0"], "--temperature"),
        (["--temp", "0.5", "--top_k=5"], "--temperature, --top_k"),
        (["--seed=3"], "--seed"),
        (["--json"], "--json"),
    ]:
        done = run("serve", "--port=0", *args, timeout=60)
        assert done.returncode == 1, done.stderr
        assert done.stderr == (
            f"jllama: error: serve: {named}: a request's sampler setting, not the server's "
            "(a request without one gets OpenAI's default); leave it out\n"), done.stderr
