"""OpenAI's Responses API (`POST /v1/responses`) through `jllama serve` and the official
`openai` client's `client.responses`.

References: the client's own types and stream helper parse every response and event; the
same conversation on /v1/chat/completions (a separate route and request shape) gives the
greedy text and token counts the Responses reply must equal; `jsonschema` validates
structured output and call arguments; the expected event order and field names are OpenAI's
API reference's, written out by hand. Model: the tiny random Llama 3.2 with Meta's template
(it renders tools), both workers.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serving import openai_client, serve
from test_server_structured import LLAMA32_TINY, SCHEMA_OF, TOOLS

GREEDY = {"temperature": 0.0}
FRESH = {"cache_prompt": False}  # every reply as a fresh run's, bit for bit
# The same tools in chat's shape and in the Responses API's flat one, strict given (absent, it
# means true there and false here; the template writes it into the prompt).
CHAT_TOOLS = [{"type": "function", "function": {**t["function"],
                                                "strict": t["function"].get("strict", False)}}
              for t in TOOLS]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}
# One conversation in both shapes: instructions and input items here, chat messages there
# (input_text parts are joined with a line break, as chat's text parts are).
INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                 {"type": "input_text", "text": "there"}]},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
    {"role": "user", "content": "Tell me a story."},
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
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
    with openai_client(server, timeout=300) as client:
        yield client


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="m", messages=messages, extra_body=FRESH,
                                          **GREEDY, **kwargs)


def test_greedy_text_equals_chat_completions(client):
    """The same conversation, greedy: the same text and token counts; a reply cut by
    max_output_tokens is "incomplete" (chat's finish_reason "length")."""
    for max_tokens in (8, 40):
        chat = _chat(client, MESSAGES, max_tokens=max_tokens)
        reply = client.responses.create(model="m", instructions="You are terse.", input=INPUT,
                                        max_output_tokens=max_tokens, extra_body=FRESH,
                                        **GREEDY)
        assert reply.object == "response" and reply.id.startswith("resp_")
        assert reply.model == "m"
        (item,) = reply.output
        assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
        (part,) = item.content
        assert part.type == "output_text"
        assert part.text == reply.output_text == chat.choices[0].message.content
        assert reply.usage.input_tokens == chat.usage.prompt_tokens
        assert reply.usage.output_tokens == chat.usage.completion_tokens
        assert reply.usage.total_tokens == chat.usage.total_tokens
        cut = chat.choices[0].finish_reason == "length"
        assert reply.status == item.status == ("incomplete" if cut else "completed")
        assert (reply.incomplete_details.reason if cut else reply.incomplete_details) == (
            "max_output_tokens" if cut else None)
    text = client.responses.create(model="m", input="Tell me a story.", max_output_tokens=8,
                                   extra_body=FRESH, **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Tell me a story."}], max_tokens=8)
    assert text.output_text == chat.choices[0].message.content


def test_stream_events_in_order_and_equal_to_the_whole_reply(client, server):
    kwargs = dict(model="m", instructions="You are terse.", input=INPUT, max_output_tokens=12,
                  extra_body=FRESH, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-3].part.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    # On the wire: an `event:` line naming each event, as the data's own type.
    body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **FRESH, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=300) as raw:
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] == kinds


def test_json_schema_format_validates_and_equals_chat(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    reply = client.responses.create(model="m", input="A person as JSON.", text={"format": fmt},
                                    max_output_tokens=60, extra_body=FRESH, **GREEDY)
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    chat = _chat(client, [{"role": "user", "content": "A person as JSON."}], max_tokens=60,
                 response_format={"type": "json_schema", "json_schema": {
                     "name": "person", "schema": PERSON, "strict": True}})
    assert reply.output_text == chat.choices[0].message.content
    for seed in (1, 2):  # sampled, streamed through the client's stream helper
        with client.responses.stream(model="m", input="A person as JSON.", text={"format": fmt},
                                     max_output_tokens=60, temperature=1.0,
                                     extra_body={"seed": seed}) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert final.status == "completed" and final.output_text == text
        jsonschema.validate(json.loads(text), PERSON)


def _call(reply, names):
    (item,) = reply.output
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert item.name in names
    jsonschema.validate(json.loads(item.arguments), SCHEMA_OF[item.name])
    return item


def test_a_function_tool_gives_a_function_call_item_whole_and_streamed(client):
    kwargs = dict(model="m", input="Weather in Oslo?", tools=FLAT_TOOLS, tool_choice="required",
                  max_output_tokens=80, extra_body=FRESH, **GREEDY)
    call = _call(client.responses.create(**kwargs), {"get_weather", "add"})
    chat = _chat(client, [{"role": "user", "content": "Weather in Oslo?"}], tools=CHAT_TOOLS,
                 tool_choice="required", max_tokens=80).choices[0].message.tool_calls[0]
    assert (call.name, call.arguments) == (chat.function.name, chat.function.arguments)
    named = client.responses.create(**{**kwargs, "tool_choice": {"type": "function",
                                                                 "name": "add"}})
    assert _call(named, {"add"}).name == "add"
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2].item, events[-2].item
    assert (added.type, added.name, added.arguments) == ("function_call", call.name, "")
    assert "".join(pieces) == events[-3].arguments == done.arguments == call.arguments
    assert events[-1].response.output[0].call_id == added.call_id == done.call_id


def test_a_function_call_output_round_trip_equals_chat(client):
    """The call fed back as the model gave it (`response.output` items) and its result: the
    same prompt and reply as chat's assistant tool_calls and tool message."""
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=FLAT_TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=80, extra_body=FRESH, **GREEDY)
    call = _call(first, {"get_weather"})
    result = '{"temperature": 3}'
    again = client.responses.create(
        model="m", tools=FLAT_TOOLS, max_output_tokens=12, extra_body=FRESH, **GREEDY,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    chat = _chat(client, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ], tools=CHAT_TOOLS, max_tokens=12)
    assert again.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + 20
    message = chat.choices[0].message
    if message.tool_calls:
        assert [(i.name, i.arguments) for i in again.output] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
    else:
        assert again.output_text == message.content


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add",
                 "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": []}, "input"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
     "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_fields_are_a_400_in_openai_shape_naming_the_field(server, fields, param):
    body = {"model": "m", "input": "Hi", "max_output_tokens": 4, **fields}
    got = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert set(got.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"] and "\n" not in error["message"]


def test_sdk_errors_stateless_rule_and_routes(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m", input=[{"type": "bogus"}])
    assert bad.value.body["param"] == "input[0].type"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="gpt-x", input="Hi")
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as stored:
        client.responses.retrieve("resp_123")
    assert "stateless" in stored.value.body["message"]
    # store is accepted and nothing is stored; the path without /v1 is the same route.
    plain = httpx.post(server.url + "/responses", json={
        "model": "m", "input": "Hi", "max_output_tokens": 3, "store": True}, timeout=60).json()
    assert plain["object"] == "response" and plain["store"] is False
    assert plain["usage"]["output_tokens"] == 3


def test_a_stream_the_server_ends_closes_with_response_failed(client, server):
    """A server shutting down ends every stream (`end_streams`): here with response.failed,
    whose error says why, after the text so far."""
    events = client.responses.create(model="m", input="Tell me a story.", stream=True,
                                     max_output_tokens=900, extra_body={"ignore_eos": True},
                                     **GREEDY)
    seen = []
    for event in events:
        seen.append(event)
        if event.type == "response.output_text.delta":
            server.server.config.app.state.end_streams("the server is shutting down")
            break
    seen += list(events)
    last = seen[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "shutting_down"
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
