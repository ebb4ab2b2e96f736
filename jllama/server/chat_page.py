"""The chat page at `GET /` (and `/index.html`): one static HTML file shipped in the package
(jllama/server/webui/index.html: its CSS and JavaScript inline, no build step, nothing fetched
from elsewhere), talking to this server's `GET /v1/models` and streamed
`POST /v1/chat/completions`. `jllama serve --no_webui` leaves it out (404 at `/`).

The page builds every node of a reply with `textContent` (never `innerHTML`); the
Content-Security-Policy it is served with allows its own inline script and style blocks alone
(by their SHA-256), so an inline event handler or script that got into the page would not run
either.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi.responses import Response

PAGE = "webui/index.html"
"""The page, relative to the jllama.server package."""


def page_bytes() -> bytes:
    """The page's HTML, as shipped."""
    return resources.files("jllama.server").joinpath(PAGE).read_bytes()


def content_security_policy(html: str) -> str:
    """A policy allowing the page's own inline <script> and <style> blocks (by hash), requests
    to this origin, and nothing else."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(
            f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
            for b in blocks
        )

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


def add_chat_page_routes(get) -> None:
    """Route `GET /` and `GET /index.html` (HEAD too) to the page; `get(path)` is the app's
    GET-and-HEAD route decorator. The file is read once, here."""
    page = page_bytes()
    headers = {
        "Content-Security-Policy": content_security_policy(page.decode()),
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
    }

    async def index():
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    get("/")(index)
    get("/index.html")(index)
