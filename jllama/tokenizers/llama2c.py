"""llama2.c tokenizer files (`tokenizer.bin`) and the BPE encoder/decoder of llama2.c's run.c.

File layout, all little-endian (as written by llama2.c's `tokenizer.py` and read by run.c's
`build_tokenizer`):
  int32 max_token_length                      the longest piece, in bytes
  then for each token id 0 .. vocab_size-1:
    float32 score                             merge priority: higher merges first
    int32   len                               piece length in bytes, 0 <= len <= max_token_length
    len raw bytes                             the piece (UTF-8 text, SentencePiece's "▁" already
                                              replaced by a space; bytes tokens as "<0xNN>")
The file does not store vocab_size: it comes from the checkpoint header.

Conventions of the llama2.c vocabularies (Llama 2's 32000-token one and the small trained ones
such as tok512.bin): id 0 "<unk>", id 1 BOS (piece "\\n<s>\\n"), id 2 EOS (piece "\\n</s>\\n"),
ids 3..258 the byte-fallback tokens "<0x00>".."<0xFF>", then the merged pieces.
"""

from __future__ import annotations

import codecs
import dataclasses
import heapq
import operator
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from jllama.errors import TokenizerError
from jllama.files import require_regular_file

BOS_ID = 1
"""Beginning-of-sequence token id (llama2.c's hard-coded 1)."""

EOS_ID = 2
"""End-of-sequence token id (llama2.c's hard-coded 2)."""

BYTE_FALLBACK_OFFSET = 3
"""Id of the byte token "<0x00>": byte b falls back to id b + 3 (as run.c)."""

_NO_MERGE_SCORE = -1e10
"""run.c's initial best_score: a merge needs a score strictly above it (exact in float32)."""

_HEADER = struct.Struct("<i")
_ENTRY_HEADER = struct.Struct("<fi")
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
# A UTF-8 "code point group" as run.c's encode cuts it: any byte, then up to three bytes of the
# form 10xxxxxx (continuation bytes), greedily.
_CODE_POINT_GROUP = re.compile(rb"[\x00-\xff][\x80-\xbf]{0,3}")
# C's isspace() in the "C" locale: \t \n \v \f \r and space.
_C_SPACE = frozenset(b"\t\n\v\f\r ")


@dataclasses.dataclass(frozen=True, repr=False)
class Tokenizer:
    """A llama2.c vocabulary: pieces and merge scores, with run.c's encode and decode.

    Attributes:
      pieces: tuple[bytes] of length vocab_size; pieces[i] is the byte string of token id i.
      scores: tuple[float] of length vocab_size; the float32 merge score of each piece (exact
        as Python floats). Higher scores merge first.
      max_token_length: the longest piece in bytes, as stored in the file header.
      source: where the vocabulary came from (a path), used in error messages only; not part
        of equality or hashing.

    The bytes -> id lookup table is built once at construction. If a piece occurs more than
    once, the lookup returns the lowest id. (run.c sorts the vocabulary with qsort, which is not
    stable, and bsearch may return any of equal entries, so run.c leaves this unspecified; the
    llama2.c files tokenizer.bin and tok512.bin have no duplicate pieces.)

    Raises (at construction):
      ValueError: pieces and scores of different lengths, or an empty vocabulary.
    """

    pieces: tuple[bytes, ...]
    scores: tuple[float, ...]
    max_token_length: int
    source: str = dataclasses.field(default="<memory>", compare=False)
    _ids: dict[bytes, int] = dataclasses.field(init=False, compare=False, hash=False)

    def __post_init__(self):
        pieces = tuple(bytes(p) for p in self.pieces)
        scores = tuple(float(s) for s in self.scores)
        if len(pieces) != len(scores):
            raise ValueError(f"{len(pieces)} pieces but {len(scores)} scores")
        if not pieces:
            raise ValueError("empty vocabulary")
        ids: dict[bytes, int] = {}
        for i, piece in enumerate(pieces):
            ids.setdefault(piece, i)
        object.__setattr__(self, "pieces", pieces)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "max_token_length", int(self.max_token_length))
        object.__setattr__(self, "_ids", ids)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, "
            f"max_token_length={self.max_token_length}, source={self.source!r})"
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids (int)."""
        return len(self.pieces)

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str | bytes, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text`, exactly as llama2.c run.c's `encode(t, text, bos, eos, ...)`.

        1. BOS (id 1) if `bos`;
        2. if the text is non-empty, the id of the piece b" " (SentencePiece's dummy prefix);
        3. the UTF-8 bytes cut into code-point groups (a byte and up to 3 following bytes of
           the form 10xxxxxx); a group that is a piece gives its id, otherwise each byte b gives
           the byte-fallback id b + 3;
        4. merges: while some adjacent pair (BOS included) concatenates to a piece whose score
           is > -1e10, replace the pair with the highest such score (leftmost on ties) by that
           piece;
        5. EOS (id 2) if `eos`.

        run.c rescans every pair after each merge (quadratic in the text length); this uses a
        heap of candidate pairs over a linked list, with the same result, in O(n log n).

        Departures where run.c cannot be followed: a str is encoded to UTF-8 with
        "surrogateescape" (so undecodable argv bytes go through as the raw bytes run.c would
        see); NUL bytes are ordinary bytes (run.c's C string would end there); if the
        vocabulary has no piece b" ", the dummy prefix is the byte token of 0x20 (run.c would
        emit id -1).

        Args:
          text: the prompt, str (encoded as UTF-8) or bytes.
          bos: prepend BOS_ID.
          eos: append EOS_ID.

        Returns:
          list of int token ids in [0, vocab_size).

        Raises:
          TokenizerError: a byte needs the byte-fallback token but the vocabulary is too small
            to have one (fewer than 259 tokens).
          UnicodeEncodeError: a str holding surrogates other than surrogateescape's.
          TypeError: text neither str nor bytes.
        """
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogateescape")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
        tokens = [BOS_ID] if bos else []
        if data:
            space = self._ids.get(b" ")
            tokens.append(space if space is not None else self._byte_id(0x20))
        ids = self._ids
        for group in _CODE_POINT_GROUP.findall(data):
            token = ids.get(group)
            if token is not None:
                tokens.append(token)
            else:
                tokens.extend(self._byte_id(b) for b in group)
        tokens = self._merge(tokens)
        if eos:
            tokens.append(EOS_ID)
        return tokens

    def _byte_id(self, byte: int) -> int:
        token = byte + BYTE_FALLBACK_OFFSET
        if token >= len(self.pieces):
            raise TokenizerError(
                f"tokenizer {self.source}: byte 0x{byte:02X} needs the byte-fallback token "
                f"{token}, but the vocabulary has only {len(self.pieces)} tokens"
            )
        return token

    def _merge(self, tokens: list[int]) -> list[int]:
        """run.c's merge loop (step 4 of `encode`) with a heap and lazy invalidation.

        Nodes are the positions of the initial list; `current[i]` is the token at node i (-1 once
        merged away), `after`/`before` link the live nodes in order. The heap holds
        (-score, left node, left token, right token, merged token) for every adjacent pair that
        can merge, plus stale entries: an entry is live iff its left node still holds its left
        token and the left node's successor still holds its right token (the merge result
        depends only on the two tokens). Popping the smallest (-score, left node) is run.c's
        choice: highest score, leftmost pair on ties (node numbers keep the list's order).
        """
        n = len(tokens)
        if n < 2:
            return tokens
        pieces, scores, ids = self.pieces, self.scores, self._ids
        current = list(tokens)
        after = list(range(1, n + 1))
        after[-1] = -1
        before = list(range(-1, n - 1))

        heap = []
        for i in range(n - 1):
            a, b = current[i], current[i + 1]
            merged = ids.get(pieces[a] + pieces[b])
            if merged is not None and scores[merged] > _NO_MERGE_SCORE:
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
                if m is not None and scores[m] > _NO_MERGE_SCORE:
                    push(heap, (-scores[m], i, merged, right, m))
            h = before[i]
            if h >= 0:
                left = current[h]
                m = ids.get(pieces[left] + pieces[merged])
                if m is not None and scores[m] > _NO_MERGE_SCORE:
                    push(heap, (-scores[m], h, left, merged, m))
        return [t for t in current if t >= 0]

    # ------------------------------------------------------------------ decoding

    def decode_piece(self, prev_token: int, token: int) -> bytes:
        """The bytes token `token` stands for, as llama2.c run.c's `decode(t, prev, token)`.

        If `prev_token` is BOS_ID and the piece starts with a space, that one space is removed
        (SentencePiece's dummy prefix). Then a piece of the form "<0xNN>" (two hex digits)
        becomes the single raw byte 0xNN. BOS and EOS give their pieces as stored; the
        printing rules (skipping them, dropping control bytes) are `StreamDecoder`'s.

        Args:
          prev_token: the token before `token` (any value other than BOS_ID, e.g. -1, for none).
          token: int id in [0, vocab_size).

        Returns:
          the bytes (possibly empty, possibly a fragment of a UTF-8 character).

        Raises:
          IndexError: `token` out of range.
        """
        token = operator.index(token)
        if not 0 <= token < len(self.pieces):
            raise IndexError(f"token id {token} out of range [0, {len(self.pieces)})")
        piece = self.pieces[token]
        if prev_token == BOS_ID and piece[:1] == b" ":
            piece = piece[1:]
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes((int(match.group(1), 16),))
        return piece

    def stream_decoder(self) -> StreamDecoder:
        """A new `StreamDecoder` over this vocabulary."""
        return StreamDecoder(self)

    def decode(self, ids: Sequence[int], prev: int = -1) -> str:
        """Text of a whole id sequence, by the rules of `StreamDecoder`.

        The token before ids[i] is ids[i-1], and before ids[0] it is `prev` (default: none, so
        a leading space of its piece is kept; pass the last prompt token to decode a
        continuation as it prints after the prompt: only a piece right after a BOS loses it). BOS and EOS ids print nothing,
        single non-whitespace ASCII control bytes are dropped, and the bytes are decoded as
        UTF-8 with invalid or unfinished sequences replaced by U+FFFD.

        Args:
          ids: sequence of int token ids in [0, vocab_size), e.g. the output of `encode`.
          prev: the token before ids[0], or -1 for none.

        Returns:
          str. For text without non-whitespace control characters,
          decode(encode(text)) == text (the dummy-prefix space is stripped after BOS).

        Raises:
          IndexError: an id out of range.
        """
        stream = StreamDecoder(self)
        parts = []
        for token in ids:
            parts.append(stream.push(prev, token))
            prev = token
        parts.append(stream.flush())
        return "".join(parts)


class StreamDecoder:
    """Incremental detokenizer: token ids in, complete UTF-8 text out.

    Follows llama2.c run.c's `decode` + `safe_printf`, but decodes UTF-8 properly: the bytes of
    each piece go through an incremental UTF-8 decoder (errors="replace"), so a character split
    over several byte-fallback tokens comes out once, whole, when its last byte arrives.

    Per token: BOS_ID and EOS_ID print nothing (run.c stops generating at BOS and would print
    EOS's "\\n</s>\\n"; here both are markers, not text); a piece that is a single byte which is
    an ASCII control character (< 0x20 or 0x7f) other than C's whitespace (\\t \\n \\v \\f \\r)
    is dropped, as safe_printf does; bytes >= 0x80 are kept (run.c drops them) and decoded.

    Usage:
      stream = tokenizer.stream_decoder()
      for prev, token in ...: print(stream.push(prev, token), end="", flush=True)
      print(stream.flush())
    """

    def __init__(self, tokenizer: Tokenizer):
        """Args: tokenizer: the vocabulary whose ids will be pushed."""
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, prev_token: int, token: int) -> str:
        """Feed one token; return the text completed by it (may be "").

        Args:
          prev_token: the token before `token` (BOS_ID strips a leading space, as run.c).
          token: int id in [0, vocab_size).

        Raises:
          IndexError: `token` out of range.
        """
        piece = self._tokenizer.decode_piece(prev_token, token)
        if token == BOS_ID or token == EOS_ID:
            return ""
        if len(piece) == 1 and (piece[0] < 0x20 or piece[0] == 0x7F) and piece[0] not in _C_SPACE:
            return ""
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """End of stream: an unfinished UTF-8 sequence comes out as U+FFFD; then resets."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


# ---------------------------------------------------------------------- reading


def _read_entries(
    data: bytes, offset: int, max_token_length: int, limit: int | None
) -> tuple[list[bytes], list[float], int, str | None]:
    """Parse (score, len, piece) entries from `offset` until EOF or `limit` entries.

    Returns (pieces, scores, offset after the last whole entry, problem): problem is None when
    parsing stopped cleanly (at EOF or at the limit), else a description of the bad entry.
    """
    pieces: list[bytes] = []
    scores: list[float] = []
    end = len(data)
    while offset < end and (limit is None or len(pieces) < limit):
        token = len(pieces)
        if offset + _ENTRY_HEADER.size > end:
            return pieces, scores, offset, (
                f"ends inside the score/length of token {token} "
                f"({end - offset} bytes left, {_ENTRY_HEADER.size} needed)"
            )
        score, length = _ENTRY_HEADER.unpack_from(data, offset)
        if length < 0:
            return pieces, scores, offset, (
                f"token {token} has a negative length {length} (at byte {offset + 4})"
            )
        if length > max_token_length:
            return pieces, scores, offset, (
                f"token {token} is {length} bytes long, more than the header's "
                f"max_token_length {max_token_length}"
            )
        start = offset + _ENTRY_HEADER.size
        if start + length > end:
            return pieces, scores, offset, (
                f"ends inside the piece of token {token} ({end - start} of {length} bytes)"
            )
        pieces.append(data[start : start + length])
        scores.append(score)
        offset = start + length
    return pieces, scores, offset, None


def read_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
    """Read a llama2.c tokenizer file (run.c's `build_tokenizer`, with its checks made strict).

    Args:
      path: the tokenizer.bin file (read whole; these files are under a megabyte).
      vocab_size: the checkpoint's vocab_size. When given, the file must hold exactly that many
        tokens. When None, tokens are read up to the end of the file, which must end exactly
        after a whole token.

    Returns:
      a `Tokenizer` with `source` set to the path.

    Raises:
      TokenizerError: missing, unreadable or directory path; a file shorter than its 4-byte
        header; max_token_length < 1; a token with a negative length or one longer than
        max_token_length; a file ending inside a token; fewer tokens than vocab_size; more
        tokens than vocab_size (probably the wrong tokenizer for the checkpoint); vocab_size
        < 1. The message is one line naming the path.
    """
    path = Path(path)
    what = f"tokenizer {path}"
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise TokenizerError(f"{what}: vocab_size must be a positive integer, got {vocab_size!r}")
    require_regular_file(path, what, TokenizerError)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{what}: cannot read: {e.strerror or e}") from None

    if len(data) < _HEADER.size:
        raise TokenizerError(
            f"{what}: {len(data)} bytes, shorter than the 4-byte header (max_token_length)"
        )
    (max_token_length,) = _HEADER.unpack_from(data, 0)
    if max_token_length < 1:
        raise TokenizerError(f"{what}: header max_token_length is {max_token_length}, not >= 1")

    pieces, scores, offset, problem = _read_entries(
        data, _HEADER.size, max_token_length, vocab_size
    )
    if problem is not None:
        if vocab_size is None:
            raise TokenizerError(f"{what}: {problem}")
        raise TokenizerError(
            f"{what}: {problem}, after {len(pieces)} whole tokens; "
            f"the checkpoint's vocab_size is {vocab_size}"
        )
    if not pieces:
        raise TokenizerError(f"{what}: holds no tokens (only the header)")
    if vocab_size is not None:
        if len(pieces) < vocab_size:
            raise TokenizerError(
                f"{what}: file ends after {len(pieces)} tokens "
                f"but the checkpoint's vocab_size is {vocab_size}"
            )
        if offset < len(data):
            rest, _, _, rest_problem = _read_entries(data, offset, max_token_length, None)
            if rest_problem is None:
                raise TokenizerError(
                    f"{what}: holds {vocab_size + len(rest)} tokens but the checkpoint's "
                    f"vocab_size is {vocab_size} (the wrong tokenizer for this checkpoint?)"
                )
            raise TokenizerError(
                f"{what}: holds more than the checkpoint's vocab_size of {vocab_size} tokens: "
                f"{len(data) - offset} bytes follow token {vocab_size - 1} "
                f"(the wrong tokenizer for this checkpoint?)"
            )
    return Tokenizer(
        pieces=tuple(pieces),
        scores=tuple(scores),
        max_token_length=max_token_length,
        source=str(path),
    )
