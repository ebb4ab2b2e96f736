"""The HTTP API (FastAPI): OpenAI's completions and chat completions over one model.

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions`. Responses and stream chunks follow OpenAI's API reference
(`text_completion`, `chat.completion`, `chat.completion.chunk` objects; server-sent events ending
with `data: [DONE]`; with `stream_options.include_usage`, a last chunk with `usage` and no
choices). Every refusal is OpenAI's error JSON (`jllama.server.errors.APIError`) with its
status: 400 for a bad field (named in `param`), 404 for an unknown model or path, 405 for a
wrong method, 413 for a body over the limit, 503 when the queue is full.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import time
import weakref
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jllama.chat import ChatTemplate
from jllama.errors import JllamaError
from jllama.server.engine import Done, Engine, Failed, Job, Text, TokenLogprob
from jllama.server.errors import APIError
from jllama.server.schema import ChatCompletionRequest, CompletionRequest, parse_body

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The default limit on a request body (bytes): far more than any prompt that fits a context."""

_DRAIN_LIMIT = 256 * 1024 * 1024  # read (and drop) at most this much of an oversized body


RETRY_AFTER_S = 1
"""The Retry-After a 503 (queue full) carries, seconds."""


def _error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


BODY_TIMEOUT_S = 30.0
"""Seconds a client has to send a request's whole body (a slow sender gets a 408)."""


async def _read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body, at most `limit` bytes, within `timeout_s` seconds (else a 408). An oversized
    body is still read (up to a hard cap) and dropped before the 413 goes out, so the client,
    still sending, sees the answer rather than a reset connection."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body_now(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None


async def _read_body_now(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > limit
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                too_big = True
            if too_big:
                if total > _DRAIN_LIMIT:
                    break
                continue
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending: one access-log line, not a traceback
        raise APIError(499, "the client closed the connection while sending the body") from None
    if too_big:
        raise APIError(
            413, f"the request body is larger than the limit of {limit} bytes",
            code="request_too_large",
        )
    return b"".join(chunks)


def create_app(engine: Engine, model_id: str, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The FastAPI application serving `engine`'s model under the name `model_id`.

    Args:
      engine: the model worker (`jllama.server.engine.Engine`).
      model_id: the name clients give as `model` (others get 404).
      max_body_bytes: the largest request body accepted, bytes (larger: 413).
      body_timeout_s: seconds a request's body may take to arrive (slower: 408).
    """
    model = engine.model
    tokenizer = model.tokenizer
    seq_len = model.config.seq_len
    created = int(time.time())
    template = None
    if model.chat_template:
        template = ChatTemplate.for_tokenizer(model.chat_template, tokenizer, source=model.source)

    app = FastAPI(title="jllama", docs_url=None, redoc_url=None, openapi_url=None)
    # Submitted jobs, until their requests end (keyed by id: a Job compares by value).
    live: weakref.WeakValueDictionary[int, Job] = weakref.WeakValueDictionary()

    def submit(job: Job) -> None:
        engine.submit(job)
        live[id(job)] = job

    def end_streams(why: str) -> None:
        """Every unfinished job's request ends now with an error (a stream's last event, then
        [DONE]; a waiting request's 503), and its generation is cancelled: a server shutting
        down must not cut streams mid-way nor wait for them to finish."""
        error = APIError(503, why, type="server_error", code="shutting_down")
        for job in list(live.values()):
            if job.loop is not None and not job.finished.is_set():
                job._emit(Failed(error))
                job.cancel()

    app.state.end_streams = end_streams

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return _error_response(APIError(404, message, code="not_found"))
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            return _error_response(APIError(405, message, code="method_not_allowed"))
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {exc.errors()[0]['msg']}"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return _error_response(APIError(
            500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"
        ))

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "jllama"}

    @app.get("/health")
    async def health():
        return {
            "status": "ok", "model": model_id, "requests_running": engine.running,
            "requests_waiting": engine.waiting, "requests_completed": engine.completed,
            "requests_cancelled": engine.cancelled,
        }

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=engine.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != model_id:
            raise _unknown_model(name)
        return model_card()

    def _unknown_model(name: str) -> APIError:
        return APIError(
            404, f"the model {name!r} does not exist; this server serves {model_id!r}",
            param="model", code="model_not_found",
        )

    def check_model(name: str) -> None:
        if name != model_id:
            raise _unknown_model(name)

    def check_length(ids: list[int], param: str, max_tokens: int | None,
                     max_param: str = "max_tokens") -> None:
        if len(ids) > seq_len:
            raise APIError(
                400, f"{param} is {len(ids)} tokens, longer than the context of {seq_len} "
                "tokens", param=param, code="context_length_exceeded",
            )
        # As OpenAI's API: the prompt and max_tokens together must fit (not clamped).
        if max_tokens is not None and len(ids) + max_tokens > seq_len:
            raise APIError(
                400, f"{param} ({len(ids)} tokens) and {max_param}={max_tokens} together are "
                f"more than the context of {seq_len} tokens", param=max_param,
                code="context_length_exceeded",
            )

    def encode_prompt(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
            if bad is not None:
                raise APIError(
                    400, f"prompt: token id {bad} is outside the vocabulary "
                    f"[0, {tokenizer.vocab_size})", param="prompt",
                )
            return list(prompt)
        ids = tokenizer.encode(prompt)
        if not ids:
            raise APIError(
                400, "prompt is empty and this model adds no BOS token: give some text",
                param="prompt",
            )
        return ids

    def encode_chat(messages: list[dict[str, str]]) -> list[int]:
        try:
            segments = template.render_segments(messages, add_generation_prompt=True)
        except JllamaError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return tokenizer.encode_segments(segments, bos=False)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await _read_body(request, max_body_bytes, body_timeout_s), CompletionRequest)
        check_model(body.model)
        sampler = body.sampler_config(tokenizer.vocab_size)
        ids = await run_in_threadpool(encode_prompt, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_length(ids, "prompt", max_tokens)
        job = Job(ids, sampler, max_tokens, stop=body.stop, logprobs=body.logprobs)
        submit(job)
        ident, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(text: str, logprobs, finish_reason) -> dict:
            return {
                "id": ident, "object": "text_completion", "created": now, "model": model_id,
                "choices": [{
                    "text": text, "index": 0, "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }],
            }

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                before = _TextOffsets()  # the completion so far, for text_offset
                async for event in _events(job):
                    if isinstance(event, Text):
                        logprobs = _completion_logprobs(event.logprobs, body, before)
                        yield chunk(event.text, logprobs, None)
                    else:
                        yield chunk("", None, event.finish_reason)
                        if body.include_usage:
                            yield {**chunk("", None, None), "choices": [], "usage": _usage(event)}

            return _stream(events(), job)
        texts, logprobs, done = await _collect(request, job)
        return {
            **chunk("".join(texts), _completion_logprobs(logprobs, body), done.finish_reason),
            "usage": _usage(done),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await _read_body(request, max_body_bytes, body_timeout_s), ChatCompletionRequest)
        check_model(body.model)
        if template is None:
            raise APIError(
                400, f"the model {model_id!r} has no chat template; use /v1/completions",
                code="no_chat_template",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        sampler = body.sampler_config(tokenizer.vocab_size)
        ids = await run_in_threadpool(encode_chat, body.message_dicts())
        max_tokens = body.max_completion_tokens or body.max_tokens
        check_length(ids, "messages", max_tokens, "max_completion_tokens"
                     if body.max_completion_tokens else "max_tokens")
        job = Job(ids, sampler, max_tokens, stop=body.stop,
                  logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        submit(job)
        ident, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(delta: dict, logprobs, finish_reason) -> dict:
            return {
                "id": ident, "object": "chat.completion.chunk", "created": now,
                "model": model_id,
                "choices": [{
                    "index": 0, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }],
            }

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                yield chunk({"role": "assistant", "content": ""}, None, None)
                async for event in _events(job):
                    if isinstance(event, Text):
                        yield chunk({"content": event.text}, _chat_logprobs(event.logprobs, body),
                                    None)
                    else:
                        yield chunk({}, None, event.finish_reason)
                        if body.include_usage:
                            yield {**chunk({}, None, None), "choices": [], "usage": _usage(event)}

            return _stream(events(), job)
        texts, logprobs, done = await _collect(request, job)
        return {
            "id": ident, "object": "chat.completion", "created": now, "model": model_id,
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                "logprobs": _chat_logprobs(logprobs, body), "finish_reason": done.finish_reason,
            }],
            "usage": _usage(done),
        }

    return app


async def _events(job: Job) -> AsyncIterator[Text | Done]:
    """The job's events up to its `Done`; a `Failed` is raised as its APIError."""
    while True:
        event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        yield event
        if isinstance(event, Done):
            return


async def _disconnect(request: Request) -> None:
    """Returns when the client closes the connection. The body has been read, so the next
    ASGI message is the disconnect: waiting for it notices at once, where polling
    `is_disconnected` between events never ran while the events kept coming (a non-streamed
    request generated to its end after its client left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, job: Job) -> tuple[list[str], list[TokenLogprob], Done]:
    """Waits for a non-streaming job, cancelling it as soon as the client disconnects (the
    worker stops before its next token)."""
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    gone = asyncio.ensure_future(_disconnect(request))
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


def _stream(chunks: AsyncIterator[dict], job: Job) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per chunk, then `data: [DONE]`. A failure after
    the headers went out becomes an `{"error": ...}` event; a client that goes away cancels the
    job (Starlette cancels this generator when the connection closes)."""

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


def _usage(done: Done) -> dict:
    usage = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    if done.cached_tokens is not None:  # OpenAI's count of prompt tokens served from a cache
        usage["prompt_tokens_details"] = {"cached_tokens": done.cached_tokens}
    return usage


def _chat_logprobs(items: list[TokenLogprob], body: ChatCompletionRequest) -> dict | None:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not body.logprobs:
        return None
    return {
        "content": [
            {
                "token": item.token, "logprob": item.logprob, "bytes": item.bytes,
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": b} for t, b, lp in item.top
                ],
            }
            for item in items
        ],
        "refusal": None,
    }


class _TextOffsets:
    """Characters of a completion so far, decoding its tokens' bytes as they come (invalid
    bytes count as one U+FFFD each, as in the text; a character still missing bytes counts
    once it is whole)."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def add(self, data: list[int]) -> int:
        """The offset of a token with bytes `data` (where its first character starts)."""
        at = self.chars
        self.chars += len(self._decoder.decode(bytes(data)))
        return at


def _completion_logprobs(items: list[TokenLogprob], body: CompletionRequest,
                         before: _TextOffsets | None = None) -> dict | None:
    """OpenAI's legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (a dict per
    token), text_offset (characters from the start of the completion to the character the
    token's first byte belongs to, counted in the text as decoded, not in the U+FFFD a token
    holding part of a character shows as). `before`: the completion's bytes before `items`
    (a stream's earlier chunks), taken on here."""
    if body.logprobs is None:
        return None
    before = _TextOffsets() if before is None else before
    offsets = [before.add(item.bytes) for item in items]
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{t: lp for t, _, lp in item.top} for item in items],
        "text_offset": offsets,
    }
