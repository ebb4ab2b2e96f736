"""Who may use the server: API keys (`jllama serve --api_key`, `--api_key_file`) and which web
pages' scripts may read its answers (CORS, `--cors_origins`).

API keys. With keys given, every request but `PUBLIC_PATHS` (the health check and the chat
page, which holds no model output) needs one of them, as OpenAI's API does
(`Authorization: Bearer KEY`) or as Anthropic's does (`x-api-key: KEY`), on any route. A
request without one, or with another, gets a 401 in OpenAI's error shape, code
"invalid_api_key" (in Anthropic's, type authentication_error, on its /v1/messages routes; the
key given is never echoed). Keys are compared in constant time.

CORS. A browser lets a script of another origin (a web page the user opened) read this
server's answers only where the answer names that origin: `--cors_origins` lists the origins
allowed (`*`: any), and preflight OPTIONS requests are answered by Starlette's
`CORSMiddleware`. The default is none: a local server holding a model, often without a key,
should not be readable by every page the user visits (llama.cpp's and vLLM's servers allow any
origin by default). The 401 of a missing key carries the CORS headers too, so an allowed page
can read why.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from jllama.errors import JllamaError
from jllama.server.anthropic import error_body as anthropic_error_body
from jllama.server.errors import APIError

PUBLIC_PATHS = ("/health", "/", "/index.html")
"""Paths answered without a key (GET and HEAD): the health check, and the chat page (static
HTML; its requests to the API need the key like any other)."""


def parse_api_keys(values: Iterable[str], key_file: str | None = None) -> tuple[str, ...]:
    """The API keys of `--api_key` values (each one key or a comma-separated list) and of
    `--api_key_file` (one key a line; blank lines and lines starting with "#" skipped), in
    order, without repeats.

    Raises:
      JllamaError: the file cannot be read, or holds no key; a key with whitespace or a
        character outside printable ASCII (it could not be sent in an HTTP header as given).
    """
    keys = [part.strip() for value in values for part in value.split(",")]
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise JllamaError(f"--api_key_file={key_file}: cannot read it ({e})") from None
        from_file = [line.strip() for line in text.splitlines()
                     if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise JllamaError(f"--api_key_file={key_file}: holds no key (one a line)")
        keys += from_file
    out = []
    for key in keys:
        if not key:
            continue
        if not all("!" <= ch <= "~" for ch in key):
            raise JllamaError("an API key must be printable ASCII without spaces (an HTTP "
                              "header carries it)")
        if key not in out:
            out.append(key)
    return tuple(out)


def presented_keys(headers: Headers) -> list[str]:
    """The keys a request presents: `Authorization: Bearer KEY` (the scheme in any case) and
    `x-api-key: KEY`."""
    keys = []
    for value in headers.getlist("authorization"):
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            keys.append(key.strip())
    keys += [value.strip() for value in headers.getlist("x-api-key") if value.strip()]
    return keys


class ApiKeys:
    """ASGI middleware answering 401 to a request without one of `keys` (module docstring).

    Args:
      app: the application.
      keys: the accepted keys (at least one).
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str]):
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.app = app
        self._keys = [key.encode() for key in keys]

    def admits(self, scope: Scope) -> bool:
        """Whether the request of `scope` presents one of the keys."""
        return any(self._accepts(key) for key in presented_keys(Headers(scope=scope)))

    def _accepts(self, key: str) -> bool:
        given = key.encode("utf-8", "replace")
        # Every key compared, in constant time each: no early exit tells which one matched.
        found = False
        for key_bytes in self._keys:
            found |= hmac.compare_digest(given, key_bytes)
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._public(scope):
            await self.app(scope, receive, send)
            return
        presented = presented_keys(Headers(scope=scope))
        if any(self._accepts(key) for key in presented):
            await self.app(scope, receive, send)
            return
        if presented:
            message = ("the API key given is not one of this server's (send it as "
                       "'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        else:
            message = ("this server needs an API key: send it as 'Authorization: Bearer KEY' "
                       "or 'x-api-key: KEY'")
        error = APIError(401, message, code="invalid_api_key")
        path = scope.get("path", "")
        # Each API's own error shape: Anthropic's on its Messages routes, OpenAI's elsewhere.
        body = (anthropic_error_body(error) if path.startswith(("/v1/messages", "/messages"))
                else error.body())
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    @staticmethod
    def _public(scope: Scope) -> bool:
        path = scope.get("path", "").rstrip("/") or "/"
        return scope.get("method") in ("GET", "HEAD") and path in PUBLIC_PATHS


def add_access_control(app, api_keys: Sequence[str] = (),
                       cors_origins: Sequence[str] = ()) -> None:
    """Add the API key check (where keys are given) and, outside it, CORS (where origins are
    given: "*" for any) to a Starlette or FastAPI `app`; call it after the app's other
    middleware, so that CORS answers first (a preflight carries no key)."""
    if api_keys:
        app.add_middleware(ApiKeys, keys=tuple(api_keys))
    if cors_origins:
        origins = ["*"] if "*" in cors_origins else list(cors_origins)
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
            expose_headers=["Retry-After"], max_age=600,
        )
