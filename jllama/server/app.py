"""The HTTP API (FastAPI): OpenAI's completions and chat completions over one model.

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions`; OpenAI's Responses API (`POST /v1/responses`,
`jllama.server.responses`) and Anthropic's Messages API (`POST /v1/messages`,
`jllama.server.anthropic`) run on the chat path (`start_chat`).
Responses and stream chunks follow OpenAI's API reference
(`text_completion`, `chat.completion`, `chat.completion.chunk` objects; server-sent events ending
with `data: [DONE]`; with `stream_options.include_usage`, a last chunk with `usage` and no
choices). `n` asks for several choices (`jllama.server.choices`: choice i samples with seed + i;
a stream's chunks carry each choice's index). `response_format` and `tools` constrain the reply
(`jllama.server.structured`, `jllama.server.tools`); a call comes back as `tool_calls`
(`jllama.server.tool_reply`). A thinking model's think block comes back as `reasoning_content`
(`jllama.server.reasoning`; `reasoning_format`), and `chat_template_kwargs` reach the chat
template. Every refusal is OpenAI's error JSON
(`jllama.server.errors.APIError`) with its status: 400 for a bad field (named in `param`), 404
for an unknown model or path, 405 for a wrong method, 413 for a body over the limit (at once
when its declared length is), 415 for a body that is not JSON by its Content-Type
(`jllama.server.request_head`), 503 when the queue is full, 401 without an API key where the
server has keys (`jllama.server.access`, with CORS). A path with a trailing slash is the path
without it; the API's paths are answered without their /v1 prefix too. Completions and chat
completions carry a `system_fingerprint`.
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from jllama.chat import ChatTemplate
from jllama.chat.reasoning import parses_reasoning, prompt_thinking
from jllama.errors import JllamaError
from jllama.server.access import add_access_control
from jllama.server.anthropic import add_anthropic_routes
from jllama.server.chat_page import add_chat_page_routes
from jllama.server.chat_run import ChatRun, ChatService
from jllama.server.choices import Choices, choice_samplers, usage
from jllama.server.engine import Engine, Failed, Job, Text
from jllama.server.errors import APIError
from jllama.server.payloads import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    system_fingerprint,
)
from jllama.server.reasoning import ReasoningReply, answer_grammar, template_kwargs
from jllama.server.request_head import TrailingSlashes, VersionPrefix
from jllama.server.responses import add_responses_routes
from jllama.server.schema import ChatCompletionRequest, CompletionRequest, parse_body
from jllama.server.structured import constraint_field, request_grammar
from jllama.server.tool_reply import TextReply, tool_reply
from jllama.server.tools import ChatPlan, call_format, plan_chat, template_renders_tools
from jllama.server.transport import BODY_TIMEOUT_S, MAX_BODY_BYTES, read_body, stream

RETRY_AFTER_S = 1
"""The Retry-After a 503 (queue full) carries, seconds."""


def reasoning_tokens(replies: list[TextReply]) -> list[int | None]:
    """Each reply's think-block tokens (None where its block is not read apart)."""
    return [reply.reasoning_tokens if isinstance(reply, ReasoningReply) else None
            for reply in replies]


def _error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)



def create_app(engine: Engine, model_id: str, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, webui: bool = True,
               api_keys: Sequence[str] = (), cors_origins: Sequence[str] = (),
               catalog: Callable[[], list[dict]] | None = None,
               reasoning_format: str = "auto",
               chat_template_kwargs: Mapping[str, Any] | None = None) -> FastAPI:
    """The FastAPI application serving `engine`'s model under the name `model_id`.

    Args:
      engine: the model worker (`jllama.server.engine.Engine`).
      model_id: the name clients give as `model` (others get 404).
      max_body_bytes: the largest request body accepted, bytes (larger: 413, at once when the
        declared Content-Length is).
      body_timeout_s: seconds a request's body may take to arrive (slower: 408).
      webui: serve the chat page at `GET /` (`jllama.server.chat_page`).
      api_keys: the keys a request must bring (none: no check); cors_origins: the web
        origins whose scripts may read the answers ("*": any; none: no CORS headers)
        (`jllama.server.access`).
      catalog: every model's card where the server serves several
        (`jllama.server.models.ModelRouter.catalog`), for /v1/models; None: this one.
      reasoning_format: how chat replies' think blocks are read, where a request does not
        say (`jllama.chat.reasoning.REASONING_FORMATS`: auto, deepseek, none).
      chat_template_kwargs: template variables for every chat request (`serve
        --enable_thinking`), under a request's own `chat_template_kwargs`.
    """
    model = engine.model
    tokenizer = model.tokenizer
    seq_len = model.config.seq_len
    created = int(time.time())
    fingerprint = system_fingerprint(model, engine.session.backend)
    template = None
    if model.chat_template:
        template = ChatTemplate.for_tokenizer(model.chat_template, tokenizer, source=model.source)
    renders_tools = template is not None and template_renders_tools(template)
    # How the model writes a call (a template that does not render the tools gets Llama 3.1's
    # instructions, and so its format).
    calls_as = call_format(template) if renders_tools else "llama3"
    parses_reasoning(reasoning_format, None)  # a bad format fails here, not at a request
    server_kwargs = dict(chat_template_kwargs or {})

    # No 307 to the path without its trailing slash: the path is answered as that one.
    app = FastAPI(title="jllama", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.add_middleware(TrailingSlashes)
    app.add_middleware(VersionPrefix)  # /chat/completions is /v1/chat/completions
    add_access_control(app, api_keys, cors_origins)  # outermost: keys, then CORS
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

    def get(path: str):
        """A GET route that answers HEAD too (its headers, no body): HTTP requires both of a
        general-purpose server, and uptime checks (`curl -I`) send HEAD; FastAPI's `app.get`
        routes GET alone (HEAD was a 405)."""
        return app.api_route(path, methods=["GET", "HEAD"])

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "jllama",
                "context_length": seq_len}  # not OpenAI's: the chat page shows it

    @get("/health")
    async def health():
        return {
            "status": "ok", "model": model_id, "requests_running": engine.running,
            "requests_waiting": engine.waiting, "requests_completed": engine.completed,
            "requests_cancelled": engine.cancelled,
        }

    @get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=engine.metrics.content_type)

    def cards() -> list[dict]:
        return [card if card["id"] != model_id else model_card()
                for card in catalog()] if catalog else [model_card()]

    @get("/v1/models")
    async def models():
        return {"object": "list", "data": cards()}

    @get("/v1/models/{name:path}")
    async def one_model(name: str):
        card = next((card for card in cards() if card["id"] == name), None)
        if card is None:
            raise _unknown_model(name)
        return card

    def _unknown_model(name: str) -> APIError:
        served = ", ".join(repr(card["id"]) for card in cards())
        return APIError(
            404, f"the model {name!r} does not exist; this server serves {served}",
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

    def encode_chat(messages: list[dict], tools: list[dict] | None,
                    kwargs: dict[str, Any]) -> tuple[list[int], str]:
        """The rendered prompt's ids, and where it leaves the reply (`prompt_thinking`: "open"
        inside a think block, "closed" after one, "")."""
        try:
            segments = template.render_segments(messages, add_generation_prompt=True,
                                                **{**kwargs, "tools": tools})
        except JllamaError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        prompt = "".join(text for text, _ in segments)
        return tokenizer.encode_segments(segments, bos=False), prompt_thinking(prompt)

    def submit_all(jobs: list[Job]) -> None:
        """Submit a request's jobs; where the queue refuses one (503), those before it are
        cancelled (a request runs whole or not at all)."""
        for k, job in enumerate(jobs):
            try:
                submit(job)
            except APIError:
                for earlier in jobs[:k]:
                    earlier.cancel()
                raise

    def head(ident: str, kind: str, now: int) -> dict:
        """The fields every response object and chunk of a request starts with."""
        return {"id": ident, "object": kind, "created": now, "model": model_id,
                "system_fingerprint": fingerprint}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await read_body(request, max_body_bytes, body_timeout_s),
                          CompletionRequest)
        check_model(body.model)
        samplers = choice_samplers(body, tokenizer.vocab_size)
        grammar = request_grammar(body.response_format, body.grammar, body.structured_outputs)
        ids = await run_in_threadpool(encode_prompt, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_length(ids, "prompt", max_tokens)
        choices = Choices([
            Job(ids, sampler, max_tokens, stop=body.stop, logprobs=body.logprobs,
                ignore_eos=body.ignore_eos, grammar=grammar, grammar_param=constraint_field(body),
                cache_prompt=body.cache_prompt)
            for sampler in samplers], body.choices)
        submit_all(choices.jobs)
        top = head(f"cmpl-{secrets.token_hex(12)}", "text_completion", int(time.time()))

        def choice(index: int, text: str, logprobs, finish_reason) -> dict:
            return {"text": text, "index": index, "logprobs": logprobs,
                    "finish_reason": finish_reason}

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                # Each choice's completion so far, for text_offset.
                before = [TextOffsets() for _ in range(choices.n)]
                dones = [None] * choices.n
                async for index, event in choices.events():
                    if isinstance(event, Text):
                        logprobs = completion_logprobs(event.logprobs, body, before[index])
                        item = choice(index, event.text, logprobs, None)
                    else:
                        dones[index] = event
                        item = choice(index, "", None, event.finish_reason)
                    yield {**top, "choices": [item]}
                if body.include_usage:
                    yield {**top, "choices": [], "usage": usage(dones)}

            return stream(events(), choices)
        results = await choices.collect(request)
        return {**top, "choices": [
            choice(index, "".join(texts), completion_logprobs(logprobs, body),
                   done.finish_reason)
            for index, (texts, logprobs, done, _) in enumerate(results)
        ], "usage": usage([result[2] for result in results])}

    async def chat_prompt(body: ChatCompletionRequest
                          ) -> tuple[ChatPlan, list[int], str]:
        """A chat request's plan (tools, constraint), its rendered prompt, and where that
        leaves the reply (`encode_chat`)."""
        check_model(body.model)
        if template is None:
            raise APIError(
                400, f"the model {model_id!r} has no chat template; use /v1/completions",
                code="no_chat_template",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        plan = plan_chat(body.message_dicts(), body.tools, body.tool_choice,
                         body.response_format, renders_tools, body.grammar,
                         body.structured_outputs, calls_as, body.parallel_tool_calls)
        kwargs = template_kwargs(server_kwargs, body.chat_template_kwargs)
        ids, thinking = await run_in_threadpool(encode_chat, plan.messages,
                                                plan.template_tools, kwargs)
        return plan, ids, thinking

    async def count_chat(body: ChatCompletionRequest) -> int:
        return len((await chat_prompt(body))[1])

    async def start_chat(body: ChatCompletionRequest) -> ChatRun:
        """A chat request checked, rendered and submitted: the path from a request to its
        generation that /v1/chat/completions, /v1/responses and /v1/messages share."""
        plan, ids, thinking = await chat_prompt(body)
        reasoning = parses_reasoning(body.reasoning_format or reasoning_format, template.source)
        grammar = plan.grammar
        if reasoning and constraint_field(body) == "response_format":  # not a raw grammar
            grammar = answer_grammar(plan, thinking)
        samplers = choice_samplers(body, tokenizer.vocab_size)
        max_tokens = body.max_completion_tokens or body.max_tokens
        check_length(ids, "messages", max_tokens, "max_completion_tokens"
                     if body.max_completion_tokens else "max_tokens")
        choices = Choices([
            Job(ids, sampler, max_tokens, stop=body.stop,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                ignore_eos=body.ignore_eos, grammar=grammar,
                grammar_param="tools" if plan.offers_tools else constraint_field(body),
                finish_by_reply=plan.offers_tools, cache_prompt=body.cache_prompt)
            for sampler in samplers], body.choices)
        submit_all(choices.jobs)
        replies = [tool_reply(plan.call_format, plan.mode in ("required", "named"))
                   if plan.offers_tools else TextReply() for _ in range(choices.n)]
        if reasoning:
            replies = [ReasoningReply(reply, thinking == "open") for reply in replies]
        return ChatRun(choices, replies, len(ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await read_body(request, max_body_bytes, body_timeout_s),
                          ChatCompletionRequest)
        run = await start_chat(body)
        choices, replies, finish = run.choices, run.replies, run.finish
        ident, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(index: int, delta: dict, logprobs, finish_reason) -> dict:
            return {**head(ident, "chat.completion.chunk", now), "choices": [{
                "index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason,
            }]}

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                for index in range(choices.n):
                    yield chunk(index, {"role": "assistant", "content": ""}, None, None)
                dones = [None] * choices.n
                async for index, event in choices.events():
                    reply = replies[index]
                    if isinstance(event, Text):
                        logprobs = chat_logprobs(event.logprobs, body)
                        # A piece of a call's head is held back until the name is whole; its
                        # logprobs still go out, in a chunk with an empty delta.
                        deltas = reply.deltas(event.text, event.tokens)
                        for delta in deltas or ([{}] if logprobs else []):
                            yield chunk(index, delta, logprobs, None)
                            logprobs = None
                    else:
                        dones[index] = event
                        for delta in reply.final_deltas():
                            yield chunk(index, delta, None, None)
                        yield chunk(index, {}, None, finish(index, event))
                if body.include_usage:
                    yield {**head(ident, "chat.completion.chunk", now), "choices": [],
                           "usage": usage(dones, reasoning_tokens(replies))}

            return stream(events(), choices)
        results = await choices.collect(request)
        for reply, (texts, _, _, tokens) in zip(replies, results, strict=True):
            if isinstance(reply, ReasoningReply):
                reply.count(texts, tokens)
        return {**head(ident, "chat.completion", now), "choices": [{
            "index": index, "message": replies[index].message("".join(texts)),
            "logprobs": chat_logprobs(logprobs, body), "finish_reason": finish(index, done),
        } for index, (texts, logprobs, done, _) in enumerate(results)],
            "usage": usage([result[2] for result in results], reasoning_tokens(replies))}

    chat = ChatService(model_id, lambda request: read_body(request, max_body_bytes,
                                                           body_timeout_s),
                       count_chat, start_chat)
    add_responses_routes(app, chat)  # OpenAI's Responses API
    add_anthropic_routes(app, chat)  # Anthropic's Messages API
    if webui:
        add_chat_page_routes(get)  # the chat page at GET /
    return app


