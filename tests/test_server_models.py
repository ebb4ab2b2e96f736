"""Several models in one server (`jllama.server.models.ModelRouter`, `serve --model`): the
embedded stories260K and SmolLM2-135M (Q4_1 GGUF) served at once, each request answered by the
model it names, as a one-model server answers it; /v1/models lists both; an unknown model is a
404 in OpenAI's (and on /v1/messages Anthropic's) shape; with max_loaded=1 the models take
turns (the idle one unloaded, its worker and backend gone)."""

from __future__ import annotations

import gc
import signal
import subprocess
import threading
import time
import weakref

import httpx
import pytest

from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread
from jllama.server.models import (
    ModelRouter,
    RouterThread,
    parse_model_flag,
    session_worker,
)

STORIES, SMOL = "stories260K", "smollm2"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    return {STORIES: open_model(), SMOL: open_model(str(smollm2_gguf))}


def prepared(model):
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    return backend


class Loaders(dict):
    """name -> loader; remembers a weak reference to each backend it made."""

    def __init__(self, models):
        super().__init__({name: (lambda name=name: self.load(name)) for name in models})
        self.models = models
        self.backends: list[tuple[str, weakref.ref]] = []

    def load(self, name):
        backend = prepared(self.models[name])
        self.backends.append((name, weakref.ref(backend)))
        return session_worker(self.models[name], backend)


REQUESTS = {
    STORIES: ("/v1/completions", {"model": STORIES, "prompt": "Once upon a time",
                                  "max_tokens": 12, "temperature": 0}),
    SMOL: ("/v1/chat/completions", {"model": SMOL, "max_tokens": 8, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Hi!"}]}),
}


def text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def ask(url: str, name: str) -> dict:
    path, body = REQUESTS[name]
    response = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def alone(models):
    """Each request's greedy text from a one-model server."""
    answers = {}
    for name, model in models.items():
        with ServerThread(model, prepared(model), name) as server:
            answers[name] = text(ask(server.url, name))
    return answers


@pytest.fixture(scope="module")
def both(models):
    with RouterThread(ModelRouter(Loaders(models), STORIES)) as server:
        yield server


def test_parse_model_flag():
    assert parse_model_flag("smol=/x/y.gguf") == ("smol", "/x/y.gguf")
    for bad in ("smol", "=x", "smol=", " = "):
        with pytest.raises(ValueError, match="NAME=CHECKPOINT"):
            parse_model_flag(bad)


def test_each_request_is_answered_by_the_model_it_names(both, alone):
    assert both.router.loaded == [STORIES]  # the default at start, the other on first use
    for name in (SMOL, STORIES, SMOL):
        reply = ask(both.url, name)
        assert reply["model"] == name
        assert text(reply) == alone[name], name
    assert alone[STORIES] != alone[SMOL]
    assert both.router.loaded == [STORIES, SMOL]
    assert dict(both.router.loads) == {STORIES: 1, SMOL: 1}


def test_requests_for_two_models_run_at_once(both, alone):
    results, errors = {}, []

    def go(name):
        try:
            results[name] = text(ask(both.url, name))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(name,)) for name in (STORIES, SMOL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and results == alone


def test_models_lists_both_and_unknown_models_are_404(both):
    listed = httpx.get(both.url + "/v1/models", timeout=TIMEOUT).json()
    assert [card["id"] for card in listed["data"]] == [STORIES, SMOL]
    assert httpx.get(both.url + f"/v1/models/{SMOL}", timeout=TIMEOUT).json()["id"] == SMOL
    for path, body in REQUESTS.values():
        response = httpx.post(both.url + path, json={**body, "model": "nope"}, timeout=TIMEOUT)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
        assert error["code"] == "model_not_found" and "'nope'" in error["message"]
        assert STORIES in error["message"] and SMOL in error["message"]
    response = httpx.post(both.url + "/v1/messages", json={
        "model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
    }, timeout=TIMEOUT)
    assert response.status_code == 404
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error"
    assert httpx.get(both.url + "/health", timeout=TIMEOUT).json()["model"] == STORIES
    assert httpx.get(both.url + "/metrics", timeout=TIMEOUT).status_code == 200


def test_one_model_at_a_time_unloads_the_least_recently_used(models, alone):
    loaders = Loaders(models)
    with RouterThread(ModelRouter(loaders, STORIES, max_loaded=1)) as server:
        router = server.router
        first = router.worker(STORIES)
        for name in (SMOL, STORIES, SMOL):
            reply = ask(server.url, name)
            assert reply["model"] == name and text(reply) == alone[name], name
            assert router.loaded == [name]
        assert dict(router.loads) == {STORIES: 2, SMOL: 2}
        assert dict(router.unloads) == {STORIES: 2, SMOL: 1}
        # The unloaded stories260K's worker thread has ended and its backend is gone.
        assert not first._thread.is_alive()
        del first
        gc.collect()
        gone = [name for name, ref in loaders.backends if ref() is None]
        assert gone == [STORIES, SMOL, STORIES], loaders.backends
        # /health and /metrics answer for the loaded model while the default is unloaded.
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["model"] == SMOL
        assert [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]] == \
            [STORIES, SMOL]


def test_jllama_serve_with_two_models(smollm2_gguf, alone):
    """`jllama serve --model smollm2=PATH --models_max_loaded=1`: stories260K (the default,
    --checkpoint's) and SmolLM2 answer as one-model servers do; a bad --model is one line."""
    from test_cli import jllama_command, run

    bad = run("serve", "--port=0", "--model=smollm2")
    assert bad.returncode == 1 and "NAME=CHECKPOINT" in bad.stderr
    taken = run("serve", "--port=0", f"--model=stories260K={smollm2_gguf}")
    assert taken.returncode == 1 and "taken" in taken.stderr
    process = subprocess.Popen(
        jllama_command() + ["serve", "--port=0", "--parallel=1", f"--model={SMOL}={smollm2_gguf}",
                            "--models_max_loaded=1"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            line = process.stderr.readline()
            lines.append(line)
            if "serving stories260K" in line:
                url = line.split(" at ")[1].split()[0].removesuffix("/v1")
                break
        assert url, lines
        assert any("models stories260K, smollm2" in line for line in lines), lines
        for name in (SMOL, STORIES):
            reply = ask(url, name)
            assert reply["model"] == name and text(reply) == alone[name], name
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(20) == 130
            assert "Traceback" not in process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def test_a_request_without_the_key_loads_no_model(models):
    """With API keys, naming an unloaded model without a key is a 401 from a loaded model's
    app and loads nothing (a stranger cannot make the server load models)."""
    loaders = Loaders(models)
    router = ModelRouter(loaders, STORIES, 0, api_keys=("sk-key",))
    with RouterThread(router) as server:
        path, body = REQUESTS[SMOL]
        reply = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert reply.status_code == 401
        assert router.loaded == [STORIES] and router.loads[SMOL] == 0
        reply = httpx.post(server.url + path, json=body, timeout=TIMEOUT,
                           headers={"Authorization": "Bearer sk-key"})
        assert reply.status_code == 200 and router.loads[SMOL] == 1
