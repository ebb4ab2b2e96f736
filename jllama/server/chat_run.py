"""The chat path of the server, as the other APIs it serves use it: OpenAI's Responses API
(`jllama.server.responses`) and Anthropic's Messages API (`jllama.server.anthropic`) turn
their requests into a chat completions request (`ChatCompletionRequest`) and run it as
/v1/chat/completions does (`ChatService.start`: the template, the sampler, tools and structured
output, the same worker queue); only the shapes of the request and the reply differ.

Errors from the chat path name chat's fields (`messages`, `max_completion_tokens`,
`response_format`...); `renamed` rewrites them into the calling API's names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import Request

from jllama.server.engine import Done, Text
from jllama.server.errors import APIError
from jllama.server.schema import ChatCompletionRequest, parse_body
from jllama.server.tool_reply import TextReply

if TYPE_CHECKING:
    from jllama.server.choices import Choices

EXTRA_FIELDS = ("seed", "top_k", "min_p", "repeat_penalty", "presence_penalty",
                "frequency_penalty", "penalty_last_n", "logit_bias", "samplers", "cache_prompt",
                "ignore_eos", "chat_template_kwargs", "reasoning_format", "grammar",
                "structured_outputs")
"""jllama's sampler fields (chat completions' own, llama.cpp server's names), the template and
reasoning fields and the grammars (vLLM's, llama.cpp's) that the Responses and Messages endpoints pass on to
the chat request where a body gives them (with the SDKs: `extra_body`); checked there, as on
/v1/chat/completions."""


@dataclasses.dataclass
class ChatRun:
    """A chat request submitted to the worker.

    Attributes:
      choices: its jobs (`jllama.server.choices.Choices`; these APIs ask for one choice).
      replies: each choice's reader of the generated text (`TextReply`, or `ToolReply` where
        tools are offered: text or one call, `HermesToolReply` for Qwen's format: text or
        calls; wrapped in a `ReasoningReply` where the think block is read apart, whose deltas
        then hold `reasoning_content` too).
      prompt_tokens: the rendered prompt's length, tokens.
    """

    choices: Choices
    replies: list[TextReply]
    prompt_tokens: int

    def finish(self, index: int, done: Done) -> str:
        """Choice `index`'s chat finish_reason ("stop", "length" or "tool_calls"), counted in
        /metrics as chat completions count it."""
        reason = self.replies[index].finish_reason(done.finish_reason)
        self.choices.job_of(index).count(reason)
        return reason


@dataclasses.dataclass(frozen=True)
class ChatService:
    """What an app's chat completions route offers the other APIs' routes.

    Attributes:
      model_id: the served model's name (others get 404).
      read_body: a request's body, within the server's size and time limits.
      count: the prompt tokens a chat request renders to (nothing is generated).
      start: the chat request checked, rendered and submitted (`ChatRun`); raises `APIError`
        as /v1/chat/completions refuses it (404 unknown model, 400 bad field, 503 queue full).
    """

    model_id: str
    read_body: Callable[[Request], Awaitable[bytes]]
    count: Callable[[ChatCompletionRequest], Awaitable[int]]
    start: Callable[[ChatCompletionRequest], Awaitable[ChatRun]]


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completions request from its JSON fields, validated as /v1/chat/completions
    validates a body (the same 400s, naming chat's fields)."""
    return parse_body(json.dumps(fields).encode(), ChatCompletionRequest)


def extra_fields(given: dict[str, Any] | None) -> dict[str, Any]:
    """The `EXTRA_FIELDS` among a body's other fields."""
    return {k: v for k, v in (given or {}).items() if k in EXTRA_FIELDS}


Renames = Iterable[tuple[str, str]]
"""(regular expression, replacement) pairs applied in order to an error's param and message."""


def renamed(error: APIError, renames: Renames) -> APIError:
    """`error` with chat's field names rewritten by `renames` in its param and message (a
    400 from the chat path reads as the calling API's)."""
    param, message = error.param, error.message
    for pattern, replacement in renames:
        if param is not None:
            param = re.sub(pattern, replacement, param)
        message = re.sub(pattern, replacement, message)
    if (param, message) == (error.param, error.message):
        return error
    return APIError(error.status, message, param=param, code=error.code, type=error.type)


Events = AsyncIterator[tuple[int, "Text | Done"]]
"""A run's choice events as `Choices.events` gives them: (choice index, its text or its end)."""


async def replay(run: ChatRun, builder: Any, events: Events,
                 finish: Callable[[Done], Iterable[Any]]) -> AsyncIterator[Any]:
    """The calling API's events from the chat run's one choice: `builder.start()`'s, then
    `builder.add(delta)`'s for each delta the choice's reply reader makes of each text (its
    final deltas at the end), then `finish(done)`'s."""
    reply = run.replies[0]
    for out in builder.start():
        yield out
    async for _, event in events:
        deltas = (reply.deltas(event.text, event.tokens) if isinstance(event, Text)
                  else reply.final_deltas())
        for delta in deltas:
            for out in builder.add(delta):
                yield out
        if isinstance(event, Done):
            for out in finish(event):
                yield out


async def collected(run: ChatRun, request: Request, renames: Renames) -> Events:
    """A run that is not streamed, as the events of a stream: its one choice collected, then
    given as its text pieces and its end (the builders make a whole reply from the events they would
    have streamed).

    Raises:
      APIError: the worker's, with `renames` applied (a grammar's 400 names chat's field).
    """
    try:
        ((texts, _, done, tokens),) = await run.choices.collect(request)
    except APIError as e:
        raise renamed(e, renames) from None
    for text, n in zip(texts, tokens, strict=True):  # piece by piece: their tokens counted
        yield 0, Text(text, [], n)
    yield 0, done
