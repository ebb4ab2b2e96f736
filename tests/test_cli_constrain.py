"""The constraint flags (--json_schema, --json, --regex, --grammar) on the embedded
stories260K: outputs checked by jsonschema / re, bad values one line naming the flag."""

from __future__ import annotations

import json
import re

import jsonschema
from constrain_cases import SCHEMAS
from test_cli import run


def _text(*args: str) -> str:
    done = run("--temperature=0", "--steps=120", "--output_format=json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["text"]


def test_schema_inline_and_from_a_file_json_regex_and_grammar(tmp_path):
    schema = SCHEMAS[19]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    for flag in (f"--json_schema={path}", f"--json_schema={json.dumps(schema)}"):
        jsonschema.validate(json.loads(_text(flag, "--prompt=Once")), schema)
    json.loads(_text("--json", "--seed=3", "--temperature=1"))
    assert re.fullmatch(r"(cat|dog)s? [a-z]{2,5}", _text(r"--regex=(cat|dog)s? [a-z]{2,5}"))
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "!"\n', encoding="utf-8")
    assert _text(f"--grammar={gbnf}") in ("yes!", "no!")
    lark = tmp_path / "g.lark"
    lark.write_text('start: "x=" /[0-9]{1,2}/\n', encoding="utf-8")
    assert re.fullmatch(r"x=[0-9]{1,2}", _text(f"--grammar={lark}"))


def test_decode_loop_masks_on_the_device():
    for sampling in ("--temperature=0", "--seed=3"):
        done = run("--decode=loop", sampling, "--steps=60", "--regex=(cat|dog)s?",
                   "--output_format=json")
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(r"(cat|dog)s?", json.loads(done.stdout)["text"])
        graph = run("--decode=graph", sampling, "--steps=60", "--regex=(cat|dog)s?",
                    "--output_format=json")
        assert json.loads(graph.stdout)["generated_ids"] == json.loads(done.stdout)["generated_ids"]


def test_bad_constraints_are_one_line_errors(tmp_path):
    missing = tmp_path / "missing.json"
    cases = [
        (["--json_schema={bad"], "--json_schema: the JSON schema is not JSON"),
        (['--json_schema={"type": "nope"}'], "--json_schema: "),
        ([f"--json_schema={missing}"], f"--json_schema={missing}: no such file"),
        (["--regex=("], "--regex: "),
        ([f"--grammar={missing}"], f"--grammar={missing}: no such file"),
        (["--json", "--regex=a"], "--json, --regex: give one constraint, not several"),
    ]
    bad = tmp_path / "bad.lark"
    bad.write_text("start: undefined_rule\n", encoding="utf-8")
    cases.append(([f"--grammar={bad}"], "--grammar: "))
    for args, expected in cases:
        done = run(*args)
        assert done.returncode != 0, args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in done.stderr, (
            args, done.stderr)


def test_an_output_cut_short_says_so_and_inline_non_objects_are_refused():
    cut = run('--json_schema={"type": "object"}', "--steps=4", "--temperature=0")
    assert cut.returncode == 0 and "before the constraint was complete" in cut.stderr
    whole = run("--regex=(cat|dog)", "--steps=20", "--temperature=0")
    assert whole.returncode == 0 and "before the constraint" not in whole.stderr
    for value, reason in [("[1, 2]", "not list"), ("42", "not int"),
                          ('{"$ref": "#"}', "matches no text")]:
        done = run(f"--json_schema={value}", "--steps=4")
        assert done.returncode == 1 and reason in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
