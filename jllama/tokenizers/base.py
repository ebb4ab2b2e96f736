"""The tokenizer protocol, and the pieces of encoding and decoding every tokenizer shares.

`Tokenizer` is what callers (the CLI, the session, chat, the server) may use of a tokenizer;
`jllama.tokenizers.spm.Tokenizer` (SentencePiece-style BPE, also importable from `llama2c`:
llama2.c files, GGUF "llama" and SentencePiece-style tokenizer.json vocabularies), `jllama.tokenizers.bpe.ByteLevelBPE`
(GPT-2 style byte-level BPE) and `jllama.tokenizers.tiktoken_model.TiktokenTokenizer` (Meta's
Llama 3 tokenizer.model) implement it. The helpers below are the decoding parts they share:
the incremental UTF-8 decoder behind `stream_decoder` and `decode` (`StreamDecoder`,
`decode_ids`, the `DecodesPrintedBytes` mixin) and the display form of a token's bytes
(`bytes_for_display`); cutting special tokens out of the text is
`jllama.tokenizers.specials`.
"""

from __future__ import annotations

import codecs
import operator
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

BOS_ID = 1
"""Beginning-of-sequence token id (llama2.c's hard-coded 1, run.c)."""

EOS_ID = 2
"""End-of-sequence token id (llama2.c's hard-coded 2, run.c)."""

Segments = Sequence[tuple[str, bool]]
"""(text, may_parse_special) pieces of one text, as chat templates render them."""


@runtime_checkable
class TextStream(Protocol):
    """An incremental detokenizer: token ids in, whole UTF-8 characters out."""

    def push(self, prev_token: int, token: int) -> str:
        """Feed `token` (after `prev_token`, -1 for none); the text it completes, may be ""."""
        ...

    def flush(self, *, drop_incomplete: bool = False) -> str:
        """End of the stream: what is held back, then a reset (see `StreamDecoder.flush`)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What jllama's callers use of a tokenizer.

    Attributes:
      vocab_size: int, number of token ids; every id is in [0, vocab_size).
      bos_id, eos_id: int ids of the beginning- and end-of-sequence tokens.
      add_bos: bool, whether `encode` prepends `bos_id` when its `bos` is None.
      stop_ids: frozenset[int], the ids that end a generation.
      control_ids: frozenset[int], ids that print nothing unless decoded with special=True.
      drops_unknown_bytes: bool, True where `encode` leaves out bytes of the text that have no
        token (byte-level BPE without all 256 byte tokens, as llama.cpp's and Hugging Face's
        BPE do); False where every byte is kept (SentencePiece byte fallback; tiktoken, which
        has all 256).
      source: str, where the vocabulary came from (a path), for messages.
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    add_bos: bool
    stop_ids: frozenset[int]
    control_ids: frozenset[int]
    drops_unknown_bytes: bool
    source: str

    def encode(self, text: str | bytes, bos: bool | None = None, eos: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`.

        Args:
          text: str, or bytes (each tokenizer says how it reads bytes that are not UTF-8).
          bos: prepend `bos_id`; None means `add_bos`.
          eos: append `eos_id`.
          parse_special: also match control/unknown special tokens' texts as those tokens
            (user-defined ones always match); otherwise they are ordinary text.

        Returns:
          list of int ids in [0, vocab_size).

        Raises:
          TypeError: text neither str nor bytes. TokenizerError: a byte the vocabulary
          cannot encode (SentencePiece-style vocabularies too small for byte fallback).
        """
        ...

    def encode_segments(self, segments: Segments, bos: bool | None = None,
                        eos: bool = False) -> list[int]:
        """Token ids of the concatenated text of `segments` ((str, may_parse_special) pairs),
        a control/unknown special token matched only where its text lies wholly inside
        segments flagged True (`split_special_tokens`), the text runs between matches encoded
        whole, so the result does not depend on where the segments are cut. Chat templates use
        it: the template's markers become single ids, the same text typed by a user stays text.
        `bos`, `eos` and errors: as `encode`."""
        ...

    def decode(self, ids: Sequence[int], prev: int = -1, *, special: bool = False) -> str:
        """The text of `ids` after the token `prev` (-1: none): `decode_ids`' rules.
        Raises IndexError for an id out of range."""
        ...

    def stream_decoder(self, special: bool = False) -> TextStream:
        """A new incremental decoder (`StreamDecoder`); `special`: print control tokens too."""
        ...

    def piece(self, token: int) -> str:
        """Display form of one token: `bytes_for_display(token_bytes(token))`. IndexError for
        an id out of range."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes of `token` alone (no previous token): byte tokens as their byte, control
        tokens' texts as stored. IndexError for an id out of range."""
        ...

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes:
        """The bytes `token` prints after `prev` (-1: at the start of the text), as the stream
        decoder prints them: b"" for a control token unless `special`, and SentencePiece-style
        vocabularies' rules for the dummy-prefix space and control bytes. IndexError for an
        id out of range."""
        ...


class PrintsBytes(Protocol):
    """What `StreamDecoder` needs of a tokenizer."""

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes: ...


def text_of(text: str | bytes, errors: str) -> str:
    """`text` as str: bytes decoded as UTF-8 with `errors` ("surrogateescape" keeps every byte,
    "replace" makes invalid sequences U+FFFD).

    Raises:
      TypeError: text neither str nor bytes.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", errors)
    if not isinstance(text, str):
        raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
    return text


# ---------------------------------------------------------------------- decoding


def check_token(token: int, vocab_size: int) -> int:
    """`token` as an int, checked to be an id of a `vocab_size`-token vocabulary.

    Raises:
      IndexError: token outside [0, vocab_size). TypeError: not an integer.
    """
    token = operator.index(token)
    if not 0 <= token < vocab_size:
        raise IndexError(f"token id {token} out of range [0, {vocab_size})")
    return token


def _could_complete(data: bytes) -> bool:
    """Whether `data` (1 to 3 bytes) is the start of some valid UTF-8 encoding of a character,
    so that more bytes could still finish it (RFC 3629's table: a surrogate start such as
    b"\\xed\\xa0" cannot)."""
    need = 2 if 0xC2 <= data[0] <= 0xDF else 3 if 0xE0 <= data[0] <= 0xEF else 4
    if not 0xC2 <= data[0] <= 0xF4 or len(data) >= need:
        return False
    seconds = [data[1:2]] if len(data) > 1 else [bytes((b,)) for b in range(0x80, 0xC0)]
    rest = data[2:]
    for second in seconds:
        try:
            (data[:1] + second + rest + b"\x80" * (need - 2 - len(rest))).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


class StreamDecoder:
    """Incremental detokenizer: token ids in, complete UTF-8 text out.

    Each token's `printed_bytes(prev_token, token, special=...)` go through an incremental
    UTF-8 decoder (errors="replace"), so a character split over several tokens comes out once,
    whole, when its last byte arrives, and an invalid sequence becomes U+FFFD where it stands.
    The printing rules (a control token prints nothing, llama2.c's dropped control bytes, the
    dummy-prefix space) are the tokenizer's `printed_bytes`.

    Usage:
      stream = tokenizer.stream_decoder()
      for prev, token in ...: print(stream.push(prev, token), end="", flush=True)
      print(stream.flush())
    """

    def __init__(self, tokenizer: PrintsBytes, special: bool = False):
        """Args: tokenizer: the vocabulary whose ids will be pushed; special: print control
        tokens' texts too."""
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, prev_token: int, token: int) -> str:
        """Feed one token; return the text completed by it (may be "").

        Args:
          prev_token: the token before `token`, or -1 for none (the start of the text).
          token: int id in [0, vocab_size).

        Raises:
          IndexError: `token` out of range.
        """
        data = self._tokenizer.printed_bytes(prev_token, token, special=self._special)
        return self._utf8.decode(data)

    def flush(self, *, drop_incomplete: bool = False) -> str:
        """End of the stream: the bytes held back for an unfinished character, then a reset.

        Args:
          drop_incomplete: how an unfinished trailing character (bytes that more bytes could
            still make a valid character, e.g. 2 of an emoji's 4) ends: False, as U+FFFD (the
            text is whole and that character is broken); True, dropped (the stream was cut,
            e.g. by max_tokens, before the character's last token). Bytes that can never
            become a character give U+FFFD either way, as they do mid-stream.

        Returns:
          str: "", U+FFFD or two (the held bytes as Python's UTF-8 decoder replaces them).
        """
        held, _ = self._utf8.getstate()
        if drop_incomplete and held and _could_complete(held):
            text = ""
        else:
            text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def decode_ids(
    tokenizer: PrintsBytes, ids: Iterable[int], prev: int = -1, special: bool = False
) -> str:
    """The text of a whole id sequence: `StreamDecoder`'s pushes, then a flush that shows an
    unfinished trailing character as U+FFFD. The token before ids[i] is ids[i-1], before
    ids[0] `prev` (-1: none, the start of the text).

    Raises:
      IndexError: an id out of range.
    """
    stream = StreamDecoder(tokenizer, special=special)
    parts = []
    for token in ids:
        parts.append(stream.push(prev, token))
        prev = token
    parts.append(stream.flush())
    return "".join(parts)


class DecodesPrintedBytes:
    """`stream_decoder`, `decode` and `piece` of the `Tokenizer` protocol, made of the
    tokenizer's own `printed_bytes` and `token_bytes` (a mixin of every jllama tokenizer)."""

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        raise NotImplementedError

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        """A new `StreamDecoder` over this vocabulary (`special`: print control tokens too)."""
        return StreamDecoder(self, special=special)

    def decode(self, ids: Sequence[int], prev: int = -1, *, special: bool = False) -> str:
        """Text of a whole id sequence (`decode_ids`): each token's `printed_bytes` after the
        one before it (`prev` before ids[0]; -1: none, the start of the text), decoded as
        UTF-8 with invalid or unfinished sequences replaced by U+FFFD.

        Args:
          ids: int token ids in [0, vocab_size), e.g. the output of `encode`.
          prev: the token before ids[0] (pass the last prompt token to decode a continuation
            as it prints after the prompt), or -1 for none.
          special: print control tokens' texts too; otherwise they print nothing.

        Raises:
          IndexError: an id out of range.
        """
        return decode_ids(self, ids, prev, special)

    def piece(self, token: int) -> str:
        """Display form of one token (for `jllama tokenize --pieces`): its `token_bytes`
        decoded as UTF-8, bytes of a partial character shown as "<0xNN>"
        (`bytes_for_display`).

        Raises:
          IndexError: `token` out of range.
        """
        return bytes_for_display(self.token_bytes(token))


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
