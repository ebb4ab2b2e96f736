"""HTTP transport of the API: reading a request body within limits, and a job's events as a
whole response (`collect`) or as server-sent events (`stream`), cancelling the job when its
client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from jllama.server.engine import Done, Failed, Job, Text, TokenLogprob
from jllama.server.errors import APIError
from jllama.server.request_head import check_body_head, too_large

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The default limit on a request body (bytes): far more than any prompt that fits a context."""

BODY_TIMEOUT_S = 30.0
"""Seconds a client has to send a request's whole body (a slow sender gets a 408)."""


async def read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body, at most `limit` bytes, within `timeout_s` seconds (else a 408).

    Its head is checked first (`check_body_head`: 400, 413 or 415 before a byte is read), and
    a chunked body (no declared length) that passes `limit` as it arrives gets its 413 as
    soon as it does. The rest of a refused body is not awaited: uvicorn's protocol drops it
    as it comes after the answer (up to a cap, `jllama.server.protocol`), so a client still
    sending reads the 413 rather than a reset connection."""
    check_body_head(request.headers, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body_now(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None


async def _read_body_now(request: Request, limit: int) -> bytes:
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending: one access-log line, not a traceback
        raise APIError(499, "the client closed the connection while sending the body") from None
    return b"".join(chunks)


async def events_of(job: Job) -> AsyncIterator[Text | Done]:
    """The job's events up to its `Done`; a `Failed` is raised as its APIError."""
    while True:
        event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        yield event
        if isinstance(event, Done):
            return


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection. The body has been read, so the next
    ASGI message is the disconnect: waiting for it notices at once, where polling
    `is_disconnected` between events never ran while the events kept coming (a non-streamed
    request generated to its end after its client left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, job: Job) -> tuple[list[str], list[TokenLogprob], Done]:
    """Waits for a non-streaming job, cancelling it as soon as the client disconnects (the
    worker stops before its next token)."""
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                raise APIError(499, "the client closed the request")
            event = event.result()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Done):
                return texts, logprobs, event
            texts.append(event.text)
            logprobs.extend(event.logprobs)
    except BaseException:  # a vanished client, a server shutting down: free the worker
        job.cancel()
        raise
    finally:
        gone.cancel()


def stream(chunks: AsyncIterator[dict], job: Job) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per chunk, then `data: [DONE]`. A failure after
    the headers went out becomes an `{"error": ...}` event; a client that goes away cancels the
    job (Starlette cancels this generator when the connection closes). `job`: a `Job`, or
    anything else with its `cancel()` (`jllama.server.choices.Choices`: every choice's)."""

    async def sse() -> AsyncIterator[bytes]:
        try:
            async for item in chunks:
                yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n".encode()
        except APIError as e:
            yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n".encode()
        finally:
            job.cancel()  # a no-op for a finished job; frees the worker for a vanished client
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        sse(), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
