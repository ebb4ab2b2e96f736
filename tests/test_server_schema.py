"""The request schema's sampler fields: the server refuses what `SamplerConfig` (and so the CLI)
refuses, with the same reason, as a 400 naming the field; OpenAI's narrower limits on top.
Expected messages are written out here by hand."""

from __future__ import annotations

import json

import pytest

from jllama.sampling import SamplerConfig, SamplerError
from jllama.server.errors import APIError
from jllama.server.schema import ChatCompletionRequest, CompletionRequest, parse_body

BASE = {"model": "m", "prompt": "a"}


def parse(**fields) -> CompletionRequest:
    return parse_body(json.dumps({**BASE, **fields}).encode(), CompletionRequest)


def refusal(kind=CompletionRequest, **fields) -> APIError:
    body = {**BASE, **fields} if kind is CompletionRequest else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as error:
        parse_body(json.dumps(body).encode(), kind)
    assert error.value.status == 400
    return error.value


@pytest.mark.parametrize("field, value, config_field, message", [
    ("top_p", 1.5, "top_p", "top_p: must be a number in [0, 1], got 1.5"),
    ("temperature", -1.0, "temperature", "temperature: must be a finite number >= 0, got -1.0"),
    ("min_p", 2.0, "min_p", "min_p: must be a number in [0, 1], got 2.0"),
    ("repeat_penalty", 0.0, "repeat_penalty",
     "repeat_penalty: must be a number in (0, 1e6], got 0.0"),
    ("penalty_last_n", -2, "penalty_last_n",
     "penalty_last_n: must be an integer >= -1 (-1: all), got -2"),
    ("samplers", ["top_k", "top_p"], "order",
     "samplers: must list each of top_k, temperature, top_p, min_p once, got ['top_k', 'top_p']"),
])
def test_the_server_refuses_what_the_config_refuses_with_the_same_reason(
        field, value, config_field, message):
    error = refusal(**{field: value})
    assert (error.param, error.message) == (field, message)
    with pytest.raises(SamplerError) as config_error:
        SamplerConfig(**{config_field: value})
    # The same text after the field's name (the request and the config name `order` apart).
    assert str(config_error.value).split(": ", 1)[1] == message.split(": ", 1)[1]


def test_openai_limits_narrow_the_ranges():
    assert refusal(temperature=7.0).message == (
        "temperature: must be in [0, 2] (OpenAI's range), got 7.0")
    assert refusal(presence_penalty=2.5).message == (
        "presence_penalty: must be in [-2, 2] (OpenAI's range), got 2.5")
    error = refusal(logit_bias={"5": 200})
    assert (error.param, error.message) == (
        "logit_bias", "logit_bias: token 5: must be in [-100, 100] (OpenAI's range), got 200.0")
    assert SamplerConfig(temperature=7).temperature == 7  # the CLI's range is wider


def test_types_stay_strict():
    assert refusal(top_k=1.5).message == "top_k: Input should be a valid integer (got 1.5)"
    assert refusal(temperature="hot").param == "temperature"
    assert refusal(top_p=True).param == "top_p"


def test_good_settings_reach_the_config():
    config = parse(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.1,
                   presence_penalty=-0.5, frequency_penalty=0.5, penalty_last_n=-1, seed=7,
                   logit_bias={"3": -100, "4": 2.5},
                   samplers=["top_k", "top_p", "min_p", "temperature"]).sampler_config(10)
    assert config == SamplerConfig(
        temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.1,
        presence_penalty=-0.5, frequency_penalty=0.5, penalty_last_n=-1, seed=7,
        logit_bias=((3, -100.0), (4, 2.5)), order=("top_k", "top_p", "min_p", "temperature"))


def test_top_k_zero_or_less_is_off_as_in_llama_cpp():
    assert parse(top_k=-1).sampler_config(vocab_size=10).top_k == 0
    assert parse(top_k=7).sampler_config(vocab_size=10).top_k == 7


def test_unsupported_options_name_the_field():
    assert refusal(best_of=3).param == "best_of"
    assert refusal(echo=True).message == "echo: echo=true is not supported (got True)"
    assert refusal(suffix="x").param == "suffix"
    assert refusal(tools=[{"type": "function"}]).param == "tools"  # completions: chat only
    parse(n=1, best_of=1, echo=False, suffix="")
    parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "response_format": {"type": "text"}}).encode(),
               ChatCompletionRequest)


def test_n_is_1_to_16():
    assert parse(n=16).choices == 16 and parse().choices == 1 and parse(n=None).choices == 1
    for n in (0, 17, 1000):
        error = refusal(n=n)
        assert error.param == "n"
        assert error.message == (f"n: must be an integer in [1, 16] (choices per request; 16 "
                                 f"is this server's limit), got {n}")
    assert refusal(n=2.0).param == "n"


def test_choice_i_samples_with_seed_plus_i():
    # Worked out by hand: seed s + i, then mod 2**64 with 0 as 2**64 - 1.
    request = parse(seed=41, n=3)
    assert [request.sampler_config(10, i).seed for i in range(3)] == [41, 42, 43]
    # Past 2**64 - 1 the seeds wrap as a request's seed does: s + i = 2**64 is seed=0's state
    # (2**64 - 1, xorshift cannot start from 0), 2**64 + 1 is seed=1's.
    request = parse(seed=2**64 - 2, n=4)
    assert [request.sampler_config(10, i).seed for i in range(4)] == [
        2**64 - 2, 2**64 - 1, 2**64 - 1, 1]
    assert parse(seed=0).sampler_config(10).seed == 2**64 - 1
    request = parse(seed=-3, n=2)  # OpenAI's seeds are int64: -3 is 2**64 - 3
    assert [request.sampler_config(10, i).seed for i in range(2)] == [2**64 - 3, 2**64 - 2]
    assert parse(n=2).sampler_config(10, 1, base_seed=7).seed == 8  # no seed: a base drawn


def test_tools_empty_list_is_refused_on_both_routes_as_openai_does():
    # OpenAI's API answers `tools: []` with a 400 ("[] is too short - 'tools'"); so do both
    # routes here (completions refuses any tools).
    from jllama.server.tools import plan_chat

    with pytest.raises(APIError) as error:
        plan_chat([{"role": "user", "content": "hi"}], [], None, None, renders_tools=True)
    assert (error.value.status, error.value.param) == (400, "tools")
    assert error.value.message == ("tools: an empty list is too short (give at least one "
                                   "tool, or leave tools out), as in OpenAI's API")
    error = refusal(tools=[])
    assert error.param == "tools"
    assert error.message == ("tools: tools (function calling) are only supported on "
                             "/v1/chat/completions (got [])")
    plan = plan_chat([{"role": "user", "content": "hi"}], None, None, None, renders_tools=True)
    assert plan.mode == "none"


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_stream_options_needs_stream_true(kind):
    for stream in (False, None):
        fields = {"stream_options": {"include_usage": True}}
        if stream is not None:
            fields["stream"] = stream
        error = refusal(kind, **fields)
        assert error.param == "stream_options"
        assert error.message == ("stream_options: only allowed when stream is true (as in "
                                 "OpenAI's API), got stream=false")
    body = {"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "stream_options": {"include_usage": True}}
    assert parse_body(json.dumps(body).encode(), kind).include_usage


def test_content_parts_are_joined_with_a_line_break():
    # As llama.cpp's and vLLM's servers join a list of text parts.
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "text", "text": "this."},
        {"type": "text", "text": ""}]}]}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.message_dicts()[0]["content"] == "Describe\nthis.\n"


def _raw_refusal(text: str) -> APIError:
    with pytest.raises(APIError) as error:
        parse_body(text.encode(), CompletionRequest)
    assert error.value.status == 400 and "\n" not in error.value.message
    return error.value


def test_a_deep_body_gets_our_one_line_message_not_pythons():
    schema = '{"type": "object", "properties": {"a": ' * 900 + "{}" + "}}" * 900
    body = ('{"model": "m", "prompt": "a", "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "x", "schema": ' + schema + "}}}")
    assert _raw_refusal(body).message == (
        "the body nests arrays and objects more than 128 levels deep")
    # Deep enough for the JSON parser, too deep for MAX_DEPTH.
    body = '{"model": "m", "prompt": "a", "x": ' + "[" * 300 + "]" * 300 + "}"
    assert _raw_refusal(body).message == (
        "the body nests arrays and objects more than 128 levels deep")
    body = '{"model": "m", "prompt": "a", "x": ' + "[" * 125 + "]" * 125 + "}"
    parse_body(body.encode(), CompletionRequest)  # 126 levels


def test_a_huge_integer_gets_our_one_line_message_not_pythons():
    body = '{"model": "m", "prompt": "a", "max_tokens": ' + "9" * 5000 + "}"
    assert _raw_refusal(body).message == (
        "the body holds an integer of 5000 digits; this server reads at most 64")
    body = '{"model": "m", "prompt": "a", "seed": -' + "1" * 65 + "}"
    assert "65 digits" in _raw_refusal(body).message
    assert parse(seed=2**64 - 1).seed == 2**64 - 1
