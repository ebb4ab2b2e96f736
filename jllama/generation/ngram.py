"""N-gram drafters: prompt lookup over a sequence's own tokens (`NgramDrafter`, `--draft=ngram`)
and an n-gram pool that the generations of one `Session` share (`--draft=ngram-pool`): the
n-grams of every sequence a drafter has read, the server's slots' included, offered as drafts to
the others, as llama.cpp's `ngram-mod` speculation shares one pool among a server's slots.

A `PooledNgramDrafter` looks up its own sequence first (prompt lookup, `NgramDrafter`); where
its last tokens occurred nowhere in it, the pool's latest occurrence in another sequence
proposes what followed there. So a request that repeats what another request wrote (a reply
quoted back, the same document edited twice, a template's boilerplate) drafts it at once.
Drafts are only proposals: the tokens are plain decoding's whatever the pool holds.

The pool holds the drafters' own token lists (no copies) for the latest `max_sequences`
sequences; an index entry names a sequence by a number that a sequence rewound or evicted
never gets back, so stale entries are skipped, and the index is rebuilt from the live
sequences once it holds many more entries than they have. It is used from one thread at a
time (a generation's, or the engine's scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens.

    Args:
      max_n, min_n: the longest and shortest suffix (tokens) looked up, longest first.

    The index (n-gram -> the position after its latest earlier occurrence) grows with the
    sequence, so a draft costs a few dictionary lookups however long the sequence is.
    """

    def __init__(self, max_n: int = 5, min_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def _update(self, history: Sequence[int]) -> None:
        seen = self._seen
        if len(history) < len(seen) or history[:len(seen)] != seen:
            seen.clear()  # another sequence, or one rewound: index it anew
            self._index.clear()
        start = len(seen)
        seen.extend(history[start:])
        # Index the n-grams that end before the last token: each has a continuation.
        for end in range(max(start, 1), len(seen)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(seen[end - n:end])] = end

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens proposed to follow `history` (the sequence so far, the last token
        included); [] when its last tokens occurred nowhere before."""
        if k < 1:
            return []
        self._update(history)
        seen = self._seen
        for n in range(min(self.max_n, len(seen) - 1), self.min_n - 1, -1):
            after = self._index.get(tuple(seen[-n:]))
            if after is not None:
                return seen[after:after + k]
        return []



class NgramPool:
    """The n-grams (of `min_n` .. `max_n` tokens) of the latest `max_sequences` sequences, each
    mapped to where it last occurred: (sequence number, the position after it).

    Args:
      max_sequences: sequences kept (the oldest is forgotten when one more is added).
      max_n, min_n: the longest and shortest n-gram indexed (a drafter's own).
    """

    def __init__(self, max_sequences: int = 32, max_n: int = 5, min_n: int = 3):
        if max_sequences < 1:
            raise ValueError(f"max_sequences={max_sequences} must be at least 1")
        self.max_sequences, self.max_n, self.min_n = max_sequences, max_n, min_n
        self._sequences: dict[int, list[int]] = {}  # oldest first
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._next = 0

    def add(self, tokens: list[int]) -> int:
        """Keep `tokens` (a drafter's own list, which it grows) as a new sequence; returns its
        number for `extend` and `drop`."""
        number, self._next = self._next, self._next + 1
        self._sequences[number] = tokens
        while len(self._sequences) > self.max_sequences:
            del self._sequences[next(iter(self._sequences))]
        return number

    def drop(self, number: int) -> None:
        """Forget a sequence (its drafter rewound it): its index entries become stale."""
        self._sequences.pop(number, None)

    def extend(self, number: int, start: int) -> None:
        """Index the n-grams of sequence `number` that end at positions start .. len - 2 (each
        has a token after it)."""
        seq = self._sequences.get(number)
        if seq is None:
            return
        for end in range(max(start, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(seq[end - n:end])] = (number, end)
        live = sum(len(s) for s in self._sequences.values())
        if len(self._index) > 4 * (self.max_n - self.min_n + 1) * max(live, 1024):
            self._rebuild()

    def _rebuild(self) -> None:
        self._index.clear()
        for number in list(self._sequences):
            self.extend(number, 1)

    def lookup(self, history: Sequence[int], k: int, exclude: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest occurrence, in another sequence than
        `exclude`, of `history`'s last n tokens (n from max_n down to min_n); [] if none."""
        for n in range(min(self.max_n, len(history)), self.min_n - 1, -1):
            found = self._index.get(tuple(history[-n:]))
            if found is None or found[0] == exclude:
                continue
            seq = self._sequences.get(found[0])
            if seq is not None and found[1] < len(seq):
                return seq[found[1]:found[1] + k]
        return []


class PooledNgramDrafter(NgramDrafter):
    """Prompt lookup over the sequence's own tokens, then over `pool`'s other sequences; the
    sequence it reads goes into the pool for the others.

    Args:
      pool: the `NgramPool` of the session.
    """

    def __init__(self, pool: NgramPool):
        super().__init__(pool.max_n, pool.min_n)
        self._pool = pool
        self._number = pool.add(self._seen)

    def _update(self, history: Sequence[int]) -> None:
        before = len(self._seen)
        rewound = len(history) < before or history[:before] != self._seen
        super()._update(history)
        if rewound:  # another sequence in the same list: under a new number
            self._pool.drop(self._number)
            self._number = self._pool.add(self._seen)
            before = 0
        self._pool.extend(self._number, before)

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens proposed to follow `history`: from its own earlier tokens, else from
        the pool's other sequences; [] when neither holds its last tokens."""
        own = super().draft(history, k)
        if own or k < 1:
            return own
        return self._pool.lookup(self._seen, k, exclude=self._number)
