"""Chat messages: one turn (`Message`) and the check a conversation passes before a template
reads it (`check_messages`). Every failure is a one-line `ChatError` naming the message."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jllama.errors import ChatError

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""


@dataclasses.dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    Attributes:
      role: who speaks: one of `ROLES` ("system", "user", "assistant", "tool").
      content: what they say, as text.

    Raises:
      ChatError: on an unknown role or a content that is not a str.
    """

    role: str
    content: str

    def __post_init__(self) -> None:
        _check_fields(self.role, self.content, where="chat message")


def _check_fields(role: object, content: object, where: str) -> None:
    if not isinstance(role, str) or role not in ROLES:
        raise ChatError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(content, str):
        raise ChatError(f"{where}: content must be a str, got {type(content).__name__}")


def check_messages(messages: Sequence[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validates a conversation and returns it as the dicts a template reads.

    Args:
      messages: a non-empty list (or tuple) of `Message`s or mappings with at least `"role"`
        and `"content"`. A mapping's other keys (`"name"`, `"tool_calls"`, ...) are passed to
        the template as they are, as transformers does.

    Returns:
      A new list of new dicts, `{"role": str, "content": str, ...}`, in order.

    Raises:
      ChatError: naming the message's index and field: not a list, an empty list, an item that
        is neither a `Message` nor a mapping, a missing field, an unknown role, a content that
        is not a str.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatError(f"chat messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatError("chat messages: the list is empty, a conversation needs a message")
    checked = []
    for index, message in enumerate(messages):
        where = f"chat message {index}"
        if isinstance(message, Message):
            item = {"role": message.role, "content": message.content}
        elif isinstance(message, Mapping):
            for field in ("role", "content"):
                if field not in message:
                    raise ChatError(f"{where}: has no {field!r} field")
            item = dict(message)
        else:
            raise ChatError(f"{where}: must be a Message or a dict, got {type(message).__name__}")
        _check_fields(item["role"], item["content"], where)
        checked.append(item)
    return checked
