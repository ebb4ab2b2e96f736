"""API errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields.

    Args:
      status: HTTP status (400 bad field, 404 unknown model or path, 413 body too large, 503
        queue full, 500 a failure of the server itself).
      message: one line naming the field and what is wrong.
      param: the field, in the request's own notation (e.g. "messages[1].role"), or None.
      code: a machine-readable code (OpenAI's, where one exists: "model_not_found",
        "context_length_exceeded"), or None.
      type: OpenAI's error type; "invalid_request_error" for a client's mistake.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split("\n"))
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param,
                "code": self.code,
            }
        }
