"""GPT-2 style byte-level BPE over a GGUF vocabulary (`tokenizer.ggml.model == "gpt2"`).

Encoding, as llama.cpp's `llm_tokenizer_bpe` (src/llama-vocab.cpp) and Hugging Face's
ByteLevel BPE do it:
  1. special tokens are cut out of the text (`split_special_tokens`): user-defined tokens
     always, control and unknown tokens only with parse_special;
  2. each text run between them is pre-tokenized by the list of regexes named by
     `tokenizer.ggml.pre` (`PRE_TOKENIZERS`). Each regex splits every fragment left by the
     previous one, and text between its matches is kept as a fragment of its own;
  3. each fragment's UTF-8 bytes are mapped to characters by GPT-2's byte <-> unicode table
     (`BYTE_TO_UNICODE`: printable bytes stand for themselves, the others for U+0100 + n);
  4. the characters are merged pairwise, lowest merge rank first (leftmost on ties), and each
     final symbol is looked up in the vocabulary, falling back to its one-byte tokens.

Decoding maps a normal token's characters back to bytes through the same table; control
tokens print nothing unless asked, user-defined tokens print their text as stored.

GPT-2's alphabet and the pre-tokenizers are `jllama.tokenizers.byte_level` (importable from
here too); the special-token and stream-decoding helpers, `jllama.tokenizers.base`.
"""


from __future__ import annotations

import dataclasses
import operator
import re
import unicodedata
from itertools import repeat
from typing import ClassVar

import regex

from jllama.errors import TokenizerError
from jllama.tokenizers.base import (
    DecodesPrintedBytes,
    Segments,
    StreamDecoder,
    check_token,
    text_of,
)
from jllama.tokenizers.byte_level import (
    BYTE_TO_UNICODE,
    LLAMA_BPE_PATTERN,
    PRE_TOKENIZERS,
    UNICODE_TO_BYTE,
    PreTokenizer,
    byte_level_decode,
    byte_level_encode,
    compile_patterns,
    merge_by_rank,
    pre_tokenize,
)
from jllama.tokenizers.specials import (
    encode_around_specials,
    special_order,
    split_special_tokens,
)

__all__ = [
    "BYTE", "BYTE_TO_UNICODE", "CONTROL", "END_OF_GENERATION_TEXTS", "NORMAL", "PRE_TOKENIZERS",
    "UNICODE_TO_BYTE", "UNKNOWN", "UNUSED", "USER_DEFINED", "ByteLevelBPE", "ByteStreamDecoder",
    "PreTokenizer", "pre_tokenize", "split_special_tokens",
]

# Old private names, still imported by tests.
_compile = compile_patterns
_LLAMA3_PATTERN = LLAMA_BPE_PATTERN

# GGUF token types (gguf-py's TokenType, llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",  # Llama 3
    "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<end_of_utterance>", "<eos>",
    "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
"""Token texts that end a generation wherever they are in the vocabulary: llama.cpp's
`special_eog_ids` text list (src/llama-vocab.cpp, `llama_vocab::impl::load`). llama.cpp then
drops <|end|> again from vocabularies that hold gpt-oss's or Solar's pairs (<|return|> and
<|call|>, <|calls|> and <|flush|>); those are not llama-architecture models, so jllama keeps it."""

_CACHE_LIMIT = 50_000
"""Most pre-tokens whose ids `ByteLevelBPE` keeps; the cache is emptied when full."""


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ByteLevelBPE(DecodesPrintedBytes):
    """A byte-level BPE vocabulary (GPT-2, SmolLM, Llama 3, ...) as stored in GGUF.
    Implements `jllama.tokenizers.base.Tokenizer`.

    Attributes:
      tokens: tuple[str] of length vocab_size, token texts in GPT-2's byte-level alphabet
        (e.g. "Ġthe" for b" the"); control and user-defined tokens in plain text.
      token_types: tuple[int] of length vocab_size, GGUF token types: 1 normal, 2 unknown,
        3 control, 4 user-defined, 5 unused, 6 byte. Empty means all normal.
      merges: tuple[str], "left right" pairs (e.g. "Ġ t"); the rank of a merge is its index.
      pre: the `tokenizer.ggml.pre` name, a key of `PRE_TOKENIZERS`.
      bos_id, eos_id: int ids of BOS and EOS.
      eot_id: int id of the end-of-turn token, or None.
      eom_id: int id of the end-of-message token (Llama 3.1 tool calls), or None.
      add_bos: whether `encode` prepends BOS when its `bos` is None.
      source: where the vocabulary came from (a path), for error messages.
      pattern: a pre-tokenizer regex that replaces the `pre` name's list (a Hugging Face
        tokenizer.json states its own, e.g. Meta's `(?i:'s|...)` for Llama 3), or None.
      ignore_merges: True/False overrides the `pre` name's ignore_merges (whether a whole
        pre-token found in the vocabulary is emitted without merging); None keeps it.
      extra_stop_ids: more ids that end a generation (e.g. generation_config.json's).
      nfc: the text between special tokens is put in Unicode normal form C before it is
        pre-tokenized (a tokenizer.json's `NFC` normalizer: Qwen's). llama.cpp does not
        normalize, so a GGUF's vocabulary leaves it False; the two differ only on text that
        is not in NFC already (a decomposed "é").

    Derived at construction: `vocab_size` (the number of tokens), `stop_ids` (eos_id, eot_id,
    eom_id and the tokens whose text is in END_OF_GENERATION_TEXTS) and `control_ids`
    (unknown, control and unused tokens: they print nothing unless decoded with special=True).

    Class attribute: drops_unknown_bytes = True (a byte the vocabulary has no token for is
    left out of `encode`, as llama.cpp and Hugging Face's `tokenizers` do).

    Equality is identity (the vocabulary is large; compare `tokens`/`merges` if needed).

    Raises (at construction):
      TokenizerError: an unknown `pre`, tokens and types of different lengths, an empty
        vocabulary, a merge without a space, or bos/eos/eot/eom out of range. One line naming
        `source`.
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    pre: str
    bos_id: int
    eos_id: int
    eot_id: int | None = None
    eom_id: int | None = None
    add_bos: bool = False
    source: str = "<memory>"
    pattern: str | None = None
    ignore_merges: bool | None = None
    extra_stop_ids: frozenset[int] = frozenset()
    nfc: bool = False
    vocab_size: int = dataclasses.field(init=False)
    stop_ids: frozenset[int] = dataclasses.field(init=False)
    control_ids: frozenset[int] = dataclasses.field(init=False)
    _ids: dict[str, int] = dataclasses.field(init=False)
    _ranks: dict[str, int] = dataclasses.field(init=False)
    _patterns: tuple[regex.Pattern, ...] = dataclasses.field(init=False)
    _ignore_merges: bool = dataclasses.field(init=False)
    _token_bytes: list[bytes | None] = dataclasses.field(init=False)
    _specials: tuple[tuple[str, int, bool], ...] = dataclasses.field(init=False)
    _cache: dict[str, tuple[int, ...]] = dataclasses.field(init=False)
    drops_unknown_bytes: ClassVar[bool] = True

    def __post_init__(self):
        # Llama 3's 128,256 tokens and 280,147 merges: the tables are built by C loops (dict,
        # zip, map) over the strings as read, with no new object per merge, and a token's bytes
        # are worked out when first asked for (`token_bytes`).
        what = f"tokenizer {self.source}"
        tokens = tuple(map(str, self.tokens))
        types = tuple(map(int, self.token_types)) or (NORMAL,) * len(tokens)
        n = len(tokens)
        if n == 0:
            raise TokenizerError(f"{what}: the vocabulary is empty")
        if len(types) != n:
            raise TokenizerError(f"{what}: {n} tokens but {len(types)} token types")
        pre = PRE_TOKENIZERS.get(self.pre)
        if pre is None:
            raise TokenizerError(
                f"{what}: unknown pre-tokenizer tokenizer.ggml.pre={self.pre!r} "
                f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        for name, value in [("bos_id", self.bos_id), ("eos_id", self.eos_id),
                            ("eot_id", self.eot_id), ("eom_id", self.eom_id)]:
            if value is None and name in ("eot_id", "eom_id"):
                continue
            value = operator.index(value)
            if not 0 <= value < n:
                raise TokenizerError(f"{what}: {name} {value} is out of range [0, {n})")
            object.__setattr__(self, name, value)

        # The first id of a text wins (reversed, so the first overwrites the later ones).
        ids = dict(zip(reversed(tokens), range(n - 1, -1, -1)))
        merges = tuple(map(str, self.merges))
        # The first space after position 0 separates the two sides, as llama.cpp's loader
        # (byte-level texts hold no spaces; a side may itself be a lone space elsewhere).
        cuts = list(map(str.find, merges, repeat(" "), repeat(1)))
        if merges and min(cuts) < 0:
            rank = cuts.index(-1)
            raise TokenizerError(f"{what}: merge {rank} {merges[rank]!r} is not two tokens")
        ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))  # first rank wins

        hidden, specials = set(), []
        for i in [i for i, kind in enumerate(types) if kind != NORMAL]:
            kind = types[i]
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                specials.append((tokens[i], i, kind == USER_DEFINED))
                if kind != USER_DEFINED:
                    hidden.add(i)
            elif kind != BYTE:
                hidden.add(i)  # unused or undefined: llama.cpp prints nothing

        stop = {self.eos_id} | {i for i in (self.eot_id, self.eom_id) if i is not None}
        stop |= {ids[t] for t in END_OF_GENERATION_TEXTS if t in ids}

        set_ = object.__setattr__
        set_(self, "tokens", tokens)
        set_(self, "vocab_size", n)
        set_(self, "token_types", types)
        set_(self, "merges", merges)
        set_(self, "add_bos", bool(self.add_bos))
        set_(self, "stop_ids", frozenset(stop) | frozenset(self.extra_stop_ids))
        set_(self, "control_ids", frozenset(hidden))
        set_(self, "_ids", ids)
        set_(self, "_ranks", ranks)
        patterns = pre.patterns if self.pattern is None else (self.pattern,)
        set_(self, "_patterns", compile_patterns(tuple(patterns)))
        set_(
            self, "_ignore_merges",
            pre.ignore_merges if self.ignore_merges is None else bool(self.ignore_merges),
        )
        set_(self, "_token_bytes", [None] * n)
        set_(self, "_specials", special_order(specials))
        set_(self, "_cache", {})

    def __repr__(self) -> str:
        return (
            f"ByteLevelBPE(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"pre={self.pre!r}, source={self.source!r})"
        )

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str | bytes, bos: bool | None = None, eos: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text` (`base.Tokenizer.encode`), as llama.cpp's `llama_tokenize` for a
        BPE vocabulary. Bytes are decoded as UTF-8 with "surrogateescape" (undecodable bytes
        go through as those raw bytes); a byte the vocabulary has no token for is left out,
        as llama.cpp and Hugging Face's `tokenizers` do (`drops_unknown_bytes`)."""
        segments = [(text_of(text, "surrogateescape"), parse_special)]
        return self.encode_segments(segments, bos=bos, eos=eos)

    def encode_segments(self, segments: Segments, bos: bool | None = None,
                        eos: bool = False) -> list[int]:
        """`base.Tokenizer.encode_segments`: each run between special tokens pre-tokenized and
        merged on its own."""
        return encode_around_specials(
            segments, self._specials, self._encode_text,
            self.bos_id if (self.add_bos if bos is None else bos) else None,
            self.eos_id if eos else None,
        )

    def _encode_text(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        for word in pre_tokenize(text, self._patterns):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _encode_word(self, word: str) -> tuple[int, ...]:
        """BPE of one pre-token: byte-level characters merged by rank, then looked up."""
        mapped = byte_level_encode(word.encode("utf-8", "surrogateescape"))
        ids = self._ids
        if self._ignore_merges and mapped in ids:
            return (ids[mapped],)
        symbols: list[str | None] = list(mapped)
        n = len(symbols)
        if n > 1:
            merge_by_rank(symbols, self._ranks)
        out = []
        for symbol in symbols:
            if symbol is None:
                continue
            token = ids.get(symbol)
            if token is not None:
                out.append(token)
                continue
            for char in symbol:  # fall back to the symbol's one-byte tokens
                token = ids.get(char)
                # A byte the vocabulary has no token for is dropped, as llama.cpp and Hugging
                # Face's tokenizers do (SmolLM2 has none for 21 bytes, e.g. 0x16 and 0xFF).
                if token is not None:
                    out.append(token)
        return tuple(out)

    # ------------------------------------------------------------------ decoding

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` prints as (with special=True: control tokens included).

        Normal tokens: their characters mapped back through UNICODE_TO_BYTE (a character
        outside the table, which byte-level vocabularies do not have, gives its own UTF-8).
        Control, unknown and user-defined tokens: their text as stored. Byte tokens "<0xNN>":
        that byte.

        Raises:
          IndexError: `token` out of range.
        """
        known = self._token_bytes
        token = check_token(token, len(known))
        data = known[token]
        if data is None:
            text, kind = self.tokens[token], self.token_types[token]
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                data = text.encode("utf-8", "surrogateescape")
            elif kind == BYTE and _BYTE_TOKEN.fullmatch(text):
                data = bytes((int(text[3:5], 16),))
            else:
                data = byte_level_decode(text)
            known[token] = data  # the same bytes whichever thread gets here first
        return data

    def printed_bytes(self, prev: int, token: int, *, special: bool = False) -> bytes:
        """The bytes `token` prints (byte-level BPE needs no previous token: `prev` is unused):
        `token_bytes(token)`, or b"" for a control/unknown/unused token unless `special`
        (llama.cpp's `token_to_piece`).

        Raises:
          IndexError: `token` out of range.
        """
        data = self.token_bytes(token)
        return b"" if not special and token in self.control_ids else data


ByteStreamDecoder = StreamDecoder
"""The old name of `ByteLevelBPE`'s stream decoder: `jllama.tokenizers.base.StreamDecoder`."""
