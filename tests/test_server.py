"""`jllama serve` on stories260K, driven by the official `openai` client and raw HTTP.

A real uvicorn server listens on a free port of 127.0.0.1 in a thread of the test process (one
per module; the CLI command itself is tested as a subprocess at the end). References are
independent of the server: the `jllama` command's own output for the same prompt and settings,
a NumPy log-softmax of the NumPy reference backend's logits, and text cut by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from serving import openai_client
from test_cli import jllama_command, run

from jllama.backends import make_backend
from jllama.backends import numpy_ref
from jllama.model.loading import open_model
from jllama.server import ServerThread

MODEL = "stories260K"
PROMPT = "Once upon a time"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def model():
    return open_model()


@pytest.fixture(scope="module")
def server(model):
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, MODEL) as running:
        yield running


@pytest.fixture()
def client(server):
    with openai_client(server, api_key="unused", timeout=TIMEOUT) as c:
        yield c


def cli_generate(prompt: str, max_tokens: int, *flags: str) -> dict:
    """The `jllama` command's JSON output for `max_tokens` tokens after `prompt`."""
    ids = open_model().tokenizer.encode(prompt)
    done = run(
        f"--prompt={prompt}", f"--steps={len(ids) + max_tokens - 1}", "--output_format=json",
        *flags,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def stream_text(client, **kwargs) -> tuple[list[str], str | None, object]:
    """(text pieces, finish_reason, usage) of a streamed completion."""
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    return pieces, finish, usage


# --------------------------------------------------------------------------------------------


def test_health_and_models(server, client):
    health = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("prompt", ["Once upon a time", "Lily and Tom went to the park"])
def test_greedy_completion_equals_the_cli(client, prompt):
    want = cli_generate(prompt, 40, "--temperature=0")
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.usage.prompt_tokens == len(want["prompt_ids"])
    assert got.usage.completion_tokens == len(want["generated_ids"])
    assert got.choices[0].finish_reason == ("length" if len(want["generated_ids"]) == 40 else "stop")
    pieces, finish, usage = stream_text(
        client, model=MODEL, prompt=prompt, max_tokens=40, temperature=0
    )
    assert "".join(pieces) == want["text"]
    assert finish == got.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        got.usage.prompt_tokens, got.usage.completion_tokens
    )


def test_ignore_eos_goes_on_to_max_tokens(client):
    # The CLI's greedy run of this prompt stops at an end-of-text id before 230 tokens.
    want = cli_generate("The sun was hot", 230, "--temperature=0")
    assert len(want["generated_ids"]) < 230
    got = client.completions.create(model=MODEL, prompt="The sun was hot", max_tokens=230,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 230
    assert got.choices[0].text.startswith(want["text"])


def test_default_max_tokens_is_openais_16(client):
    got = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert got.usage.completion_tokens == 16


def test_seeded_sampling_repeats_and_equals_the_cli(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0.8, seed=4242)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    # The server's default top_p is OpenAI's 1 (no nucleus); seed 4242 is run.c's xorshift seed.
    want = cli_generate("Once upon a time", 60, "--temperature=0.8", "--top_p=1", "--seed=4242")
    assert a == want["text"]
    assert client.completions.create(**{**kwargs, "seed": 4243}).choices[0].text != a


def test_one_slot_reuses_a_repeated_prompt_and_reports_cached_tokens(client):
    """This module's server has one slot (--parallel=1): a prompt's prefix that the cache holds
    from the previous request is not fed again, and usage says so (OpenAI's
    prompt_tokens_details.cached_tokens) as the slots worker's does; the last prompt token is
    always fed (its logits give the first new token)."""
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play"
    client.completions.create(model=MODEL, prompt="Tom and Sue", max_tokens=4, temperature=0)
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens <= 1  # at most BOS is shared
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1
    assert b.choices[0].text == a.choices[0].text
    # The cache holds the prompt and what was generated: a longer prompt reuses it all.
    c = client.completions.create(model=MODEL, prompt=prompt + a.choices[0].text + " and",
                                  max_tokens=2, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens + 6
    _, _, usage = stream_text(client, model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 1
    # cache_prompt=false (llama.cpp server's field): the whole prompt is fed again.
    d = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"cache_prompt": False})
    assert d.usage.prompt_tokens_details.cached_tokens == 0
    assert d.choices[0].text == a.choices[0].text


def test_samplers_reach_the_sampler_as_on_the_cli(client):
    flags = ("--temperature=1.2", "--top_p=1", "--top_k=5", "--min_p=0.05",
             "--repeat_penalty=1.3", "--seed=99")
    want = cli_generate("Once upon a time", 50, *flags)
    got = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=50, temperature=1.2, seed=99,
        extra_body={"top_k": 5, "min_p": 0.05, "repeat_penalty": 1.3},
    )
    assert got.choices[0].text == want["text"]


def test_logit_bias_bans_and_forces_tokens(client, model):
    greedy = cli_generate(PROMPT, 2, "--temperature=0")
    first, second = greedy["generated_ids"]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100},
    )
    assert banned.choices[0].text != model.tokenizer.decode([first], prev=greedy["prompt_ids"][-1])
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.9, seed=5,
        logit_bias={str(second): 100},
    )
    want = model.tokenizer.decode([second] * 3, prev=greedy["prompt_ids"][-1])
    assert forced.choices[0].text == want


# --------------------------------------------------------------------------------------------
# Stop strings. The greedy continuation of the prompt comes from the CLI; its tokens' pieces
# show where each stop string falls.


@pytest.fixture(scope="module")
def greedy():
    want = cli_generate(PROMPT, 30, "--temperature=0")
    tokenizer = open_model().tokenizer
    pieces = [tokenizer.decode([t], prev=p) for p, t in
              zip([want["prompt_ids"][-1]] + want["generated_ids"], want["generated_ids"])]
    assert "".join(pieces) == want["text"]
    return want["text"], pieces


def _where(pieces, stop) -> int:
    """How many pieces the first occurrence of `stop` in their concatenation touches."""
    text = "".join(pieces)
    start = text.index(stop)
    ends = np.cumsum([len(p) for p in pieces])
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, start + len(stop) - 1, side="right"))
    return last - first + 1, first


@pytest.mark.parametrize("stop, span, at_first", [
    ("her", 1, False),  # inside the token " there"
    ("e was", 2, False),  # the end of " there" and the start of " was"
    (",", 1, True),  # the very first token is ","
])
def test_stop_strings(client, greedy, stop, span, at_first):
    text, pieces = greedy
    assert _where(pieces, stop) == (span, 0) if at_first else _where(pieces, stop)[0] == span
    want = text[: text.index(stop)]  # OpenAI: the output ends just before the stop string
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "never seen"]
    )
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "stop"
    streamed, finish, _ = stream_text(
        client, model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop
    )
    assert "".join(streamed) == want and finish == "stop"
    assert all(stop not in piece for piece in streamed)
    if at_first:
        assert want == "" and "".join(streamed) == ""


# --------------------------------------------------------------------------------------------


def test_completion_logprobs_equal_the_numpy_reference(client, model):
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    ).choices[0]
    tokenizer, config = model.tokenizer, model.config
    ids = tokenizer.encode(PROMPT)
    cache = numpy_ref.KVCache.zeros(config)
    inv_freq = numpy_ref.rope_frequencies(config) if hasattr(numpy_ref, "rope_frequencies") else None
    from jllama.model.rope import rope_frequencies

    inv_freq = rope_frequencies(config)
    sequence = list(ids)
    for pos in range(len(ids) + 4):
        logits = numpy_ref.forward(config, model.weights, cache, inv_freq, sequence[pos], pos)
        if pos >= len(ids) - 1:
            x = logits.astype(np.float64)
            lp = x - x.max() - np.log(np.exp(x - x.max()).sum())  # log-softmax, by hand
            k = pos - (len(ids) - 1)
            token = int(np.argmax(lp))
            sequence.append(token)
            assert got.logprobs.tokens[k] == tokenizer.decode([token], prev=sequence[-2])
            assert got.logprobs.token_logprobs[k] == pytest.approx(lp[token], abs=1e-3)
            best = np.argsort(-lp)[:3]
            assert list(got.logprobs.top_logprobs[k].values()) == pytest.approx(
                [lp[t] for t in best], abs=1e-3
            )
    assert "".join(got.logprobs.tokens) == got.text


def test_text_offsets_count_from_the_start_of_the_completion_when_streamed_too(client):
    """text_offset[i] is where token i starts in the completion's text: each token's text
    stands there (this completion is ASCII), and a stream's chunks carry the same offsets."""
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0
    ).choices[0]
    tokens, offsets = whole.logprobs.tokens, whole.logprobs.text_offset
    assert whole.text.isascii() and len(tokens) == 12
    for token, at in zip(tokens, offsets):
        assert whole.text[at:at + len(token)] == token
    assert offsets == sorted(offsets) and offsets[0] == 0
    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0, logprobs=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.text_offset
    assert streamed == offsets


# --------------------------------------------------------------------------------------------
# Concurrency.


def _alone(client, i: int) -> dict:
    return dict(
        model=MODEL, prompt=["Once upon a time", "Tom had a dog", "The sun"][i % 3],
        max_tokens=24 + i % 5, temperature=0.0 if i % 4 == 0 else 0.9, seed=1000 + i,
        top_p=0.95,
    )


def test_32_concurrent_streams_get_the_text_they_get_alone(server, client):
    n = 32
    alone = [client.completions.create(**_alone(client, i)).choices[0].text for i in range(n)]
    results: list[str | BaseException | None] = [None] * n
    barrier = threading.Barrier(n, timeout=TIMEOUT)

    def one(i: int) -> None:
        try:
            with openai_client(server, timeout=TIMEOUT) as c:
                barrier.wait()
                results[i] = "".join(
                    chunk.choices[0].text
                    for chunk in c.completions.create(stream=True, **_alone(c, i))
                    if chunk.choices
                )
        except BaseException as e:  # reported below, not lost in the thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == alone
    assert len(set(alone)) > 3  # the requests really differ


class _SlowBackend:
    """The real backend, 20 ms slower per token: a generation long enough to walk away from."""

    def __init__(self, backend):
        self._backend = backend

    def forward(self, token, pos):
        time.sleep(0.02)
        return self._backend.forward(token, pos)


def test_streams_read_to_the_end_count_as_completed_not_cancelled(server, client):
    """Each stream closes right after its last event; that close is not a cancellation."""
    before = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    for _ in range(8):
        _, finish, _ = stream_text(client, model=MODEL, prompt=PROMPT, max_tokens=4,
                                   temperature=0)
        assert finish == "length"
    after = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert after["requests_completed"] - before["requests_completed"] == 8, (before, after)
    assert after["requests_cancelled"] == before["requests_cancelled"], (before, after)


def test_a_client_that_disconnects_frees_the_worker(model):
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, _SlowBackend(backend), MODEL, use_prefill=False) as slow:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", slow.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                next(response.iter_lines())  # the first event: the generation is under way
            # the response is closed here, ~10 s of generation before it would end on its own
            started = time.monotonic()
            while time.monotonic() - started < 8:
                health = http.get(slow.url + "/health").json()
                if health["requests_cancelled"] == 1 and health["requests_running"] == 0:
                    break
                time.sleep(0.05)
            assert health["requests_cancelled"] == 1, health
            assert health["requests_running"] == 0 and health["requests_completed"] == 0
            short = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            assert http.post(slow.url + "/v1/completions", json=short).status_code == 200


def test_a_non_streamed_client_that_disconnects_frees_the_worker_at_once(model):
    """A non-streamed request (480 tokens at 20 ms each: ~10 s) whose client leaves once it
    runs: the worker stops within a few of its 20 ms steps (it generated to the end: the
    events kept coming, and the disconnect was only polled between them)."""
    import socket

    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, _SlowBackend(backend), MODEL, use_prefill=False) as slow, \
            httpx.Client(timeout=TIMEOUT) as http:
        host, port = slow.url.split("//")[1].split("/")[0].split(":")
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 480}).encode()
        raw = socket.create_connection((host, int(port)))
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        while http.get(slow.url + "/health").json()["requests_running"] == 0:
            time.sleep(0.01)
        time.sleep(0.2)  # ten tokens in
        raw.close()
        left = time.monotonic()
        while time.monotonic() - left < 8:
            health = http.get(slow.url + "/health").json()
            if health["requests_running"] == 0:
                break
            time.sleep(0.01)
        stopped = time.monotonic() - left
        assert health["requests_cancelled"] == 1 and health["requests_completed"] == 0, health
        assert stopped < 0.5, stopped


# --------------------------------------------------------------------------------------------
# Malformed requests: each gets its 4xx JSON error, and the server keeps serving.

GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

BAD = [
    # (path, body: dict or raw bytes, status, param or None)
    ("/v1/completions", b'{"model": "stories260K", "prompt": ', 400, None),  # bad JSON
    ("/v1/completions", b"", 400, None),  # empty body
    ("/v1/completions", b"[1, 2]", 400, None),  # not an object
    ("/v1/completions", b"\xff\xfe{}", 400, None),  # not UTF-8
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a", "temperature": NaN}', 400, None),
    ("/v1/completions", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 7}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": -0.1}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {**GOOD, "n": 17}, 400, "n"),  # over the server's 16
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 100000]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 3000}, 400, "prompt"),  # over the context
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", b"x" * (10 * 1024 * 1024), 413, None),  # a 10 MB body
    # Half a UTF-16 pair: valid JSON, not Unicode text (was a 500 from the tokenizer).
    ("/v1/completions", b'{"model": "stories260K", "prompt": "\\ud83d", "max_tokens": 2}', 400,
     "prompt"),
    ("/v1/chat/completions",
     b'{"model": "stories260K", "messages": [{"role": "user", "content": "a\\udc00"}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", CHAT, 400, None),  # stories260K has no chat template
    ("/v1/nothing", GOOD, 404, None),
    # Python's words must not come through: "Exceeds the limit (4300 digits) for integer string
    # conversion ... sys.set_int_max_str_digits()", "maximum recursion depth exceeded".
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a", "max_tokens": ' + b"9" * 5000
     + b"}", 400, None),
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a", "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "x", "schema": '
     + b'{"type": "object", "properties": {"a": ' * 900 + b"{}" + b"}}" * 900 + b"}}}", 400, None),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {**GOOD, "tools": []}, 400, "tools"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_malformed_request_gets_a_json_error_and_the_server_goes_on(server, path, body, status,
                                                                    param):
    with httpx.Client(timeout=TIMEOUT) as http:
        if isinstance(body, bytes):
            response = http.post(server.url + path, content=body,
                                 headers={"Content-Type": "application/json"})
        else:
            response = http.post(server.url + path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and "\n" not in error["message"]
        assert "recursion" not in error["message"] and "sys." not in error["message"]
        assert error["param"] == param
        if param:
            assert param.split("[")[0].split(".")[0] in error["message"]
        after = http.post(server.url + "/v1/completions", json=GOOD)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_wrong_method_and_context_error_code(server):
    with httpx.Client(timeout=TIMEOUT) as http:
        assert http.get(server.url + "/v1/completions").status_code == 405
        too_long = http.post(server.url + "/v1/completions",
                             json={**GOOD, "prompt": "word " * 3000})
        assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_the_openai_client_raises_our_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="a", temperature=9)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="a")


# --------------------------------------------------------------------------------------------
# The command.


def test_jllama_serve_command():
    process = subprocess.Popen(
        jllama_command() + ["serve", "--port=0"], stderr=subprocess.PIPE, text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline and process.poll() is None:
            line = process.stderr.readline()
            lines.append(line)
            if "serving stories260K" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url, lines
        with openai_client(url, timeout=TIMEOUT) as c:
            got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == cli_generate(PROMPT, 8, "--temperature=0")["text"]
        port = url.split(":")[2].split("/")[0]
        busy = run("serve", f"--port={port}")  # the port is taken: one line, exit code 1
        assert busy.returncode == 1
        assert busy.stderr.strip().count("\n") == 0 and f":{port}" in busy.stderr
    finally:
        process.send_signal(signal.SIGINT)
        try:
            # Ctrl-C: jllama's exit code for an interrupt, after a graceful shutdown.
            assert process.wait(20) == 130
            assert "Traceback" not in process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def test_max_tokens_beyond_the_context_is_a_400(server):
    """stories260K's context is 512 tokens: a short prompt with max_tokens=600 cannot fit
    (OpenAI answers 400 too; it was clamped with a 200)."""
    with httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(server.url + "/v1/completions", json={**GOOD, "max_tokens": 600})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
        fits = http.post(server.url + "/v1/completions", json={**GOOD, "max_tokens": 500})
        assert fits.status_code == 200


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("response_format", {"type": "json_objekt"}),
])
def test_completions_refuse_tools_and_bad_response_format(server, field, value):
    with httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(server.url + "/v1/completions", json={**GOOD, field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field)
        plain = http.post(server.url + "/v1/completions",
                          json={**GOOD, "response_format": {"type": "text"}})
        assert plain.status_code == 200


def test_a_full_queue_says_when_to_retry(model):
    """max_waiting=0: every request is refused with 503, OpenAI's error object and a
    Retry-After header (clients back off by it)."""
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, MODEL, max_waiting=0) as running, \
            httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(running.url + "/v1/completions", json=GOOD)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "queue_full"


def test_a_client_gone_while_sending_its_body_logs_no_traceback(model, capfd):
    """Three clients declare a 1000-byte body, send 10 bytes and close: no traceback per
    connection (it was 57 lines of starlette.requests.ClientDisconnect), and the server goes
    on answering."""
    import socket

    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, MODEL) as running, httpx.Client(timeout=TIMEOUT) as http:
        host, port = running.url.split("//")[1].split("/")[0].split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                            b'{"model":')
                time.sleep(0.2)
        time.sleep(0.5)
        assert http.post(running.url + "/v1/completions", json=GOOD).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err, err


def test_sigterm_under_load_ends_every_stream_and_exits_0():
    """8 streams of 240 tokens on `jllama serve --parallel=4`; SIGTERM once one stream has 20
    events: every stream ends with an error event ("shutting_down") or its finish_reason,
    then [DONE], and the process exits 0 (uvicorn re-raised the SIGTERM: exit -15)."""
    import asyncio

    process = subprocess.Popen(
        jllama_command() + ["serve", "--port=0", "--parallel=4", "--seq_len=256"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        url = None
        for line in process.stderr:
            if "serving stories260K" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url
        sent = []

        async def stream(i):
            events = []
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                body = {"model": MODEL, "prompt": "Once", "max_tokens": 240, "stream": True,
                        "temperature": 0.8, "seed": i}
                async with http.stream("POST", url + "/completions", json=body) as reply:
                    assert reply.status_code == 200
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 20 and not sent:
                                sent.append(process.send_signal(signal.SIGTERM))
            return events

        async def all_streams():
            return await asyncio.gather(*[stream(i) for i in range(8)])

        for events in asyncio.run(all_streams()):
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert ("error" in last and last["error"]["code"] == "shutting_down"
                    or last["choices"][0]["finish_reason"] in ("stop", "length")), last
        assert sent and process.wait(30) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_slow_clients_are_closed_and_do_not_stall_others(model, capfd):
    """80 connections that send a request head a byte at a time are closed once the head
    deadline passes (1 s here; 10 s by default), a body that does not arrive gets a 408, the
    log stays quiet, and normal requests answer meanwhile in well under a second."""
    import socket

    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, MODEL, head_timeout_s=1.0, body_timeout_s=1.0) as running, \
            httpx.Client(timeout=TIMEOUT) as http:
        host, port = running.url.split("//")[1].split(":")
        slow = [socket.create_connection((host, int(port))) for _ in range(80)]
        for raw in slow:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        body = socket.create_connection((host, int(port)))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{")
        started, latencies = time.monotonic(), []
        while time.monotonic() - started < 2.5:
            t = time.monotonic()
            assert http.post(running.url + "/v1/completions", json=GOOD).status_code == 200
            latencies.append(time.monotonic() - t)
            for raw in slow[:10]:  # a byte now and then does not extend the deadline
                try:
                    raw.sendall(b"s")
                except OSError:
                    pass
        closed = 0
        for raw in slow:
            raw.settimeout(1.0)
            try:
                closed += raw.recv(100) == b""
            except OSError:
                pass
            raw.close()
        body.settimeout(1.0)
        assert body.recv(100).startswith(b"HTTP/1.1 408")
        body.close()
    assert closed == 80
    assert max(latencies) < 1.0, latencies
    assert len(capfd.readouterr().err.splitlines()) <= 80


@pytest.mark.parametrize("raw", [
    b"\x00\xffGARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
])
def test_bytes_that_are_not_http_get_the_error_object(server, raw):
    """h11 cannot parse these: the 400 carries OpenAI's error object (it was plain text)."""
    import socket

    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(raw)
        conn.settimeout(5)
        reply = b""
        while chunk := conn.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http_request"
    assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=TIMEOUT).status_code == 200
