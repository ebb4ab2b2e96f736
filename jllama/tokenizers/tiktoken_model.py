"""Meta's Llama 3 `tokenizer.model`: a tiktoken BPE vocabulary, encoded with `tiktoken`.

File layout (tiktoken's "BPE file", as Meta ships it with Llama 3, 3.1, 3.2 and 3.3): UTF-8
text, one token a line, `<base64 of the token's bytes> <rank>`, e.g. `IQ== 0` for b"!". A
token's rank is its id; Llama 3's 128000 ranks are 0..127999 in order. Special tokens are not
in the file: Meta's reference tokenizer (llama-models, `models/llama3/tokenizer.py`) appends
256 of them after the base vocabulary, in the order of `LLAMA3_SPECIAL_TOKENS`, so
`<|begin_of_text|>` is 128000 and `<|eot_id|>` 128009.

Encoding is tiktoken's, with Meta's pre-tokenizer regex `LLAMA3_PATTERN`: within each regex
match, the pair whose concatenation has the lowest rank merges first, and a match that is a
token as a whole is that token. Special tokens are cut out of the text first, and only when
asked (`parse_special`, or a flagged segment of `encode_segments`), as the other jllama
tokenizers do; elsewhere their text is encoded as ordinary text (Meta's `encode` with the
default `allowed_special=set()`).

Decoding maps each id to its bytes (special tokens to their text, printed only when asked)
and decodes UTF-8 incrementally, so a character split over tokens comes out whole.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import tiktoken

from jllama.errors import TokenizerError
from jllama.platform.files import require_regular_file
from jllama.tokenizers.base import (
    DecodesPrintedBytes,
    Segments,
    check_token,
    text_of,
)
from jllama.tokenizers.specials import encode_around_specials, special_order

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenizer regex (Meta's `pat_str`, also the `Split` pattern of Llama 3's
`tokenizer.json`): contractions in any case, letter runs with one leading non-letter, numbers
of up to 3 digits, punctuation runs with their newlines, whitespace runs."""

NUM_RESERVED_SPECIAL_TOKENS = 256
"""How many special tokens follow the base vocabulary (Meta's `num_reserved_special_tokens`)."""

_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)

LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{k}|>"
    for k in range(2, 2 + NUM_RESERVED_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)
"""The 256 special tokens in id order after the base vocabulary, as llama-models' Llama 3
tokenizer lists them: 12 named ones (`<|eom_id|>` and `<|python_tag|>` since Llama 3.1,
`<|image|>` since 3.2), then `<|reserved_special_token_2|>` ... `_245|>`.

Only the names of unused ids differ from Hugging Face's Llama 3.1 `tokenizer.json` (which
calls 128005 `<|reserved_special_token_2|>` and 128011 `<|reserved_special_token_3|>`); every
token a model emits or a template writes has the same id in both."""

LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
"""Tokens that end a generation (Meta's `stop_tokens`)."""


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TiktokenTokenizer(DecodesPrintedBytes):
    """A tiktoken BPE vocabulary with special tokens; implements
    `jllama.tokenizers.base.Tokenizer`.

    Attributes:
      encoding: the `tiktoken.Encoding` doing the BPE; its special tokens must be
        `special_tokens`, with the ids after its base vocabulary.
      special_tokens: tuple[str] of special-token texts; the i-th has id
        `encoding.n_vocab - len(special_tokens) + i`. Must include `<|begin_of_text|>` and
        `<|end_of_text|>`.
      add_bos: whether `encode` prepends BOS when its `bos` is None (Llama 3: True).
      source: the file read, for messages.

    Derived at construction: `vocab_size` (the base vocabulary plus the special tokens),
    `bos_id` (`<|begin_of_text|>`), `eos_id` (`<|end_of_text|>`),
    `stop_ids` (the ids of `LLAMA3_STOP_TOKENS` present) and `control_ids` (every special
    token: they print nothing unless decoded with special=True).

    Class attribute: drops_unknown_bytes = False (tiktoken has a token for each of the 256
    bytes; bytes that are not UTF-8 become U+FFFD before encoding).

    Equality is identity.

    Raises (at construction):
      TokenizerError: a required special token missing, or special tokens that are not the
        encoding's last ids.
    """

    encoding: tiktoken.Encoding
    special_tokens: tuple[str, ...] = LLAMA3_SPECIAL_TOKENS
    add_bos: bool = True
    source: str = "<memory>"
    vocab_size: int = dataclasses.field(init=False)
    bos_id: int = dataclasses.field(init=False)
    eos_id: int = dataclasses.field(init=False)
    stop_ids: frozenset[int] = dataclasses.field(init=False)
    control_ids: frozenset[int] = dataclasses.field(init=False)
    _token_bytes: tuple[bytes, ...] = dataclasses.field(init=False)
    _specials: tuple[tuple[str, int, bool], ...] = dataclasses.field(init=False)
    drops_unknown_bytes: ClassVar[bool] = False

    def __post_init__(self):
        what = f"tokenizer {self.source}"
        texts = tuple(str(t) for t in self.special_tokens)
        base = self.encoding.n_vocab - len(texts)
        ids = {text: base + i for i, text in enumerate(texts)}
        if len(ids) != len(texts):
            raise TokenizerError(f"{what}: a special token is listed twice")
        for text, token in ids.items():
            try:
                found = self.encoding.encode_single_token(text)
            except KeyError:
                found = None
            if found != token:
                raise TokenizerError(
                    f"{what}: special token {text} should be id {token} but the tiktoken "
                    "encoding does not have it there"
                )
        for needed in ("<|begin_of_text|>", "<|end_of_text|>"):
            if needed not in ids:
                raise TokenizerError(f"{what}: the special tokens lack {needed}")
        table = []
        for token in range(base):
            try:
                table.append(self.encoding.decode_single_token_bytes(token))
            except KeyError:  # a rank the file does not use
                table.append(b"")
        table.extend(text.encode("utf-8") for text in texts)
        specials = [(text, token, False) for text, token in ids.items()]
        set_ = object.__setattr__
        set_(self, "special_tokens", texts)
        set_(self, "add_bos", bool(self.add_bos))
        set_(self, "bos_id", ids["<|begin_of_text|>"])
        set_(self, "eos_id", ids["<|end_of_text|>"])
        set_(self, "stop_ids", frozenset(ids[t] for t in LLAMA3_STOP_TOKENS if t in ids))
        set_(self, "control_ids", frozenset(ids.values()))
        set_(self, "vocab_size", len(table))
        set_(self, "_token_bytes", tuple(table))
        set_(self, "_specials", special_order(specials))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(vocab_size={self.vocab_size}, source={self.source!r})"

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str | bytes, bos: bool | None = None, eos: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text` (`base.Tokenizer.encode`): bytes are decoded as UTF-8 with an
        invalid sequence as U+FFFD (which tiktoken would also make of it); special-token
        texts (e.g. "<|eot_id|>") are those tokens only with `parse_special`."""
        segments = [(text_of(text, "replace"), parse_special)]
        return self.encode_segments(segments, bos=bos, eos=eos)

    def encode_segments(self, segments: Segments, bos: bool | None = None,
                        eos: bool = False) -> list[int]:
        """`base.Tokenizer.encode_segments`: each run between special tokens through
        tiktoken's `encode_ordinary`."""
        return encode_around_specials(
            segments, self._specials, self.encoding.encode_ordinary,
            self.bos_id if (self.add_bos if bos is None else bos) else None,
            self.eos_id if eos else None,
        )

    # ------------------------------------------------------------------ decoding

    def token_bytes(self, token: int) -> bytes:
        """The bytes of token `token` (a special token's text for a special token).

        Raises:
          IndexError: `token` out of range.
        """
        return self._token_bytes[check_token(token, len(self._token_bytes))]

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes:
        """The bytes `token` prints (`prev` is unused): `token_bytes(token)`, or b"" for a
        special token unless `special`.

        Raises:
          IndexError: `token` out of range.
        """
        data = self.token_bytes(token)
        return b"" if not special and token in self.control_ids else data


def parse_tiktoken_bpe(data: bytes, source: str) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file's text.

    Args:
      data: the file's contents.
      source: the file's name, for messages.

    Returns:
      dict token bytes -> rank, in file order. Blank lines are skipped.

    Raises:
      TokenizerError: text that is not UTF-8; a line that is not `<base64> <rank>`; a rank
        that is not a non-negative decimal integer; a token or rank given twice; ranks that
        are not 0..n-1; a missing one-byte token (tiktoken needs all 256); no tokens. One line,
        with the line number where there is one.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(
            f"{source}: not a tiktoken BPE file: invalid UTF-8 at byte {e.start} (a SentencePiece "
            "model?)"
        ) from None
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> line number
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerError(
                f"{source}: line {number}: expected '<base64 token> <rank>', got {line!r:.60}"
            )
        encoded, rank_text = fields
        try:
            token = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(
                f"{source}: line {number}: {encoded!r:.40} is not base64"
            ) from None
        if not token:
            raise TokenizerError(f"{source}: line {number}: the token is empty")
        if not rank_text.isdigit() or not rank_text.isascii():
            raise TokenizerError(
                f"{source}: line {number}: rank {rank_text!r:.30} is not a non-negative integer"
            )
        rank = int(rank_text)
        if token in ranks:
            raise TokenizerError(f"{source}: line {number}: token {token!r:.40} is listed twice")
        if rank in seen:
            raise TokenizerError(
                f"{source}: line {number}: rank {rank} was already given on line {seen[rank]}"
            )
        ranks[token] = rank
        seen[rank] = number
    if not ranks:
        raise TokenizerError(f"{source}: holds no tokens")
    if max(seen) != len(ranks) - 1:
        missing = next(r for r in range(len(ranks)) if r not in seen)
        raise TokenizerError(
            f"{source}: ranks must be 0..{len(ranks) - 1} (one per token), but rank {missing} "
            "is missing"
        )
    absent = [b for b in range(256) if bytes((b,)) not in ranks]
    if absent:
        raise TokenizerError(
            f"{source}: has no token for the byte 0x{absent[0]:02X} ({len(absent)} one-byte "
            "tokens missing; a byte-level BPE vocabulary needs all 256)"
        )
    return ranks


def tiktoken_tokenizer(
    ranks: dict[bytes, int],
    source: str = "<memory>",
    special_tokens: Sequence[str] = LLAMA3_SPECIAL_TOKENS,
    pattern: str = LLAMA3_PATTERN,
) -> TiktokenTokenizer:
    """A `TiktokenTokenizer` over `ranks`, with special tokens given the ids after them.

    Args:
      ranks: token bytes -> rank, ranks 0..n-1 (as `parse_tiktoken_bpe` returns them).
      source: where the ranks came from, for messages.
      special_tokens: special-token texts, given ids n, n+1, ... (default: Llama 3's).
      pattern: the pre-tokenizer regex, in tiktoken's syntax (default: Llama 3's).

    Returns:
      the tokenizer, adding BOS by default.

    Raises:
      TokenizerError: as `TiktokenTokenizer`.
    """
    n = len(ranks)
    encoding = tiktoken.Encoding(
        name=Path(source).name or "tiktoken",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={text: n + i for i, text in enumerate(special_tokens)},
    )
    return TiktokenTokenizer(encoding, tuple(special_tokens), add_bos=True, source=source)


def read_tiktoken_model(path: str | os.PathLike) -> TiktokenTokenizer:
    """Read Meta's Llama 3 `tokenizer.model` (tiktoken BPE format).

    Args:
      path: the file (about 2 MB for Llama 3's 128000 tokens).

    Returns:
      a `TiktokenTokenizer` with Llama 3's 256 special tokens after the file's tokens.

    Raises:
      TokenizerError: a missing or unreadable file, or a malformed one (see
        `parse_tiktoken_bpe`; a SentencePiece model, which is binary, is named as such). One
        line naming the path, and the line number for a bad line.
    """
    path = Path(path)
    what = f"tokenizer {path}"
    require_regular_file(path, what, TokenizerError)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{what}: cannot read: {e.strerror or e}") from None
    if b"\x00" in data[:4096]:
        raise TokenizerError(
            f"{what}: is a binary file (a SentencePiece model or a GGUF file?), not a tiktoken "
            "BPE file of '<base64 token> <rank>' lines"
        )
    ranks = parse_tiktoken_bpe(data, what)
    return tiktoken_tokenizer(ranks, source=str(path))
