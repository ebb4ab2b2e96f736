"""Constrained decoding with SmolLM2-135M-Instruct (byte-level BPE from GGUF, 49152 tokens, its
control tokens and two end-of-generation ids): every JSON schema of `constrain_cases`, greedy
and sampled with 3 seeds, through the Python API, a chat turn, and the command line in
generate, chat and batch mode; every output checked with `jsonschema`."""

from __future__ import annotations

import json
import subprocess

import jsonschema
import pytest
from constrain_cases import SCHEMAS
from test_cli import jllama_command, run

from jllama import Session
from jllama.constrain import Grammar, vocabulary_for
from jllama.sampling import Sampler

PROMPT = "Here is the JSON:"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return Session.open(str(smollm2_gguf), seq_len=512)


def test_its_vocabulary(smollm2):
    tok = smollm2.tokenizer
    v = vocabulary_for(tok)
    assert v.stop_ids == (0, 2) and v.end_id == 2  # <|endoftext|>, <|im_end|>
    assert set(tok.control_ids) <= v.special_ids
    im_start = tok.encode("<|im_start|>", bos=False, parse_special=True)
    assert len(im_start) == 1 and v.lltokenizer.is_special_token(im_start[0])
    the = tok.encode(" the", bos=False)
    assert len(the) == 1 and v.lltokenizer.decode_bytes(the) == b" the"  # "Ġthe"


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schemas(smollm2, index):
    schema = SCHEMAS[index]
    grammar = Grammar.json_schema(schema)
    for seed in (None, 1, 2, 3):
        sampler = Sampler(temperature=0.0) if seed is None else Sampler(temperature=1.0, seed=seed)
        completion = smollm2.complete(PROMPT, sampler, max_tokens=100, grammar=grammar)
        text = "".join(piece.text for piece in completion)
        assert completion.finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), schema)


def test_a_chat_turn_keeps_to_the_schema_and_the_next_turn_goes_on(smollm2):
    schema = SCHEMAS[19]
    chat = smollm2.chat()
    reply = list(chat.say("Describe a red item as JSON.", Sampler(temperature=0.0),
                          max_tokens=100, grammar=Grammar.json_schema(schema)))
    assert chat.last.stop_reason == "stop" and chat.last.generation.stop_token == 2
    jsonschema.validate(json.loads(chat.messages[-1]["content"]), schema)
    assert reply
    list(chat.say("Thanks!", Sampler(temperature=0.0), max_tokens=8))
    assert chat.last.generation.constraint is None and chat.last.generated_ids


def _write(tmp_path, name, value) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(value) if not isinstance(value, str) else value, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("index", [6, 9, 17])
def test_cli_generate_with_a_schema_file(smollm2_gguf, tmp_path, index):
    schema = SCHEMAS[index]
    done = run(f"--checkpoint={smollm2_gguf}", f"--json_schema={_write(tmp_path, 's.json', schema)}",
               f"--prompt={PROMPT}", "--temperature=0", "--steps=120", "--seq_len=512",
               "--output_format=json")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(json.loads(done.stdout)["text"]), schema)


def test_cli_chat_and_batch_with_inline_constraints(smollm2_gguf, tmp_path):
    schema = SCHEMAS[6]
    chat = subprocess.run(
        jllama_command() + [f"--checkpoint={smollm2_gguf}", "--mode=chat", "--temperature=0",
                            "--steps=100", "--seq_len=512", f"--json_schema={json.dumps(schema)}",
                            "--prompt=Give a person as JSON."],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False)
    assert chat.returncode == 0, chat.stderr
    jsonschema.validate(json.loads(chat.stdout.strip()), schema)
    prompts = _write(tmp_path, "prompts.txt", "A person:\nAnother person:\n")
    batch = run("batch", f"--checkpoint={smollm2_gguf}", f"--file={prompts}", "--steps=100",
                "--seq_len=512", "--seed=5", "--parallel=2", f"--json_schema={json.dumps(schema)}")
    assert batch.returncode == 0, batch.stderr
    lines = [json.loads(line) for line in batch.stdout.splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["finish_reason"] == "stop"
        jsonschema.validate(json.loads(line["text"]), schema)


def test_cli_batch_twenty_schemas_greedy_and_three_seeds(smollm2_gguf, tmp_path):
    """Every schema of `constrain_cases`, greedy and sampled with seeds 1, 2, 3, through the
    command line: one `jllama batch` whose lines carry their own json_schema, temperature and
    seed."""
    cases = [(i, seed) for i in range(len(SCHEMAS)) for seed in (None, 1, 2, 3)]
    lines = [json.dumps({"prompt": PROMPT, "json_schema": SCHEMAS[i],
                         **({"temperature": 0} if seed is None else {"seed": seed,
                                                                     "temperature": 1.0})})
             for i, seed in cases]
    prompts = _write(tmp_path, "prompts.jsonl", "\n".join(lines) + "\n")
    batch = run("batch", f"--checkpoint={smollm2_gguf}", f"--file={prompts}", "--steps=100",
                "--seq_len=512", "--parallel=8")
    assert batch.returncode == 0, batch.stderr
    out = [json.loads(line) for line in batch.stdout.splitlines()]
    assert [o["index"] for o in out] == list(range(len(cases)))
    for (i, seed), o in zip(cases, out):
        assert o["finish_reason"] == "stop", (i, seed, o["text"])
        jsonschema.validate(json.loads(o["text"]), SCHEMAS[i])
        if seed is not None:
            assert o["seed"] == seed


def test_cli_batch_line_errors_name_the_line(smollm2_gguf, tmp_path):
    for line, message in [
        ({"prompt": "x", "json_schema": {"type": "nonsense"}}, "line 1 (index 0): json_schema: "),
        ({"prompt": "x", "temperature": -1}, "line 1 (index 0): temperature must be"),
    ]:
        prompts = _write(tmp_path, "bad.jsonl", json.dumps(line) + "\n")
        done = run("batch", f"--checkpoint={smollm2_gguf}", f"--file={prompts}", "--steps=4")
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
