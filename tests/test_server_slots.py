"""`jllama serve --parallel=N`: concurrent seeded requests equal each alone, a repeated prompt
prefix is reported as cached, a vanished client frees its slot, /metrics counts it all.
Stories260K on the jax backend, 4 slots."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from serving import openai_client

from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread

MODEL = "stories260K"
TIMEOUT = 60


@pytest.fixture(scope="module")
def server():
    model = open_model(seq_len=256)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, MODEL, parallel=4) as running:
        yield running


def _body(i):
    return {"model": MODEL, "prompt": ["Once upon a time", "Tom had", "The sun", "Lily"][i % 4],
            "max_tokens": 24, "temperature": 0.9, "seed": 1000 + i}


def test_concurrent_seeded_requests_equal_each_alone(server):
    with httpx.Client(timeout=TIMEOUT) as http:
        alone = [http.post(server.url + "/v1/completions", json=_body(i)).json()["choices"][0]
                 ["text"] for i in range(8)]

    async def together():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            replies = await asyncio.gather(*[
                http.post(server.url + "/v1/completions", json=_body(i)) for i in range(8)])
        return [r.json()["choices"][0]["text"] for r in replies]

    assert asyncio.run(together()) == alone


def test_a_repeated_prefix_is_served_from_a_slot_and_reported(server):
    client = openai_client(server, timeout=TIMEOUT)
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt + " outside", max_tokens=4,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert first.usage.prompt_tokens_details.cached_tokens <= first.usage.prompt_tokens - 1
    fresh = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].text == first.choices[0].text


def test_a_vanished_client_frees_its_slot_and_metrics_count(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        before = http.get(server.url + "/health").json()["requests_cancelled"]
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = http.get(server.url + "/health").json()
            if health["requests_cancelled"] > before and health["requests_running"] == 0:
                break
            time.sleep(0.05)
        assert health["requests_cancelled"] == before + 1 and health["requests_running"] == 0
        text = http.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["jllama_slots"] == 4
    assert values["jllama_requests_running"] == 0
    assert values["jllama_generation_tokens_total"] > 0
    assert values["jllama_prompt_tokens_total"] > 0
    assert values['jllama_requests_finished_total{finish_reason="length"}'] >= 1



def test_ignore_eos_goes_on_to_max_tokens(server):
    # Greedy "The sun was hot" ends with an end-of-text id after ~200 of these 240 tokens
    # (the CLI's greedy run stops there too); ignore_eos (llama.cpp server's field) goes on.
    body = {"model": MODEL, "prompt": "The sun was hot", "max_tokens": 240, "temperature": 0}
    with httpx.Client(timeout=TIMEOUT) as http:
        plain = http.post(server.url + "/v1/completions", json=body).json()
        forced = http.post(server.url + "/v1/completions", json={**body, "ignore_eos": True})
    forced = forced.json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < 240
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 240
    assert forced["choices"][0]["text"].startswith(plain["choices"][0]["text"])
