"""The command line's own surface (issue 34's new-user pass): absl's parse errors as one clean
line each, --version, llama.cpp's short flags (-m -p -n -c -t, --temp) as the long forms, and
an empty --model_name refused."""

from __future__ import annotations

import pytest
from test_cli import run


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
