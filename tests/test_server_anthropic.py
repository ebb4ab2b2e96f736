"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through
`jllama serve` and the official `anthropic` client.

References: the client's own types and its stream accumulator (`client.messages.stream`)
parse every reply and event; the same conversation on /v1/chat/completions (the official
`openai` client, another route and request shape) gives the greedy text and token counts the
Messages reply must equal; a stop sequence's cut is worked out from chat's uncut text by hand
(`str.find`); `jsonschema` validates tool inputs. Model: the tiny random Llama 3.2 with Meta's
template (it renders tools), both workers.

This client version sends no `temperature` / `top_k` of its own (its newest models take none):
greedy decoding goes through `extra_body`, which the server reads as the Messages API's
`temperature` field.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from serving import openai_client, serve
from test_server_structured import LLAMA32_TINY, SCHEMA_OF, TOOLS

GREEDY = {"temperature": 0.0, "cache_prompt": False}  # every reply as a fresh run's
# The tools in chat's shape and in Anthropic's (name, description, input_schema).
CHAT_TOOLS = TOOLS
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                    **({"description": t["function"]["description"]}
                       if "description" in t["function"] else {}),
                    **({"strict": t["function"]["strict"]} if "strict" in t["function"] else {})}
                   for t in TOOLS]
# One conversation in both shapes (text blocks are joined with a line break, as chat's parts).
SYSTEM = [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                 {"type": "text", "text": "there"}]},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Tell me a story."},
]
CHAT_MESSAGES = [
    {"role": "system", "content": "You are\nterse."},
    {"role": "user", "content": "Hello\nthere"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Tell me a story."},
]


@pytest.fixture(scope="module", params=[1, 4], ids=["fifo", "slots"])
def server(request):
    with serve(LLAMA32_TINY, request.param) as running:
        yield running


@pytest.fixture()
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0,
                             timeout=300) as client:
        yield client


@pytest.fixture()
def chat(server):
    with openai_client(server, timeout=300) as client:
        def create(messages, **kwargs):
            return client.chat.completions.create(
                model="m", messages=messages, temperature=0.0,
                extra_body={"cache_prompt": False}, **kwargs)

        yield create


def test_greedy_text_equals_chat_completions(client, chat):
    for max_tokens in (8, 40):
        want = chat(CHAT_MESSAGES, max_tokens=max_tokens)
        reply = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES,
                                       max_tokens=max_tokens, extra_body=GREEDY)
        assert reply.type == "message" and reply.role == "assistant" and reply.model == "m"
        assert reply.id.startswith("msg_")
        (block,) = reply.content
        assert block.type == "text" and block.text == want.choices[0].message.content
        assert reply.usage.input_tokens == want.usage.prompt_tokens
        assert reply.usage.output_tokens == want.usage.completion_tokens
        cut = want.choices[0].finish_reason == "length"
        assert reply.stop_reason == ("max_tokens" if cut else "end_turn")
        assert reply.stop_sequence is None
    system = client.messages.create(model="m", system="You are\nterse.", messages=MESSAGES,
                                    max_tokens=8, extra_body=GREEDY)
    assert system.content[0].text == chat(CHAT_MESSAGES, max_tokens=8).choices[0].message.content


def test_stop_sequences_cut_the_text_and_name_the_one_found(client, chat):
    """Five stop sequences (chat's limit is 4): the text ends before the first place one of
    them occurs in the uncut greedy text, and stop_sequence says which."""
    text = chat(CHAT_MESSAGES, max_tokens=30).choices[0].message.content
    assert len(text) > 12, text
    stop = text[8:10]
    reply = client.messages.create(
        model="m", system=SYSTEM, messages=MESSAGES, max_tokens=30, extra_body=GREEDY,
        stop_sequences=["zzq1", "zzq2", stop, "zzq3", "zzq4"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert "".join(b.text for b in reply.content) == text[:text.find(stop)]
    with client.messages.stream(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=30,
                                extra_body=GREEDY, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert [b.text for b in final.content] == [b.text for b in reply.content]


def test_stream_events_in_order_and_equal_to_the_whole_reply(client, server):
    kwargs = dict(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=12, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        pieces = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)
    # On the wire: `event:` lines naming each event as its data's type, a ping after the
    # first block's start, the usage in message_start and message_delta.
    body = {"model": "m", "system": SYSTEM, "messages": MESSAGES, "max_tokens": 12,
            "stream": True, **GREEDY}
    headers = {"x-api-key": "x", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers,
                      timeout=300) as raw:
        assert raw.status_code == 200
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * deltas, "content_block_stop", "message_delta",
                     "message_stop"]
    assert datas[0]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == 12
    assert "".join(d["delta"]["text"] for d in datas[3:-3]) == whole.content[0].text


def _tool_use(reply, names):
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in names
    jsonschema.validate(block.input, SCHEMA_OF[block.name])
    return block


def test_tool_use_then_a_tool_result_turn_equals_chat(client, chat):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.messages.create(model="m", messages=ask, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   max_tokens=80, extra_body=GREEDY)
    call = _tool_use(first, {"get_weather"})
    want = chat(ask, tools=CHAT_TOOLS, max_tokens=80,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.input == json.loads(want.choices[0].message.tool_calls[0].function.arguments)
    assert first.usage.input_tokens == want.usage.prompt_tokens
    anyone = client.messages.create(model="m", messages=ask, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "any"}, max_tokens=80,
                                    extra_body=GREEDY)
    _tool_use(anyone, {"get_weather", "add"})
    # Streamed: input_json_delta pieces that the client puts together into the same input.
    with client.messages.stream(model="m", messages=ask, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                max_tokens=80, extra_body=GREEDY) as stream:
        partial = "".join(e.partial_json for e in stream if e.type == "input_json")
        streamed = stream.get_final_message()
    assert _tool_use(streamed, {"get_weather"}).input == call.input == json.loads(partial)
    # The call and its result fed back: the prompt and reply of chat's tool_calls + tool turn.
    result = '{"temperature": 3}'
    again = client.messages.create(model="m", tools=ANTHROPIC_TOOLS, max_tokens=12,
                                   extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": result}]}])
    want = chat([*ask, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}],
        tools=CHAT_TOOLS, max_tokens=12)
    assert again.usage.input_tokens == want.usage.prompt_tokens > first.usage.input_tokens + 20
    message = want.choices[0].message
    if message.tool_calls:
        assert [(b.name, b.input) for b in again.content] == [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    else:
        assert again.content[0].text == message.content


def test_count_tokens_is_the_rendered_prompt(client, chat):
    count = client.messages.count_tokens(model="m", system=SYSTEM, messages=MESSAGES)
    reply = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=2,
                                   extra_body=GREEDY)
    assert count.input_tokens == reply.usage.input_tokens == chat(
        CHAT_MESSAGES, max_tokens=1).usage.prompt_tokens
    tooled = client.messages.count_tokens(model="m", messages=MESSAGES, tools=ANTHROPIC_TOOLS)
    assert tooled.input_tokens == chat(CHAT_MESSAGES[1:], tools=CHAT_TOOLS,
                                       max_tokens=1).usage.prompt_tokens
    assert tooled.input_tokens > client.messages.count_tokens(
        model="m", messages=MESSAGES).input_tokens + 100


def _error(got: httpx.Response, status: int, kind: str) -> str:
    assert got.status_code == status, got.text
    body = got.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    assert "\n" not in body["error"]["message"]
    return body["error"]["message"]


def test_errors_in_anthropic_shape(client, server):
    url = server.url + "/v1/messages"
    ask = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert _error(httpx.post(url, json=ask, timeout=60), 400,
                  "invalid_request_error") == "max_tokens: this field is required"
    with pytest.raises(anthropic.BadRequestError) as missing:  # the client reads it so too
        client.post("/v1/messages", body=ask, cast_to=anthropic.types.Message)
    assert missing.value.status_code == 400
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=4, messages=ask["messages"])
    for fields, start in [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant",
                                                           "content": "Sure"}]}, "messages[1]"),
        ({"temperature": 1.5}, "temperature"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "x", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
        ({"max_tokens": 5000}, "messages ("),
    ]:
        message = _error(httpx.post(url, json={**ask, "max_tokens": 4, **fields}, timeout=60),
                         400, "invalid_request_error")
        assert message.startswith(start), message
    assert _error(httpx.post(url, json={**ask, "model": "x", "max_tokens": 4}, timeout=60), 404,
                  "not_found_error")
    _error(httpx.get(url, timeout=60), 405, "invalid_request_error")
    _error(httpx.get(url + "/batches", timeout=60), 404, "not_found_error")
    _error(httpx.post(url + "/count_tokens", json={"model": "m"}, timeout=60), 400,
           "invalid_request_error")


def test_routes_without_v1_and_the_api_headers(server):
    headers = {"x-api-key": "anything", "anthropic-version": "2023-06-01"}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
            **GREEDY}
    bare = httpx.post(server.url + "/messages", json=body, headers=headers, timeout=60).json()
    v1 = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).json()
    assert bare["content"] == v1["content"] and bare["usage"] == v1["usage"]
    count = httpx.post(server.url + "/messages/count_tokens", json=body, timeout=60).json()
    assert count == {"input_tokens": v1["usage"]["input_tokens"]}


def test_a_stream_the_server_ends_closes_with_an_error_event(server):
    """A server shutting down ends every stream (`end_streams`): with Anthropic's `error`
    event (overloaded_error, as its 503), which the client raises."""
    body = {"model": "m", "max_tokens": 900, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a story."}], **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=300) as raw:
        lines = []
        for line in raw.iter_lines():
            lines.append(line)
            if line == "event: content_block_delta" and lines.count(line) == 1:
                server.server.config.app.state.end_streams("the server is shutting down")
    events = [line for line in lines if line.startswith("event: ")]
    assert events[-1] == "event: error" and "event: message_stop" not in events
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "overloaded_error",
                                                "message": "the server is shutting down"}}
