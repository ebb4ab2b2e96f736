"""A chat reply as OpenAI's API returns it: text as `content`, or (with tools offered) one call
as `tool_calls`, whole (`message`) or as stream deltas (`deltas`).

Source: OpenAI API reference, chat completions: the assistant message's `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments"}}`, arguments a JSON text) with
`content` null and finish_reason "tool_calls"; streamed, `delta.tool_calls` items with their
`index`, the first carrying id, type and name, the next ones pieces of `arguments`.

A model with Qwen's (Hermes') template writes its calls as `<tool_call>` blocks, one or more:
`HermesToolReply` reads them (vLLM's `hermes` tool parser, llama.cpp's Hermes 2 Pro format).
"""

from __future__ import annotations

import json
import re
import secrets

from jllama.server.tools import HERMES_CLOSE, HERMES_OPEN


class TextReply:
    """A reply with no tools offered: its text is the content."""

    def deltas(self, text: str, tokens: int = 1) -> list[dict]:
        """Stream deltas for the next piece of text (of `tokens` generated tokens)."""
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

    def deltas(self, text: str, tokens: int = 1) -> list[dict]:
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


def _head(key: str) -> re.Pattern:
    """A call's JSON up to its arguments' value: `{"name": NAME, "KEY": `."""
    return re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "' + key + '": ')


class ToolCallReader:
    """Reads a reply as it is generated: text, or one call in the format the grammar fixes.

    `feed(text)` returns the events the new text completes: `("content", text)`,
    `("call", name)` once the name is known, `("arguments", text)` pieces of the parameters
    value. `finish()` returns what is left (a reply cut short before its name: its text as
    content). `is_call` is True once the reply is known to be a call.

    Args:
      expect_call: the reply is a call from its first character.
      key: the arguments' key ("parameters" in Llama 3.1's format, "arguments" in Hermes').

    Attributes:
      rest: the text after the arguments' value (the call's closing "}" on), once it ends.
    """

    def __init__(self, expect_call: bool, key: str = "parameters"):
        self.is_call: bool | None = True if expect_call else None
        self.name: str | None = None
        self.arguments = ""
        self._buffer = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self._done = False
        self._head = _head(key)
        self.rest = ""

    @property
    def done(self) -> bool:
        """The arguments' value has ended."""
        return self._done

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.is_call is None and (self._buffer + text):
            self.is_call = (self._buffer + text)[0] == "{"
        if self.is_call is False:
            return [("content", text)] if text else []
        self._buffer += text
        events = []
        if self.name is None:
            head = self._head.match(self._buffer)
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
                self.rest += text[k:]
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
                    self.rest += text[k:]
                    return text[:k]
                self._depth -= 1
                self._done = self._depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in ", \t\r\n" and self._depth == 0 and self._started:
                self._done = True
                self.rest += text[k:]
                return text[:k]
            self._started = True
        return text

    def finish(self) -> list[tuple[str, str]]:
        if self.is_call and self.name is None and self._buffer:
            self.is_call = False
            return [("content", self._buffer)]
        return []


class HermesToolReply(TextReply):
    """A reply with tools offered to a model that writes Hermes' (Qwen's) format: text, then
    (or only) one or more `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks
    joined by newlines, as `content` and `tool_calls` items 0, 1, ... (their arguments streamed
    as they come). As vLLM's hermes parser, the text before the first block is the content
    (here without the whitespace that ends it).

    Args:
      expect_call: the grammar makes the reply calls (tool_choice "required" or named).
    """

    def __init__(self, expect_call: bool):
        self.in_calls = expect_call  # past the text: the blocks have begun
        self.calls: list[dict] = []
        """The calls read so far, as `tool_calls` items."""
        self._reader: ToolCallReader | None = None  # the open call's
        self._buffer = ""
        self._closing = False  # after a call's arguments, before its `</tool_call>`
        self._gap = ""  # the whitespace between the text and the first block

    @property
    def is_call(self) -> bool:
        """The reply holds a call whose name has been read."""
        return bool(self.calls)

    def _call_deltas(self, events: list[tuple[str, str]]) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "call":
                self.calls.append({"id": new_call_id(), "type": "function",
                                   "function": {"name": value, "arguments": ""}})
                out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                            "id": self.calls[-1]["id"], "type": "function",
                                            "function": {"name": value, "arguments": ""}}]})
            elif kind == "arguments":
                self.calls[-1]["function"]["arguments"] += value
                out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                            "function": {"arguments": value}}]})
        return out

    def _text_deltas(self) -> list[dict]:
        """The text before the blocks: given out up to a possible start of `<tool_call>` or
        whitespace that may end it (held until known)."""
        at = self._buffer.find(_TAG)
        if at >= 0:
            text = self._buffer[:at].rstrip()
            self._gap = self._buffer[len(text):at]  # given back if no call follows
            self._buffer = self._buffer[at:]
            self.in_calls = True
        else:
            cut = len(self._buffer) - _held_prefix(self._buffer, _TAG)
            text = self._buffer[:cut].rstrip()
            self._buffer = self._buffer[len(text):]
        return [{"content": text}] if text else []

    def deltas(self, text: str, tokens: int = 1) -> list[dict]:
        self._buffer += text
        out = [] if self.in_calls else self._text_deltas()
        while self.in_calls and self._buffer:
            if self._closing:
                end = self._buffer.find(HERMES_CLOSE.lstrip())
                if end < 0:
                    break
                self._buffer = self._buffer[end + len(HERMES_CLOSE.lstrip()):]
                self._closing = False
            elif self._reader is None:
                head = self._buffer.lstrip()
                if not head.startswith(HERMES_OPEN):
                    break  # not yet a whole `<tool_call>\\n` (or the end)
                self._buffer = head[len(HERMES_OPEN):]
                self._reader = ToolCallReader(True, key="arguments")
            else:
                out += self._call_deltas(self._reader.feed(self._buffer))
                self._buffer = ""
                if not self._reader.done:
                    break
                self._buffer, self._reader, self._closing = self._reader.rest, None, True
        return out

    def final_deltas(self) -> list[dict]:
        if self.calls:
            return []
        # Cut short before a call's name: what was held is content.
        out, self._buffer = self._buffer, ""
        if self._reader is not None:
            out = HERMES_OPEN + "".join(text for _, text in self._reader.finish())
        out = self._gap + out
        return [{"content": out}] if out else []

    def message(self, text: str) -> dict:
        deltas = self.deltas(text) + self.final_deltas()
        content = "".join(d.get("content", "") for d in deltas)
        if not self.calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None,
                "tool_calls": [json.loads(json.dumps(call)) for call in self.calls]}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason


_TAG = HERMES_OPEN.rstrip()  # "<tool_call>"


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tool_reply(call_format: str, expect_call: bool) -> TextReply:
    """The reader of a reply with tools offered, for a model that writes calls in
    `call_format` (`jllama.server.tools.CALL_FORMATS`)."""
    if call_format == "hermes":
        return HermesToolReply(expect_call)
    return ToolReply(expect_call)


def new_call_id() -> str:
    """An id for a call, "call_" and 24 hex digits (OpenAI's ids start "call_")."""
    return f"call_{secrets.token_hex(12)}"
