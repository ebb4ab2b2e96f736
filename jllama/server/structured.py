"""`response_format` (OpenAI's structured outputs) as a `jllama.constrain.Grammar`.

Source: OpenAI API reference, chat completions `response_format`: `{"type": "text"}`,
`{"type": "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema": {"name",
"description", "schema", "strict"}}`. jllama accepts it on /v1/completions too, as llama.cpp's and
vLLM's servers do.

Two other servers' fields give grammars that are not JSON (`request_grammar`): llama.cpp's
`grammar` (GBNF, or llguidance's Lark, as the command's --grammar) and vLLM's
`structured_outputs` (`{"regex": PATTERN}`, `{"grammar": TEXT}` or `{"json": SCHEMA}`, one
of them), e.g. a regex that makes a thinking model's reply `<think>...</think>` and an answer.
"""

from __future__ import annotations

import re
from typing import Any

from jllama.constrain import Grammar, GrammarError
from jllama.server.errors import APIError

_PARAM = "response_format"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_format_grammar(value: Any) -> Grammar | None:
    """The grammar a `response_format` asks for.

    Args:
      value: the request's `response_format` as parsed JSON (None: absent).

    Returns:
      None for absent or `{"type": "text"}`; a grammar of any JSON object for `json_object`;
      the schema's grammar for `json_schema` (`strict: true` refuses keywords llguidance does
      not implement; absent or false ignores them, as a non-strict schema is a hint). A
      `json_schema` without `schema` is any JSON object.

    Raises:
      APIError (400): a malformed value or a schema llguidance refuses; `param` names the field
        (e.g. "response_format.json_schema.schema"), the message is `GrammarError`'s.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f"{_PARAM}: must be an object", param=_PARAM)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    if kind != "json_schema":
        raise APIError(400, f"{_PARAM}.type: must be 'text', 'json_object' or 'json_schema', "
                       f"got {kind!r}", param=f"{_PARAM}.type")
    spec = value.get("json_schema")
    where = f"{_PARAM}.json_schema"
    if not isinstance(spec, dict):
        raise APIError(400, f"{where}: must be an object with 'name' and 'schema'", param=where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(400, f"{where}.name: must be 1 to 64 letters, digits, _ or - (OpenAI's "
                       f"rule), got {name!r}", param=f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict: must be a boolean", param=f"{where}.strict")
    schema = spec.get("schema", {"type": "object"})
    return schema_grammar(schema, f"{where}.schema", strict=bool(strict))


def request_grammar(response_format: Any, grammar: Any = None,
                    structured_outputs: Any = None) -> Grammar | None:
    """The grammar of a request's `response_format`, llama.cpp's `grammar` or vLLM's
    `structured_outputs`, at most one of them given.

    Raises:
      APIError (400): two of them given, a malformed one, or a grammar llguidance refuses
        (`param` names the field).
    """
    given = [name for name, value in (("response_format", response_format),
                                      ("grammar", grammar),
                                      ("structured_outputs", structured_outputs))
             if value is not None]
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)}: give one constraint, not several",
                       param=given[1])
    if grammar is not None:
        return _text_grammar("grammar", grammar)
    if structured_outputs is None:
        return response_format_grammar(response_format)
    where = "structured_outputs"
    kinds = ("regex", "grammar", "json")
    if (not isinstance(structured_outputs, dict)
            or len([k for k in kinds if structured_outputs.get(k) is not None]) != 1):
        raise APIError(400, f"{where}: must be an object with one of {', '.join(kinds)} "
                       "(vLLM's fields; others are not supported)", param=where)
    if structured_outputs.get("json") is not None:
        return schema_grammar(structured_outputs["json"], f"{where}.json", strict=False)
    kind = "regex" if structured_outputs.get("regex") is not None else "grammar"
    return _text_grammar(f"{where}.{kind}", structured_outputs[kind], regex=kind == "regex")


def constraint_field(body: Any) -> str:
    """The field a request's constraint comes from: "grammar", "structured_outputs" or
    "response_format" (also where it has none, or tools give it: the caller knows those);
    the `param` of a 400 when its matcher fails mid-generation."""
    if body.grammar is not None:
        return "grammar"
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def _text_grammar(param: str, text: Any, regex: bool = False) -> Grammar:
    """A regex, or a grammar in GBNF (text with "::=") or Lark, as a 400 naming `param` where
    llguidance refuses it."""
    if not isinstance(text, str) or not text:
        raise APIError(400, f"{param}: must be a non-empty string", param=param)
    kind = "regex" if regex else "gbnf" if "::=" in text else "lark"
    try:
        return Grammar.of(kind, text)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def schema_grammar(schema: Any, param: str, strict: bool) -> Grammar:
    """`Grammar.json_schema(schema, lenient=not strict)`, a refusal as a 400 naming `param`.

    Raises:
      APIError (400): the schema is not an object or a boolean, or llguidance refuses it.
    """
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param}: a JSON schema must be an object or a boolean",
                       param=param)
    try:
        return Grammar.json_schema(schema, lenient=not strict)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
