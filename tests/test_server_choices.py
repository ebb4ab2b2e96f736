"""`n` choices per request on /v1/completions and /v1/chat/completions, with the official `openai`
client, on both workers (one at a time, and 3 slots).

The references are requests of the same server with n=1: choice i of a request with seed S is
the reply to seed S + i, exactly (the server's documented rule); a greedy request's choices are
all the greedy reply. Usage as OpenAI's API counts it: the prompt once, the completion tokens of
every choice summed. Models: stories260K (completions) and the tiny random Llama 3.2 with Meta's
chat template (chat).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from serving import openai_client, serve


LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
PROMPT = "Once upon a time"
ASK = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module", params=[1, 3], ids=["fifo", "slots"])
def stories(request):
    with serve(None, request.param, 256) as running, openai_client(running) as client:
        yield client


@pytest.fixture(scope="module", params=[1, 3], ids=["fifo", "slots"])
def tiny(request):
    with serve(LLAMA32_TINY, request.param, 512) as running, openai_client(running) as client:
        yield client


@pytest.mark.parametrize("fresh", [False, True], ids=["reused", "cache_prompt=false"])
def test_choice_i_is_the_reply_to_seed_plus_i(stories, fresh):
    extra = {"cache_prompt": False} if fresh else {}
    kwargs = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0,
              "extra_body": extra}
    together = stories.completions.create(n=4, seed=1234, **kwargs)
    alone = [stories.completions.create(seed=1234 + i, **kwargs) for i in range(4)]
    assert [c.index for c in together.choices] == [0, 1, 2, 3]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in together.choices] == [
        a.choices[0].finish_reason for a in alone]
    assert len({c.text for c in together.choices}) == 4
    # OpenAI's usage for n choices: the prompt once, the completion tokens summed.
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert together.usage.total_tokens == (together.usage.prompt_tokens
                                           + together.usage.completion_tokens)


def test_greedy_choices_are_all_the_greedy_reply(stories):
    one = stories.completions.create(model="m", prompt=PROMPT, max_tokens=30, temperature=0)
    three = stories.completions.create(model="m", prompt=PROMPT, max_tokens=30, temperature=0,
                                       n=3)
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_no_seed_gives_different_choices(stories):
    reply = stories.completions.create(model="m", prompt=PROMPT, max_tokens=24,
                                       temperature=1.5, n=3)
    assert len({c.text for c in reply.choices}) == 3


def test_a_stream_of_n_choices_carries_each_index(stories):
    kwargs = {"model": "m", "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 77,
              "n": 3}
    whole = stories.completions.create(**kwargs)
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in stories.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_n_over_16_is_a_400(stories):
    with pytest.raises(openai.BadRequestError, match=r"n: must be an integer in \[1, 16\]"):
        stories.completions.create(model="m", prompt=PROMPT, max_tokens=2, n=17)


def test_chat_choices_whole_and_streamed(tiny):
    kwargs = {"model": "m", "messages": ASK, "max_tokens": 16, "temperature": 1.0}
    together = tiny.chat.completions.create(n=3, seed=99, **kwargs)
    alone = [tiny.chat.completions.create(seed=99 + i, **kwargs) for i in range(3)]
    assert [c.message.content for c in together.choices] == [
        a.choices[0].message.content for a in alone]
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts, roles, finishes, usage = ["", "", ""], [None] * 3, [None] * 3, None
    for chunk in tiny.chat.completions.create(n=3, seed=99, stream=True,
                                              stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in together.choices]
    assert roles == ["assistant"] * 3
    assert finishes == [c.finish_reason for c in together.choices]
    assert usage.completion_tokens == together.usage.completion_tokens


def test_greedy_chat_choices_are_equal(tiny):
    reply = tiny.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0,
                                         n=2)
    assert reply.choices[0].message.content == reply.choices[1].message.content
    assert reply.choices[0].message.content


def test_a_request_the_queue_cannot_hold_whole_runs_no_choice():
    """max_waiting=1 on the one-at-a-time worker: choice 0 runs (or waits), the next one waits
    (or is refused), the one after is refused; the request gets the 503 and its choices already
    queued are cancelled, none completed."""
    with serve(None, 1, 256) as running, httpx.Client(timeout=120) as http:
        running.engine.max_waiting = 1
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "n": 4}
        reply = http.post(running.url + "/v1/completions", json=body)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = http.get(running.url + "/health").json()
            if health["requests_running"] == 0 and health["requests_waiting"] == 0:
                break
            time.sleep(0.02)
        # Choice 0, and choice 1 where the worker took choice 0 before it came, were cancelled.
        assert health["requests_cancelled"] in (1, 2), health
        assert health["requests_completed"] == 0, health
        one = http.post(running.url + "/v1/completions", json={**body, "n": 1, "max_tokens": 4})
        assert one.status_code == 200
