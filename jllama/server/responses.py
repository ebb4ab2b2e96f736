"""`POST /v1/responses` (and `/responses`): OpenAI's Responses API, stateless, run on the chat
path (`jllama.server.chat_run`: the request becomes a chat completions request,
`jllama.server.responses_request`).

Source: OpenAI API reference, Responses: the response object (`id` "resp_...", `object`
"response", `status`, `output` items, `usage` with input_tokens / output_tokens /
total_tokens) and its streaming events.

The reply is one output item: a `message` with one `output_text` part, or (tools offered) a
`function_call` with its `call_id`, `name` and `arguments` (a JSON text); a thinking model's
think block (`jllama.server.reasoning`) is a `reasoning` item before it, its text one
`reasoning_text` content part (streamed as response.reasoning_text.delta... and
response.reasoning_text.done inside its own output_item.added / output_item.done). `status` is
"completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" where the
tokens ran out (max_output_tokens, or the context). Streamed (`stream: true`), the events are
`event:` / `data:` pairs numbered by `sequence_number`: response.created, response.in_progress,
then for a message response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, or for a call response.output_item.added,
response.function_call_arguments.delta..., response.function_call_arguments.done,
response.output_item.done; last response.completed (or response.incomplete). A failure after
the first event is a last response.failed whose `error` says why.

Nothing is stored: `GET` and `DELETE /v1/responses/{id}` answer 404.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from jllama.server.chat_run import (ChatRun, ChatService, Events, chat_request, collected,
                                    renamed, replay)
from jllama.server.engine import Done
from jllama.server.errors import APIError
from jllama.server.responses_request import (
    RENAMES,
    STATELESS,
    ResponsesRequest,
    chat_fields,
)
from jllama.server.schema import parse_body
from jllama.server.sse import named_stream

Event = tuple[str, dict]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """A response's output items, built from the chat reply's stream deltas (`content`
    pieces, a call's head, pieces of its arguments), with the stream events that build them.
    Whole replies are built the same way, their events dropped.

    Args:
      head: the response object's fields that do not change (id, model, the request's
        settings echoed).
    """

    def __init__(self, head: dict):
        self.head = head
        self.output: list[dict] = []
        self._open: dict | None = None
        self._sequence = 0
        self.usage: dict | None = None
        self.status = "in_progress"

    def event(self, name: str, **data) -> Event:
        """An event named `name`, numbered."""
        self._sequence += 1
        return name, {"type": name, "sequence_number": self._sequence - 1, **data}

    def response(self, **more) -> dict:
        """The response object as it stands."""
        done = self.status in ("completed", "incomplete")
        return {
            **self.head, "status": self.status, "completed_at": int(time.time()) if done
            else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete" else None,
            "output": list(self.output), "usage": self.usage, **more,
        }

    def start(self) -> list[Event]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _open_item(self, item: dict) -> list[Event]:
        events = self._close("completed")
        self.output.append(item)
        self._open = item
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item={**item, "content": []} if item["type"] != "function_call"
                                 else dict(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self._where(),
                                     content_index=0, part=_part("")))
        return events

    def add(self, delta: dict) -> list[Event]:
        """The events of a chat stream delta ({"reasoning_content"}, {"content"} or
        {"tool_calls"})."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                events += self._open_item({
                    "id": _id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": [{"type": "reasoning_text", "text": ""}]})
            self._open["content"][0]["text"] += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", **self._where(),
                                     content_index=0, delta=delta["reasoning_content"]))
        if "content" in delta:
            if self._open is None or self._open["type"] != "message":
                events += self._open_item({
                    "id": _id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": [_part("")]})
            self._open["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", **self._where(),
                                     content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            function = call["function"]
            if "id" in call:  # a call's head: its name
                events += self._open_item({
                    "id": _id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": function["name"], "arguments": ""})
            if function.get("arguments"):
                self._open["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta",
                                         **self._where(), delta=function["arguments"]))
        return events

    def _close(self, status: str) -> list[Event]:
        item, events = self._open, []
        if item is None:
            return events
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                self.event("response.output_text.done", **self._where(), content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **self._where(), content_index=0,
                           part=dict(part)),
            ]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **self._where(),
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", **self._where(),
                                     arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=len(self.output) - 1,
                                 item=item))
        self._open = None
        return events

    def finish(self, done: Done, reasoning_tokens: int = 0) -> list[Event]:
        """The last events: the open item closed (an empty message where the reply had no
        text; a reply cut short in its think block is that reasoning item alone, as OpenAI's
        incomplete reasoning responses), then response.completed or response.incomplete;
        `reasoning_tokens`: the output tokens of the think block, for `usage`."""
        events = [] if self.output else self.add({"content": ""})
        self.status = "incomplete" if done.finish_reason == "length" else "completed"
        events += self._close(self.status)
        self.usage = {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens or 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }
        return events + [self.event(f"response.{self.status}", response=self.response())]

    def failed(self, error: APIError) -> Event:
        """The event that ends a stream the worker failed: response.failed with the error."""
        self.status = "failed"
        code = error.code or ("server_error" if error.status >= 500 else "invalid_prompt")
        return self.event("response.failed", response=self.response(
            error={"code": code, "message": error.message}))


def _head(body: ResponsesRequest, model_id: str) -> dict:
    """The response's fields that echo the request."""
    extra = body.model_extra or {}
    text = body.text or {}
    return {
        "id": _id("resp"), "object": "response", "created_at": int(time.time()),
        "model": model_id, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": True if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None
        else "auto",
        "tools": [{**tool, "strict": tool.get("strict", True)} for tool in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled", "user": extra.get("user"),
    }


def _replay(run: ChatRun, builder: ResponseBuilder, events: Events) -> AsyncIterator[Event]:
    """The response's events from the chat run's (the one choice's)."""
    def finish(done: Done):
        run.finish(0, done)
        return builder.finish(done, getattr(run.replies[0], "reasoning_tokens", 0))

    return replay(run, builder, events, finish)


def add_responses_routes(app: FastAPI, chat: ChatService) -> None:
    """`POST /v1/responses` and `/responses` on `app`, run through `chat`; `GET` and `DELETE`
    of a response id answer 404 (nothing is stored)."""

    async def create(request: Request):
        body = parse_body(await chat.read_body(request), ResponsesRequest)
        fields = chat_fields(body)  # its errors name the Responses API's fields already
        try:
            run = await chat.start(chat_request(fields))
        except APIError as e:
            raise renamed(e, RENAMES) from None
        builder = ResponseBuilder(_head(body, chat.model_id))
        if body.stream:
            return named_stream(_replay(run, builder, run.choices.events()), run.choices,
                                lambda e: builder.failed(renamed(e, RENAMES)))
        async for _ in _replay(run, builder, collected(run, request, RENAMES)):
            pass
        return builder.response()

    async def not_stored(response_id: str):
        raise APIError(404, f"no response {response_id!r}: {STATELESS}", param="response_id",
                       code="not_found")

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/responses", create, methods=["POST"])
        app.add_api_route(f"{prefix}/responses/{{response_id}}", not_stored,
                          methods=["GET", "DELETE"])
