"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head, and OpenAI's error
object for a request that is not HTTP.

A client that opens a connection (or keeps one alive after a response) and sends its request
line and headers a byte at a time (slowloris) is closed once HEAD_TIMEOUT_S pass without a
whole head, silently (one line each would let such clients flood the log). uvicorn times out
only idle keep-alive connections, and not once a byte of the next request came.

Bytes h11 cannot parse as a request (garbage, `Content-Length: -5`) get uvicorn's 400 with
`{"error": {...}}` as its body instead of plain text, as every other refusal of the server.

A request answered before its body was read (a 413 from its declared length, a 415, a 404)
keeps its connection: h11 drops the rest of the body as it arrives and the next request on the
connection is read after it, so a client still sending reads the answer rather than a reset
(closing a socket with unread bytes sends a TCP RST, which can discard the answer on the
client's side). Past DRAIN_BYTES dropped, or HEAD_TIMEOUT_S after the answer, the connection is
closed instead."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jllama.server.errors import APIError

HEAD_TIMEOUT_S = 10.0
"""Seconds a client has to send a whole request head (request line and headers)."""

DRAIN_BYTES = 64 * 1024 * 1024
"""The most bytes of an already answered request's body dropped before its connection closes."""


def timed_protocol(head_timeout_s: float = HEAD_TIMEOUT_S) -> type[H11Protocol]:
    """An `H11Protocol` class closing connections whose request head takes longer than
    `head_timeout_s` seconds (from the connection, or from the previous response)."""

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._timed_cycle = None
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)
            self._dropped = 0

        def data_received(self, data: bytes) -> None:
            # Answered while the client still sends the body: h11 drops these bytes (see the
            # module docstring), up to a cap.
            if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
                self._dropped += len(data)
                if self._dropped > DRAIN_BYTES:
                    self.transport.close()
                    return
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.cycle is not self._timed_cycle:
                self._timed_cycle = self.cycle  # a new request's head is complete
                self._stop_timer()

        def on_response_complete(self) -> None:
            self._dropped = 0
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's head, on keep-alive
                self._stop_timer()
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _stop_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def send_400_response(self, msg: str) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                # The request whose body broke the framing has an app task running (it started
                # on the head): it ends as its client had gone (its sends are dropped, its
                # receive says disconnect), as connection_lost would make it, since its answer
                # after this 400 would be an h11 error and a traceback in the log.
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                # The request was answered already (an early 413) and the bytes h11 cannot
                # parse are the rest of its body: a second response cannot follow (h11 would
                # raise inside data_received, a traceback in the log); close.
                self.transport.close()
                return
            body = json.dumps(APIError(400, f"not an HTTP request this server can read: {msg}",
                                       code="bad_http_request").body()).encode()
            head = h11.Response(status_code=400, reason=b"Bad Request", headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body))),
                (b"connection", b"close")])
            for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._timed_cycle and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol
