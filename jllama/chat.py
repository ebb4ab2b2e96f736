"""Chat templates: a conversation rendered to prompt text as Hugging Face renders it.

A chat model is trained on conversations laid out in one fixed way (role headers, special
tokens, a default system line). The model's files carry that layout as a Jinja template: GGUF's
`tokenizer.chat_template`, or `chat_template` in Hugging Face's `tokenizer_config.json`. This
module renders such a template the way Hugging Face transformers' `apply_chat_template` does, so
the prompt text is the one the model was trained on:

- a sandboxed Jinja environment, `ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)` with the `loopcontrols` extension (`{% break %}`, `{% continue %}`): the
  template cannot reach Python internals (`''.__class__`) nor mutate what it is given
  (`messages.append(...)`);
- the helpers templates call: `raise_exception(message)`, `strftime_now(format)` (local time),
  a `tojson` filter that does not escape HTML (`json.dumps(..., ensure_ascii=False)`, keys in
  their given order), and a `{% generation %}...{% endgeneration %}` block that renders its
  body unchanged (transformers uses it to mark assistant text for training masks);
- the variables: `messages` (a list of `{"role", "content", ...}` dicts), `add_generation_prompt`,
  `bos_token`, `eos_token`, `tools=None`, `documents=None`, and any extra keyword arguments
  (which override those).

Jinja's own rules apply, as in transformers: a name the template does not get is undefined,
which prints as "" and is false, and a trailing newline at the very end of the template is
dropped.

Templates and special tokens. A rendered prompt holds special-token text (`<|im_start|>`,
`<|eot_id|>`) written by the template, next to user text that may contain the same characters.
`ChatTemplate.render_segments` tells the two apart, so a tokenizer can parse special tokens in
the template's text only and keep a user's `<|im_start|>` plain text.

Every failure is a one-line `jllama.errors.ChatError`: a template that does not compile (with
its line number), one that fails as it renders (its line number, or the message it gave
`raise_exception`), and a malformed message list.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox

from jllama.errors import ChatError

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""

DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the template for a model that carries none.

Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and the generation prompt is
`<|im_start|>assistant\\n`. No system line is added and no BOS is written (the tokenizer adds
BOS if the model wants one). This is the layout of OpenAI's ChatML, used by Qwen and SmolLM2.
"""


# --------------------------------------------------------------------------------------------
# Messages.


@dataclasses.dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    Attributes:
      role: who speaks: one of `ROLES` ("system", "user", "assistant", "tool").
      content: what they say, as text.

    Raises:
      ChatError: on an unknown role or a content that is not a str.
    """

    role: str
    content: str

    def __post_init__(self) -> None:
        _check_fields(self.role, self.content, where="chat message")


def _check_fields(role: object, content: object, where: str) -> None:
    if not isinstance(role, str) or role not in ROLES:
        raise ChatError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(content, str):
        raise ChatError(f"{where}: content must be a str, got {type(content).__name__}")


def check_messages(messages: Sequence[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validates a conversation and returns it as the dicts a template reads.

    Args:
      messages: a non-empty list (or tuple) of `Message`s or mappings with at least `"role"`
        and `"content"`. A mapping's other keys (`"name"`, `"tool_calls"`, ...) are passed to
        the template as they are, as transformers does.

    Returns:
      A new list of new dicts, `{"role": str, "content": str, ...}`, in order.

    Raises:
      ChatError: naming the message's index and field: not a list, an empty list, an item that
        is neither a `Message` nor a mapping, a missing field, an unknown role, a content that
        is not a str.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatError(f"chat messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatError("chat messages: the list is empty, a conversation needs a message")
    checked = []
    for index, message in enumerate(messages):
        where = f"chat message {index}"
        if isinstance(message, Message):
            item = {"role": message.role, "content": message.content}
        elif isinstance(message, Mapping):
            for field in ("role", "content"):
                if field not in message:
                    raise ChatError(f"{where}: has no {field!r} field")
            item = dict(message)
        else:
            raise ChatError(f"{where}: must be a Message or a dict, got {type(message).__name__}")
        _check_fields(item["role"], item["content"], where)
        checked.append(item)
    return checked


# --------------------------------------------------------------------------------------------
# The Jinja environment, with the helpers transformers gives templates.


def _raise_exception(message: object) -> None:
    """`raise_exception(message)` in a template: stops rendering with the template's message."""
    raise ChatError(f"chat template: {_one_line(str(message))}")


def _strftime_now(format: str) -> str:
    """`strftime_now(format)` in a template: the local date and time, as `datetime.strftime`."""
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The `tojson` filter as transformers defines it: plain `json.dumps`, no HTML escaping.

    Jinja's built-in `tojson` escapes `<`, `>`, `&` and `'` for HTML and sorts keys; a prompt
    wants neither. The arguments are `json.dumps`'s.
    """
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged.

    transformers uses the block to find assistant text (for `return_assistant_tokens_mask`);
    rendering a prompt needs only the text, so the body is emitted as is.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


MAX_TEMPLATE_STEPS = 1_000_000
"""Loop iterations over `range` one rendering may take: a template from a model file must not
hang the program (`{% for x in range(99999) %}{% for y in range(99999) %}`)."""

MAX_TEMPLATE_VALUE = 1 << 22
"""The longest string or list `*` may make in a template, and the largest `**` result bits."""

_steps_left: contextvars.ContextVar[list[int]] = contextvars.ContextVar("_steps_left")


class _BoundedRange:
    """`range(...)` for templates: at most jinja's MAX_RANGE items, and every item drawn counts
    against the rendering's MAX_TEMPLATE_STEPS."""

    def __init__(self, *args: int):
        self._range = jinja2.sandbox.safe_range(*args)

    def __len__(self) -> int:
        return len(self._range)

    def __iter__(self):
        budget = _steps_left.get(None)
        for item in self._range:
            if budget is not None:
                budget[0] -= 1
                if budget[0] < 0:
                    raise ChatError(
                        f"chat template: more than {MAX_TEMPLATE_STEPS} loop steps (refused)"
                    )
            yield item


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` refused where they would build huge values
    (`{{ 'x' * 10**10 }}` would otherwise take all memory and time)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * max(n, 0) > MAX_TEMPLATE_VALUE:
                        raise ChatError(
                            f"chat template: a value of {len(seq) * n} items (refused; the "
                            f"limit is {MAX_TEMPLATE_VALUE})"
                        )
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > MAX_TEMPLATE_VALUE:
                raise ChatError(f"chat template: {left} ** {right} is too large (refused)")
        return super().call_binop(context, operator, left, right)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.globals["range"] = _BoundedRange
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


# What a template can raise as it renders: Jinja's errors (undefined names, the sandbox's
# SecurityError) and the Python errors of its expressions ('a' + 1, {}['x'], 1 / 0, deep
# recursion).
_TEMPLATE_ERRORS = (
    jinja2.TemplateError,
    ArithmeticError,
    AttributeError,
    LookupError,
    RuntimeError,
    TypeError,
    ValueError,
)

_ENV = _environment()  # holds no state once built; compiled templates are thread-safe


def _one_line(text: str) -> str:
    return " ".join(text.split("\n")).strip()


def _template_line(exc: BaseException) -> int | None:
    """The template line an exception was raised at, from Jinja's rewritten traceback.

    Jinja rewrites a rendering traceback so that the template's frames carry the file name
    `<template>` (for a template compiled from a string) and the template's line numbers.
    """
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# --------------------------------------------------------------------------------------------
# The template.


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, compiled once.

    Attributes:
      source: the Jinja text, as GGUF's `tokenizer.chat_template` or the `chat_template` of
        Hugging Face's `tokenizer_config.json` holds it (`DEFAULT_CHATML` for a model with
        none).
      bos_token: the text of the BOS token, given to the template as `bos_token` ("" if none).
      eos_token: the text of the EOS token, given to the template as `eos_token` ("" if none).

    Raises:
      ChatError: if a field is not a str, or the source does not compile ("chat template: line
        N: ...").
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("source", "bos_token", "eos_token"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ChatError(f"chat template: {name} must be a str, got {type(value).__name__}")
        try:
            compiled = _ENV.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatError(
                f"chat template: line {exc.lineno}: {_one_line(exc.message or 'syntax error')}"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to prompt text, as transformers' `apply_chat_template(...,
        tokenize=False)`.

        Args:
          messages: the conversation (see `check_messages`).
          add_generation_prompt: ask the template to end with the header of an assistant turn
            (e.g. `<|im_start|>assistant\\n`), so the model's next tokens are the reply.
          **kwargs: more template variables (e.g. `tools`, `date_string`,
            `enable_thinking`); they override `bos_token`, `eos_token`, `tools` and `documents`.

        Returns:
          The rendered text. It may begin with `bos_token` if the template writes it: a
          tokenizer must then not add another BOS (transformers tokenizes a rendered chat with
          `add_special_tokens=False`).

        Raises:
          ChatError: a malformed message, or a template that fails as it renders (a call of
            `raise_exception`, a forbidden attribute, an error in an expression), with the
            template line where known.
        """
        return self._render(check_messages(messages), add_generation_prompt, kwargs)

    def render_segments(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[tuple[str, bool]]:
        """`render(...)`'s text cut into the template's own text and the messages' contents.

        Contract:
          - `"".join(text for text, _ in segments) == render(messages, add_generation_prompt,
            **kwargs)`, exactly.
          - A piece flagged True is text the template wrote: role headers, separators,
            `bos_token`, a default system line. Special-token text in it (`<|im_start|>`) is
            meant as special tokens.
          - A piece flagged False is text of a message's `content`, copied by the template:
            user text, whose special-token-looking characters are to be tokenized as plain
            text, so a message cannot inject control tokens. (transformers and llama.cpp both
            tokenize the whole rendered prompt with special tokens parsed, so their ids differ
            from these only where a content holds special-token text.)
          - Pieces are non-empty, and neighbours have different flags (two contents the
            template wrote side by side form one False piece). An empty content makes no piece.
          - The cuts say where special tokens may be parsed, not where to cut the text for the
            tokenizer: to get the ids transformers gets from the whole string, find special
            tokens only inside True pieces, then tokenize each stretch of text between two
            special tokens as one string, across piece boundaries (a cut between "[INST] " and
            "Hello" must not change how " Hello" is split).

        How contents are found. The conversation is rendered once as is, and once more with
        every non-empty content replaced by a unique marker (random text that occurs nowhere
        else). The marked render gives the template's text around each content. Walking both
        renders side by side, each marker must be matched in the real text by its content as
        is, or stripped of surrounding whitespace (what Llama 3's `content | trim` leaves: the
        stripped text is flagged False, the removed whitespace does not appear), followed by
        the template's text up to the next marker; and the template's text must match exactly
        everywhere. If the whole real text is rebuilt that way, those places are the contents,
        however often the same characters ("user", "\\n") occur in the template's text. A
        content the template copies twice gives two False pieces; one it drops gives none.

        If the rebuild fails, the template treats some content other than as an opaque string
        (it splits it, tests it, escapes it, changes its case). Each message is then tried on
        its own, with one marked render per message and the same matching. A message whose
        content still cannot be matched is left inside True pieces: a tokenizer then parses
        special-token text in it as special tokens, which is what llama.cpp does for the
        whole prompt.

        Args:
          messages: as for `render`.
          add_generation_prompt: as for `render`.
          **kwargs: as for `render`.

        Returns:
          `[(text, from_template), ...]` in order.

        Raises:
          ChatError: as `render`.
        """
        checked = check_messages(messages)
        text = self._render(checked, add_generation_prompt, kwargs)
        spans = self._content_spans(checked, text, add_generation_prompt, kwargs)
        return _cut(text, spans)

    # ----------------------------------------------------------------------------------------

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": None,
            "documents": None,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        token = _steps_left.set([MAX_TEMPLATE_STEPS])
        try:
            return self._compiled.render(variables)
        except ChatError:
            raise
        except MemoryError:
            raise ChatError("chat template: rendering ran out of memory") from None
        except _TEMPLATE_ERRORS as exc:
            line = _template_line(exc)
            where = f"line {line}: " if line is not None else ""
            detail = _one_line(str(exc)) or type(exc).__name__
            raise ChatError(f"chat template: {where}{detail}") from None
        finally:
            _steps_left.reset(token)

    def _content_spans(
        self,
        messages: list[dict[str, Any]],
        text: str,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> list[tuple[int, int]]:
        """`[(start, end), ...]`: where the messages' contents lie in `text` (see
        `render_segments`)."""
        contents = [m["content"] for m in messages]
        indices = [i for i, content in enumerate(contents) if content]
        if not indices:
            return []
        markers = _markers(len(contents), [text, self.source, *contents, *_kwargs_text(kwargs)])

        def marked_render(replace: Sequence[int]) -> str | None:
            copies = [dict(m) for m in messages]
            for i in replace:
                copies[i]["content"] = markers[i]
            try:
                return self._render(copies, add_generation_prompt, kwargs)
            except ChatError:  # the template objects to a marker: no match
                return None

        candidates = {markers[i]: _candidates(contents[i]) for i in indices}
        marked = marked_render(indices)
        if marked is not None:
            spans = _align(marked, candidates, text)
            if spans is not None:
                return spans
        spans = []
        for i in indices:  # the slow path: some content is not copied as is
            marked = marked_render([i])
            if marked is not None:
                spans.extend(_align(marked, {markers[i]: candidates[markers[i]]}, text) or [])
        return spans


def _candidates(content: str) -> tuple[str, ...]:
    """What a template may have made of a content: itself, or stripped (`| trim`)."""
    return tuple(dict.fromkeys((content, content.strip())))


def _kwargs_text(kwargs: Mapping[str, Any]) -> list[str]:
    """The string values among extra template variables (a marker must differ from them)."""
    return [value for value in kwargs.values() if isinstance(value, str)]


def _markers(count: int, avoid: Sequence[str]) -> list[str]:
    """`count` distinct marker strings, none of which occurs in any of `avoid`.

    A marker is private-use characters around random hex digits: no whitespace (so `trim`
    keeps it), nothing a template would treat specially.
    """
    while True:
        token = secrets.token_hex(8)
        markers = [f"\ue000{token}.{i}\ue001" for i in range(count)]
        if not any(f"\ue000{token}." in s for s in avoid):
            return markers


def _align(
    marked: str, candidates: Mapping[str, Sequence[str]], text: str
) -> list[tuple[int, int]] | None:
    """Matches a marked render against the real one.

    Args:
      marked: the template's output with markers in place of some contents.
      candidates: for each marker, the texts that may stand in its place in `text`, tried in
        order; the first one that is followed in `text` by the template's text up to the next
        marker is taken.
      text: the real render.

    Returns:
      The `(start, end)` spans in `text` of the texts taken for the markers (an empty text
      gives none), if `marked` with those texts in place of its markers equals `text`, else
      None.
    """
    # With a capturing group, split gives [literal, marker, literal, marker, ..., literal].
    parts = re.split("(" + "|".join(re.escape(marker) for marker in candidates) + ")", marked)
    spans = []
    position = 0
    for k in range(0, len(parts), 2):
        literal = parts[k]
        if not text.startswith(literal, position):
            return None
        position += len(literal)
        if k + 1 == len(parts):
            break
        following = parts[k + 2]
        for candidate in candidates[parts[k + 1]]:
            end = position + len(candidate)
            if text.startswith(candidate, position) and text.startswith(following, end):
                break
        else:
            return None
        if candidate:
            spans.append((position, end))
        position = end
    return spans if position == len(text) else None


def _cut(text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[str, bool]]:
    """`text` as alternating pieces: False inside `spans`, True elsewhere; none empty."""
    flags = []  # (start, end, from_template) runs
    position = 0
    for start, end in sorted(spans):
        if start < position:  # overlaps a span already taken (only if a template is erratic)
            continue
        flags.append((position, start, True))
        flags.append((start, end, False))
        position = end
    flags.append((position, len(text), True))
    segments: list[tuple[str, bool]] = []
    for start, end, from_template in flags:
        if start == end:
            continue
        if segments and segments[-1][1] == from_template:
            segments[-1] = (segments[-1][0] + text[start:end], from_template)
        else:
            segments.append((text[start:end], from_template))
    return segments


LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
"""The Llama 3 instruct layout, for a Llama 3 model that carries no template (Meta's
`tokenizer.model` has none).

The text starts with `bos_token` (`<|begin_of_text|>`: the tokenizer must then not add another
BOS); each message becomes `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`
with the content stripped of surrounding whitespace, and the generation prompt is
`<|start_header_id|>assistant<|end_header_id|>\\n\\n`. This renders as Meta's Llama 3 Instruct
template on Hugging Face does. No system line or date is added (Llama 3.1's template adds
a "Cutting Knowledge Date" system message; that model's folder carries its own template).
"""
