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
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import heapq
import operator
import re
from collections.abc import Mapping, Sequence

import regex

from jllama.errors import TokenizerError
from jllama.tokenizers.llama2c import bytes_for_display, split_special_tokens

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


def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's table (openai/gpt-2 encoder.py `bytes_to_unicode`): the 188 printable bytes
    "!".."~", "¡".."¬", "®".."ÿ" stand for the code point of the same number; the other 68
    bytes, in increasing order, for U+0100, U+0101, ... ."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = [], 0
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(0x100 + extra))
            extra += 1
    return tuple(table)


BYTE_TO_UNICODE: tuple[str, ...] = _byte_to_unicode()
"""BYTE_TO_UNICODE[b]: the one-character string that stands for byte b in token texts."""

UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
"""The inverse of BYTE_TO_UNICODE."""

# bytes.decode("latin-1") gives code points 0..255; this table maps them to GPT-2's characters.
_LATIN1_TO_GPT2 = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` value pre-tokenizes (src/llama-vocab.cpp, llama.cpp).

    Attributes:
      patterns: regexes (the `regex` package's syntax: \\p{L} letters, \\p{N} numbers, \\s
        Unicode White_Space) applied in order.
      ignore_merges: a pre-token that is a whole token is emitted as is, without merging
        (llama.cpp's `ignore_merges`, Hugging Face's BPE "ignore_merges"; Llama 3).
      add_bos: whether BOS is added when the GGUF has no `tokenizer.ggml.add_bos_token`.
    """

    patterns: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_SMOLLM = PreTokenizer((r"\p{N}", _GPT2_PATTERN))
_GPT2 = PreTokenizer((_GPT2_PATTERN,))
_LLAMA3 = PreTokenizer((_LLAMA3_PATTERN,), ignore_merges=True, add_bos=True)
_DEFAULT = PreTokenizer(
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")
)

PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva",
         "minerva-7b"],
        _SMOLLM,
    ),
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], _GPT2),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano"],
        _LLAMA3,
    ),
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT, also used when the key is missing.
    "default": _DEFAULT,
}
"""`tokenizer.ggml.pre` value -> its pre-tokenizer, as llama.cpp maps them (src/llama-vocab.cpp:
the pre-type chosen in `llama_vocab::impl::load`, the regexes in `llm_tokenizer_bpe`)."""


@functools.cache
def _compile(patterns: tuple[str, ...]) -> tuple[regex.Pattern, ...]:
    return tuple(regex.compile(p) for p in patterns)


def pre_tokenize(text: str, patterns: Sequence[regex.Pattern]) -> list[str]:
    """Split `text` by a list of regexes the way llama.cpp's `unicode_regex_split` does.

    Each regex splits every fragment produced by the previous one: its matches become
    fragments, and so does each stretch of text between matches (Python's `findall` would drop
    those). A fragment is searched on its own, so lookaheads see its end as the end of text.

    Returns:
      list of non-empty str whose concatenation is `text`.
    """
    fragments = [text] if text else []
    for pattern in patterns:
        out = []
        for fragment in fragments:
            pos = 0
            for match in pattern.finditer(fragment):
                start, end = match.span()
                if start == end:
                    continue
                if start > pos:
                    out.append(fragment[pos:start])
                out.append(fragment[start:end])
                pos = end
            if pos < len(fragment):
                out.append(fragment[pos:])
        fragments = out
    return fragments


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ByteLevelBPE:
    """A byte-level BPE vocabulary (GPT-2, SmolLM, Llama 3, ...) as stored in GGUF.

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

    Derived at construction: `stop_ids` (eos_id, eot_id, eom_id and the tokens whose text is in
    END_OF_GENERATION_TEXTS) and `control_ids` (unknown, control and unused tokens: they print
    nothing unless decoded with special=True).

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
    stop_ids: frozenset[int] = dataclasses.field(init=False)
    control_ids: frozenset[int] = dataclasses.field(init=False)
    _ids: dict[str, int] = dataclasses.field(init=False)
    _ranks: dict[tuple[str, str], int] = dataclasses.field(init=False)
    _patterns: tuple[regex.Pattern, ...] = dataclasses.field(init=False)
    _ignore_merges: bool = dataclasses.field(init=False)
    _token_bytes: tuple[bytes, ...] = dataclasses.field(init=False)
    _specials: tuple[tuple[str, int, bool], ...] = dataclasses.field(init=False)
    _cache: dict[str, tuple[int, ...]] = dataclasses.field(init=False)

    def __post_init__(self):
        what = f"tokenizer {self.source}"
        tokens = tuple(str(t) for t in self.tokens)
        types = tuple(int(t) for t in self.token_types) or (NORMAL,) * len(tokens)
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
        for name in ("bos_id", "eos_id", "eot_id", "eom_id"):
            value = getattr(self, name)
            if value is None and name in ("eot_id", "eom_id"):
                continue
            value = operator.index(value)
            if not 0 <= value < n:
                raise TokenizerError(f"{what}: {name} {value} is out of range [0, {n})")
            object.__setattr__(self, name, value)

        ids: dict[str, int] = {}
        for i, token in enumerate(tokens):
            ids.setdefault(token, i)
        ranks: dict[tuple[str, str], int] = {}
        merges = tuple(str(m) for m in self.merges)
        for rank, merge in enumerate(merges):
            # The first space after position 0 separates the two sides, as llama.cpp's loader
            # (byte-level texts hold no spaces; a side may itself be a lone space elsewhere).
            cut = merge.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"{what}: merge {rank} {merge!r} is not two tokens")
            ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)

        token_bytes, hidden, specials = [], set(), []
        for i, (token, kind) in enumerate(zip(tokens, types)):
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                token_bytes.append(token.encode("utf-8", "surrogateescape"))
                specials.append((token, i, kind == USER_DEFINED))
                if kind != USER_DEFINED:
                    hidden.add(i)
            elif kind == BYTE and _BYTE_TOKEN.fullmatch(token):
                token_bytes.append(bytes((int(token[3:5], 16),)))
            else:
                token_bytes.append(_byte_level_decode(token))
                if kind not in (NORMAL, BYTE):
                    hidden.add(i)  # unused or undefined: llama.cpp prints nothing

        stop = {self.eos_id} | {i for i in (self.eot_id, self.eom_id) if i is not None}
        stop |= {ids[t] for t in END_OF_GENERATION_TEXTS if t in ids}

        set_ = object.__setattr__
        set_(self, "tokens", tokens)
        set_(self, "token_types", types)
        set_(self, "merges", merges)
        set_(self, "add_bos", bool(self.add_bos))
        set_(self, "stop_ids", frozenset(stop) | frozenset(self.extra_stop_ids))
        set_(self, "control_ids", frozenset(hidden))
        set_(self, "_ids", ids)
        set_(self, "_ranks", ranks)
        patterns = pre.patterns if self.pattern is None else (self.pattern,)
        set_(self, "_patterns", _compile(tuple(patterns)))
        set_(
            self, "_ignore_merges",
            pre.ignore_merges if self.ignore_merges is None else bool(self.ignore_merges),
        )
        set_(self, "_token_bytes", tuple(token_bytes))
        set_(self, "_specials", tuple(sorted(specials, key=lambda s: (-len(s[0]), s[1]))))
        set_(self, "_cache", {})

    def __repr__(self) -> str:
        return (
            f"ByteLevelBPE(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"pre={self.pre!r}, source={self.source!r})"
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids (int)."""
        return len(self.tokens)

    # ------------------------------------------------------------------ encoding

    def encode(
        self,
        text: str | bytes,
        bos: bool | None = None,
        eos: bool = False,
        parse_special: bool = False,
    ) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize` for a BPE vocabulary.

        Args:
          text: str, or bytes (decoded as UTF-8 with "surrogateescape": undecodable bytes go
            through as those raw bytes).
          bos: prepend `bos_id`; None means `add_bos`.
          eos: append `eos_id`.
          parse_special: match control and unknown tokens' texts in `text` as those tokens
            (user-defined tokens are always matched).

        Returns:
          list of int token ids in [0, vocab_size).

        A byte the vocabulary has no token for is left out, as llama.cpp and Hugging Face's
        `tokenizers` do.

        Raises:
          TypeError: text neither str nor bytes.
        """
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", "surrogateescape")
        elif not isinstance(text, str):
            raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
        return self.encode_segments([(text, parse_special)], bos=bos, eos=eos)

    def encode_segments(
        self, segments: Sequence[tuple[str, bool]], bos: bool | None = None, eos: bool = False
    ) -> list[int]:
        """Token ids of the concatenated text of `segments`, with control tokens parsed only
        inside flagged segments.

        The text is first cut at the special-token matches (`split_special_tokens`: a control
        token only where it lies wholly in segments flagged True); each text run between them
        is then encoded whole, so the result does not depend on where the segments are cut.

        Args:
          segments: sequence of (str, may_parse_special) pairs.
          bos: prepend `bos_id`; None means `add_bos`.
          eos: append `eos_id`.

        Returns:
          list of int token ids.

        Raises:
          as `encode`.
        """
        out = [self.bos_id] if (self.add_bos if bos is None else bos) else []
        for part in split_special_tokens(segments, self._specials):
            if isinstance(part, int):
                out.append(part)
            else:
                out.extend(self._encode_text(part))
        if eos:
            out.append(self.eos_id)
        return out

    def _encode_text(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
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
        mapped = word.encode("utf-8", "surrogateescape").decode("latin-1")
        mapped = mapped.translate(_LATIN1_TO_GPT2)
        ids = self._ids
        if self._ignore_merges and mapped in ids:
            return (ids[mapped],)
        symbols: list[str | None] = list(mapped)
        n = len(symbols)
        if n > 1:
            self._merge(symbols)
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

    def _merge(self, symbols: list[str | None]) -> None:
        """Merge `symbols` in place (merged-away entries become None).

        Nodes are the positions of the initial characters; `after`/`before` link the live
        ones. The heap holds (rank, left node) for every adjacent pair that has a merge, plus
        stale entries; an entry is live iff its left node and that node's successor still form
        a pair of that rank (a rank belongs to one pair). Popping the smallest (rank, node)
        merges the lowest-rank pair, leftmost on ties, as llama.cpp's `llm_bigram_bpe` queue.
        """
        ranks = self._ranks
        n = len(symbols)
        after = list(range(1, n + 1))
        after[-1] = -1
        before = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            rank = ranks.get((symbols[i], symbols[i + 1]))
            if rank is not None:
                heap.append((rank, i))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            rank, i = pop(heap)
            left = symbols[i]
            j = after[i]
            if left is None or j < 0 or ranks.get((left, symbols[j])) != rank:
                continue
            merged = left + symbols[j]
            symbols[i] = merged
            symbols[j] = None
            k = after[j]
            after[i] = k
            if k >= 0:
                before[k] = i
                r = ranks.get((merged, symbols[k]))
                if r is not None:
                    push(heap, (r, i))
            h = before[i]
            if h >= 0:
                r = ranks.get((symbols[h], merged))
                if r is not None:
                    push(heap, (r, h))

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
        token = operator.index(token)
        if not 0 <= token < len(self._token_bytes):
            raise IndexError(f"token id {token} out of range [0, {len(self._token_bytes)})")
        return self._token_bytes[token]

    def stream_decoder(self, special: bool = False) -> ByteStreamDecoder:
        """A new `ByteStreamDecoder` (`special`: print control tokens too)."""
        return ByteStreamDecoder(self, special=special)

    def decode(self, ids: Sequence[int], prev: int = -1, *, special: bool = False) -> str:
        """Text of an id sequence: the tokens' bytes decoded as UTF-8 (errors="replace").

        Args:
          ids: sequence of int token ids.
          prev: accepted for the common tokenizer protocol; byte-level BPE needs no previous
            token.
          special: print control/unknown/unused tokens' texts; otherwise they print nothing.

        Returns:
          str. decode(encode(text)) == text for any text (parse_special=False).

        Raises:
          IndexError: an id out of range.
        """
        del prev
        stream = ByteStreamDecoder(self, special=special)
        return "".join([stream.push(-1, t) for t in ids] + [stream.flush()])

    def piece(self, token: int) -> str:
        """Display form of one token (for `jllama tokenize --pieces`): its bytes as
        `token_bytes` gives them, decoded as UTF-8, with bytes of partial characters shown as
        "<0xNN>" (e.g. the first byte of an emoji: "<0xF0>").

        Raises:
          IndexError: `token` out of range.
        """
        return bytes_for_display(self.token_bytes(token))


class ByteStreamDecoder:
    """Incremental detokenizer for `ByteLevelBPE`: ids in, complete characters out.

    The bytes of each token go through an incremental UTF-8 decoder (errors="replace"), so a
    character split over several tokens comes out once, whole, with its last byte.

    Usage:
      stream = tokenizer.stream_decoder()
      for prev, token in ...: print(stream.push(prev, token), end="", flush=True)
      print(stream.flush())
    """

    def __init__(self, tokenizer: ByteLevelBPE, special: bool = False):
        """Args: tokenizer: the vocabulary; special: print control tokens' texts too."""
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, prev_token: int, token: int) -> str:
        """Feed one token; return the text it completes (may be "").

        Args:
          prev_token: unused (the common protocol passes it).
          token: int id in [0, vocab_size).

        Raises:
          IndexError: `token` out of range.
        """
        data = self._tokenizer.token_bytes(token)
        if not self._special and token in self._tokenizer.control_ids:
            return ""
        return self._utf8.decode(data)

    def flush(self) -> str:
        """End of stream: an unfinished UTF-8 sequence comes out as U+FFFD; then resets."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


_GPT2_TO_LATIN1 = {ord(c): chr(b) for c, b in UNICODE_TO_BYTE.items()}
# Characters outside GPT-2's table stand for their own UTF-8 bytes; below U+0100 those bytes
# are written as Latin-1 characters here, so one translate + encode("latin-1") decodes a token.
_GPT2_TO_LATIN1.update({
    c: chr(c).encode("utf-8").decode("latin-1") for c in range(256) if c not in _GPT2_TO_LATIN1
})


def _byte_level_decode(token: str) -> bytes:
    try:
        return token.translate(_GPT2_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a character beyond U+00FF that is not in the table
        return b"".join(
            bytes((UNICODE_TO_BYTE[c],)) if c in UNICODE_TO_BYTE else c.encode("utf-8", "replace")
            for c in token
        )
