"""Server-sent events with an `event:` line each, as OpenAI's Responses API and Anthropic's
Messages API stream them (chat completions' streams are `data:` lines ending with
`data: [DONE]`: `jllama.server.transport.stream`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from jllama.server.errors import APIError


def event_bytes(name: str, data: dict) -> bytes:
    """One event: `event: NAME`, `data: JSON` and a blank line."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def named_stream(events: AsyncIterator[tuple[str, dict]], job,
                 failure: Callable[[APIError], tuple[str, dict]]) -> StreamingResponse:
    """The (name, data) events as a text/event-stream response.

    A failure after the headers went out (the worker's error, a shutdown) becomes the event
    `failure(error)` gives, and the stream ends there; whatever ends the stream (its last
    event, a failure, a client gone) cancels `job` (anything with `cancel()`: a no-op for a
    finished job, else the worker stops at the next token)."""

    async def sse() -> AsyncIterator[bytes]:
        try:
            async for name, data in events:
                yield event_bytes(name, data)
        except APIError as e:
            yield event_bytes(*failure(e))
        finally:
            job.cancel()

    return StreamingResponse(
        sse(), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
