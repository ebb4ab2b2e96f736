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

The same `Tokenizer` also serves SentencePiece vocabularies read from GGUF files
(`jllama.tokenizers.gguf`), which set the optional fields: other BOS/EOS ids, no dummy prefix,
control tokens that print nothing, and special tokens matched in the text.

Every tokenizer in `jllama.tokenizers` offers the same protocol: `vocab_size`, `bos_id`,
`eos_id`, `add_bos`, `stop_ids`, `encode(text, bos=None, eos=False, parse_special=False)`,
`encode_segments(segments, bos=None, eos=False)`, `decode(ids, prev=-1, *, special=False)`,
`stream_decoder(special=False)` (an object with `push(prev_token, token)` and `flush()`) and
`piece(id)`. This module also holds the two helpers the tokenizers share:
`split_special_tokens` and `bytes_for_display`.
"""

from __future__ import annotations

import bisect
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
_SPACE_MARK = "\u2581".encode()  # SentencePiece's "▁"
# C's isspace() in the "C" locale: \t \n \v \f \r and space.
_C_SPACE = frozenset(b"\t\n\v\f\r ")


# ---------------------------------------------------------------------- shared helpers


def split_special_tokens(
    segments: Sequence[tuple[str, bool]],
    specials: Sequence[tuple[str, int, bool]],
) -> list[str | int]:
    """Cut text at special-token matches, as llama.cpp's `tokenizer_st_partition` does.

    The text is the concatenation of the segments' strings. Each special token is tried in
    the order given (callers pass them longest text first, then lowest id, as llama.cpp sorts
    its special-token cache); each one cuts every text fragment left by the previous ones at
    its non-overlapping occurrences, leftmost first. A token with `always` set (GGUF
    user-defined tokens) matches anywhere; one without (control and unknown tokens) matches
    only where the occurrence lies wholly inside flagged segments (consecutive flagged
    segments count as one span), so `[(text, True)]` is llama.cpp's `parse_special=true` and
    `[(text, False)]` its `parse_special=false`.

    Args:
      segments: consecutive (text, may_parse_special) pieces of the text.
      specials: (token text, token id, always) triples; empty texts are ignored.

    Returns:
      list of non-empty str (text runs, to be encoded as ordinary text) and int (token ids),
      in text order. Empty text gives [].

    Source: llama.cpp src/llama-vocab.cpp (`tokenizer_st_partition`, cache_special_tokens),
    extended with the per-segment flags.
    """
    text = "".join(part for part, _ in segments)
    # Maximal flagged spans [start, end) of the text, as two sorted lists.
    span_starts: list[int] = []
    span_ends: list[int] = []
    offset = 0
    for part, flagged in segments:
        end = offset + len(part)
        if flagged and part:
            if span_ends and span_ends[-1] == offset:
                span_ends[-1] = end
            else:
                span_starts.append(offset)
                span_ends.append(end)
        offset = end

    def allowed(start: int, end: int) -> bool:
        k = bisect.bisect_right(span_starts, start) - 1
        return k >= 0 and end <= span_ends[k]

    # Fragments: (start, end) ranges of unsplit text, or token ids.
    fragments: list[tuple[int, int] | int] = [(0, len(text))] if text else []
    for special, token, always in specials:
        if not special or special not in text:
            continue
        cut: list[tuple[int, int] | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                cut.append(fragment)
                continue
            start, end = fragment
            emit_from = search_from = start
            while True:
                hit = text.find(special, search_from, end)
                if hit < 0:
                    break
                if not always and not allowed(hit, hit + len(special)):
                    search_from = hit + 1
                    continue
                if hit > emit_from:
                    cut.append((emit_from, hit))
                cut.append(token)
                emit_from = search_from = hit + len(special)
            if emit_from < end:
                cut.append((emit_from, end))
        fragments = cut
    return [f if isinstance(f, int) else text[f[0] : f[1]] for f in fragments]


def bytes_for_display(data: bytes) -> str:
    """`data` decoded as UTF-8, with each byte of an invalid or partial sequence shown as
    "<0xNN>" (upper-case hex), e.g. b"\\xe2\\x96" -> "<0xE2><0x96>". For `piece(id)`."""
    out = []
    while data:
        try:
            out.append(data.decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            out.append(data[: e.start].decode("utf-8"))
            out.extend(f"<0x{b:02X}>" for b in data[e.start : e.end])
            data = data[e.end :]
    return "".join(out)


# ---------------------------------------------------------------------- the tokenizer


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
      bos_id: int, the BOS id `encode` prepends (llama2.c: 1).
      eos_id: int, the EOS id `encode(eos=True)` appends (llama2.c: 2).
      add_bos: bool, whether `encode` prepends BOS when its `bos` is None (llama2.c: True).
      add_space_prefix: bool, whether a text run that starts the text or follows a special
        token gets SentencePiece's dummy-prefix space (llama2.c: True), and whether decoding
        drops the leading space of the piece after BOS.
      control_ids: frozenset of ids that print nothing unless decoded with special=True.
        None (the default) means {bos_id, eos_id}; GGUF vocabularies pass their control,
        unknown and unused tokens.
      special_tokens: tuple of (text, id, always) triples matched in the text before BPE (see
        `split_special_tokens`): `always` for GGUF user-defined tokens, else only with
        parse_special. llama2.c files have none, so there `parse_special` has no effect (its
        BOS/EOS pieces "\\n<s>\\n" and "\\n</s>\\n" are not meant to be typed).
      stop_ids: frozenset of ids that end a generation. None (the default) means
        {bos_id, eos_id}: run.c stops at BOS, and jllama also at EOS.
      space_mark_is_space: bool, read U+2581 ("▁") in the text as a space, as SentencePiece
        and llama.cpp do (they write spaces as "▁" before BPE, so the two are one there).
        False for llama2.c files (run.c encodes it as any other character).

    The bytes -> id lookup table is built once at construction. If a piece occurs more than
    once, the lookup returns the lowest id. (run.c sorts the vocabulary with qsort, which is not
    stable, and bsearch may return any of equal entries, so run.c leaves this unspecified; the
    llama2.c files tokenizer.bin and tok512.bin have no duplicate pieces.)

    Byte fallback uses the piece "<0xNN>" (upper-case hex) where the vocabulary has one, else
    run.c's rule id = byte + 3 (the same ids in llama2.c's files).

    Raises (at construction):
      ValueError: pieces and scores of different lengths, an empty vocabulary, or a
        bos/eos/control/special/stop id out of range.
    """

    pieces: tuple[bytes, ...]
    scores: tuple[float, ...]
    max_token_length: int
    source: str = dataclasses.field(default="<memory>", compare=False)
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    add_bos: bool = True
    add_space_prefix: bool = True
    control_ids: frozenset[int] | None = None
    special_tokens: tuple[tuple[str, int, bool], ...] = ()
    stop_ids: frozenset[int] | None = None
    space_mark_is_space: bool = False
    _ids: dict[bytes, int] = dataclasses.field(init=False, compare=False, hash=False)
    _byte_ids: tuple[int, ...] = dataclasses.field(init=False, compare=False, hash=False)
    _specials: tuple[tuple[str, int, bool], ...] = dataclasses.field(
        init=False, compare=False, hash=False
    )

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
        n = len(pieces)
        bos_id, eos_id = operator.index(self.bos_id), operator.index(self.eos_id)
        control = frozenset(
            {bos_id, eos_id} if self.control_ids is None else map(operator.index, self.control_ids)
        )
        stop = frozenset(
            {bos_id, eos_id} if self.stop_ids is None else map(operator.index, self.stop_ids)
        )
        specials = tuple((str(t), operator.index(i), bool(a)) for t, i, a in self.special_tokens)
        for what, group in [
            ("bos_id", [bos_id]), ("eos_id", [eos_id]), ("control_ids", control),
            ("stop_ids", stop), ("special_tokens", [i for _, i, _ in specials]),
        ]:
            bad = [i for i in group if not 0 <= i < n]
            if bad:
                raise ValueError(f"{what}: id {bad[0]} out of range [0, {n})")
        byte_ids = []
        for b in range(256):
            token = ids.get(b"<0x%02X>" % b)
            byte_ids.append(token if token is not None else -1)
        object.__setattr__(self, "pieces", pieces)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "max_token_length", int(self.max_token_length))
        object.__setattr__(self, "bos_id", bos_id)
        object.__setattr__(self, "eos_id", eos_id)
        object.__setattr__(self, "add_bos", bool(self.add_bos))
        object.__setattr__(self, "add_space_prefix", bool(self.add_space_prefix))
        object.__setattr__(self, "space_mark_is_space", bool(self.space_mark_is_space))
        object.__setattr__(self, "control_ids", control)
        object.__setattr__(self, "special_tokens", specials)
        object.__setattr__(self, "stop_ids", stop)
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_byte_ids", tuple(byte_ids))
        object.__setattr__(
            self, "_specials", tuple(sorted(specials, key=lambda s: (-len(s[0]), s[1])))
        )

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

    def encode(
        self,
        text: str | bytes,
        bos: bool | None = None,
        eos: bool = False,
        parse_special: bool = False,
    ) -> list[int]:
        """Token ids of `text`, exactly as llama2.c run.c's `encode(t, text, bos, eos, ...)`.

        1. BOS (`bos_id`, 1 in llama2.c files) if `bos`;
        2. if the text is non-empty, the id of the piece b" " (SentencePiece's dummy prefix);
        3. the UTF-8 bytes cut into code-point groups (a byte and up to 3 following bytes of
           the form 10xxxxxx); a group that is a piece gives its id, otherwise each byte b gives
           its byte-fallback id (the piece "<0xNN>", which is id b + 3 in llama2.c's files);
        4. merges: while some adjacent pair (BOS included) concatenates to a piece whose score
           is > -1e10, replace the pair with the highest such score (leftmost on ties) by that
           piece;
        5. EOS (`eos_id`, 2 in llama2.c files) if `eos`.

        run.c rescans every pair after each merge (quadratic in the text length); this uses a
        heap of candidate pairs over a linked list, with the same result, in O(n log n).

        With `special_tokens` (GGUF vocabularies only), the text is first cut at special-token
        matches (`split_special_tokens`); each text run between them is encoded by steps 2-4
        on its own, with the dummy prefix only on a run that starts the text or follows a
        special token (llama.cpp's SPM rule), and the special tokens' ids go between them.

        Departures where run.c cannot be followed: a str is encoded to UTF-8 with
        "surrogateescape" (so undecodable argv bytes go through as the raw bytes run.c would
        see); NUL bytes are ordinary bytes (run.c's C string would end there); if the
        vocabulary has no piece b" ", the dummy prefix is the byte token of 0x20 (run.c would
        emit id -1).

        Args:
          text: the prompt, str (encoded as UTF-8) or bytes.
          bos: prepend `bos_id`; None means `add_bos`.
          eos: append `eos_id`.
          parse_special: also match control/unknown special tokens in the text (user-defined
            ones always match). No effect for llama2.c files, which have no special tokens.

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
        if not self._specials:
            return self._encode_parts([data] if data else [], bos, eos)
        segments = [(data.decode("utf-8", "surrogateescape"), parse_special)]
        return self._encode_parts(self._split(segments), bos, eos)

    def encode_segments(
        self, segments: Sequence[tuple[str, bool]], bos: bool | None = None, eos: bool = False
    ) -> list[int]:
        """Token ids of the concatenated text of `segments`, with special tokens parsed only
        inside flagged segments.

        The same as `encode("".join(texts), bos, eos, parse_special=...)` except that a
        control/unknown special token is matched only where its text lies wholly inside
        segments flagged True (see `split_special_tokens`); the text runs between the matches
        are encoded whole, so the result does not depend on where the segments are cut. Chat
        templates use this: the template's own markers become single ids while the same text
        typed by the user stays text.

        Args:
          segments: sequence of (str, may_parse_special) pairs.
          bos: prepend `bos_id`; None means `add_bos`.
          eos: append `eos_id`.

        Returns:
          list of int token ids.

        Raises:
          as `encode`.
        """
        if not self._specials:
            return self.encode("".join(text for text, _ in segments), bos=bos, eos=eos)
        return self._encode_parts(self._split(segments), bos, eos)

    def _split(self, segments: Sequence[tuple[str, bool]]) -> list[bytes | int]:
        parts = split_special_tokens(segments, self._specials)
        return [p if isinstance(p, int) else p.encode("utf-8", "surrogateescape") for p in parts]

    def _encode_parts(self, parts: list[bytes | int], bos: bool | None, eos: bool) -> list[int]:
        """Steps 1-5 of `encode` over text runs (bytes) and special-token ids (int).

        BOS joins the first run's merge list as in run.c (its piece never merges in practice);
        a special token ends the current run's merges.
        """
        if bos is None:
            bos = self.add_bos
        out: list[int] = []
        run = [self.bos_id] if bos else []
        prefix = self.add_space_prefix
        for part in parts:
            if isinstance(part, int):
                out.extend(self._merge(run))
                out.append(part)
                run = []
                prefix = self.add_space_prefix
            else:
                run.extend(self._initial_tokens(part, prefix))
                prefix = False
        out.extend(self._merge(run))
        if eos:
            out.append(self.eos_id)
        return out

    def _initial_tokens(self, data: bytes, prefix: bool) -> list[int]:
        """Steps 2-3 of `encode`: the dummy prefix (if `prefix` and data) and the groups."""
        tokens = []
        ids = self._ids
        if self.space_mark_is_space:
            data = data.replace(_SPACE_MARK, b" ")
        if prefix and data:
            space = ids.get(b" ")
            tokens.append(space if space is not None else self._byte_id(0x20))
        for group in _CODE_POINT_GROUP.findall(data):
            token = ids.get(group)
            if token is not None:
                tokens.append(token)
            else:
                tokens.extend(self._byte_id(b) for b in group)
        return tokens

    def _byte_id(self, byte: int) -> int:
        token = self._byte_ids[byte]
        if token >= 0:
            return token
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

        If `prev_token` is `bos_id` (BOS_ID in llama2.c files), `add_space_prefix` is set and
        the piece starts with a space, that one space is removed (SentencePiece's dummy
        prefix). Then a piece of the form "<0xNN>" (two hex digits)
        becomes the single raw byte 0xNN. BOS and EOS give their pieces as stored; the
        printing rules (skipping them, dropping control bytes) are `StreamDecoder`'s.

        Args:
          prev_token: the token before `token` (any value other than bos_id, e.g. -1, for none).
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
        if prev_token == self.bos_id and self.add_space_prefix and piece[:1] == b" ":
            piece = piece[1:]
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes((int(match.group(1), 16),))
        return piece

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        """A new `StreamDecoder` over this vocabulary (`special`: print control tokens too)."""
        return StreamDecoder(self, special=special)

    def decode(self, ids: Sequence[int], prev: int = -1, *, special: bool = False) -> str:
        """Text of a whole id sequence, by the rules of `StreamDecoder`.

        The token before ids[i] is ids[i-1], and before ids[0] it is `prev` (default: none, so
        a leading space of its piece is kept; pass the last prompt token to decode a
        continuation as it prints after the prompt: only a piece right after a BOS loses it).
        Control ids (BOS and EOS in llama2.c files) print nothing unless `special`, single
        non-whitespace ASCII control bytes are dropped, and the bytes are decoded as UTF-8
        with invalid or unfinished sequences replaced by U+FFFD.

        Args:
          ids: sequence of int token ids in [0, vocab_size), e.g. the output of `encode`.
          prev: the token before ids[0], or -1 for none.
          special: print the pieces of control ids as stored (e.g. "\\n<s>\\n").

        Returns:
          str. For text without non-whitespace control characters,
          decode(encode(text)) == text (the dummy-prefix space is stripped after BOS).

        Raises:
          IndexError: an id out of range.
        """
        stream = StreamDecoder(self, special=special)
        parts = []
        for token in ids:
            parts.append(stream.push(prev, token))
            prev = token
        parts.append(stream.flush())
        return "".join(parts)

    def piece(self, token: int) -> str:
        """Display form of one token (for `jllama tokenize --pieces`): its bytes as
        `decode_piece(-1, token)` gives them (byte tokens as the byte, control tokens as
        stored), decoded as UTF-8 with bytes of partial characters shown as "<0xNN>".

        Raises:
          IndexError: `token` out of range.
        """
        return bytes_for_display(self.decode_piece(-1, token))


class StreamDecoder:
    """Incremental detokenizer: token ids in, complete UTF-8 text out.

    Follows llama2.c run.c's `decode` + `safe_printf`, but decodes UTF-8 properly: the bytes of
    each piece go through an incremental UTF-8 decoder (errors="replace"), so a character split
    over several byte-fallback tokens comes out once, whole, when its last byte arrives.

    Per token: the tokenizer's control ids (BOS_ID and EOS_ID in llama2.c files) print nothing
    unless `special` (run.c stops generating at BOS and would print EOS's "\\n</s>\\n"; here
    both are markers, not text); a piece that is a single byte which is
    an ASCII control character (< 0x20 or 0x7f) other than C's whitespace (\\t \\n \\v \\f \\r)
    is dropped, as safe_printf does; bytes >= 0x80 are kept (run.c drops them) and decoded.

    Usage:
      stream = tokenizer.stream_decoder()
      for prev, token in ...: print(stream.push(prev, token), end="", flush=True)
      print(stream.flush())
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        """Args: tokenizer: the vocabulary whose ids will be pushed; special: print control
        tokens' pieces too."""
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, prev_token: int, token: int) -> str:
        """Feed one token; return the text completed by it (may be "").

        Args:
          prev_token: the token before `token` (bos_id strips a leading space, as run.c).
          token: int id in [0, vocab_size).

        Raises:
          IndexError: `token` out of range.
        """
        piece = self._tokenizer.decode_piece(prev_token, token)
        if not self._special and token in self._tokenizer.control_ids:
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

    if data[:4] == b"GGUF":
        raise TokenizerError(
            f"{what}: is a GGUF model file, not a llama2.c tokenizer (a GGUF file carries its "
            "own tokenizer: pass it as --checkpoint)"
        )
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
