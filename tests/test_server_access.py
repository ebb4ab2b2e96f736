"""Who may use `jllama serve`: API keys (with the official `openai` client: the right key works,
another raises its AuthenticationError), CORS preflights, the API's paths without their /v1
prefix, and `system_fingerprint`. Stories260K for completions, the tiny random Llama 3.2 (Meta's
chat template) for chat."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving import openai_client, serve
from test_cli import jllama_command, run

from jllama import __version__
from jllama.errors import JllamaError
from jllama.server.access import parse_api_keys

LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
KEYS = ("sk-first-key", "sk-second")
ORIGIN = "http://app.example"
FINGERPRINT = re.compile(rf"jllama-{re.escape(__version__)}-[0-9a-f]{{10}}")
PROMPT = "Once upon a time"


def _server(path=None, **options):
    return serve(path, seq_len=256, **options)


@pytest.fixture(scope="module")
def locked():
    with _server(api_keys=KEYS, cors_origins=(ORIGIN,)) as running:
        yield running


@pytest.fixture(scope="module")
def tiny():
    with _server(LLAMA32_TINY) as running:
        yield running


def _client(url, key):
    return openai_client(url, api_key=key, timeout=60)


def test_the_right_key_works_and_another_raises(locked):
    for key in KEYS:
        with _client(locked.url + "/v1", key) as client:
            assert [m.id for m in client.models.list().data] == ["m"]
            reply = client.completions.create(model="m", prompt=PROMPT, max_tokens=3)
            assert reply.usage.completion_tokens == 3
    with _client(locked.url + "/v1", "sk-wrong") as client, \
            pytest.raises(openai.AuthenticationError) as error:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=3)
    assert error.value.status_code == 401
    assert error.value.body == {  # OpenAI's error object
        "message": "the API key given is not one of this server's (send it as "
                   "'Authorization: Bearer KEY' or 'x-api-key: KEY')",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def test_a_missing_key_is_a_401_on_every_route_but_health(locked):
    with httpx.Client(base_url=locked.url, timeout=60) as http:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                             ("GET", "/models"), ("POST", "/v1/responses"),
                             ("POST", "/v1/messages"), ("GET", "/v1/nothing")]:
            reply = http.request(method, path, json={"model": "m", "prompt": "a"})
            assert reply.status_code == 401, (path, reply.text)
            message = ("this server needs an API key: send it as 'Authorization: Bearer KEY' "
                       "or 'x-api-key: KEY'")
            if path == "/v1/messages":  # Anthropic's error shape on its route
                assert reply.json() == {"type": "error", "error": {
                    "type": "authentication_error", "message": message}}
            else:
                assert reply.json()["error"]["code"] == "invalid_api_key"
                assert reply.json()["error"]["message"] == message
            assert reply.headers["www-authenticate"] == "Bearer"
        assert http.get("/health").status_code == 200
        assert http.head("/health").status_code == 200
        # The chat page (where served: --no_webui leaves it out) is static: no key for it.
        assert http.get("/").status_code != 401
        wrong = http.get("/v1/models", headers={"Authorization": "Basic c2stZmlyc3Qta2V5"})
        assert wrong.status_code == 401


def test_x_api_key_and_any_bearer_case_work(locked):
    with httpx.Client(base_url=locked.url, timeout=60) as http:
        assert http.get("/v1/models", headers={"x-api-key": KEYS[1]}).status_code == 200
        assert http.get("/metrics", headers={"X-Api-Key": KEYS[0]}).status_code == 200
        reply = http.post("/v1/completions", headers={"authorization": f"bearer {KEYS[0]}"},
                          json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
        assert reply.status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": "sk-first"}).status_code == 401


def test_a_preflight_from_an_allowed_origin_is_answered(locked):
    with httpx.Client(base_url=locked.url, timeout=60) as http:
        reply = http.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in reply.headers["access-control-allow-methods"]
        assert "authorization" in reply.headers["access-control-allow-headers"].lower()
        other = http.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        # The answers themselves name the origin, a 401 included (the page can read why).
        refused = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        allowed = http.get("/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEYS[0]})
        assert allowed.headers["access-control-allow-origin"] == ORIGIN


def test_without_cors_origins_no_origin_is_allowed(tiny):
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        reply = http.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert reply.status_code == 405
        assert "access-control-allow-origin" not in reply.headers
        plain = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_the_api_answers_without_the_v1_prefix(tiny):
    with _client(tiny.url, "x") as root, _client(tiny.url + "/v1", "x") as v1:
        assert [m.id for m in root.models.list().data] == ["m"]
        assert root.models.retrieve("m").id == "m"
        kwargs = {"model": "m", "max_tokens": 6, "temperature": 0}
        messages = [{"role": "user", "content": "Hi"}]
        assert (root.chat.completions.create(messages=messages, **kwargs).choices[0].message
                == v1.chat.completions.create(messages=messages, **kwargs).choices[0].message)
        assert (root.completions.create(prompt=PROMPT, **kwargs).choices[0].text
                == v1.completions.create(prompt=PROMPT, **kwargs).choices[0].text)
    with httpx.Client(base_url=tiny.url, timeout=60) as http:
        slash = http.post("/completions/", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
        assert slash.status_code == 200
        assert http.get("/models/gpt-4").json()["error"]["code"] == "model_not_found"
        assert http.post("/embeddings", json={}).status_code == 404


def test_system_fingerprint_in_responses_and_chunks(tiny):
    with _client(tiny.url + "/v1", "x") as client:
        messages = [{"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        assert FINGERPRINT.fullmatch(chat.system_fingerprint)
        chunks = list(client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, stream=True,
            stream_options={"include_usage": True}))
        assert {c.system_fingerprint for c in chunks} == {chat.system_fingerprint}
        text = client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        assert text.system_fingerprint == chat.system_fingerprint
        streamed = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                                  stream=True))
        assert {c.system_fingerprint for c in streamed} == {chat.system_fingerprint}


def test_api_key_flags_parse(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# ops\nsk-from-file\n\n  sk-b  \n")
    assert parse_api_keys(["sk-a,sk-b", " sk-c "], str(keys)) == (
        "sk-a", "sk-b", "sk-c", "sk-from-file")
    assert parse_api_keys([]) == ()
    with pytest.raises(JllamaError, match="cannot read it"):
        parse_api_keys([], str(tmp_path / "none"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(JllamaError, match="holds no key"):
        parse_api_keys([], str(tmp_path / "empty"))
    with pytest.raises(JllamaError, match="printable ASCII"):
        parse_api_keys(["sk-é"])


def test_jllama_serve_takes_keys_and_origins(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# for the tests\nsk-file\n")
    process = subprocess.Popen(
        jllama_command() + ["serve", "--port=0", "--api_key=sk-a,sk-b", "--api_key=sk-c",
                            f"--api_key_file={keys}", f"--cors_origins={ORIGIN}"],
        stderr=subprocess.PIPE, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            lines.append(process.stderr.readline())
            if "serving stories260K" in lines[-1]:
                url = lines[-1].split(" at ")[1].split()[0]
            if "CORS origins" in lines[-1]:
                break
        assert url, lines
        assert lines[-1] == (f"jllama: 4 API keys (every route but /health and the chat page "
                             f"needs one); CORS origins: {ORIGIN}\n")
        for key in ("sk-a", "sk-b", "sk-c", "sk-file"):
            with _client(url, key) as client:
                assert [m.id for m in client.models.list().data] == ["stories260K"]
        with _client(url, "sk-d") as client, pytest.raises(openai.AuthenticationError):
            client.models.list()
        preflight = httpx.options(url + "/completions", timeout=60, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(20) == 130
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    missing = run("serve", "--port=0", f"--api_key_file={tmp_path / 'none'}")
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "--api_key_file=" in missing.stderr


def test_the_anthropic_client_with_the_right_key_works_and_another_raises():
    import anthropic

    with _server(LLAMA32_TINY, api_keys=KEYS) as server:
        messages = [{"role": "user", "content": "Hello"}]
        with anthropic.Anthropic(base_url=server.url, api_key=KEYS[1], max_retries=0,
                                 timeout=60) as client:
            reply = client.messages.create(model="m", max_tokens=4, messages=messages)
            assert reply.type == "message" and reply.usage.output_tokens >= 1
        with anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0,
                                 timeout=60) as client, \
                pytest.raises(anthropic.AuthenticationError) as error:
            client.messages.create(model="m", max_tokens=4, messages=messages)
        assert error.value.status_code == 401
        assert error.value.body["error"]["type"] == "authentication_error"
