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
- limits transformers does not have, so a template cannot hang the program, take all its
  memory or crash it: `MAX_TEMPLATE_SECONDS` and `MAX_TEMPLATE_GROWTH` watched from outside
  (`jllama.chat.watchdog`), each step that could make a huge value at once sized before it
  runs (`MAX_TEMPLATE_VALUE`, `MAX_TEMPLATE_OUTPUT`; `jllama.chat.limits`, checked in
  `jllama.chat.bounded`'s hooks), recursion ended at Python's limit, and the text bounded
  (`MAX_TEMPLATE_SOURCE`) with nesting too deep for the parser or Python's compiler an error.

Every failure is a one-line `jllama.errors.ChatError` starting "chat template: ": a template
that does not compile (with its line number), one that fails as it renders (its line number,
or the message it gave `raise_exception`), a limit reached.
"""

from __future__ import annotations

import contextvars
import datetime
import itertools
import json
import json.encoder
from collections.abc import Mapping
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox

from jllama.chat import limits
from jllama.chat.bounded import bound_filters, bounded_environment
from jllama.chat.limits import MAX_TEMPLATE_OUTPUT, MAX_TEMPLATE_SOURCE, MAX_TEMPLATE_VALUE
from jllama.chat.watchdog import MAX_TEMPLATE_GROWTH, MAX_TEMPLATE_SECONDS, REASON, Stopped
from jllama.chat.watchdog import start as start_watch
from jllama.chat.watchdog import stop as stop_watch
from jllama.errors import ChatError


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
    wants neither. The arguments are `json.dumps`'s, and the text is the same, refused past
    `MAX_TEMPLATE_VALUE` characters (a list holding one string many times is small to make and
    huge to write, and so is a short list with long separators): sized before json's C encoder
    writes it (a value the caller gave is written as it is: `_given`), or, with an `indent`
    (where json's Python encoder writes it piece by piece anyway), before its pieces are
    joined. `indent` is at most `MAX_JSON_INDENT`.
    """
    if indent is None:
        # json's C encoder writes the whole text in one call: size it first, unless it is
        # one of the caller's own values (`_given`).
        if type(value) is not str and id(value) not in _given():
            n = limits.text_size(value)
            if separators is not None:
                n += n // 2 * _separators_extra(separators)  # text_size counts >= 2 an item
            limits.check_size(n)
        elif len(value) > limits.MAX_TEMPLATE_VALUE:
            raise limits.too_large(len(value))
        return json_text(value, ensure_ascii, None, separators, sort_keys)
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if width > MAX_JSON_INDENT:
        raise ChatError(f"chat template: tojson indent of {width} (refused; the limit is "
                        f"{MAX_JSON_INDENT})")
    # With an indent, json's Python encoder makes the text piece by piece (Python code the
    # watcher can stop): the pieces are counted as they come, a batch at a time (a check per
    # piece costs a fifth of the encoding), and refused once past the limit.
    pieces = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    ).iterencode(value)
    chunks: list[str] = []
    n = 0
    while batch := list(itertools.islice(pieces, _JSON_BATCH)):
        n += sum(map(len, batch))
        if n > limits.MAX_TEMPLATE_VALUE:
            raise ChatError(f"chat template: tojson wrote more than {limits.MAX_TEMPLATE_VALUE} "
                            "characters (refused)")
        chunks += batch
    return "".join(chunks)


# The values a rendering was given, for `_tojson` (`render_template` sets it per rendering).
_GIVEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("jllama_given", default=None)

_GIVEN_DEPTH = 4
"""How deep into the variables `_given` looks: tools[i]["function"]["parameters"] is 4 down."""


def _given() -> set | frozenset:
    """The ids of the containers the caller gave the rendering, to `_GIVEN_DEPTH` levels.

    Why `tojson` need not size these first: their text is the caller's own data written out,
    as large as what the caller already holds (a server request's, at most a few times its
    body, which the server bounds: a JSON body cannot share one object between two places);
    the limits are against what a template *makes* (`[big] * 1000`, a list literal naming one
    value many times), and anything it makes is a new object, not in this set. The ids stay
    unique while the rendering runs: `variables` holds every object (the sandbox is immutable,
    so the template cannot drop one). Computed once a rendering, at its first `tojson`
    (sizing a tool's schema walk by walk cost 5-8% of a rendering with tools)."""
    holder = _GIVEN.get()
    if holder is None:
        return frozenset()
    if holder[1] is None:
        ids = set()
        level = [v for v in holder[0].values() if type(v) in (dict, list, tuple)]
        for _ in range(_GIVEN_DEPTH):
            ids.update(map(id, level))
            below = []
            for v in level:
                for item in (v.values() if type(v) is dict else v):
                    if type(item) in (dict, list, tuple):
                        below.append(item)
            level = below
        holder[1] = ids
    return holder[1]


def _separators_extra(separators: Any) -> int:
    """The characters an item's `separators` write beyond the ", " and ": " that
    `limits.text_size` counts (0 for separators json refuses itself)."""
    try:
        item, key = separators
    except (TypeError, ValueError):
        return 0
    if not (isinstance(item, str) and isinstance(key, str)):
        return 0
    return max(len(item) - 2, 0) + max(len(key) - 2, 0)


def json_text(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
              separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`json.dumps(value, ...)` with `_tojson`'s arguments, and no limit (`_tojson` sizes first).

    `json.dumps` with any argument other than its defaults builds a `JSONEncoder` and its C
    encoder at each call, which costs more than encoding a tool call's arguments: the C
    encoders of the commonest calls (`tojson`, `tojson(ensure_ascii=True)`) are built once. They
    check no circular references, where `json.dumps` does (a value that holds itself is
    refused by `_tojson`'s sizing first, and is an error either way: json's recursion limit).
    """
    if separators is None and not sort_keys and indent is None and type(ensure_ascii) is bool:
        encode = _C_ENCODERS[ensure_ascii]
        if encode is not None:
            return "".join(encode(value, 0))
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _c_encoder(ensure_ascii: bool) -> Any:
    """json's C encoder as `json.dumps(ensure_ascii=ensure_ascii)` builds it (None where json
    has no C speedups)."""
    if json.encoder.c_make_encoder is None:
        return None
    return json.encoder.c_make_encoder(
        None, json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring,
        None, ": ", ", ", False, False, True)


_C_ENCODERS = {False: _c_encoder(False), True: _c_encoder(True)}


_JSON_BATCH = 64
"""Pieces of indented JSON made between two checks of the text's length."""


MAX_JSON_INDENT = 64
"""The widest `tojson` indent (each nesting level writes it again on every line)."""


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
# The environment.


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = bounded_environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    bound_filters(env)
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
      ChatError: the text does not compile ("chat template: line N: ..."), is longer than
        `MAX_TEMPLATE_SOURCE`, or nests too deeply for the parser.
    """
    if len(source) > limits.MAX_TEMPLATE_SOURCE:
        raise ChatError(f"chat template: {len(source)} characters long (refused; the limit is "
                        f"{limits.MAX_TEMPLATE_SOURCE})")
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatError(
            f"chat template: line {exc.lineno}: {one_line(exc.message or 'syntax error')}"
        ) from None
    except (RecursionError, SyntaxError, MemoryError) as exc:
        # Jinja's parser recurses a few frames a nesting level; the Python it generates nests
        # one indentation level a block (Python allows 100): 5,000 nested parentheses or 3,000
        # nested ifs end here, not in a crash.
        raise ChatError(
            f"chat template: nested too deeply to compile ({type(exc).__name__}: "
            f"{one_line(str(exc))})"
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
        attribute, an error in an expression, recursion past Python's limit, a limit reached,
        memory exhausted), with the template line where known.
    """
    watch = start_watch()
    given = _GIVEN.set([variables, None])
    try:
        try:
            return compiled.render(variables)
        finally:
            _GIVEN.reset(given)
            stop_watch(watch)
    except Stopped:
        # Again: the watcher raises at each look until the rendering ends, and a second
        # Stopped arriving as the first unwinds can cut the `finally` short before it ran.
        stop_watch(watch)
        raise ChatError(f"chat template: {watch[REASON] or 'stopped'} (refused)") from None
    except ChatError:
        raise
    except MemoryError:
        raise ChatError("chat template: rendering ran out of memory") from None
    except _TEMPLATE_ERRORS as exc:
        line = _template_line(exc)
        where = f"line {line}: " if line is not None else ""
        detail = one_line(str(exc)) or type(exc).__name__
        raise ChatError(f"chat template: {where}{detail}") from None
