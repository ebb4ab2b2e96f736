"""A request of OpenAI's Responses API (`POST /v1/responses`) as the chat completions request
it is run as (`jllama.server.chat_run`).

Source: OpenAI API reference, Responses: create (`input` items: messages with `input_text` /
`output_text` parts, `function_call`, `function_call_output`; flat function tools;
`text.format`).

- `instructions` becomes a first system message; `input` a string (one user message) or a list
  of items: messages (`role` user, assistant, system or developer; `content` a string or text
  parts, joined with a line break as chat's parts are), `function_call` items (an assistant
  message with that call) and `function_call_output` items (a tool message answering
  `call_id`). Items fed back from an earlier response's `output` are such items.
- `max_output_tokens` is chat's `max_completion_tokens` (any positive count: OpenAI's least is
  16); `temperature`, `top_p` and jllama's sampler fields (`EXTRA_FIELDS`) go on as they are.
- `tools` (`{"type": "function", "name", "description", "parameters", "strict"}`, strict
  true where absent, as in the Responses API) and `tool_choice` ("none", "auto", "required",
  `{"type": "function", "name"}`) become chat's; one call per reply, as on chat completions.
- `text.format` (`text`, `json_object`, `json_schema` with name, schema, strict) is chat's
  `response_format`.

Stateless: nothing is stored. `store` is accepted and ignored (the reply says `"store":
false`); what would need a stored response or conversation is refused with a 400
(`previous_response_id`, `conversation`, `background`, `prompt`), and so are what this server
cannot do (`truncation: "auto"`, log-probs through `top_logprobs` or `include`). Other fields
(`reasoning`, `user`, `include` of other data, `service_tier`, ...) are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from jllama.server.chat_run import extra_fields
from jllama.server.errors import bad_field, nonempty_string, text_parts

RENAMES = (
    (r"\bmessages(\[\d+\])?", "input"),
    (r"\bmax_completion_tokens\b", "max_output_tokens"),
    (r"\bresponse_format\.json_schema\b", "text.format"),
    (r"\bresponse_format\b", "text.format"),
    (r"\b(tools\[\d+\])\.function\b", r"\1"),
)
"""Chat's field names in an error, as the Responses API names them (`chat_run.renamed`)."""

STATELESS = "this server is stateless (it stores no responses): send the whole conversation " \
             "as input"


def _refused(message: str, allowed=lambda value: value is None) -> AfterValidator:
    def check(value: Any) -> Any:
        if not allowed(value):
            raise ValueError(message)
        return value

    return AfterValidator(check)


class ResponsesRequest(BaseModel):
    """POST /v1/responses, the fields read here (others: `chat_fields` passes jllama's
    sampler fields on; the rest are ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    input: Any
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Any = None
    top_p: Any = None
    text: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: Annotated[Any, _refused(
        f"not supported: {STATELESS}")] = None
    conversation: Annotated[Any, _refused(f"not supported: {STATELESS}")] = None
    background: Annotated[Any, _refused(
        "true is not supported: this server is stateless (a response cannot be "
        "fetched later)", lambda value: not value)] = None
    prompt: Annotated[Any, _refused("not supported (stored prompt templates): give the text "
                                    "as instructions and input")] = None
    truncation: Annotated[Literal["auto", "disabled"] | None, _refused(
        '"auto" is not supported (no input is dropped): give "disabled" or leave it out',
        lambda value: value != "auto")] = None
    top_logprobs: Annotated[Any, _refused("not supported on /v1/responses (log-probs: use "
                                          "/v1/chat/completions)")] = None
    include: Annotated[list[str] | None, _refused(
        '"message.output_text.logprobs" is not supported on /v1/responses (log-probs: use '
        "/v1/chat/completions)",
        lambda value: "message.output_text.logprobs" not in (value or []))] = None


def _text(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """A message item's content as chat's text parts (a string: one part)."""
    return text_parts(content, where, kinds, "input_text parts")


def _item_message(item: Any, where: str) -> dict:
    """One input item as a chat message."""
    if not isinstance(item, dict):
        raise bad_field(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_field(f"{where}.role", "must be 'user', 'assistant', 'system' or "
                       f"'developer', got {role!r}")
        kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
        return {"role": role, "content": _text(item.get("content"), f"{where}.content", kinds)}
    if kind == "function_call":
        arguments = nonempty_string(item, "arguments", where)
        try:
            json.loads(arguments)
        except ValueError:
            raise bad_field(f"{where}.arguments", "must be a JSON text") from None
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": nonempty_string(item, "call_id", where), "type": "function",
            "function": {"name": nonempty_string(item, "name", where), "arguments": arguments}}]}
    if kind == "function_call_output":
        call_id = nonempty_string(item, "call_id", where)
        output = item.get("output")
        content = output if isinstance(output, str) else _text(
            output, f"{where}.output", ("input_text",))
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    raise bad_field(f"{where}.type", "an input item must be a message, function_call or "
               f"function_call_output (the kinds this server supports), got {kind!r}")


def input_messages(body: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages.

    Raises:
      APIError (400): a bad item (`param` e.g. "input[2].content[0].type").
    """
    messages = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    if not isinstance(body.input, list) or not body.input:
        raise bad_field("input", "must be a string or a non-empty list of input items")
    return messages + [_item_message(item, f"input[{i}]") for i, item in enumerate(body.input)]


def _tools(tools: Any) -> Any:
    """Flat function tools as chat's (not a list: passed on for chat's 400)."""
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_field(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
               '"name": ...}')


def _format(text: dict[str, Any] | None) -> Any:
    """`text.format` as chat's `response_format`."""
    spec = (text or {}).get("format")
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        return spec
    return {"type": "json_schema", "json_schema": {
        k: v for k, v in spec.items() if k != "type"}}


def chat_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request (its JSON fields) a Responses request runs as.

    Raises:
      APIError (400): a bad input item or tool_choice (the rest is checked as chat's fields).
    """
    fields: dict[str, Any] = {"model": body.model, "messages": input_messages(body),
                              **extra_fields(body.model_extra)}
    for name, value in [("max_completion_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p),
                        ("tools", _tools(body.tools)),
                        ("tool_choice", _tool_choice(body.tool_choice)),
                        ("parallel_tool_calls", body.parallel_tool_calls),
                        ("response_format", _format(body.text))]:
        if value is not None:
            fields[name] = value
    return fields
