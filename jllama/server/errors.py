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


def bad_field(param: str, message: str) -> APIError:
    """A 400 naming the field `param` (the request's own notation) and what is wrong."""
    return APIError(400, f"{param}: {message}", param=param)


def text_parts(content: Any, where: str, kinds: tuple[str, ...], what: str) -> list[dict]:
    """A message's content as chat's text parts: a string is one part; a list of parts
    (`{"type": one of kinds, "text": str}`, `what` names them in the error) one part each.

    Raises:
      APIError (400): `where` (or `where[j].type` / `.text`) is neither.
    """
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_field(where, f"must be a string or a list of {what}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad_field(f"{where}[{j}].type", f"must be {' or '.join(map(repr, kinds))} "
                            f"(only text is supported here), got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{j}].text", "must be a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def nonempty_string(item: dict, key: str, where: str) -> str:
    """item[key], which must be a non-empty string.

    Raises:
      APIError (400): naming `where.key`.
    """
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_field(f"{where}.{key}", f"must be a non-empty string, got {value!r}")
    return value
