"""Several models in one server (`jllama serve --model NAME=CHECKPOINT`, repeatable).

`ModelRouter` is the ASGI application in front of one `create_app` per model, each over its own
worker (`jllama.server.make_worker`, its own Session), so requests for different models are
independent. A request's JSON body's `model` picks the model; a request naming no known model,
and every other request (GET /v1/models, /health, /metrics, the chat page), goes to a loaded
model's app (the default model's when it is loaded, else the one used last), which answers it
as it does with one model: `/v1/models` lists every model the router serves (`catalog`), an
unknown `model` gets the 404 `model_not_found` (Anthropic's error shape on /v1/messages), keys
and CORS are checked by that app as ever.

Loading and unloading: a model is loaded on its first request (the default model at start,
`start`). With `max_loaded` N > 0, at most N models are loaded: before loading another, the
least recently used model that no request is using is unloaded (its worker closed, its app
and session dropped); when every loaded model is in use, the request waits until one is free.
A request holds its model from the moment it is routed until its response (a stream included)
has ended.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from types import SimpleNamespace

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from jllama.server.access import ApiKeys
from jllama.server.errors import APIError
from jllama.server.transport import BODY_TIMEOUT_S, MAX_BODY_BYTES


def parse_model_flag(value: str) -> tuple[str, str]:
    """`NAME=CHECKPOINT` (serve --model) as (name, checkpoint).

    Raises:
      ValueError: no `=`, or a blank name or checkpoint.
    """
    name, sep, checkpoint = value.partition("=")
    if not sep or not name.strip() or not checkpoint.strip():
        raise ValueError(f"--model={value}: expected NAME=CHECKPOINT")
    return name.strip(), checkpoint.strip()


def _forget_fastapi_routes() -> None:
    """Empty FastAPI's caches keyed by route function (`fastapi.dependencies.models`'
    `_is_*_callable_cached`, lru_caches of up to a few thousand entries): they hold an unloaded
    model's route functions, and through their closures its worker, session and weights."""
    try:
        from fastapi.dependencies import models
    except ImportError:
        return
    for name in dir(models):
        cached = getattr(models, name)
        if name.startswith("_is_") and name.endswith("_cached") and hasattr(cached,
                                                                            "cache_clear"):
            cached.cache_clear()


class ModelRouter:
    """Names -> lazily created workers and their apps; an ASGI application.

    Args:
      loaders: each model's name -> a function that loads it and returns its worker (what
        `jllama.server.make_worker` returns); called in a worker thread, once per load.
      default: the default model (loaded by `start`; answers the requests naming no model).
      max_loaded: the most models loaded at once (0: no limit).
      **app_options: `create_app`'s (max_body_bytes, body_timeout_s, webui, api_keys,
        cors_origins), the same for every model.
    """

    def __init__(self, loaders: dict[str, Callable[[], object]], default: str,
                 max_loaded: int = 0, **app_options):
        if default not in loaders:
            raise ValueError(f"the default model {default!r} is not among {list(loaders)}")
        self.loaders = dict(loaders)
        self.default = default
        self.max_loaded = max_loaded
        self.app_options = app_options
        self._max_body = app_options.get("max_body_bytes", MAX_BODY_BYTES)
        self._body_timeout = app_options.get("body_timeout_s", BODY_TIMEOUT_S)
        self._loaded: OrderedDict[str, SimpleNamespace] = OrderedDict()  # LRU first
        self._loading: set[str] = set()
        self._active: Counter[str] = Counter()
        self._cond: asyncio.Condition | None = None
        self._lock = threading.Lock()  # the loaded table, across the loop and start/close
        self._context: dict[str, int] = {}  # a model's context, once it has been loaded
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.created = int(time.time())
        self.state = SimpleNamespace(end_streams=self.end_streams)
        self._keys: ApiKeys | None = None  # the key check, made at the first request

    # The table of models.

    @property
    def loaded(self) -> list[str]:
        """The loaded models, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def worker(self, name: str):
        """`name`'s worker if it is loaded, else None."""
        with self._lock:
            entry = self._loaded.get(name)
        return None if entry is None else entry.engine

    def catalog(self) -> list[dict]:
        """Every model's card for /v1/models (context_length once the model has been
        loaded)."""
        cards = []
        for name in self.loaders:
            card = {"id": name, "object": "model", "created": self.created,
                    "owned_by": "jllama"}
            if name in self._context:
                card["context_length"] = self._context[name]
            cards.append(card)
        return cards

    def _load(self, name: str) -> SimpleNamespace:
        from jllama.server.app import create_app

        engine = self.loaders[name]()
        try:
            app = create_app(engine, name, catalog=self.catalog, **self.app_options)
        except BaseException:
            engine.close()
            raise
        self._context[name] = engine.model.config.seq_len
        self.loads[name] += 1
        return SimpleNamespace(engine=engine, app=app)

    def _unload(self, entry: SimpleNamespace, name: str) -> None:
        entry.engine.close()
        entry.engine = entry.app = None
        self.unloads[name] += 1
        _forget_fastapi_routes()
        gc.collect()  # the model's arrays go with their last reference

    def start(self) -> ModelRouter:
        """Load the default model now (the server starts with it)."""
        with self._lock:
            if self.default in self._loaded:
                return self
        entry = self._load(self.default)
        with self._lock:
            self._loaded[self.default] = entry
        return self

    def close(self) -> None:
        """Close every loaded model's worker."""
        with self._lock:
            entries = list(self._loaded.items())
            self._loaded.clear()
        for name, entry in entries:
            self._unload(entry, name)

    def end_streams(self, why: str) -> None:
        """Every loaded model's unfinished requests end now (the server is shutting down)."""
        with self._lock:
            apps = [entry.app for entry in self._loaded.values()]
        for app in apps:
            app.state.end_streams(why)

    async def acquire(self, name: str) -> SimpleNamespace:
        """`name` loaded (loading it, and first unloading the least recently used idle model
        where max_loaded would be passed) and held by the caller until `release`."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        cond = self._cond
        async with cond:
            while True:
                with self._lock:
                    entry = self._loaded.get(name)
                    if entry is not None:
                        self._loaded.move_to_end(name)
                        self._active[name] += 1
                        return entry
                    idle = [n for n in self._loaded if not self._active[n]]
                    full = (self.max_loaded > 0
                            and len(self._loaded) + len(self._loading) >= self.max_loaded)
                if name in self._loading or (full and not idle):
                    await cond.wait()
                    continue
                if full:
                    with self._lock:
                        victim = self._loaded.pop(idle[0])
                    await run_in_threadpool(self._unload, victim, idle[0])
                    continue
                self._loading.add(name)
                break
        entry = None
        try:
            entry = await run_in_threadpool(self._load, name)
        finally:
            async with cond:
                self._loading.discard(name)
                if entry is not None:
                    with self._lock:
                        self._loaded[name] = entry
                        self._active[name] += 1
                cond.notify_all()
        return entry

    async def release(self, name: str) -> None:
        async with self._cond:
            self._active[name] -= 1
            self._cond.notify_all()

    async def _any(self) -> str:
        """The model to answer a request that names none of ours: the default when loaded,
        else the one used last (waiting for a load under way when none is loaded)."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            while True:
                with self._lock:
                    if self.default in self._loaded:
                        return self.default
                    if self._loaded:
                        return next(reversed(self._loaded))
                if not self._loading:
                    return self.default  # nothing loaded, nothing loading: load the default
                await self._cond.wait()

    # ASGI.

    async def _peek(self, scope, receive) -> tuple[str | None, Callable]:
        """The body's `model` (None: none, or not JSON, or too long or slow to read here) and
        a `receive` that gives the app the whole body again."""
        if scope["method"] != "POST":
            return None, receive
        headers = dict(scope.get("headers") or [])
        try:
            if int(headers.get(b"content-length", b"0")) > self._max_body:
                return None, receive  # the app answers 413 at once
        except ValueError:
            return None, receive
        messages, size, whole = [], 0, False

        async def read() -> None:
            nonlocal size, whole
            while size <= self._max_body:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    return
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    whole = True
                    return

        try:
            await asyncio.wait_for(read(), self._body_timeout)
        except TimeoutError:
            pass

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        if not whole:
            return None, replay
        body = b"".join(m.get("body", b"") for m in messages)
        try:
            name = json.loads(body).get("model")
        except (ValueError, AttributeError, RecursionError):
            return None, replay
        return (name if isinstance(name, str) else None), replay

    def _admits(self, scope) -> bool:
        """Whether `scope` presents one of the API keys (True where there are none)."""
        keys = self.app_options.get("api_keys") or ()
        if not keys:
            return True
        if self._keys is None:
            self._keys = ApiKeys(None, keys)
        return self._keys.admits(scope)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        name, receive = (await self._peek(scope, receive)) if scope["type"] == "http" \
            else (None, receive)
        if name not in self.loaders:
            name = await self._any()  # its app answers (an unknown model: 404)
        elif name not in self.loaded and not self._admits(scope):
            # No load for a request without a key: a loaded model's app answers its 401.
            name = await self._any()
        try:
            entry = await self.acquire(name)
        except Exception as e:  # noqa: BLE001 (the model failed to load: a 500 says why)
            error = APIError(500, f"cannot load the model {name!r}: {type(e).__name__}: {e}",
                             type="server_error", code="model_load_failed")
            if scope.get("path", "").rstrip("/").endswith(("/messages", "/count_tokens")):
                from jllama.server.anthropic import error_response

                await error_response(error)(scope, receive, send)
            else:
                await JSONResponse(error.body(), status_code=500)(scope, receive, send)
            return
        try:
            await entry.app(scope, receive, send)
        finally:
            await self.release(name)


def session_worker(model, backend, use_prefill: bool = True, parallel: int = 1,
                   max_waiting: int = 256):
    """A worker for a loaded model and prepared backend, as `jllama.server.ServerThread`
    makes it (tests and scripts: a `ModelRouter` loader returns one)."""
    from jllama.generation.session import Session
    from jllama.server import make_worker

    session = Session(model, backend, decode="graph", device_sampling=False,
                      prefill="chunked" if use_prefill else "token")
    return make_worker(session, parallel, max_waiting)


class RouterThread:
    """A `ModelRouter` served in a background thread (tests, scripts); as
    `jllama.server.ServerThread`, whose start/stop it uses. The default model is loaded at
    construction; `stop` closes every loaded model."""

    def __init__(self, router: ModelRouter, host: str = "127.0.0.1", port: int = 0,
                 head_timeout_s: float | None = None):
        from jllama.server import ServerThread, bind, make_server

        self.router = router.start()
        self.engine = router  # ServerThread.stop closes it
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(None, router.default, self._sock, head_timeout_s, app=router)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="jllama-http",
            daemon=True,
        )
        self._base = ServerThread

    def start(self, timeout: float = 30.0) -> RouterThread:
        return self._base.start(self, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._base.stop(self, timeout)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
