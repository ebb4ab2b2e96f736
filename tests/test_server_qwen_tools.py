"""Tool calls in Qwen's (Hermes') format through `jllama serve`, with the official clients, on the
tiny random Qwen3 GGUF of tests/data/qwen_tiny and its own template (Qwen3-0.6B's): the reply's
`<tool_call>` blocks as OpenAI's `tool_calls` (streamed and not), Responses' `function_call`
items and Anthropic's `tool_use` blocks; a past call and its result rendered by the template;
the grammars that hold a reply to the format. A random model's calls are made deterministic by
the tools' schemas (each argument a `const`) and tool_choice "required" or a name.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import anthropic
import pytest
from serving import openai_client

from jllama.backends import make_backend
from jllama.chat import ChatTemplate
from jllama.model.loading import open_model
from jllama.server import ServerThread

DATA = Path(__file__).parent / "data"
ASK = [{"role": "user", "content": "What is two and two?"}]
ADD = {"type": "object", "properties": {"a": {"const": 2}, "b": {"const": 2}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ARGUMENTS = {"add": {"a": 2, "b": 2}, "now": {}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3") / "qwen3-tiny.gguf"
    path.write_bytes(gzip.decompress((DATA / "qwen_tiny" / "qwen3-tiny-F32.gguf.gz").read_bytes()))
    model = open_model(path)
    # The tools' system text is ~450 tokens of this 400-token vocabulary: a context past the
    # file's 128 (a random model's RoPE has no trained length to keep to).
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, seq_len=640))
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, "qwen3") as running:
        yield model, running


@pytest.fixture(scope="module")
def client(served):
    with openai_client(served[1]) as c:
        yield c


def _call(client, stream=False, **fields):
    return client.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, temperature=0, max_tokens=64, stream=stream,
        **{"tool_choice": "required", "extra_body": OFF, **fields})


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        choice = chunk.choices[0]
        for item in choice.delta.tool_calls or []:
            call = calls.setdefault(item.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = item.id or call["id"]
            call["name"] = item.function.name or call["name"]
            call["arguments"] += item.function.arguments or ""
        assert not choice.delta.content
        finish = choice.finish_reason or finish
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [False, None], ids=["one-call", "parallel"])
def test_qwen3_calls_as_tool_calls_streamed_and_not(client, parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = _call(client, **fields).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    calls = reply.message.tool_calls
    assert calls and (parallel is None or len(calls) == 1)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert json.loads(call.function.arguments) == ARGUMENTS[call.function.name]
    streamed, finish = _streamed_calls(_call(client, stream=True, **fields))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in streamed)
    named = _call(client, tool_choice={"type": "function", "function": {"name": "add"}},
                  parallel_tool_calls=False).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in named] == [
        ("add", {"a": 2, "b": 2})]


def test_auto_streamed_and_not_agree(client):
    """tool_choice "auto": whatever the random model writes (text, or text and calls), the
    stream's pieces join to the whole reply's content and calls."""
    whole = _call(client, tool_choice="auto").choices[0]
    content, calls, finish = "", {}, None
    for chunk in _call(client, stream=True, tool_choice="auto"):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for item in choice.delta.tool_calls or []:
            calls.setdefault(item.index, [item.function.name, ""])[1] += (
                item.function.arguments or "")
        finish = choice.finish_reason or finish
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [calls[k] for k in sorted(calls)] == [
        [c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]


def test_a_call_and_its_result_go_back_through_the_template(served, client):
    model, _ = served
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    reply = client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=1, extra_body=OFF)
    template = ChatTemplate.for_tokenizer(model.chat_template, model.tokenizer)
    rendered = template.render_segments(
        [*ASK, {**messages[1], "content": "", "tool_calls": [
            {**call, "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
         {**messages[2]}], add_generation_prompt=True, tools=TOOLS, enable_thinking=False)
    text = "".join(piece for piece, _ in rendered)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n4\n</tool_response>" in text and '"name": "now"' in text
    assert reply.usage.prompt_tokens == len(model.tokenizer.encode_segments(rendered, bos=False))


def test_responses_and_messages_calls(served, client):
    flat = [{"type": "function", "name": t["function"]["name"],
             "parameters": t["function"]["parameters"]} for t in TOOLS]
    kwargs = {"model": "qwen3", "input": "What is two and two?", "tools": flat,
              "tool_choice": "required", "temperature": 0, "max_output_tokens": 64,
              "extra_body": OFF}
    done = client.responses.create(**kwargs, parallel_tool_calls=False)
    assert [item.type for item in done.output] == ["function_call"]
    item = done.output[0]
    assert json.loads(item.arguments) == ARGUMENTS[item.name]
    events = list(client.responses.create(stream=True, **kwargs))
    final = events[-1].response
    assert final.output and {o.type for o in final.output} == {"function_call"}
    with anthropic.Anthropic(base_url=served[1].url, api_key="x", max_retries=0,
                             timeout=120) as claude:
        message = claude.messages.create(
            model="qwen3", max_tokens=64, messages=ASK, thinking={"type": "disabled"},
            tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS],
            tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "add", {"a": 2, "b": 2})]


def test_hermes_grammars_and_reader(served):
    """The "hermes" grammars held to exact texts by llguidance's matcher on the tiny Qwen3's
    vocabulary (its `<tool_call>` / `</tool_call>` tokens, its BOS "," an ordinary token), and
    `HermesToolReply` fed one character at a time."""
    import llguidance

    from jllama.constrain.vocabulary import vocabulary_for
    from jllama.server.tool_reply import HermesToolReply
    from jllama.server.tools import call_grammar, parse_tools

    tokenizer = served[0].tokenizer
    vocabulary = vocabulary_for(tokenizer)
    tools = parse_tools(TOOLS)

    def matches(grammar, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocabulary.lltokenizer, grammar.llguidance, log_level=0)
        return (all(matcher.consume_token(t) for t in tokenizer.encode(text, bos=False))
                and matcher.is_accepting())

    one = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    required = call_grammar(tools, "required", call_format="hermes")
    single = call_grammar(tools, "required", call_format="hermes", parallel=False)
    auto = call_grammar(tools, "auto", call_format="hermes")
    apart = call_grammar(tools, "auto", call_format="hermes", think_apart=True)
    assert matches(required, one) and matches(required, two) and not matches(required, "Four.")
    assert matches(single, one) and not matches(single, two)
    assert not matches(required, one.replace("add", "sub"))
    assert not matches(required, one.replace('"b": 2', '"b": 3'))
    assert matches(auto, "Four.") and matches(auto, two) and matches(auto, "\nFour.")
    assert matches(auto, "Adding.\n" + two) and matches(auto, "Four <tool_call")
    assert not matches(auto, one.replace("add", "sub"))
    assert not matches(auto, "Adding.\n" + one.replace("add", "sub"))
    assert matches(apart, "Four.") and matches(apart, one) and matches(apart, "Adding. " + one)
    assert not matches(apart, " Four.") and not matches(apart, "<think>x</think>")
    assert not matches(apart, " " + one)

    cases = [(two, True, ""), (two, False, ""), ("Adding.\n" + two, False, "Adding."),
             ("Four <tool_call>", False, None), ("Four <tool_call", False, None)]
    for text, expect_call, content in cases:
        reply = HermesToolReply(expect_call)
        deltas = [d for ch in text for d in reply.deltas(ch)] + reply.final_deltas()
        if content is not None:
            assert "".join(d.get("content", "") for d in deltas) == content
            deltas = [d for d in deltas if "tool_calls" in d]
            assert [c["function"]["name"] for c in reply.calls] == ["add", "now"]
            assert [c["function"]["arguments"] for c in reply.calls] == [
                '{"a": 2, "b": 2}', "{}"]
            pieces = ["".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                              if d["tool_calls"][0]["index"] == k) for k in (0, 1)]
            assert pieces == ['{"a": 2, "b": 2}', "{}"]
            assert reply.finish_reason("stop") == "tool_calls"
        else:
            assert "".join(d["content"] for d in deltas) == text
            assert reply.finish_reason("stop") == "stop"
    cut = HermesToolReply(True)
    assert cut.message('<tool_call>\n{"na') == {"role": "assistant",
                                                 "content": '<tool_call>\n{"na'}
    both = HermesToolReply(False).message("Adding.\n" + one)
    assert both["content"] == "Adding." and len(both["tool_calls"]) == 1
