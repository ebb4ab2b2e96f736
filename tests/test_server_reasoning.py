"""Thinking models through `jllama serve`'s APIs with the official clients: the think block as
`reasoning_content` (chat completions, streamed and not), a `reasoning` item (Responses), a
`thinking` block (Anthropic's Messages), `chat_template_kwargs` / `enable_thinking`.

Model: the tiny random Llama 3.2 test model with Qwen3-0.6B's real chat template, whose
generation prompt also opens `<think>` when the variable `think_open` is given (what
Qwen3-Thinking-2507's template always does). A random model never writes `</think>` by itself,
so every reply is made a think block and an answer by vLLM's `structured_outputs` regex; the
reference split is the reply with `reasoning_format: "none"` (its raw text), cut here by
Python's `re`. The same on the tiny random Qwen3 GGUF of tests/data/qwen_tiny (llama.cpp's
converter; Qwen3's own template and its `<think>` / `</think>` tokens), unchanged.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import anthropic
import openai
import pytest
from serving import openai_client

from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread

DATA = Path(__file__).parent / "data"
LLAMA32_TINY = DATA / "llama32_tiny" / "hf"
QWEN3_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
QWEN3_TEMPLATE = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text().replace(
    "    {%- if enable_thinking is defined and enable_thinking is false %}",
    "    {%- if think_open is defined and think_open %}\n        {{- '<think>\\n' }}\n"
    "    {%- elif enable_thinking is defined and enable_thinking is false %}", 1)
ASK = [{"role": "user", "content": "What is two and two?"}]
THINK = {"regex": "<think>\n[a-z]{4,12}\n</think>\n\n[a-z]{3,12}"}
OPENED = {"regex": "[a-z]{4,12}\n</think>\n\n[a-z]{3,12}"}
RAW = re.compile(r"(?:<think>)?\n?([a-z]+)\n</think>\n\n([a-z]+)")


def test_the_template_opens_think_where_asked():
    assert QWEN3_PROMPT in QWEN3_TEMPLATE and "think_open" in QWEN3_TEMPLATE


@pytest.fixture(scope="module")
def server():
    model = open_model(LLAMA32_TINY, seq_len=256)
    model = dataclasses.replace(model, chat_template=QWEN3_TEMPLATE)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, "m") as running:
        yield running


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A client of a server of the tiny random Qwen3 GGUF (llama.cpp's converter; Qwen3's
    template, `<think>` and `</think>` single added tokens; `tests/qwen_models.py`, not
    imported: it imports torch)."""
    path = tmp_path_factory.mktemp("qwen3") / "qwen3-tiny.gguf"
    path.write_bytes(gzip.decompress((DATA / "qwen_tiny" / "qwen3-tiny-F32.gguf.gz").read_bytes()))
    model = open_model(path, seq_len=128)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    with ServerThread(model, backend, "qwen3") as running, openai_client(running) as c:
        yield c


@pytest.fixture()
def client(server):
    with openai_client(server) as c:
        yield c


def _chat(client, constraint, stream=False, **extra):
    return client.chat.completions.create(
        model="m", messages=ASK, temperature=0, stream=stream,
        extra_body={"structured_outputs": constraint, **extra})


def _streamed(chunks) -> tuple[list[tuple[str, str]], str]:
    """The stream's (kind, text) deltas in order, and its finish_reason."""
    pieces, finish = [], None
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning = getattr(delta, "reasoning_content", None)
        if reasoning:
            pieces.append(("reasoning", reasoning))
        if delta.content:
            pieces.append(("content", delta.content))
        finish = choice.finish_reason or finish
    return pieces, finish


def _joined(pieces, kind) -> str:
    return "".join(text for k, text in pieces if k == kind)


@pytest.mark.parametrize("opened", [False, True], ids=["model-opens", "template-opens"])
def test_reasoning_content_apart_streamed_and_not(client, opened):
    constraint, kwargs = (OPENED, {"think_open": True}) if opened else (THINK, None)
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    raw = _chat(client, constraint, reasoning_format="none", **extra).choices[0]
    match = RAW.fullmatch(raw.message.content)
    assert match, raw.message.content
    assert raw.message.content.startswith("<think>") is not opened
    assert getattr(raw.message, "reasoning_content", None) is None

    whole = _chat(client, constraint, **extra).choices[0]
    assert whole.finish_reason == "stop"
    assert whole.message.reasoning_content == match.group(1)
    assert whole.message.content == match.group(2)

    pieces, finish = _streamed(_chat(client, constraint, stream=True, **extra))
    assert finish == "stop"
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # all reasoning first
    assert "reasoning" in kinds and "content" in kinds
    assert _joined(pieces, "reasoning") == match.group(1)
    assert _joined(pieces, "content") == match.group(2)


def test_a_block_never_closed_is_all_reasoning(client):
    extra = {"chat_template_kwargs": {"think_open": True}}
    long = {"regex": "[a-z]{30,40}\n</think>\n\nok"}
    whole = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=4,
        extra_body={"structured_outputs": long, **extra}).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content == ""
    assert re.fullmatch("[a-z]+", whole.message.reasoning_content)
    pieces, finish = _streamed(client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=4, stream=True,
        extra_body={"structured_outputs": long, **extra}))
    assert finish == "length"
    assert {kind for kind, _ in pieces} == {"reasoning"}
    assert _joined(pieces, "reasoning") == whole.message.reasoning_content


def test_enable_thinking_reaches_the_template(client):
    plain = {"regex": "[a-z]{3,12}"}
    on = _chat(client, plain)
    off = _chat(client, plain, chat_template_kwargs={"enable_thinking": False})
    # Qwen3's template writes an empty think block into the prompt when thinking is off.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    for reply in (on, off):
        assert reply.choices[0].message.reasoning_content is None
        assert re.fullmatch("[a-z]{3,12}", reply.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, plain, chat_template_kwargs={"messages": []})
    assert bad.value.body["param"] == "chat_template_kwargs"


def test_reasoning_content_of_an_earlier_turn_is_given_to_the_template(client):
    # Qwen3's template writes the thinking of the assistant turns after the last user message
    # (a call and its result) and drops older ones.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}

    def prompt_tokens(**reasoning):
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call],
                           **reasoning},
                    {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
        return client.chat.completions.create(model="m", messages=messages, temperature=0,
                                              max_tokens=1).usage.prompt_tokens

    assert prompt_tokens(reasoning_content="two and two make four") > prompt_tokens()


def test_responses_reasoning_item(client):
    kwargs = {"model": "m", "input": "What is two and two?", "temperature": 0,
              "extra_body": {"structured_outputs": THINK}}
    raw = client.responses.create(**{**kwargs, "extra_body": {
        "structured_outputs": THINK, "reasoning_format": "none"}})
    match = RAW.fullmatch(raw.output_text)
    assert match, raw.output_text
    done = client.responses.create(**kwargs)
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == match.group(1)
    assert done.output_text == match.group(2)
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == match.group(1)
    final = events[-1].response
    assert final.output[0].content[0].text == match.group(1)
    assert final.output_text == match.group(2)


def test_messages_thinking_block(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0,
                             timeout=120) as client:
        kwargs = {"model": "m", "max_tokens": 64, "messages": ASK,
                  "thinking": {"type": "enabled", "budget_tokens": 1024},
                  "extra_body": {"structured_outputs": THINK, "temperature": 0}}
        message = client.messages.create(**kwargs)
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking, text = message.content
        assert re.fullmatch("[a-z]+", thinking.thinking) and thinking.signature == ""
        assert re.fullmatch("[a-z]+", text.text)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert [block.type for block in streamed.content] == ["thinking", "text"]
        assert streamed.content[0].thinking == thinking.thinking
        assert streamed.content[1].text == text.text
        # A thinking block given back in the conversation is taken (Qwen3 drops it).
        again = client.messages.create(model="m", max_tokens=2, messages=[
            *ASK, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "add", "signature": ""},
                {"type": "text", "text": "four"}]},
            {"role": "user", "content": "Thanks"}])
        assert again.stop_reason == "max_tokens"
        off = client.messages.count_tokens(model="m", messages=ASK,
                                           thinking={"type": "disabled"})
        on = client.messages.count_tokens(model="m", messages=ASK)
        assert off.input_tokens > on.input_tokens


ANSWER_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                 "additionalProperties": False}


@pytest.mark.parametrize("thinking", ["open", "", "closed"])
def test_response_format_shapes_the_answer_after_the_block(thinking):
    """`after_thinking`'s grammar, held to exact texts by llguidance's matcher on the tiny
    model's vocabulary: a free block up to the first `</think>` (where the prompt opened it, or
    where the reply opens it itself), then whitespace and the schema's JSON."""
    import llguidance

    from jllama.constrain import Grammar
    from jllama.constrain.vocabulary import vocabulary_for
    from jllama.server.reasoning import after_thinking

    tokenizer = open_model(LLAMA32_TINY, seq_len=64).tokenizer
    vocabulary = vocabulary_for(tokenizer)
    grammar = after_thinking(Grammar.json_schema(ANSWER_SCHEMA), thinking)

    def matches(text: str) -> bool:
        matcher = llguidance.LLMatcher(vocabulary.lltokenizer, grammar.llguidance, log_level=0)
        return (all(matcher.consume_token(t) for t in tokenizer.encode(text, bos=False))
                and matcher.is_accepting())

    answer = '{"a": 4}'
    block = "two and two, <b>four</b>\n</think>\n\n"
    assert matches(answer) is (thinking != "open")
    assert matches(block + answer) is (thinking == "open")
    assert matches("<think>\n" + block + answer) is (thinking != "closed")
    assert not matches(block.replace("</think>", "") + answer)
    assert not matches("<think>\n" + block + '{"a": "four"}')
    # A call that tool_choice "required" asks for, likewise after the block.
    from jllama.server.tools import call_grammar, parse_tools

    tools = parse_tools([{"type": "function", "function": {"name": "add",
                                                           "parameters": ANSWER_SCHEMA}}])
    grammar = after_thinking(call_grammar(tools, "required"), thinking)
    call = '{"name": "add", "parameters": {"a": 4}}'
    assert matches(call) is (thinking != "open")
    assert matches(block + call) is (thinking == "open")
    assert not matches(block + '{"name": "sub", "parameters": {"a": 4}}')
    # tool_choice "auto": text or a call; a block the reply opens itself goes first, and
    # then the call is held to its schema.
    grammar = after_thinking(call_grammar(tools, "auto", think_apart=thinking != "closed"),
                             thinking)
    opened, bad_call = thinking == "open", '{"name": "sub", "parameters": {"a": 4}}'
    assert matches("Four.") is not opened and matches(call) is not opened
    assert matches(block + "Four.") and matches(block + call)  # after a block, or all text
    if thinking == "":
        assert matches("<think>\n" + block + call)
        assert not matches("<think>\n" + block + bad_call)
    if opened:
        assert not matches(block + bad_call)


def test_response_format_leaves_the_block_free(client):
    opened = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=6,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        extra_body={"chat_template_kwargs": {"think_open": True}}).choices[0]
    # Without the block first, the schema would make the reply `{"a": ...` at once.
    assert opened.finish_reason == "length" and opened.message.content == ""
    assert opened.message.reasoning_content and "{" not in opened.message.reasoning_content
    off = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=20,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert off.finish_reason == "stop" and off.message.reasoning_content is None
    assert isinstance(json.loads(off.message.content)["a"], int)


def test_a_qwen3_gguf(qwen3):
    """The tiny Qwen3 GGUF: its own template (Qwen3-0.6B's), its `<think>` / `</think>` tokens
    (user-defined, printed as text); no template change."""
    def ask(stream=False, **extra):
        return qwen3.chat.completions.create(
            model="qwen3", messages=ASK, temperature=0, stream=stream,
            extra_body={"structured_outputs": THINK, **extra})

    raw = ask(reasoning_format="none").choices[0].message.content
    match = RAW.fullmatch(raw)
    assert match and raw.startswith("<think>"), raw
    whole = ask().choices[0].message
    assert (whole.reasoning_content, whole.content) == match.groups()
    pieces, finish = _streamed(ask(stream=True))
    assert finish == "stop"
    assert (_joined(pieces, "reasoning"), _joined(pieces, "content")) == match.groups()
    off = ask(chat_template_kwargs={"enable_thinking": False})
    assert off.usage.prompt_tokens == ask().usage.prompt_tokens + 4  # <think>\n\n</think>\n\n


def test_reasoning_tokens_in_usage(client):
    """`usage.completion_tokens_details.reasoning_tokens`: the tokens up to the one that ends
    `</think>` (told by the reply's logprobs, one item a token), streamed and not; Responses'
    `output_tokens_details.reasoning_tokens` the same; 0 without a block, all of them for a
    block the tokens ran out in."""
    whole = _chat(client, THINK, logprobs=True)
    tokens = [item.token for item in whole.choices[0].logprobs.content]
    ends = next(k for k in range(len(tokens)) if "</think>" in "".join(tokens[:k + 1]))
    assert 0 < ends + 1 < whole.usage.completion_tokens
    assert whole.usage.completion_tokens_details.reasoning_tokens == ends + 1
    chunks = list(_chat(client, THINK, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == ends + 1
    response = client.responses.create(model="m", input=ASK[0]["content"], temperature=0,
                                       extra_body={"structured_outputs": THINK})
    assert response.usage.output_tokens_details.reasoning_tokens == ends + 1
    streamed = list(client.responses.create(model="m", input=ASK[0]["content"], temperature=0,
                                            stream=True,
                                            extra_body={"structured_outputs": THINK}))
    assert streamed[-1].response.usage.output_tokens_details.reasoning_tokens == ends + 1

    off = _chat(client, {"regex": "[a-z]{3,12}"},
                chat_template_kwargs={"enable_thinking": False}).usage
    assert off.completion_tokens_details.reasoning_tokens == 0
    cut = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=4,
        extra_body={"structured_outputs": {"regex": "[a-z]{30,40}\n</think>\n\nok"},
                    "chat_template_kwargs": {"think_open": True}}).usage
    assert cut.completion_tokens == cut.completion_tokens_details.reasoning_tokens == 4
