"""Tool (function) calling for /v1/chat/completions: the request's `tools` and `tool_choice`
checked, offered to the model, its reply constrained to a call and returned as OpenAI's
`tool_calls`.

Source: OpenAI API reference, chat completions (`tools`, `tool_choice`, assistant messages'
`tool_calls`, `role: "tool"` messages, streamed `delta.tool_calls`).

The call the model writes is Llama 3.1's format (its template asks for it):
`{"name": NAME, "parameters": ARGUMENTS}`, one call per reply. The grammar fixes that layout
(`name` first, `", "` and `": "` separators, no other whitespace around the two keys), so the
arguments can be streamed as they come: `jllama.server.tool_reply.ToolCallReader` finds the
name, then passes on the text of the `parameters` value, which becomes `function.arguments`
(the model's own text). `plan_chat` puts it together for a request.

- "required": the reply is exactly one call of one of the tools (a JSON schema: anyOf over the
  tools of `{"name": const, "parameters": its schema}`).
- {"type": "function", "function": {"name": N}}: exactly one call of N.
- "auto" (the default with tools): a Lark grammar `start: TEXT | call`, TEXT any text whose
  first character is not "{", call the schema above: the first character decides, so a reply
  is a call if and only if it starts with "{", with nothing after the call.
- "none": the tools are not offered and the output is free text.

Templates that do not render `tools` (ChatML, e.g. SmolLM2's) get `tool_preamble`'s system text
instead, and past calls written in the same format as their content.

Qwen2.5's and Qwen3's templates (and Hermes 2 Pro's, whose format they took) ask for another
format, "hermes" in vLLM's and llama.cpp's parser names, chosen where the template writes
`<tool_call>` (`call_format`): each call a block `<tool_call>\n{"name": NAME, "arguments":
ARGUMENTS}\n</tool_call>`, blocks joined by "\n" (several calls unless parallel_tool_calls is
false), read by `jllama.server.tool_reply.HermesToolReply`. Its "auto" is text without
`<tool_call>`, or text (possibly none) then the blocks, as vLLM's hermes parser reads a reply.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jllama.constrain import Grammar, GrammarError
from jllama.errors import JllamaError
from jllama.server.errors import APIError
from jllama.server.structured import request_grammar, schema_grammar

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_LAYOUT = {"whitespace_flexible": False, "whitespace_pattern": None,  # None: not the default
           "item_separator": ", ", "key_separator": ": "}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CALL_FORMATS = ("llama3", "hermes")
"""How a model writes a call: Llama 3.1's JSON `{"name", "parameters"}`, or Hermes' (Qwen's)
`<tool_call>` blocks of `{"name", "arguments"}`."""
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"


def parse_tools(tools: Any) -> list[dict]:
    """The request's `tools`, checked: `[{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}]` (parameters: a JSON schema; absent: no
    arguments).

    Returns:
      The tools as given, each with `parameters` filled in (absent: an empty object schema).

    Raises:
      APIError (400): not a non-empty list (an empty one is refused as OpenAI's API refuses
        it, "[] is too short - 'tools'": leave `tools` out for none), a tool that is not a
        function, a bad or repeated name, parameters that are not a schema llguidance takes
        (`param` e.g. "tools[0].function.parameters").
    """
    if isinstance(tools, list) and not tools:
        raise APIError(400, "tools: an empty list is too short (give at least one tool, or "
                       "leave tools out), as in OpenAI's API", param="tools")
    if not isinstance(tools, list):
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
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise APIError(400, f"{where}.function.parameters: must be the JSON schema of an "
                           'object ("type": "object"): the arguments are an object',
                           param=f"{where}.function.parameters")
        parameters = {"type": "object", **parameters}
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


def call_format(template) -> str:
    """The `CALL_FORMATS` item a `jllama.chat.ChatTemplate` asks for: "hermes" where its
    source writes `<tool_call>` (Qwen2.5's, Qwen3's, Hermes'), else "llama3"."""
    source = getattr(template, "source", None) or ""
    return "hermes" if "<tool_call>" in source else "llama3"


def _call_schema(tools: list[dict], key: str = "parameters") -> dict:
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       key: t["function"]["parameters"]},
        "required": ["name", key], "additionalProperties": False,
    } for t in tools]
    return {"anyOf": options, "x-guidance": {**_LAYOUT,
                                             "lenient": not all(t["function"].get("strict")
                                                                for t in tools)}}


def call_grammar(tools: list[dict], mode: str, name: str | None = None, *,
                 think_apart: bool = False, call_format: str = "llama3",
                 parallel: bool = True) -> Grammar | None:
    """The grammar of the reply for a `parse_tool_choice` result (None for "none").

    think_apart: the reply comes after a think block (`jllama.server.reasoning.after_thinking`
    puts the block and the whitespace after it before this grammar): "auto"'s free text may
    neither start with whitespace nor open a block (`<think>`), so that the block and the
    whitespace after it are never read as the start of free text, which would take anything
    after them, a call not held to its schema included.

    call_format: a `CALL_FORMATS` item (`call_format`).
    parallel: "hermes" only: one call or more (False: exactly one, parallel_tool_calls false).

    Raises:
      APIError (400, param "tools"): llguidance refuses the combined grammar.
    """
    if mode == "none":
        return None
    if mode == "named":
        tools = [t for t in tools if t["function"]["name"] == name]
    if call_format == "hermes":
        return _hermes_grammar(tools, mode, think_apart, parallel)
    schema = _call_schema(tools)
    try:
        if mode == "auto":
            # llguidance's `&` and `~` on a lexeme: TEXT minus what opens a think block.
            text = ("/[^{\\s](.|\\n)*/ & ~/<think>(.|\\n)*/" if think_apart
                    else "/[^{](.|\\n)*/")
            return Grammar.of("lark", f"start: TEXT | call\nTEXT: {text}\n"
                                      f"call: %json {json.dumps(schema)}\n")
        return Grammar.json_schema(schema)
    except GrammarError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None


def _hermes_grammar(tools: list[dict], mode: str, think_apart: bool,
                    parallel: bool) -> Grammar:
    """`call_grammar` for "hermes": one `<tool_call>` block (or several joined by "\n"); with
    "auto" a text without `<tool_call>`, or one that leads to the blocks (the `lead` rule is
    lazy: it ends at the first `<tool_call>\n`); think_apart: neither starts with whitespace
    or `<think>`."""
    schema = _call_schema(tools, "arguments")
    more = " more*" if parallel else ""
    rules = (f"body: %json {json.dumps(schema)} {json.dumps(HERMES_CLOSE)}\n"
             f"more: \"\\n\" {json.dumps(HERMES_OPEN)} body\n")
    if mode == "auto":
        if think_apart:
            text = "/[^\\s](.|\\n)*/ & ~/<think>(.|\\n)*/"
            lead = "/([^\\s](.|\\n)*)?<tool_call>\\n/ & ~/<think>(.|\\n)*/"
        else:
            text, lead = "/(.|\\n)+/", "/(.|\\n)*<tool_call>\\n/"
        rules = (f"start: TEXT | lead body{more}\nlead[lazy]: {lead}\n"
                 f"TEXT: {text} & ~/(.|\\n)*<tool_call>(.|\\n)*/\n" + rules)
    else:
        rules = f"start: {json.dumps(HERMES_OPEN)} body{more}\n" + rules
    try:
        return Grammar.of("lark", rules)
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
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise APIError(400, f"messages[{i}].tool_call_id: a tool message needs the id of "
                           "the call it answers", param=f"messages[{i}].tool_call_id")
        if calls is not None and not isinstance(calls, list):
            raise APIError(400, f"messages[{i}].tool_calls: must be a list of calls",
                           param=f"messages[{i}].tool_calls")
        if calls is not None:
            parsed = []
            for j, call in enumerate(calls):
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


def template_renders_tools(template) -> bool:
    """Whether a `jllama.chat.ChatTemplate` writes the `tools` it is given into the prompt
    (Llama 3.1/3.2's do; ChatML ones such as SmolLM2's ignore them): a probe tool's name
    is looked for in a one-message render."""
    probe = f"jllama_probe_{secrets.token_hex(6)}"
    tool = {"type": "function", "function": {"name": probe, "description": "",
                                             "parameters": dict(_EMPTY_PARAMETERS)}}
    try:
        text = template.render([{"role": "user", "content": "Hello"}], tools=[tool])
    except JllamaError:
        return False
    return probe in text


@dataclasses.dataclass(frozen=True)
class ChatPlan:
    """How a chat request is rendered and constrained.

    Attributes:
      messages: the conversation as the template reads it (`history`).
      template_tools: the template's `tools` variable (None: not rendered).
      grammar: what the reply must match (response_format's, a call's), or None.
      mode: "none" (no tools offered), "auto", "required" or "named".
      tools: the tools offered (None: none), for `call_grammar` again (`think_apart`).
      call_format: how the model writes a call (`CALL_FORMATS`).
      parallel: more than one call allowed (`call_grammar`'s, "hermes" only).
    """

    messages: list[dict]
    template_tools: list[dict] | None
    grammar: Grammar | None
    mode: str
    tools: list[dict] | None = None
    call_format: str = "llama3"
    parallel: bool = True

    @property
    def offers_tools(self) -> bool:
        return self.mode != "none"


def plan_chat(messages: list[dict], tools: Any, tool_choice: Any, response_format: Any,
              renders_tools: bool, grammar: Any = None,
              structured_outputs: Any = None, call_format: str = "llama3",
              parallel_tool_calls: bool | None = None) -> ChatPlan:
    """A chat request's `ChatPlan` from its messages, tools, tool_choice and response_format
    (or llama.cpp's `grammar`, vLLM's `structured_outputs`: `request_grammar`), for a model
    that writes calls in `call_format`.

    Raises:
      APIError (400): a bad `tools`, `tool_choice`, `response_format` or `tool_calls` item
        (`param` names it), or response_format together with tool_choice "auto" (a JSON
        reply and a call both start with "{", so the reply could not be told apart).
    """
    checked = parse_tools(tools) if tools is not None else None
    mode, name = parse_tool_choice(tool_choice, checked)
    if checked is None:
        mode = "none"  # "auto" (or "none") with no tools: nothing to call
    constraint = request_grammar(response_format, grammar, structured_outputs)
    offered = checked if mode != "none" else None
    if mode == "auto" and constraint is not None:
        field = ("grammar" if grammar is not None else "structured_outputs"
                 if structured_outputs is not None else "response_format")
        raise APIError(400, f'{field}: not supported with tools and tool_choice "auto" '
                       '(give tool_choice "none", "required" or a function)', param=field)
    grammar = constraint
    parallel = parallel_tool_calls is not False
    if offered:
        # A reply that must be a call has no content for response_format to shape.
        grammar = call_grammar(offered, mode, name, call_format=call_format, parallel=parallel)
    return ChatPlan(history(messages, renders_tools, offered),
                    offered if renders_tools else None, grammar, mode, offered, call_format,
                    parallel)
