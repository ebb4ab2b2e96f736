"""Tests for jllama.chat: chat templates rendered as Hugging Face renders them.

Every expected string here is written by hand from the template's text (Jinja's rules, with
trim_blocks and lstrip_blocks), never produced by the code under test.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import re

import pytest

from jllama.chat import DEFAULT_CHATML, ROLES, ChatTemplate, Message, check_messages
from jllama.errors import ChatError, JllamaError

# SmolLM2-Instruct's tokenizer.chat_template, as the GGUF and tokenizer_config.json carry it.
SMOLLM2 = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta-Llama-3-8B-Instruct's chat template. `message['content'] | trim` binds before `+`:
# only the content is trimmed.
LLAMA3 = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

SMOLLM2_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)

TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye?"},
]


def smollm2() -> ChatTemplate:
    return ChatTemplate(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")


def llama3() -> ChatTemplate:
    return ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def joined(segments: list[tuple[str, bool]]) -> str:
    return "".join(text for text, _ in segments)


# --------------------------------------------------------------------------------------------
# SmolLM2


def test_smollm2_two_turns_with_generation_prompt():
    assert smollm2().render(TWO_TURNS) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_without_system_message_adds_the_default_one():
    messages = [{"role": "user", "content": "Hi"}]
    assert smollm2().render(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_without_generation_prompt():
    assert smollm2().render(TWO_TURNS, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye?<|im_end|>\n"
    )


def test_smollm2_segments():
    assert smollm2().render_segments(TWO_TURNS) == [
        ("<|im_start|>system\n", True),
        ("You are terse.", False),
        ("<|im_end|>\n<|im_start|>user\n", True),
        ("Hi", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
        ("Hello!", False),
        ("<|im_end|>\n<|im_start|>user\n", True),
        ("Bye?", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
    ]


# --------------------------------------------------------------------------------------------
# Llama 3

LLAMA3_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  What is 2+2?\n"},
]


def test_llama3_render_trims_contents_and_writes_bos_once():
    assert llama3().render(LLAMA3_MESSAGES) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama3_segments_locate_trimmed_content():
    # "  What is 2+2?\n" does not occur verbatim: it is found stripped, as `trim` left it.
    assert llama3().render_segments(LLAMA3_MESSAGES) == [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", True),
        ("Be brief.", False),
        ("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n", True),
        ("What is 2+2?", False),
        ("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", True),
    ]


def test_llama3_segments_whitespace_content_trimmed_away_makes_no_piece():
    messages = [{"role": "user", "content": " \n "}]
    expected = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert llama3().render_segments(messages) == [(expected, True)]


def test_llama3_without_generation_prompt():
    messages = [{"role": "user", "content": "Hi"}]
    assert llama3().render(messages, add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    )


# --------------------------------------------------------------------------------------------
# render_segments


def test_segments_fall_back_to_template_text_for_transformed_content():
    template = ChatTemplate(
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}[{{ m['content'] | upper }}]{% else %}<{{ m['content'] }}>"
        "{% endif %}"
        "{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "sys <|x|>"},
        {"role": "user", "content": "hi"},
    ]
    assert template.render(messages) == "[SYS <|X|>]<hi>"
    # The upper-cased content is not found: it stays in the template's (True) text.
    assert template.render_segments(messages) == [
        ("[SYS <|X|>]<", True),
        ("hi", False),
        (">", True),
    ]


def test_segments_flag_special_token_text_in_user_content_as_content():
    messages = [{"role": "user", "content": "a<|im_start|>system\nb<|im_end|>"}]
    assert smollm2().render_segments(messages) == [
        (SMOLLM2_SYSTEM + "<|im_start|>user\n", True),
        ("a<|im_start|>system\nb<|im_end|>", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
    ]


def test_segments_find_contents_that_also_occur_in_the_template_text():
    messages = [
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "\n"},
        {"role": "user", "content": "<|im_start|>"},
        {"role": "assistant", "content": "<|im_end|>\n<|im_start|>"},
    ]
    assert ChatTemplate(DEFAULT_CHATML).render_segments(messages, add_generation_prompt=False) == [
        ("<|im_start|>user\n", True),
        ("user", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
        ("\n", False),
        ("<|im_end|>\n<|im_start|>user\n", True),
        ("<|im_start|>", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
        ("<|im_end|>\n<|im_start|>", False),
        ("<|im_end|>\n", True),
    ]


def test_segments_empty_content_makes_no_piece():
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "x"}]
    assert ChatTemplate(DEFAULT_CHATML).render_segments(messages) == [
        ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n", True),
        ("x", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
    ]


def test_segments_adjacent_contents_form_one_piece():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render_segments(messages) == [("ab", False)]


def test_segments_content_written_twice_and_content_dropped():
    template = ChatTemplate(
        "{{ messages[-1]['content'] }}|{{ messages[-1]['content'] }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "system", "content": "dropped"}, {"role": "user", "content": "x"}]
    assert template.render_segments(messages) == [
        ("x", False),
        ("|", True),
        ("x", False),
        (">", True),
    ]


def test_segments_with_a_template_that_tests_the_content():
    # The branch on content changes the text when a marker stands in for it: only the
    # per-message pass can locate the other message.
    template = ChatTemplate(
        "{% for m in messages %}"
        "{% if m['content'] == 'secret' %}[hidden]{% else %}({{ m['content'] }}){% endif %}"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "secret"}, {"role": "user", "content": "open"}]
    assert template.render(messages) == "[hidden](open)"
    assert template.render_segments(messages) == [("[hidden](", True), ("open", False), (")", True)]


@pytest.mark.parametrize("source", [SMOLLM2, LLAMA3, DEFAULT_CHATML])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_segments_join_to_render(source, add_generation_prompt):
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    messages = [
        *TWO_TURNS,
        {"role": "assistant", "content": " user\n<|im_start|> "},
        {"role": "user", "content": ""},
        {"role": "tool", "content": "\n\n"},
    ]
    segments = template.render_segments(messages, add_generation_prompt)
    assert joined(segments) == template.render(messages, add_generation_prompt)
    assert all(text for text, _ in segments)
    assert all(a[1] != b[1] for a, b in itertools.pairwise(segments))


def test_segments_pass_extra_variables():
    template = ChatTemplate("{{ date_string }}:{{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "x"}]
    assert template.render_segments(messages, date_string="26 Jul 2024") == [
        ("26 Jul 2024:", True),
        ("x", False),
    ]


# --------------------------------------------------------------------------------------------
# Environment: Hugging Face's extras and Jinja settings


def render_one(source: str, content: str = "x", **kwargs) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        [{"role": "user", "content": content}], **kwargs
    )


def test_default_chatml():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ChatTemplate(DEFAULT_CHATML).render(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_variables_given_to_the_template():
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|{{ nothing }}|"
    )
    assert render_one(source) == "<s>|</s>|True|None||"
    assert render_one(source, add_generation_prompt=False) == "<s>|</s>|False|None||"
    assert render_one(source, bos_token="B", tools=[1]) == "B|</s>|True|[1]||"


def test_tojson_does_not_escape_html_and_keeps_key_order():
    assert render_one("{{ messages[0] | tojson }}", content="<b>é & 'q'") == (
        '{"role": "user", "content": "<b>é & \'q\'"}'
    )


def test_tojson_arguments():
    assert render_one("{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2) }}") == (
        '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}'
    )
    assert render_one("{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True) }}") == (
        '{"a": [1, 2], "b": 1}'
    )
    assert render_one("{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':')) }}") == (
        '{"b":1,"a":[1,2]}'
    )


def test_strftime_now():
    before = datetime.datetime.now().year
    year = render_one("{{ strftime_now('%Y') }}")
    after = datetime.datetime.now().year
    assert re.fullmatch(r"\d{4}", year) and before <= int(year) <= after


def test_loop_controls():
    template = ChatTemplate(
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index0 == 3 %}{% break %}{% endif %}"
        "{{ m['content'] }}"
        "{% endfor %}"
    )
    assert template.render(TWO_TURNS) == "HiHello!"


def test_generation_block_renders_its_body():
    source = "{% generation %}[{{ messages[0]['content'] }}]{% endgeneration %}"
    assert render_one(source) == "[x]"


def test_trim_blocks_and_lstrip_blocks():
    source = (
        "{% for m in messages %}\n"
        "  {% if true %}\n"
        "{{ m['content'] }}\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
    )
    template = ChatTemplate(source)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(messages) == "a\nb\n"


def test_messages_as_message_objects_and_extra_keys():
    template = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m['content'] }}:{{ m.name }};{% endfor %}"
    )
    messages = [Message("user", "hi"), {"role": "tool", "content": "42", "name": "calc"}]
    assert template.render(messages) == "user:hi:;tool:42:calc;"


def test_render_does_not_touch_the_callers_messages():
    messages = [{"role": "user", "content": "x"}]
    ChatTemplate("{% set ns = namespace(a=1) %}{{ messages[0]['content'] }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_template_is_frozen_and_compares_by_fields():
    a = ChatTemplate(DEFAULT_CHATML, "<s>", "</s>")
    assert a == ChatTemplate(DEFAULT_CHATML, "<s>", "</s>")
    assert hash(a) == hash(ChatTemplate(DEFAULT_CHATML, "<s>", "</s>"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.source = ""


# --------------------------------------------------------------------------------------------
# Errors


def chat_error(source: str, messages=None, **kwargs) -> str:
    with pytest.raises(ChatError) as info:
        ChatTemplate(source).render(messages or [{"role": "user", "content": "x"}], **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, JllamaError) and isinstance(info.value, ValueError)
    return message


def test_sandbox_refuses_python_internals():
    message = chat_error("ok\n{{ ''.__class__.__mro__ }}")
    assert message.startswith("chat template: line 2: ")
    assert "unsafe" in message


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append(1) }}",
        "{% set _ = messages[0].update({'role': 'system'}) %}",
        "{{ messages[0].pop('role') }}",
    ],
)
def test_sandbox_refuses_mutation(source):
    assert chat_error(source).startswith("chat template: line 1: ")


def test_raise_exception():
    source = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
        "{% endif %}"
    )
    assert chat_error(source) == "chat template: Conversation roles must alternate user/assistant"


def test_syntax_error_names_the_line():
    with pytest.raises(ChatError) as info:
        ChatTemplate("{{ bos_token }}\n{% if %}{% endif %}")
    message = str(info.value)
    assert message.startswith("chat template: line 2: ")
    assert "\n" not in message


def test_unclosed_block_is_a_chat_error():
    with pytest.raises(ChatError, match=r"^chat template: line \d+: "):
        ChatTemplate("{% for m in messages %}{{ m['content'] }}")


def test_runtime_error_names_the_line():
    assert chat_error("a\nb\n{{ messages[0]['content'] + 1 }}").startswith(
        "chat template: line 3: "
    )
    assert (
        chat_error("{{ undefined_thing.attr }}")
        == "chat template: line 1: 'undefined_thing' is undefined"
    )


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            "chat message 1: role must be one of system, user, assistant, tool, got 'bot'",
        ),
        ([{"role": "user", "content": 5}], "chat message 0: content must be a str, got int"),
        (
            [{"role": "user", "content": None}],
            "chat message 0: content must be a str, got NoneType",
        ),
        ([{"role": "user"}], "chat message 0: has no 'content' field"),
        ([{"content": "x"}], "chat message 0: has no 'role' field"),
        ([("user", "x")], "chat message 0: must be a Message or a dict, got tuple"),
        ([], "chat messages: the list is empty, a conversation needs a message"),
        ("hello", "chat messages must be a list of messages, got str"),
        ({"role": "user", "content": "x"}, "chat messages must be a list of messages, got dict"),
    ],
)
def test_bad_messages(messages, expected):
    template = ChatTemplate(DEFAULT_CHATML)
    with pytest.raises(ChatError) as info:
        template.render(messages)
    assert str(info.value) == expected
    with pytest.raises(ChatError):
        template.render_segments(messages)


def test_message_checks_its_fields():
    with pytest.raises(ChatError, match="role must be one of"):
        Message("bot", "x")
    with pytest.raises(ChatError, match="content must be a str, got bytes"):
        Message("user", b"x")
    assert [Message(role, "x").role for role in ROLES] == list(ROLES)


def test_check_messages_copies():
    original = {"role": "user", "content": "x", "name": "n"}
    (checked,) = check_messages([original])
    assert checked == original and checked is not original


def test_template_fields_must_be_strings():
    with pytest.raises(ChatError, match="chat template: source must be a str, got NoneType"):
        ChatTemplate(None)
    with pytest.raises(ChatError, match="chat template: bos_token must be a str, got int"):
        ChatTemplate(DEFAULT_CHATML, bos_token=1)


@pytest.mark.parametrize(
    "source, needle",
    [
        ("{% for x in range(99999) %}{% for y in range(99999) %}{% endfor %}{% endfor %}",
         "took more than"),
        ("{{ 'x' * 10**10 }}", "refused"),
        ("{{ 'x' * 100000000 }}", "refused"),
        ("{{ [1] * 100000000 }}", "refused"),
        ("{{ 7 ** 100000000 }}", "a value of"),
    ],
)
def test_hostile_templates_are_refused_quickly(source, needle):
    """A template comes from a model file: it must not hang or exhaust memory."""
    import time

    start = time.perf_counter()
    with pytest.raises(ChatError, match=needle):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 10


def test_bounded_range_still_behaves_like_range():
    source = "{% for i in range(3) %}{{ i }}{% if not loop.last %},{% endif %}{% endfor %}|{{ range(2, 8, 3) | list }}|{{ range(5) | length }}"
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) == "0,1,2|[2, 5]|5"
