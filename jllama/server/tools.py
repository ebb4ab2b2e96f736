"""Tool (function) calling for /v1/chat/completions: the request's `tools` and `tool_choice`
checked, offered to the model, its reply constrained to a call and returned as OpenAI's
`tool_calls`.

Source: OpenAI API reference, chat completions (`tools`, `tool_choice`, assistant messages'
`tool_calls`, `role: "tool"` messages, streamed `delta.tool_calls`).

The call the model writes is Llama 3.1's format (its template asks for it):
`{"name": NAME, "parameters": ARGUMENTS}`, one call per reply. The grammar fixes that layout
(`name` first, `", "` and `": "` separators, no other whitespace around the two keys), so the
arguments can be streamed as they come: `ToolCallReader` finds the name, then passes on the
text of the `parameters` value, which becomes `function.arguments` (the model's own text).

- "required": the reply is exactly one call of one of the tools (a JSON schema: anyOf over the
  tools of `{"name": const, "parameters": its schema}`).
- {"type": "function", "function": {"name": N}}: exactly one call of N.
- "auto" (the default with tools): a Lark grammar `start: TEXT | call`, TEXT any text whose
  first character is not "{", call the schema above: the first character decides, so a reply
  is a call if and only if it starts with "{", with nothing after the call.
- "none": the tools are not offered and the output is free text.

Templates that do not render `tools` (ChatML, e.g. SmolLM2's) get `tool_preamble`'s system text
instead, and past calls written in the same format as their content.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from jllama.constrain import Grammar, GrammarError
from jllama.server.errors import APIError
from jllama.server.structured import schema_grammar

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parse_tools(tools: Any) -> list[dict]:
    """The request's `tools`, checked: `[{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}]` (parameters: a JSON schema; absent: no
    arguments).

    Returns:
      The tools as given, each with `parameters` filled in (absent: an empty object schema).

    Raises:
      APIError (400): not a non-empty list, a tool that is not a function, a bad or repeated
        name, parameters that are not a schema llguidance takes (`param` e.g.
        "tools[0].function.parameters").
    """
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools: must be a non-empty list of tools", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f'{where}.type: must be "function"', param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function: must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name: must be 1 to 64 letters, digits, _ or "
                           f"- (got {name!r})", param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}.function.name: {name!r} is given twice",
                           param=f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{where}.function.description: must be a string",
                           param=f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, f"{where}.function.strict: must be a boolean",
                           param=f"{where}.function.strict")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        schema_grammar(parameters, f"{where}.function.parameters", strict=bool(strict))
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def parse_tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """`tool_choice` as (mode, name): ("none" | "auto" | "required", None) or ("named", NAME).
    Absent: "auto" with tools, "none" without.

    Raises:
      APIError (400, param "tool_choice"): an unknown value, a name not among the tools, or
        "required" / a name without tools.
    """
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(400, 'tool_choice: "required" needs tools', param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise APIError(400, 'tool_choice: must be "none", "auto", "required" or {"type": '
                       '"function", "function": {"name": ...}}', param="tool_choice")
    name = function["name"]
    if name not in [t["function"]["name"] for t in tools or []]:
        raise APIError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
    return "named", name


def _call_schema(tools: list[dict]) -> dict:
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       "parameters": t["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False,
    } for t in tools]
    return {"anyOf": options, "x-guidance": {**_LAYOUT,
                                             "lenient": not all(t["function"].get("strict")
                                                                for t in tools)}}


def call_grammar(tools: list[dict], mode: str, name: str | None = None) -> Grammar | None:
    """The grammar of the reply for a `parse_tool_choice` result (None for "none").

    Raises:
      APIError (400, param "tools"): llguidance refuses the combined grammar.
    """
    if mode == "none":
        return None
    if mode == "named":
        tools = [t for t in tools if t["function"]["name"] == name]
    schema = _call_schema(tools)
    try:
        if mode == "auto":
            return Grammar.of("lark", "start: TEXT | call\nTEXT: /[^{](.|\\n)*/\n"
                                      f"call: %json {json.dumps(schema)}\n")
        return Grammar.json_schema(schema)
    except GrammarError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None


def tool_preamble(tools: list[dict]) -> str:
    """The system text that offers `tools` where the chat template does not render them:
    Llama 3.1's own instructions and each tool as JSON."""
    listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
    return ("You have access to the following functions. To call a function, please respond "
            'with JSON for a function call. Respond in the format {"name": function name, '
            '"parameters": dictionary of argument name and its value}. Do not use variables.'
            f"\n\n{listed}")


def call_text(name: str, arguments: Any) -> str:
    """A past call written as the model writes one (for templates without tool support)."""
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def history(messages: list[dict], renders_tools: bool, tools: list[dict] | None) -> list[dict]:
    """The request's messages as the chat template reads them.

    Assistant `tool_calls` get their `arguments` parsed to objects (what Hugging Face templates
    read: Llama 3's writes `arguments | tojson`); a `null` content becomes "". Where the template
    does not render tools (`renders_tools` False), a past call becomes the assistant's content
    in the model's call format, and `tool_preamble` joins the system message (or becomes one).

    Args:
      messages: dicts with role, content (str or None), and tool_calls / tool_call_id.

    Raises:
      APIError (400): a malformed `tool_calls` item (`param` e.g.
        "messages[2].tool_calls[0].function.arguments").
    """
    out = []
    for i, message in enumerate(messages):
        item = {k: v for k, v in message.items() if v is not None}
        item["content"] = message.get("content") or ""
        calls = message.get("tool_calls")
        if calls is not None:
            parsed = []
            for j, call in enumerate(calls if isinstance(calls, list) else [None]):
                where = f"messages[{i}].tool_calls[{j}]"
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise APIError(400, f"{where}.function: must be an object with a name",
                                   param=f"{where}.function")
                try:
                    arguments = json.loads(function.get("arguments", "{}"))
                except (TypeError, ValueError):
                    raise APIError(400, f"{where}.function.arguments: must be a JSON text",
                                   param=f"{where}.function.arguments") from None
                parsed.append({"id": call.get("id"), "type": "function",
                               "function": {"name": function["name"], "arguments": arguments}})
            if renders_tools:
                item["tool_calls"] = parsed
            else:
                del item["tool_calls"]
                item["content"] = "\n".join([item["content"]] * bool(item["content"]) + [
                    call_text(c["function"]["name"], c["function"]["arguments"])
                    for c in parsed])
        out.append(item)
    if tools and not renders_tools:
        preamble = tool_preamble(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": ')


class ToolCallReader:
    """Reads a reply as it is generated: text, or one call in the format the grammar fixes.

    `feed(text)` returns the events the new text completes: `("content", text)`,
    `("call", name)` once the name is known, `("arguments", text)` pieces of the parameters
    value. `finish()` returns what is left (a reply cut short before its name: its text as
    content). `is_call` is True once the reply is known to be a call.
    """

    def __init__(self, expect_call: bool):
        self.is_call: bool | None = True if expect_call else None
        self.name: str | None = None
        self.arguments = ""
        self._buffer = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self._done = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.is_call is None and (self._buffer + text):
            self.is_call = (self._buffer + text)[0] == "{"
        if self.is_call is False:
            return [("content", text)] if text else []
        self._buffer += text
        events = []
        if self.name is None:
            head = _HEAD.match(self._buffer)
            if head is None:
                return []
            self.name = json.loads(head.group(1))
            events.append(("call", self.name))
            self._buffer = self._buffer[head.end():]
        piece = self._scan(self._buffer)
        self._buffer = ""
        if piece:
            self.arguments += piece
            events.append(("arguments", piece))
        return events

    def _scan(self, text: str) -> str:
        """The part of `text` inside the parameters value (the closing "}" of the call and
        anything after it dropped)."""
        for k, ch in enumerate(text):
            if self._done:
                return text[:k]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._done = self._depth == 0
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # the call's own "}" after a scalar value
                    self._done = True
                    return text[:k]
                self._depth -= 1
                self._done = self._depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in ", \t\r\n" and self._depth == 0 and self._started:
                self._done = True
                return text[:k]
            self._started = True
        return text

    def finish(self) -> list[tuple[str, str]]:
        if self.is_call and self.name is None and self._buffer:
            self.is_call = False
            return [("content", self._buffer)]
        return []


def new_call_id() -> str:
    """An id for a call, "call_" and 24 hex digits (OpenAI's ids start "call_")."""
    return f"call_{secrets.token_hex(12)}"
