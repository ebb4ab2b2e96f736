"""llama2.c run.c's `encode`, steps 2-4: the dummy prefix, code-point groups with byte
fallback, and the BPE merge loop (with a heap).

run.c cuts the text's UTF-8 bytes into code-point groups, looks each up (falling back to one
byte token per byte), then repeatedly scans the token list for the adjacent pair whose
concatenation is a piece with the highest score (leftmost on ties, and only scores above
-1e10) and replaces the pair with that piece, until no pair merges. `merge` gives the same
result in O(n log n). Source: karpathy/llama2.c run.c, `encode`.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence

from jllama.errors import TokenizerError

NO_MERGE_SCORE = -1e10
"""run.c's initial best_score: a merge needs a score strictly above it (exact in float32), so
a piece scored this low never comes out of a merge."""

BYTE_FALLBACK_OFFSET = 3
"""Id of the byte token "<0x00>": byte b falls back to id b + 3 (as run.c)."""

# A UTF-8 "code point group" as run.c's encode cuts it: any byte, then up to three bytes of the
# form 10xxxxxx (continuation bytes), greedily.
_CODE_POINT_GROUP = re.compile(rb"[\x00-\xff][\x80-\xbf]{0,3}")


def byte_token_ids(ids: Mapping[bytes, int], vocab_size: int) -> tuple[int, ...]:
    """The byte-fallback id of each byte 0..255: the piece "<0xNN>" (upper-case hex) where the
    vocabulary has one, else run.c's id byte + 3, or -1 where that is not an id."""
    out = []
    for b in range(256):
        token = ids.get(b"<0x%02X>" % b)
        if token is None:
            token = b + BYTE_FALLBACK_OFFSET if b + BYTE_FALLBACK_OFFSET < vocab_size else -1
        out.append(token)
    return tuple(out)


def initial_tokens(
    data: bytes, prefix: bool, ids: Mapping[bytes, int], byte_ids: Sequence[int],
    vocab_size: int, source: str,
) -> list[int]:
    """Steps 2-3 of run.c's `encode`: the dummy prefix (the piece b" ", else the byte token of
    0x20) if `prefix` and `data`, then each code-point group's id, or its bytes' byte-fallback
    ids (`byte_ids`, from `byte_token_ids`).

    Raises:
      TokenizerError: a byte without a byte-fallback id (a vocabulary of fewer than 259
        tokens); one line naming `source`.
    """

    def byte_id(byte: int) -> int:
        token = byte_ids[byte]
        if token < 0:
            raise TokenizerError(
                f"tokenizer {source}: byte 0x{byte:02X} needs the byte-fallback token "
                f"{byte + BYTE_FALLBACK_OFFSET}, but the vocabulary has only {vocab_size} tokens"
            )
        return token

    tokens = []
    if prefix and data:
        space = ids.get(b" ")
        tokens.append(space if space is not None else byte_id(0x20))
    for group in _CODE_POINT_GROUP.findall(data):
        token = ids.get(group)
        if token is not None:
            tokens.append(token)
        else:
            tokens.extend(byte_id(b) for b in group)
    return tokens


def merge(
    tokens: list[int],
    pieces: Sequence[bytes],
    scores: Sequence[float],
    ids: Mapping[bytes, int],
) -> list[int]:
    """The tokens after run.c's merge loop.

    Args:
      tokens: the initial ids (BOS, the dummy prefix, the code-point groups).
      pieces, scores: the vocabulary's piece and merge score of each id.
      ids: piece -> id (the lowest id of a piece listed twice).

    Returns:
      list of ids (`tokens` itself when it has fewer than two).

    Nodes are the positions of the initial list; `current[i]` is the token at node i (-1 once
    merged away), `after`/`before` link the live nodes in order. The heap holds
    (-score, left node, left token, right token, merged token) for every adjacent pair that
    can merge, plus stale entries: an entry is live iff its left node still holds its left
    token and the left node's successor still holds its right token (the merge result depends
    only on the two tokens). Popping the smallest (-score, left node) is run.c's choice:
    highest score, leftmost pair on ties (node numbers keep the list's order).
    """
    n = len(tokens)
    if n < 2:
        return tokens
    current = list(tokens)
    after = list(range(1, n + 1))
    after[-1] = -1
    before = list(range(-1, n - 1))

    heap = []
    for i in range(n - 1):
        a, b = current[i], current[i + 1]
        merged = ids.get(pieces[a] + pieces[b])
        if merged is not None and scores[merged] > NO_MERGE_SCORE:
            heap.append((-scores[merged], i, a, b, merged))
    heapq.heapify(heap)

    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, i, a, b, merged = pop(heap)
        j = after[i]
        if current[i] != a or j < 0 or current[j] != b:
            continue  # stale: one side changed since this pair was pushed
        current[i] = merged
        current[j] = -1
        k = after[j]
        after[i] = k
        if k >= 0:
            before[k] = i
            right = current[k]
            m = ids.get(pieces[merged] + pieces[right])
            if m is not None and scores[m] > NO_MERGE_SCORE:
                push(heap, (-scores[m], i, merged, right, m))
        h = before[i]
        if h >= 0:
            left = current[h]
            m = ids.get(pieces[left] + pieces[merged])
            if m is not None and scores[m] > NO_MERGE_SCORE:
                push(heap, (-scores[m], h, left, merged, m))
    return [t for t in current if t >= 0]
