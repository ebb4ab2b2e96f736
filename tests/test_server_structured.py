"""Structured output through `jllama serve` and the official `openai` client: `response_format`
(json_object, json_schema with strict) and `tools` / `tool_choice`.

References: `jsonschema` validates every reply (an implementation independent of llguidance);
the tool-calling shapes are OpenAI's (the client's own types parse them). Models: SmolLM2 (its
ChatML template renders no tools: the documented fallback) and the tiny random Llama 3.2 test
model whose tokenizer_config.json holds Meta's real Llama 3.1/3.2 template (it renders tools
into the first user message). Both workers: one request at a time and slots (--parallel=4).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import tokenizers
from constrain_cases import SCHEMAS

from serving import openai_client, serve

LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
ASK = [{"role": "user", "content": "Reply with JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=[1, 4], ids=["fifo", "slots"])
def smollm2(request, smollm2_gguf):
    with serve(smollm2_gguf, request.param) as running:
        with openai_client(running, timeout=300) as client:
            yield client


@pytest.fixture(scope="module", params=[1, 4], ids=["fifo", "slots"])
def tiny(request):
    with serve(LLAMA32_TINY, request.param) as running:
        with openai_client(running, timeout=300) as client:
            yield client


def _schema_format(schema):
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _sampling(seed):
    return {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}


def test_twenty_schemas_greedy_and_three_seeds(smollm2):
    """Every reply parses and validates; the requests of a schema go in at once (the slots
    worker runs them side by side)."""

    def ask(case):
        index, seed = case
        reply = smollm2.chat.completions.create(
            model="m", messages=ASK, max_tokens=150,
            response_format=_schema_format(SCHEMAS[index]), **_sampling(seed))
        return index, seed, reply.choices[0]

    cases = [(i, seed) for i in range(len(SCHEMAS)) for seed in (None, 1, 2, 3)]
    with ThreadPoolExecutor(4) as pool:
        for index, seed, choice in pool.map(ask, cases):
            assert choice.finish_reason == "stop", (index, seed, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[index])


def test_a_stream_equals_the_whole_reply(smollm2):
    schema = SCHEMAS[19]
    kwargs = dict(model="m", messages=ASK, max_tokens=150, response_format=_schema_format(schema),
                  temperature=1.0, seed=7)
    whole = smollm2.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              smollm2.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


def test_tool_choice_auto_without_tools_is_plain_structured_output(smollm2):
    reply = smollm2.chat.completions.create(
        model="m", messages=ASK, max_tokens=150, temperature=0, tool_choice="auto",
        response_format=_schema_format(SCHEMAS[5]))
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[5])


def test_json_object_on_both_endpoints(smollm2):
    cat = [{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}]
    chat = smollm2.chat.completions.create(model="m", messages=cat, max_tokens=200,
                                           temperature=0, response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = smollm2.completions.create(
        model="m", prompt="A JSON object:", max_tokens=200, temperature=0,
        extra_body={"response_format": _schema_format(SCHEMAS[6])})
    assert text.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text.choices[0].text), SCHEMAS[6])


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": "json"}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0]"),
    ({"response_format": _schema_format({"$ref": "#"})}, "response_format.json_schema.schema"),
    ({"response_format": _schema_format(False)}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b!"}}},
     "response_format.json_schema.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "integer"}}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "3"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": "x"}]},
     "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "type": "function",
                                   "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_structured_fields_are_a_400_naming_the_field(smollm2, fields, param):
    body = {"model": "m", "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        smollm2.chat.completions.create(**body)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param, error.value.body
    assert "\n" not in error.value.body["message"]


def _check_call(choice, names):
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    return call


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_tool_choice_required_and_named(tiny, seed):
    required = tiny.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=80, **_sampling(seed))
    _check_call(required.choices[0], {"get_weather", "add"})
    named = tiny.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=80,
        **_sampling(seed))
    assert _check_call(named.choices[0], {"add"}).function.name == "add"


def test_the_template_renders_the_tools_and_none_leaves_them_out(tiny):
    """Meta's template writes each tool as JSON into the first user message: the prompt grows
    by the tools' text; with tool_choice "none" it is the plain prompt and the reply free
    text."""
    messages = [{"role": "user", "content": "Hello"}]
    plain = tiny.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                         temperature=0)
    offered = tiny.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=80, temperature=0)
    none = tiny.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                        tool_choice="none", max_tokens=4, temperature=0)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_auto_gives_a_call_or_text(tiny, seed):
    """tool_choice "auto": a reply that starts with "{" is a call and must be whole and valid;
    any other reply is content with no tool_calls."""
    reply = tiny.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=40,
        temperature=1.0, seed=seed)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        _check_call(choice, {"get_weather", "add"})
    else:
        assert choice.message.content and not choice.message.content.startswith("{")
        assert choice.finish_reason in ("stop", "length")


def test_auto_takes_the_call_branch_once_a_reply_starts_with_a_brace(tiny):
    """The tiny model never starts a reply with "{" of its own; a logit bias on the "{" token
    (its id from the `tokenizers` library) makes it, and the rest must then be one whole
    call (the bias keeps pushing "{", which the grammar allows only inside strings)."""
    brace = tokenizers.Tokenizer.from_file(str(LLAMA32_TINY / "tokenizer.json")).token_to_id("{")
    for seed in (None, 1, 2):
        reply = tiny.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=80,
            logit_bias={str(brace): 30}, **_sampling(seed))
        _check_call(reply.choices[0], {"get_weather", "add"})


def test_a_streamed_call_equals_the_whole_one(tiny):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  tool_choice="required", max_tokens=80, temperature=1.0, seed=11)
    whole = tiny.chat.completions.create(**kwargs).choices[0]
    call = _check_call(whole, {"get_weather", "add"})
    name, arguments, ids, finish, content = None, "", set(), None, ""
    for chunk in tiny.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                assert item.index == 0
                ids.add(item.id) if item.id else None
                name = item.function.name or name
                arguments += item.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, arguments, finish, content) == (call.function.name, call.function.arguments,
                                                  "tool_calls", "")
    assert len(ids) == 1


def _finished(client) -> dict[str, float]:
    """/metrics' jllama_requests_finished_total by finish_reason."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    text = httpx.get(root + "/metrics", timeout=60).text
    prefix = 'jllama_requests_finished_total{finish_reason="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_metrics_count_a_call_as_tool_calls(tiny):
    """A reply that is a call ends "tool_calls" (the worker's generation ended "stop"): so does
    its count in /metrics, whole and streamed."""
    before = _finished(tiny)
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  tool_choice="required", max_tokens=80, temperature=0)
    assert tiny.chat.completions.create(**kwargs).choices[0].finish_reason == "tool_calls"
    finishes = [c.choices[0].finish_reason for c in
                tiny.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert finishes[-1] == "tool_calls"
    after = _finished(tiny)
    assert after.get("tool_calls", 0) == before.get("tool_calls", 0) + 2
    assert after.get("stop", 0) == before.get("stop", 0)


def test_a_conversation_with_a_tool_result_goes_on(tiny):
    """The call comes back as the assistant's tool_calls and the result as a tool message;
    Meta's template renders both (the call's arguments as an object)."""
    first = tiny.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
        temperature=0)
    call = _check_call(first.choices[0], {"get_weather"})
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'},
    ]
    again = tiny.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                         max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call, the result
    quiet = tiny.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                         tool_choice="none", max_tokens=6, temperature=0)
    assert quiet.choices[0].message.tool_calls is None and quiet.choices[0].message.content


def test_smollm2_gets_the_fallback_preamble_and_calls(smollm2):
    """ChatML renders no tools: the tools go into a system message (Llama 3.1's wording), and
    the constrained reply is still a call whose arguments validate."""
    messages = [{"role": "user", "content": "What is the weather in Rome, in celsius?"}]
    plain = smollm2.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                            temperature=0)
    for seed in (None, 1, 2):
        reply = smollm2.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                tool_choice="required", max_tokens=80,
                                                **_sampling(seed))
        _check_call(reply.choices[0], {"get_weather", "add"})
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 100
