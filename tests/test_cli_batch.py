"""`jllama batch`'s file of prompts (issue 34): the prompts counted one way everywhere (the
output's 0-based "index", which the error lines name beside the file's 1-based line), and a
JSON line's unknown keys refused rather than ignored."""

from __future__ import annotations

import json

from test_cli import run


def _one_error_line(done) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_errors_name_a_prompt_by_the_index_the_output_gives_it(tmp_path):
    # Line 3 is the second prompt (line 2 is blank): index 1 in the output.
    good = tmp_path / "good.txt"
    good.write_text("Once upon a time\n\nLily went\n")
    done = run("batch", f"--file={good}", "--steps=8", "--seed=1")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["index"] for line in done.stdout.splitlines()] == [0, 1]
    assert json.loads(done.stdout.splitlines()[1])["prompt"] == "Lily went"
    # The same place holding a prompt longer than the context (512 tokens).
    long = tmp_path / "long.txt"
    long.write_text("Once upon a time\n\n" + "Lily went " * 300 + "\n")
    line = _one_error_line(run("batch", f"--file={long}", "--steps=8"))
    assert line.startswith(f"jllama: error: --file={long}: line 3 (index 1): the prompt is "), line
    assert line.endswith("tokens; it must hold 1 .. 512 (seq_len)"), line
    # A JSON line's error names the same two numbers.
    bad = tmp_path / "bad.txt"
    bad.write_text('Once upon a time\n\n{"prompt": "x", "max_tokens": 0}\n')
    line = _one_error_line(run("batch", f"--file={bad}"))
    assert line == (f"jllama: error: --file={bad}: line 3 (index 1): max_tokens must be an "
                    "integer >= 1"), line


def test_an_unknown_key_is_refused_with_the_close_one(tmp_path):
    typo = tmp_path / "typo.txt"
    typo.write_text('Once upon a time\n{"prompt": "Lily went", "temprature": 0}\n')
    line = _one_error_line(run("batch", f"--file={typo}"))
    assert line == (f"jllama: error: --file={typo}: line 2 (index 1): unknown key "
                    "'temprature' (did you mean 'temperature'?)"), line
    other = tmp_path / "other.txt"
    other.write_text('{"prompt": "Lily went", "logit_bias": {}}\n')
    line = _one_error_line(run("batch", f"--file={other}"))
    assert line == (f"jllama: error: --file={other}: line 1 (index 0): unknown key "
                    "'logit_bias' (a line takes prompt, max_tokens, stop, seed, temperature, "
                    "json_schema)"), line
