"""Stop strings: cut generated text at the first occurrence of any of them, as it streams.

Text arrives in pieces (one per token, or none while a UTF-8 character is incomplete), and a
stop string may arrive split across pieces. `StopMatcher` releases text as soon as it cannot be
the start of a stop string, and holds back the rest, so the stop string itself (or a part of it)
is never released: OpenAI's and llama.cpp's servers both end the output just before it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string in a stream of text pieces.

    Args:
      stops: the stop strings, each non-empty (an empty sequence: nothing ever stops).

    Attributes:
      stopped: True once a stop string was found; later pushes release nothing.
      matched: the stop string found (of those starting earliest, the first given), or None.

    Raises:
      ValueError: an empty stop string.

    Usage:
      matcher = StopMatcher(["\\n\\n", "END"])
      for piece in pieces:
          out.write(matcher.push(piece))
          if matcher.stopped: break
      else:
          out.write(matcher.flush())
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add `text`; return what can be released now (may be "").

        When a stop string is complete, returns the text before its first occurrence (the
        earliest start among all stop strings), sets `stopped` and drops the rest."""
        if self.stopped:
            return ""
        pending = self._pending + text
        found = [(i, k) for k, i in enumerate(pending.find(s) for s in self._stops) if i >= 0]
        first = min(found, default=(-1, -1))[0]
        if first >= 0:
            self.stopped = True
            self.matched = self._stops[min(found)[1]]
            self._pending = ""
            return pending[:first]
        held = self._held_back(pending)
        self._pending = pending[len(pending) - held:]
        return pending[: len(pending) - held]

    def flush(self) -> str:
        """End of the stream without a stop: release the text held back."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
