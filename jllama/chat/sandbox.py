"""The Jinja sandbox chat templates run in, with the helpers and limits Hugging Face gives them.

A chat template comes from a model file, so it is untrusted code. It is compiled and rendered
here, the way Hugging Face transformers' `apply_chat_template` does, and nowhere else:

- the environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
  the `loopcontrols` extension (`{% break %}`, `{% continue %}`): a template cannot reach Python
  internals (`''.__class__`) nor mutate what it is given (`messages.append(...)`);
- the helpers templates call: `raise_exception(message)`, `strftime_now(format)` (local time),
  a `tojson` filter that does not escape HTML (`json.dumps(..., ensure_ascii=False)`, keys in
  their given order), and a `{% generation %}...{% endgeneration %}` block that renders its
  body unchanged (transformers uses it to mark assistant text for training masks);
- limits transformers does not have, so a template cannot hang the program or take all its
  memory: `MAX_TEMPLATE_STEPS` loop steps over `range` per rendering, and `*` / `**` refused
  where they would build values over `MAX_TEMPLATE_VALUE`.

Every failure is a one-line `jllama.errors.ChatError` starting "chat template: ": a template
that does not compile (with its line number), one that fails as it renders (its line number,
or the message it gave `raise_exception`), a limit reached.
"""

from __future__ import annotations

import contextvars
import datetime
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox

from jllama.errors import ChatError

MAX_TEMPLATE_STEPS = 1_000_000
"""Loop iterations over `range` one rendering may take: a template from a model file must not
hang the program (`{% for x in range(99999) %}{% for y in range(99999) %}`)."""

MAX_TEMPLATE_VALUE = 1 << 22
"""The longest string or list `*` may make in a template, and the largest `**` result bits."""


def one_line(text: str) -> str:
    """`text` with its line breaks turned into spaces and the ends stripped."""
    return " ".join(text.split("\n")).strip()


# --------------------------------------------------------------------------------------------
# The helpers transformers gives templates.


def _raise_exception(message: object) -> None:
    """`raise_exception(message)` in a template: stops rendering with the template's message."""
    raise ChatError(f"chat template: {one_line(str(message))}")


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


# --------------------------------------------------------------------------------------------
# The limits.

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
# Compiling and rendering.


def compile_template(source: str) -> jinja2.Template:
    """Compiles a chat template's Jinja text in the sandbox.

    Args:
      source: the template text. As in transformers, a trailing newline at the very end is
        dropped, and a name the template does not get renders as "" and is false.

    Returns:
      The compiled template (thread-safe; render it with `render_template`).

    Raises:
      ChatError: the text does not compile ("chat template: line N: ...").
    """
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatError(
            f"chat template: line {exc.lineno}: {one_line(exc.message or 'syntax error')}"
        ) from None


def render_template(compiled: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Renders a compiled template within the sandbox's limits.

    Args:
      compiled: from `compile_template`.
      variables: the template's variables (`messages`, `add_generation_prompt`, ...).

    Returns:
      The rendered text.

    Raises:
      ChatError: the template fails as it renders (a call of `raise_exception`, a forbidden
        attribute, an error in an expression, a limit reached, memory exhausted), with the
        template line where known.
    """
    token = _steps_left.set([MAX_TEMPLATE_STEPS])
    try:
        return compiled.render(variables)
    except ChatError:
        raise
    except MemoryError:
        raise ChatError("chat template: rendering ran out of memory") from None
    except _TEMPLATE_ERRORS as exc:
        line = _template_line(exc)
        where = f"line {line}: " if line is not None else ""
        detail = one_line(str(exc)) or type(exc).__name__
        raise ChatError(f"chat template: {where}{detail}") from None
    finally:
        _steps_left.reset(token)
