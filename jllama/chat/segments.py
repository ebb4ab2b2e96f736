"""Where the messages' contents lie in a rendered chat: the template's own text told apart from
the text it copied out of messages (see `jllama.chat.ChatTemplate.render_segments` for the
contract and the method: a second render with markers in place of the contents, matched
against the real one)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def content_spans(
    messages: Sequence[Mapping[str, Any]],
    text: str,
    render: Callable[[list[dict[str, Any]]], str | None],
    avoid: Sequence[str],
) -> list[tuple[int, int]]:
    """`[(start, end), ...]`: where the messages' contents lie in `text`.

    Args:
      messages: the checked conversation (dicts with a str "content").
      text: the template's rendering of `messages`.
      render: renders a copy of the conversation the same way (same generation prompt and
        variables), or returns None where the template refuses it.
      avoid: other strings a marker must not occur in (the template's source, the string
        values of extra variables).

    Returns:
      The spans, in no particular order; a content the template does not copy as is (it
      splits, tests, escapes or changes it) has none.
    """
    contents = [m["content"] for m in messages]
    indices = [i for i, content in enumerate(contents) if content]
    if not indices:
        return []
    markers = _markers(len(contents), [text, *avoid, *contents])

    def marked_render(replace: Sequence[int]) -> str | None:
        copies = [dict(m) for m in messages]
        for i in replace:
            copies[i]["content"] = markers[i]
        return render(copies)

    candidates = {markers[i]: _candidates(contents[i]) for i in indices}
    marked = marked_render(indices)
    if marked is not None:
        spans = _align(marked, candidates, text)
        if spans is not None:
            return spans
    spans = []
    for i in indices:  # the slow path: some content is not copied as is
        marked = marked_render([i])
        if marked is not None:
            spans.extend(_align(marked, {markers[i]: candidates[markers[i]]}, text) or [])
    return spans


def cut(text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[str, bool]]:
    """`text` as alternating pieces: `(piece, False)` inside `spans`, `(piece, True)` elsewhere;
    none empty, neighbours with different flags. A span overlapping one already taken (only
    from an erratic template) is ignored."""
    flags = []  # (start, end, from_template) runs
    position = 0
    for start, end in sorted(spans):
        if start < position:
            continue
        flags.append((position, start, True))
        flags.append((start, end, False))
        position = end
    flags.append((position, len(text), True))
    segments: list[tuple[str, bool]] = []
    for start, end, from_template in flags:
        if start == end:
            continue
        if segments and segments[-1][1] == from_template:
            segments[-1] = (segments[-1][0] + text[start:end], from_template)
        else:
            segments.append((text[start:end], from_template))
    return segments


def _candidates(content: str) -> tuple[str, ...]:
    """What a template may have made of a content: itself, or stripped (`| trim`)."""
    return tuple(dict.fromkeys((content, content.strip())))


def _markers(count: int, avoid: Sequence[str]) -> list[str]:
    """`count` distinct marker strings, none of which occurs in any of `avoid`.

    A marker is private-use characters around random hex digits: no whitespace (so `trim`
    keeps it), nothing a template would treat specially.
    """
    while True:
        token = secrets.token_hex(8)
        markers = [f"\ue000{token}.{i}\ue001" for i in range(count)]
        if not any(f"\ue000{token}." in s for s in avoid):
            return markers


def _align(
    marked: str, candidates: Mapping[str, Sequence[str]], text: str
) -> list[tuple[int, int]] | None:
    """Matches a marked render against the real one.

    Args:
      marked: the template's output with markers in place of some contents.
      candidates: for each marker, the texts that may stand in its place in `text`, tried in
        order; the first one that is followed in `text` by the template's text up to the next
        marker is taken.
      text: the real render.

    Returns:
      The `(start, end)` spans in `text` of the texts taken for the markers (an empty text
      gives none), if `marked` with those texts in place of its markers equals `text`, else
      None.
    """
    # With a capturing group, split gives [literal, marker, literal, marker, ..., literal].
    parts = re.split("(" + "|".join(re.escape(marker) for marker in candidates) + ")", marked)
    spans = []
    position = 0
    for k in range(0, len(parts), 2):
        literal = parts[k]
        if not text.startswith(literal, position):
            return None
        position += len(literal)
        if k + 1 == len(parts):
            break
        following = parts[k + 2]
        for candidate in candidates[parts[k + 1]]:
            end = position + len(candidate)
            if text.startswith(candidate, position) and text.startswith(following, end):
                break
        else:
            return None
        if candidate:
            spans.append((position, end))
        position = end
    return spans if position == len(text) else None
