"""A chat reply as OpenAI's API returns it: text as `content`, or (with tools offered) one call
as `tool_calls`, whole (`message`) or as stream deltas (`deltas`).

Source: OpenAI API reference, chat completions: the assistant message's `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments"}}`, arguments a JSON text) with
`content` null and finish_reason "tool_calls"; streamed, `delta.tool_calls` items with their
`index`, the first carrying id, type and name, the next ones pieces of `arguments`.
"""

from __future__ import annotations

import json
import re
import secrets


class TextReply:
    """A reply with no tools offered: its text is the content."""

    def deltas(self, text: str) -> list[dict]:
        """Stream deltas for the next piece of text."""
        return [{"content": text}] if text else []

    def final_deltas(self) -> list[dict]:
        """Deltas for what is held back at the end (none here)."""
        return []

    def message(self, text: str) -> dict:
        """The whole reply as an assistant message."""
        return {"role": "assistant", "content": text}

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish_reason for the generation's ("stop" or "length")."""
        return reason


class ToolReply(TextReply):
    """A reply with tools offered: free text, or one call in Llama 3.1's format
    (`ToolCallReader`).

    Args:
      expect_call: the grammar makes the reply a call (tool_choice "required" or named).
    """

    def __init__(self, expect_call: bool):
        self.reader = ToolCallReader(expect_call)
        self.call_id = new_call_id()

    def _as_deltas(self, events: list[tuple[str, str]]) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append({"content": value})
            elif kind == "call":
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": value, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
        return out

    def deltas(self, text: str) -> list[dict]:
        return self._as_deltas(self.reader.feed(text))

    def final_deltas(self) -> list[dict]:
        return self._as_deltas(self.reader.finish())

    @property
    def is_call(self) -> bool:
        """The reply is a call whose name has been read."""
        return bool(self.reader.is_call) and self.reader.name is not None

    def message(self, text: str) -> dict:
        events = self.reader.feed(text) + self.reader.finish()
        if not self.is_call:
            return {"role": "assistant",
                    "content": "".join(v for kind, v in events if kind == "content")}
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": self.call_id, "type": "function",
            "function": {"name": self.reader.name, "arguments": self.reader.arguments},
        }]}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.is_call and reason == "stop" else reason


_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": ')


class ToolCallReader:
    """Reads a reply as it is generated: text, or one call in the format the grammar fixes.

    `feed(text)` returns the events the new text completes: `("content", text)`,
    `("call", name)` once the name is known, `("arguments", text)` pieces of the parameters
    value. `finish()` returns what is left (a reply cut short before its name: its text as
    content). `is_call` is True once the reply is known to be a call.
    """

    def __init__(self, expect_call: bool):
        self.is_call: bool | None = True if expect_call else None
        self.name: str | None = None
        self.arguments = ""
        self._buffer = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self._done = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.is_call is None and (self._buffer + text):
            self.is_call = (self._buffer + text)[0] == "{"
        if self.is_call is False:
            return [("content", text)] if text else []
        self._buffer += text
        events = []
        if self.name is None:
            head = _HEAD.match(self._buffer)
            if head is None:
                return []
            self.name = json.loads(head.group(1))
            events.append(("call", self.name))
            self._buffer = self._buffer[head.end():]
        piece = self._scan(self._buffer)
        self._buffer = ""
        if piece:
            self.arguments += piece
            events.append(("arguments", piece))
        return events

    def _scan(self, text: str) -> str:
        """The part of `text` inside the parameters value (the closing "}" of the call and
        anything after it dropped)."""
        for k, ch in enumerate(text):
            if self._done:
                return text[:k]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._done = self._depth == 0
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # the call's own "}" after a scalar value
                    self._done = True
                    return text[:k]
                self._depth -= 1
                self._done = self._depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in ", \t\r\n" and self._depth == 0 and self._started:
                self._done = True
                return text[:k]
            self._started = True
        return text

    def finish(self) -> list[tuple[str, str]]:
        if self.is_call and self.name is None and self._buffer:
            self.is_call = False
            return [("content", self._buffer)]
        return []


def new_call_id() -> str:
    """An id for a call, "call_" and 24 hex digits (OpenAI's ids start "call_")."""
    return f"call_{secrets.token_hex(12)}"
