"""What the server decides from a request's head alone, before it reads a byte of the body: the
route of a path with a trailing slash, and whether a body's declared length and type can be
read at all.

The API's paths are answered without their `/v1` prefix too (`VersionPrefix`).

Trailing slashes are routed, not refused: `POST /v1/completions/` is answered by the handler of
`POST /v1/completions`. Starlette's default is a 307 with an empty body (vLLM's server, also
FastAPI, answers so), which a client that does not follow redirects reports as an empty reply;
llama.cpp's server answers 404. No two of this API's resources differ by a trailing slash, so
the path can only mean the one without it, and answering it costs nothing where a 404 would
turn a harmless spelling into a failure.

Content types (`check_body_head`): a JSON body is read when its Content-Type is
`application/json` (any case, with or without `charset=utf-8`), when it has none, and when it
is `application/x-www-form-urlencoded`, what `curl -d '{...}'` sends unless told otherwise
(llama.cpp's server ignores the type, and its users post that way). Any other type (text/plain,
multipart/form-data, image/png...) and any charset but UTF-8 get a 415: the body would be read
as something it does not claim to be. OpenAI's API and vLLM's refuse `curl -d` without
`-H 'Content-Type: application/json'` too; this server is local first, for people trying it by
hand."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from jllama.server.errors import APIError

JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")
"""Media types whose body is read as JSON (the second: curl's default for `-d`)."""

UTF8 = ("utf-8", "utf8")

_MAX_DIGITS = 20  # h11's own limit on a Content-Length (2^64 has 20 digits)


class TrailingSlashes:
    """ASGI middleware routing a path that ends in "/" (one or more) as the path without it;
    the app must not redirect slashes itself (`FastAPI(redirect_slashes=False)`)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            raw = scope.get("raw_path")
            if raw:
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


API_PATHS = ("/chat/completions", "/completions", "/models", "/responses", "/messages")
"""The API's resources under /v1 that are answered without the prefix too (and what is below
them: /models/{id}, /messages/count_tokens)."""


class VersionPrefix:
    """ASGI middleware routing a path of `API_PATHS` given without its `/v1` prefix as the path
    with it (`POST /chat/completions` is `POST /v1/chat/completions`), as llama.cpp's server
    answers both: clients configured with the server's root as their base URL work."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        bare = path.rstrip("/")
        if scope["type"] == "http" and any(bare == p or bare.startswith(p + "/")
                                           for p in API_PATHS):
            scope = {**scope, "path": "/v1" + path}
            raw = scope.get("raw_path")
            if raw:
                scope["raw_path"] = b"/v1" + raw
        await self.app(scope, receive, send)


def check_body_head(headers: Headers, limit: int) -> None:
    """Refuses a request body from its headers alone, so the answer goes out before any of
    the body is read (a client declaring 10 MB, or 2^64 bytes, and sending none gets its 413
    at once rather than a 408 when the body deadline passes).

    Args:
      headers: the request's headers.
      limit: the most body bytes the server reads.

    Raises:
      APIError: 400 for a Content-Length that is not one decimal number (h11, the server's
        HTTP parser, refuses those before the app sees them; checked again here for any other
        server) or one given with Transfer-Encoding (the framings would disagree); 413 for a
        declared length over `limit`; 415 for a Content-Type not read as JSON.
    """
    lengths = {part.strip() for value in headers.getlist("content-length")
               for part in value.split(",")}
    if lengths:
        if len(lengths) > 1:
            raise APIError(400, f"Content-Length given as {len(lengths)} different values",
                           code="bad_content_length")
        declared = lengths.pop()
        if not (declared.isascii() and declared.isdigit()) or len(declared) > _MAX_DIGITS:
            raise APIError(400, f"Content-Length {declared[:40]!r} is not a length in bytes",
                           code="bad_content_length")
        if "transfer-encoding" in headers:
            raise APIError(400, "a request may give Content-Length or Transfer-Encoding, not "
                           "both", code="bad_content_length")
        if int(declared) > limit:
            raise too_large(limit)
    check_content_type(headers)


def too_large(limit: int) -> APIError:
    """The 413 of a body over `limit` bytes."""
    return APIError(413, f"the request body is larger than the limit of {limit} bytes",
                    code="request_too_large")


def check_content_type(headers: Headers) -> None:
    """Raises a 415 (an unknown media type or charset) or a 400 (two Content-Type headers)
    unless the body may be read as UTF-8 JSON (module docstring)."""
    values = headers.getlist("content-type")
    if len(set(values)) > 1:
        raise APIError(400, f"Content-Type given {len(values)} times", code="bad_content_type")
    value = values[0].strip() if values else ""
    if not value:
        return
    media, *params = value.split(";")
    if media.strip().lower() not in JSON_TYPES:
        raise APIError(415, f"Content-Type {value[:80]!r} is not JSON: send the body as "
                       "'application/json'", code="unsupported_media_type")
    for param in params:
        name, _, given = param.partition("=")
        charset = given.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in UTF8:
            raise APIError(415, f"charset {given.strip()[:40]!r}: the body must be UTF-8 JSON "
                           "('application/json; charset=utf-8')", code="unsupported_media_type")
