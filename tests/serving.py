"""The tests' server helpers: `serve` starts a `ServerThread` on a model file (the JAX backend,
prepared), `openai_client` the official `openai` client the server tests drive it with."""

from __future__ import annotations

import openai

from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread


def serve(path=None, parallel: int = 1, seq_len: int | None = 1024, name: str = "m",
          **options) -> ServerThread:
    """A server (not started: use it as a context manager) on `path` (None: stories260K)."""
    model = open_model(path, seq_len=seq_len)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    return ServerThread(model, backend, name, parallel=parallel, **options)


def openai_client(server, api_key: str = "x", timeout: float = 120) -> openai.OpenAI:
    """The official client of `server` (a ServerThread, or the URL of its /v1 API), with no
    retries: a failed request fails the test at once."""
    base_url = server if isinstance(server, str) else server.url + "/v1"
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
