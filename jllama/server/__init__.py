"""An OpenAI-compatible HTTP server for one model (`jllama serve`).

  errors.py   APIError: OpenAI's error JSON with its HTTP status
  schema.py   request bodies, validated (pydantic, strict types) -> SamplerConfig
  engine.py   the model worker thread and its first-in, first-out queue
  app.py      the FastAPI routes, server-sent events
  request_head.py  what a request's head decides: trailing slashes, body length and type
  models.py   several models (serve --model NAME=CHECKPOINT): the request's `model` picks
              one; loaded on first use, the least recently used idle one unloaded

`ServerThread` runs the server in a background thread of this process (tests, notebooks);
`jllama serve` runs it in the foreground.
"""

from __future__ import annotations

import signal
import socket
import threading

from jllama.errors import JllamaError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one.

    Raises:
      JllamaError: the address cannot be bound (in use, not local, bad host), one line.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OverflowError) as e:
        raise JllamaError(f"--host={host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise JllamaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def make_worker(session, parallel: int = 1, max_waiting: int = 256):
    """The model worker for `session`: one request at a time in arrival order
    (`jllama.server.engine.Engine`) when parallel is 1, else `parallel` slots advanced in
    rounds with prompt-prefix reuse (`jllama.server.slots.SlotEngine`)."""
    if parallel <= 1:
        from jllama.server.engine import Engine

        return Engine(session, max_waiting=max_waiting)
    from jllama.server.slots import SlotEngine

    return SlotEngine(session, parallel=parallel, max_waiting=max_waiting)


def make_server(engine, model_id: str, sock: socket.socket, head_timeout_s: float | None = None,
                app=None, **app_options):
    """A `uvicorn.Server` for `engine`'s model on the bound socket `sock` (not started).
    head_timeout_s: seconds a client has to send a request's head (None: HEAD_TIMEOUT_S of
    `jllama.server.protocol`); app_options: `create_app`'s (max_body_bytes, body_timeout_s,
    webui). app: the ASGI application to serve instead of `create_app`'s (several models:
    a `jllama.server.models.ModelRouter`; engine and model_id unused)."""
    import uvicorn

    from jllama.server.app import create_app
    from jllama.server.protocol import HEAD_TIMEOUT_S, timed_protocol

    if app is None:
        app = create_app(engine, model_id, **app_options)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
        # No WebSocket routes: an Upgrade is a plain HTTP request here (with wsproto
        # installed, as selenium brings it, uvicorn would take it and answer 403, no body).
        ws="none",
        h11_max_incomplete_event_size=64 * 1024,
        http=timed_protocol(HEAD_TIMEOUT_S if head_timeout_s is None else head_timeout_s),
    )

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT or SIGTERM first ends every running stream
        with an error event and [DONE] (`end_streams`), and a SIGTERM is not raised again
        after the shutdown (uvicorn re-raises it: exit -15): the server exits 0."""

        def handle_exit(self, sig, frame) -> None:
            app.state.end_streams("the server is shutting down")
            if sig == signal.SIGTERM:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    server = Server(config)
    server.jllama_socket = sock
    return server


class ServerThread:
    """The server in a background thread, for tests and scripts.

    Args:
      model: a `jllama.model.loading.Model`.
      backend: a prepared backend for it.
      use_prefill: feed prompts through the backend's batched prefill where it has one.
      parallel: requests generated at once (`make_worker`).
      model_id: the name clients use as `model`.
      host, port: where to listen (port 0: a free port; see `url`).
      draft, draft_tokens: speculative decoding of greedy requests (`Session`'s).
      **app_options: for `make_server` and `create_app` (max_body_bytes, head_timeout_s,
        body_timeout_s, webui: the chat page at `/`, on unless False).

    Usage:
      with ServerThread(model, backend, "stories260K") as server:
          client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, model, backend, model_id: str, host: str = "127.0.0.1", port: int = 0,
                 use_prefill: bool = True, max_waiting: int = 256, parallel: int = 1,
                 draft: str = "none", draft_tokens: int = 15, **app_options):
        from jllama.generation.session import Session

        session = Session(model, backend, decode="graph", device_sampling=False,
                          prefill="chunked" if use_prefill else "token", draft=draft,
                          draft_tokens=draft_tokens)
        self.engine = make_worker(session, parallel, max_waiting)
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(self.engine, model_id, self._sock, **app_options)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="jllama-http",
            daemon=True,
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; returns once uvicorn has started (or raises RuntimeError)."""
        self._thread.start()
        started = threading.Event()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                started.set()
                break
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.02)
        if not started.is_set():
            self.stop()
            raise RuntimeError("the server did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and the model worker."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
