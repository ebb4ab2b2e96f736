"""SentencePiece-style BPE with byte fallback, encoded and decoded as llama2.c's run.c does.

`Tokenizer` holds a vocabulary of byte pieces with merge scores: llama2.c's tokenizer.bin
(read by `jllama.tokenizers.llama2c.read_tokenizer`), a GGUF "llama" vocabulary
(`jllama.tokenizers.gguf`) or a SentencePiece-style tokenizer.json (`jllama.tokenizers.hf`).
Its `encode` is run.c's `encode` (dummy prefix, code-point groups with byte fallback, then
run.c's merge loop: `jllama.tokenizers.spm_encode`), extended with special tokens; its
`decode_piece` is run.c's `decode`, and printing follows run.c's `safe_printf`.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import ClassVar

from jllama.tokenizers.base import (
    BOS_ID,
    EOS_ID,
    DecodesPrintedBytes,
    Segments,
    check_token,
)
from jllama.tokenizers.specials import special_order, split_special_tokens
from jllama.tokenizers.spm_encode import (
    BYTE_FALLBACK_OFFSET,
    NO_MERGE_SCORE,
    byte_token_ids,
    initial_tokens,
    merge,
)

SPACE_MARK = "\u2581"
"""SentencePiece's "▁", which stands for a space in token texts."""

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = SPACE_MARK.encode()
# C's isspace() in the "C" locale: \t \n \v \f \r and space.
_C_SPACE = frozenset(b"\t\n\v\f\r ")

__all__ = ["BOS_ID", "BYTE_FALLBACK_OFFSET", "EOS_ID", "NO_MERGE_SCORE", "SPACE_MARK", "Tokenizer"]


@dataclasses.dataclass(frozen=True, repr=False)
class Tokenizer(DecodesPrintedBytes):
    """A SentencePiece-style vocabulary: pieces and merge scores, with run.c's encode and
    decode. Implements `jllama.tokenizers.base.Tokenizer`.

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
        drops the leading space of the piece after BOS (run.c) and, with `strip_text_start`,
        of the piece that starts the text.
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
      strip_text_start: bool, whether the piece that starts the text (no previous token:
        prev < 0) also loses its dummy-prefix space when printed, as SentencePiece's decoder
        and llama.cpp's `llama_detokenize` drop it, so decode(encode(text, bos=False)) ==
        text. True for vocabularies from GGUF and tokenizer.json; False (the default) keeps
        run.c's rule alone (only the piece after BOS loses it), as llama2.c files do.

    Derived at construction: `vocab_size`, the number of pieces. Class attribute:
    drops_unknown_bytes = False (byte fallback keeps every byte).

    decode(encode(text)) == text for text without non-whitespace ASCII control characters
    (run.c's safe_printf drops those), and with `strip_text_start` also without BOS.

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
    strip_text_start: bool = False
    vocab_size: int = dataclasses.field(init=False, compare=False)
    _ids: dict[bytes, int] = dataclasses.field(init=False, compare=False, hash=False)
    _byte_ids: tuple[int, ...] = dataclasses.field(init=False, compare=False, hash=False)
    _specials: tuple[tuple[str, int, bool], ...] = dataclasses.field(
        init=False, compare=False, hash=False
    )
    drops_unknown_bytes: ClassVar[bool] = False

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
        for name, value in [
            ("pieces", pieces), ("scores", scores), ("vocab_size", n),
            ("max_token_length", int(self.max_token_length)), ("bos_id", bos_id),
            ("eos_id", eos_id), ("add_bos", bool(self.add_bos)),
            ("add_space_prefix", bool(self.add_space_prefix)),
            ("space_mark_is_space", bool(self.space_mark_is_space)),
            ("strip_text_start", bool(self.strip_text_start)), ("control_ids", control),
            ("special_tokens", specials), ("stop_ids", stop), ("_ids", ids),
            ("_byte_ids", byte_token_ids(ids, n)), ("_specials", special_order(specials)),
        ]:
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str | bytes, bos: bool | None = None, eos: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`, exactly as llama2.c run.c's `encode(t, text, bos, eos, ...)`.

        1. BOS (`bos_id`, 1 in llama2.c files) if `bos`;
        2. if the text is non-empty, the id of the piece b" " (SentencePiece's dummy prefix);
        3. the UTF-8 bytes cut into code-point groups (a byte and up to 3 following bytes of
           the form 10xxxxxx); a group that is a piece gives its id, otherwise each byte b gives
           its byte-fallback id (the piece "<0xNN>", which is id b + 3 in llama2.c's files);
        4. merges: while some adjacent pair (BOS included) concatenates to a piece whose score
           is > -1e10, replace the pair with the highest such score (leftmost on ties) by that
           piece (`spm_encode.merge`, O(n log n) where run.c is quadratic);
        5. EOS (`eos_id`, 2 in llama2.c files) if `eos`.

        With `special_tokens` (GGUF vocabularies only), the text is first cut at special-token
        matches (`split_special_tokens`); each text run between them is encoded by steps 2-4
        on its own, with the dummy prefix only on a run that starts the text or follows a
        special token (llama.cpp's SPM rule), and the special tokens' ids go between them.

        Departures where run.c cannot be followed: a str is encoded to UTF-8 with
        "surrogateescape" (so undecodable argv bytes go through as the raw bytes run.c would
        see); NUL bytes are ordinary bytes (run.c's C string would end there); if the
        vocabulary has no piece b" ", the dummy prefix is the byte token of 0x20 (run.c would
        emit id -1).

        Arguments as `base.Tokenizer.encode` (`parse_special` has no effect for llama2.c
        files, which have no special tokens). Raises TokenizerError where a byte needs the
        byte-fallback token but the vocabulary is too small to have one (fewer than 259
        tokens), UnicodeEncodeError for a str holding surrogates other than
        surrogateescape's, TypeError for text neither str nor bytes.
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

    def encode_segments(self, segments: Segments, bos: bool | None = None,
                        eos: bool = False) -> list[int]:
        """`base.Tokenizer.encode_segments`: `encode("".join(texts), bos, eos, ...)` except
        that a control/unknown special token is matched only inside segments flagged True."""
        if not self._specials:
            return self.encode("".join(text for text, _ in segments), bos=bos, eos=eos)
        return self._encode_parts(self._split(segments), bos, eos)

    def _split(self, segments: Segments) -> list[bytes | int]:
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
                out.extend(merge(run, self.pieces, self.scores, self._ids))
                out.append(part)
                run = []
                prefix = self.add_space_prefix
            else:
                run.extend(self._initial_tokens(part, prefix))
                prefix = False
        out.extend(merge(run, self.pieces, self.scores, self._ids))
        if eos:
            out.append(self.eos_id)
        return out

    def _initial_tokens(self, data: bytes, prefix: bool) -> list[int]:
        """Steps 2-3 of `encode` (`spm_encode.initial_tokens`), "▁" read as a space if set."""
        if self.space_mark_is_space:
            data = data.replace(_SPACE_MARK, b" ")
        return initial_tokens(
            data, prefix, self._ids, self._byte_ids, len(self.pieces), self.source
        )

    # ------------------------------------------------------------------ decoding

    def decode_piece(self, prev_token: int, token: int) -> bytes:
        """The bytes token `token` stands for, as llama2.c run.c's `decode(t, prev, token)`.

        If `prev_token` is `bos_id` (BOS_ID in llama2.c files), `add_space_prefix` is set and
        the piece starts with a space, that one space is removed (SentencePiece's dummy
        prefix). Then a piece of the form "<0xNN>" (two hex digits) becomes the single raw
        byte 0xNN. BOS and EOS give their pieces as stored; the printing rules (skipping
        them, dropping control bytes) are `printed_bytes`'.

        Args:
          prev_token: the token before `token` (any value other than bos_id, e.g. -1, for none).
          token: int id in [0, vocab_size).

        Returns:
          the bytes (possibly empty, possibly a fragment of a UTF-8 character).

        Raises:
          IndexError: `token` out of range.
        """
        return self._bytes(token, strip=prev_token == self.bos_id)

    def _bytes(self, token: int, strip: bool) -> bytes:
        piece = self.pieces[check_token(token, len(self.pieces))]
        if strip and self.add_space_prefix and piece[:1] == b" ":
            piece = piece[1:]
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes((int(match.group(1), 16),))
        return piece

    def token_bytes(self, token: int) -> bytes:
        """The bytes of `token` alone: `decode_piece(-1, token)` (byte tokens as their byte,
        control tokens as stored, the piece's leading space kept).

        Raises:
          IndexError: `token` out of range.
        """
        return self._bytes(token, strip=False)

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes:
        """The bytes `token` prints after `prev`, as `stream_decoder` prints them.

        `decode_piece(prev, token)` (run.c's `decode`: the dummy-prefix space goes after BOS),
        where with `strip_text_start` a token with no previous one (prev < 0) also loses it
        (SentencePiece's decoder); then as run.c's `safe_printf`: a piece that is a single
        ASCII control byte (< 0x20 or 0x7F) other than C's whitespace (\\t \\n \\v \\f
        \\r) prints nothing; bytes >= 0x80 are kept (run.c drops them; here they are UTF-8).
        A control id (`control_ids`: BOS and EOS in llama2.c files) prints nothing unless
        `special` (run.c stops generating at BOS and would print EOS's "\\n</s>\\n"; here both
        are markers, not text).

        Args:
          prev: the token before `token`, or -1 for none (the start of the text).
          token: int id in [0, vocab_size).
          special: print control tokens' pieces too.

        Raises:
          IndexError: `token` out of range.
        """
        strip = prev == self.bos_id or (self.strip_text_start and prev < 0)
        piece = self._bytes(token, strip=strip)
        if not special and token in self.control_ids:
            return b""
        if len(piece) == 1 and (piece[0] < 0x20 or piece[0] == 0x7F) and piece[0] not in _C_SPACE:
            return b""
        return piece

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, "
            f"max_token_length={self.max_token_length}, source={self.source!r})"
        )
