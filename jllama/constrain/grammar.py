"""What a constrained generation must produce: a `Grammar` (a JSON schema, any JSON value, a
regular expression, a Lark or a GBNF grammar) checked and compiled by llguidance.

llguidance (https://github.com/guidance-ai/llguidance, the library llama.cpp's `--grammar` and
vLLM's guided decoding use) compiles each kind into its own grammar text; `Grammar` keeps that
text with the kind and the source as given, so a bad schema or grammar fails here, once, with one
line, before any model runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import llguidance
import numpy as np

from jllama.errors import JllamaError

GRAMMAR_KINDS = ("json_schema", "json", "regex", "lark", "gbnf")
"""json_schema: a JSON Schema (llguidance's subset, docs/json_schema.md); json: any JSON value;
regex: a Rust `regex` pattern the whole output matches; lark: llguidance's Lark syntax
(docs/syntax.md); gbnf: llama.cpp's GBNF (grammars/README.md), converted to Lark by llguidance."""


JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
"""The whitespace a JSON value may hold between its tokens (llguidance's whitespace_pattern,
where a schema's "x-guidance" does not set its own): none, one space, or a newline and an
indentation of up to 20 (llama.cpp's json.gbnf allows the same). llguidance's default is any
run of whitespace, which a small model can fill to the end of max_tokens."""


class GrammarError(JllamaError, ValueError):
    """A schema, pattern or grammar llguidance refuses; the message is one line."""


def _one_line(message: str) -> str:
    """llguidance's messages quote the source over several lines: one line of its parts."""
    return " | ".join(part.strip() for part in message.strip().splitlines() if part.strip())


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A checked constraint.

    Attributes:
        kind: one of `GRAMMAR_KINDS`.
        source: the schema (as compact JSON text), pattern or grammar text as given.
        llguidance: the grammar text `llguidance.LLMatcher` takes.
    """

    kind: str
    source: str
    llguidance: str

    @classmethod
    def of(cls, kind: str, text: str | dict | bool, *, lenient: bool = False) -> Grammar:
        """The grammar of `kind` from `text` (for json_schema also a dict or a bool schema;
        for json, `text` is ignored).

        Args:
            lenient: json_schema only: keywords llguidance does not implement are ignored
                rather than refused (OpenAI's non-strict schemas).

        Raises:
            GrammarError: an unknown kind, a schema that is not JSON or not a schema, a bad
                pattern or grammar (llguidance's message, on one line).
        """
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(GRAMMAR_KINDS)}")
        if kind == "json":
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                "{}", defaults={"whitespace_pattern": JSON_WHITESPACE})
            return cls._checked(kind, "{}", compiled)
        if kind == "json_schema":
            return cls.json_schema(text, lenient=lenient)
        if not isinstance(text, str):
            raise GrammarError(f"a {kind} must be text, not {type(text).__name__}")
        if not text.strip():
            raise GrammarError(f"the {kind} is empty")
        if kind == "regex":
            compiled = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "lark":
            compiled = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            try:
                compiled = llguidance.grammar_from("gbnf", text)
            except ValueError as e:
                raise GrammarError(_one_line(str(e))) from None
        return cls._checked(kind, text, compiled)

    @classmethod
    def json_schema(cls, schema: str | dict | bool, *, lenient: bool = False) -> Grammar:
        """A JSON schema (a dict, a bool, or its JSON text); see `of`."""
        if isinstance(schema, str):
            from jllama.platform.files import parse_json

            try:
                schema = parse_json(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not JSON: {_one_line(str(e))}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean, not "
                               f"{type(schema).__name__}")
        if schema is False:
            raise GrammarError("the JSON schema false matches no value")
        if schema is True:
            schema = {}  # any value (llguidance takes options on an object schema only)
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        options: dict[str, Any] = {"lenient": True} if lenient else {}
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_pattern": JSON_WHITESPACE}, overrides=options)
        except ValueError as e:
            raise GrammarError(f"the JSON schema: {_one_line(str(e))}") from None
        return cls._checked("json_schema", text, compiled)

    @classmethod
    def _checked(cls, kind: str, source: str, compiled: str) -> Grammar:
        what = "JSON schema" if kind == "json_schema" else kind
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
        if failed:
            raise GrammarError(f"the {what}: {_one_line(messages[0])}")
        _probe(what, compiled)
        return cls(kind, source, compiled)


FORCED_LIMIT = 10_000
"""The most bytes a grammar may force before any choice (more: it forces an endless text, as
`root ::= "a" root`, which llguidance only fails on after 50,000 items mid-generation)."""


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A vocabulary of the 256 bytes and an end token: what `_probe` starts a matcher on."""
    from jllama.constrain.vocabulary import SPECIAL_MARK, _Wrapper

    tokens = [bytes([i]) for i in range(256)] + [SPECIAL_MARK + b"end"]
    wrapper = _Wrapper(tokens, 256, None, [256], lambda text: list(
        text.encode("utf-8") if isinstance(text, str) else text))
    return llguidance.LLTokenizer(wrapper, n_vocab=257, eos_token=[256])


def _probe(what: str, compiled: str) -> None:
    """Start a matcher on `compiled` and take its first mask, so a grammar that matches no
    text (a schema that only refers to itself) or forces an endless one is refused here, not
    after the model has loaded and begun.

    Raises:
      GrammarError: as said.
    """
    matcher = llguidance.LLMatcher(_byte_tokenizer(), compiled, log_level=0)
    if not matcher.is_error():
        forced = matcher.compute_ff_tokens()
        if len(forced) > FORCED_LIMIT:
            raise GrammarError(f"the {what} forces an endless text (more than {FORCED_LIMIT} "
                               f"bytes before any choice, starting {bytes(forced[:20])!r})")
        bits = np.zeros(9, np.int32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if matcher.is_error():
        reason = short_reason(matcher.get_error())
        if reason == "NoExtensionBias":
            reason = "it matches no text (a schema that only refers to itself?)"
        raise GrammarError(f"the {what}: {reason}")


def short_reason(message: str) -> str:
    """The first line of an llguidance matcher error (the rest is its state and the grammar),
    at most 200 characters."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "unknown")
    return first if len(first) <= 200 else first[:197] + "..."
