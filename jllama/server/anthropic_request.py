"""A request of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as
the chat completions request it is run as (`jllama.server.chat_run`).

Source: Anthropic API reference, Messages (create, count tokens): `system`, `messages` with
text / tool_use / tool_result blocks, `tools` (name, description, input_schema),
`tool_choice` (auto, any, tool, none), `max_tokens`, `stop_sequences`, `temperature` (0 to 1),
`top_p`, `top_k`.

- `system` (a string or text blocks) becomes a first system message.
- A user message's text blocks are its content (blocks joined with a line break, as chat's
  parts are); each `tool_result` block becomes a tool message answering its `tool_use_id`
  (its content a string or text blocks; `is_error` is not rendered). An assistant message's
  text blocks are its content, its `tool_use` blocks its calls (`input` as the arguments) and
  its `thinking` blocks its `reasoning_content` (`redacted_thinking` blocks are skipped).
- `thinking` `{"type": "enabled"}` / `{"type": "disabled"}` is the template's
  `enable_thinking` true / false (Qwen3's switch; `budget_tokens` is not enforced); the reply's
  think block comes back as a `thinking` block (`jllama.server.reasoning`).
- `tools` and `tool_choice` become chat's ("any" is "required", `{"type": "tool", "name"}` a
  named function); `disable_parallel_tool_use` changes nothing (one call per reply).
- `max_tokens` (required) is chat's `max_completion_tokens`; `stop_sequences` are stop strings
  (any number); `temperature`, `top_p`, `top_k` and jllama's sampler fields (`EXTRA_FIELDS`)
  go on as they are (the newest SDKs send the sampler fields through `extra_body` only).
- `output_config.format` (`{"type": "json_schema", "schema"}`: structured outputs) is chat's
  `response_format` json_schema; `output_config.effort` changes nothing.

Refused with a 400: a last message from the assistant (prefill: the chat template ends the
prompt with a new assistant turn, so the reply could not continue it), blocks other than
text / tool_use / tool_result (images, documents; an assistant's thinking blocks are taken),
server tools (a `type` other than "custom"). `metadata`, `service_tier` and the like are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from jllama.server.chat_run import extra_fields
from jllama.server.errors import bad_field, nonempty_string, text_parts

RENAMES = (
    (r"\bmax_completion_tokens\b", "max_tokens"),
    (r"\bmessages\[\d+\]", "messages"),
    (r"\b(tools\[\d+\])\.function\.parameters\b", r"\1.input_schema"),
    (r"\b(tools\[\d+\])\.function\b", r"\1"),
    (r"\bresponse_format\.json_schema\b", "output_config.format"),
    (r"\bresponse_format\b", "output_config.format"),
)
"""Chat's field names in an error, as the Messages API names them (`chat_run.renamed`)."""


def _thinking(value: Any) -> Any:
    if value is not None and (not isinstance(value, dict)
                              or value.get("type") not in ("enabled", "disabled")):
        raise ValueError('must be {"type": "enabled", "budget_tokens": N} or {"type": '
                         '"disabled"}')
    return value


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what the prompt is rendered from."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Annotated[Any, AfterValidator(_thinking)] = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: Any = None
    top_k: Any = None
    stream: bool = False
    output_config: dict[str, Any] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"must be in [0, 1] (Anthropic's range), got {value!r}")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "" in value:
            raise ValueError("a stop sequence must not be empty")
        return value


def _texts(content: Any, where: str) -> list[dict]:
    """A string, or text blocks, as chat's text parts."""
    return text_parts(content, where, ("text",), "text blocks")


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise bad_field(where, "must be a string or a non-empty list of content blocks")
    if not all(isinstance(block, dict) for block in content):
        raise bad_field(where, "a content block must be an object")
    return content


def _user(content: Any, where: str) -> list[dict]:
    """A user message as chat messages: its tool results (tool messages) and text."""
    out, texts = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}[{j}]"
        if kind == "text":
            texts += _texts([block], where)
        elif kind == "tool_result":
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": nonempty_string(block, "tool_use_id", at),
                        "content": _texts(result, f"{at}.content")})
        else:
            raise bad_field(f"{at}.type", 'a user block must be "text" or "tool_result" (the kinds '
                       f"this server supports), got {kind!r}")
    return out + ([{"role": "user", "content": texts}] if texts else [])


def _assistant(content: Any, where: str) -> dict:
    """An assistant message as a chat message: its text and its calls."""
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}[{j}]"
        if kind == "text":
            texts += _texts([block], where)
        elif kind == "thinking":  # an earlier reply's thinking, given back to the template
            reasoning.append(nonempty_string(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic's own models: nothing this server can read
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad_field(f"{at}.input", "must be an object")
            calls.append({"id": nonempty_string(block, "id", at), "type": "function", "function": {
                "name": nonempty_string(block, "name", at), "arguments": json.dumps(arguments)}})
        else:
            raise bad_field(f"{at}.type", 'an assistant block must be "text", "thinking" or '
                       f'"tool_use" (the kinds this server supports), got {kind!r}')
    message = {"role": "assistant", "content": texts or None}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return {**message, "tool_calls": calls} if calls else {**message, "content": texts}


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """`system` and `messages` as chat messages.

    Raises:
      APIError (400): a bad message or block (`param` e.g. "messages[1].content[0].type"), a
        last message from the assistant.
    """
    out = []
    if body.system is not None:
        out.append({"role": "system", "content": _texts(body.system, "system")})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            out += _user(message.get("content"), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(message.get("content"), f"{where}.content"))
        else:
            raise bad_field(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
    if body.messages[-1].get("role") == "assistant":
        raise bad_field(f"messages[{len(body.messages) - 1}]", "a last assistant message (prefill) "
                   "is not supported: the reply is a new assistant turn; end with a user message")
    return out


def _tools(tools: list[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom":
            raise bad_field(f"tools[{i}].type", "only custom (client) tools are supported, got "
                       f"{kind!r}")
        if "input_schema" not in tool:
            raise bad_field(f"tools[{i}].input_schema", "this field is required")
        # In the order OpenAI's function tools give them: templates write the tool's JSON.
        function = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _output_format(config: dict[str, Any] | None) -> dict | None:
    """`output_config.format` as chat's `response_format`."""
    spec = (config or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise bad_field("output_config.format.type", 'must be "json_schema"')
    if "schema" not in spec:
        raise bad_field("output_config.format.schema", "this field is required")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", 'must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
               '{"type": "tool", "name": ...}')


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat completions request (its JSON fields) a Messages request runs as; its
    stop_sequences are set on the parsed request (`stop_strings`), not here, as chat allows 4.

    Raises:
      APIError (400): a bad message, block, tool or tool_choice (the rest is checked as chat's
        fields).
    """
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body),
                              **extra_fields(body.model_extra)}
    tools = _tools(body.tools)
    if tools:  # Anthropic's tools: [] is no tools (chat refuses an empty list)
        fields["tools"] = tools
        if body.tool_choice is not None:
            fields["tool_choice"] = _tool_choice(body.tool_choice)
            if body.tool_choice.get("disable_parallel_tool_use"):  # one call at most
                fields["parallel_tool_calls"] = False
    elif _tool_choice(body.tool_choice) not in (None, "auto", "none"):
        raise bad_field("tool_choice", "needs tools")
    if body.thinking is not None:
        # Extended thinking on or off is the template's switch (Qwen3's enable_thinking);
        # budget_tokens is not enforced: max_tokens bounds thinking and answer together.
        given = fields.get("chat_template_kwargs")
        fields["chat_template_kwargs"] = {**(given if isinstance(given, dict) else {}),
                                          "enable_thinking": body.thinking["type"] == "enabled"}
    if isinstance(body, MessagesRequest):
        fields["max_completion_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        response_format = _output_format(body.output_config)
        if response_format is not None:
            fields["response_format"] = response_format
    return fields
