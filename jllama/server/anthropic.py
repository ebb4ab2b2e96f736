"""`POST /v1/messages` and `/v1/messages/count_tokens` (and both without `/v1`): Anthropic's
Messages API, run on the chat path (`jllama.server.chat_run`: the request becomes a chat
completions request, `jllama.server.anthropic_request`).

Source: Anthropic API reference, Messages: the message object (`id` "msg_...", `type`
"message", `role` "assistant", `content` blocks, `stop_reason`, `stop_sequence`, `usage`),
streaming (message_start, content_block_start, ping, content_block_delta with text_delta /
input_json_delta, content_block_stop, message_delta, message_stop; `error`), errors
(`{"type": "error", "error": {"type", "message"}}`).

The reply's content is one text block, or (tools offered) one `tool_use` block (`id`
"toolu_...", `name`, `input`: the arguments as an object; {} where max_tokens cut them short),
or none for an empty reply; a thinking model's think block (`jllama.server.reasoning`) is a
`thinking` block before it (streamed as thinking_delta events, then a signature_delta whose
`signature` is "": this server signs nothing). stop_reason: "end_turn" (the end-of-turn token), "stop_sequence"
(`stop_sequence` says which), "max_tokens", "tool_use". usage.input_tokens counts the whole
rendered prompt (what count_tokens gives), cached prefix or not.

Errors are Anthropic's shape with the status the rest of the server gives (400
invalid_request_error, 404 not_found_error for an unknown model or path, 405, 413
request_too_large, 503 overloaded_error, 500 api_error). The headers `x-api-key` and
`anthropic-version` are accepted; the version is not read.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jllama.server.anthropic_request import (
    RENAMES,
    CountTokensRequest,
    MessagesRequest,
    chat_fields,
)
from jllama.server.chat_run import (ChatRun, ChatService, Events, chat_request, collected,
                                    renamed, replay)
from jllama.server.engine import Done
from jllama.server.errors import APIError
from jllama.server.schema import parse_body
from jllama.server.sse import named_stream

Event = tuple[str, dict]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: APIError) -> dict:
    """Anthropic's error JSON for `error` (its type from the status; other 4xx:
    invalid_request_error, other 5xx: api_error)."""
    kind = _ERROR_TYPES.get(error.status) or (
        "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def stop_reason(reason: str, done: Done) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat finish_reason and the worker's `Done`."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    return "end_turn", None


class MessageBuilder:
    """A message's content blocks, built from the chat reply's stream deltas, with the stream
    events that build them (whole replies are built the same way, their events dropped).

    Args:
      head: the message's fixed fields (id, type, role, model).
      input_tokens: the prompt's length.
    """

    def __init__(self, head: dict, input_tokens: int):
        self.head = head
        self.input_tokens = input_tokens
        self.content: list[dict] = []
        self._open: dict | None = None
        self._json = ""  # the open tool_use block's arguments so far
        self._pinged = False
        self.stop: tuple[str | None, str | None] = (None, None)  # stop_reason, stop_sequence
        self.output_tokens = 0

    def message(self) -> dict:
        """The message object as it stands."""
        return {**self.head, "content": list(self.content), "stop_reason": self.stop[0],
                "stop_sequence": self.stop[1], "usage": {
                    "input_tokens": self.input_tokens, "output_tokens": self.output_tokens}}

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": self.message()})]

    def _open_block(self, block: dict) -> list[Event]:
        events = self._close()
        self.content.append(block)
        self._open = block
        events.append(("content_block_start", {
            "type": "content_block_start", "index": len(self.content) - 1,
            "content_block": dict(block)}))
        if not self._pinged:
            self._pinged = True
            events.append(("ping", {"type": "ping"}))
        return events

    def _delta(self, delta: dict) -> Event:
        return "content_block_delta", {"type": "content_block_delta",
                                       "index": len(self.content) - 1, "delta": delta}

    def add(self, delta: dict) -> list[Event]:
        """The events of a chat stream delta ({"reasoning_content"}, {"content"} or
        {"tool_calls"})."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "thinking":
                events += self._open_block({"type": "thinking", "thinking": "",
                                            "signature": ""})
            self._open["thinking"] += delta["reasoning_content"]
            events.append(self._delta({"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self._open is None or self._open["type"] != "text":
                events += self._open_block({"type": "text", "text": ""})
            self._open["text"] += delta["content"]
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            function = call["function"]
            if "id" in call:
                events += self._open_block({"type": "tool_use", "id": call["id"],
                                            "name": function["name"], "input": {}})
            if function.get("arguments"):
                self._json += function["arguments"]
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": function["arguments"]}))
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        events = []
        if self._open["type"] == "thinking":  # Anthropic's streams sign a block as it ends
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        if self._open["type"] == "tool_use":
            try:
                arguments = json.loads(self._json)
            except ValueError:  # cut short by max_tokens
                arguments = None
            self._open["input"] = arguments if isinstance(arguments, dict) else {}
            self._json = ""
        self._open = None
        return events + [("content_block_stop", {"type": "content_block_stop",
                                                 "index": len(self.content) - 1})]

    def finish(self, stop: tuple[str, str | None], output_tokens: int) -> list[Event]:
        """The last events: the open block closed, message_delta, message_stop."""
        self.stop, self.output_tokens = stop, output_tokens
        return self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                               "usage": {"output_tokens": output_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ]


def _replay(run: ChatRun, builder: MessageBuilder, events: Events) -> AsyncIterator[Event]:
    """The message's events from the chat run's (the one choice's)."""
    return replay(run, builder, events, lambda done: builder.finish(
        stop_reason(run.finish(0, done), done), done.completion_tokens))


def add_anthropic_routes(app: FastAPI, chat: ChatService) -> None:
    """The Messages API's routes on `app`, run through `chat`; every answer of theirs, and of
    any other path under /v1/messages, is in Anthropic's shape."""

    async def start(body: MessagesRequest) -> ChatRun:
        fields = chat_fields(body)  # its errors name the Messages API's fields already
        try:
            request = chat_request(fields)
            if body.stop_sequences:  # not through chat's check: it allows at most 4
                request = request.model_copy(update={"stop": tuple(body.stop_sequences)})
            run = await chat.start(request)
        except APIError as e:
            raise renamed(e, RENAMES) from None
        reply = getattr(run.replies[0], "inner", run.replies[0])  # under a ReasoningReply
        if hasattr(reply, "call_id"):
            reply.call_id = f"toolu_{secrets.token_hex(12)}"
        return run

    async def create(request: Request):
        try:
            body = parse_body(await chat.read_body(request), MessagesRequest)
            run = await start(body)
            head = {"id": f"msg_{secrets.token_hex(12)}", "type": "message",
                    "role": "assistant", "model": chat.model_id}
            builder = MessageBuilder(head, run.prompt_tokens)
            if body.stream:
                def failure(error: APIError) -> Event:
                    return "error", error_body(renamed(error, RENAMES))

                return named_stream(_replay(run, builder, run.choices.events()), run.choices,
                                    failure)
            async for _ in _replay(run, builder, collected(run, request, RENAMES)):
                pass
            return builder.message()
        except APIError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 (the server's own failure, in Anthropic's shape)
            return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                           type="server_error"))

    async def count_tokens(request: Request):
        try:
            body = parse_body(await chat.read_body(request), CountTokensRequest)
            fields = chat_fields(body)
            try:
                return {"input_tokens": await chat.count(chat_request(fields))}
            except APIError as e:
                raise renamed(e, RENAMES) from None
        except APIError as e:
            return error_response(e)

    async def elsewhere(request: Request):
        """Any other method or path under /v1/messages: 405 or 404, in Anthropic's shape."""
        path = request.url.path.rstrip("/")
        if path.endswith(("/messages", "/messages/count_tokens")):
            message = f"method {request.method} is not allowed on {request.url.path}"
            return error_response(APIError(405, message))
        return error_response(APIError(404, f"no route {request.method} {request.url.path}"))

    methods = ["GET", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS", "POST"]
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/messages", create, methods=["POST"])
        app.add_api_route(f"{prefix}/messages/count_tokens", count_tokens, methods=["POST"])
        for path in (f"{prefix}/messages", f"{prefix}/messages/{{rest:path}}"):
            app.add_api_route(path, elsewhere, methods=methods)
