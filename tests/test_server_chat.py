"""`jllama serve` chat completions on SmolLM2-135M-Instruct (ChatML template in its GGUF), with
the official `openai` client; the reference is the `jllama --mode=chat` command's reply."""

from __future__ import annotations

import math
import subprocess

import openai
import pytest
from serving import openai_client
from test_cli import REPO, jllama_command

from jllama.backends import prepared_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread

MODEL = "smollm2"
SEQ_LEN = 512
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    model = open_model(smollm2_gguf, seq_len=SEQ_LEN)
    # As `jllama serve` and the CLI prepare it: the GGUF's default cache type (f16).
    backend = prepared_backend(model, "jax")
    with ServerThread(model, backend, MODEL) as running:
        yield running


@pytest.fixture()
def client(server):
    with openai_client(server) as c:
        yield c


def cli_chat_reply(checkpoint, message: str, max_tokens: int) -> str:
    done = subprocess.run(
        jllama_command() + [
            f"--checkpoint={checkpoint}", "--mode=chat", f"--prompt={message}",
            "--temperature=0", f"--steps={max_tokens}", f"--seq_len={SEQ_LEN}",
        ],
        input="", capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


def test_greedy_chat_equals_the_cli_streaming_and_not(client, smollm2_gguf):
    want = cli_chat_reply(smollm2_gguf, QUESTION, 40)
    assert want.strip()
    messages = [{"role": "user", "content": QUESTION}]
    # cache_prompt=false (llama.cpp server's field): the prompt is fed from position 0, as the
    # CLI feeds it, rather than its prefix reused from the previous request (logits a few ulps
    # apart: this greedy reply changes at a near-tie, "au martyre" / "au roi").
    fresh = {"cache_prompt": False}
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body=fresh
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens <= 40 and got.usage.prompt_tokens > 5
    deltas, finish, usage, roles = [], None, None, []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=fresh,
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles[0] == "assistant"
    assert "".join(deltas) == want
    assert finish == got.choices[0].finish_reason
    assert usage.completion_tokens == got.usage.completion_tokens


def test_chat_logprobs_and_seeded_repeat(client):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a fruit."}]
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3,
    ).choices[0]
    items = got.logprobs.content
    assert len(items) >= 1
    assert "".join(item.token for item in items) == got.message.content
    for item in items:
        assert len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=1.0, seed=7)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b and a


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 2000}]
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2
        )
    for field in ("max_tokens", "max_completion_tokens"):  # 512 positions: cannot fit
        with pytest.raises(openai.BadRequestError, match=f"{field}=600") as info:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], **{field: 600})
        assert info.value.body["code"] == "context_length_exceeded"
        assert info.value.body["param"] == field
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert ok.usage.completion_tokens <= 3
