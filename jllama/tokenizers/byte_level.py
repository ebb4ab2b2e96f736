"""The steps of byte-level BPE: GPT-2's byte alphabet, llama.cpp's pre-tokenizers, the merge.

Byte-level BPE vocabularies (GPT-2, SmolLM, Llama 3, ...) write every token as characters of
GPT-2's byte <-> unicode table (`BYTE_TO_UNICODE`), split the text before BPE by a list of
regexes named by GGUF's `tokenizer.ggml.pre` (`PRE_TOKENIZERS`, `pre_tokenize`), and merge
each piece's characters lowest rank first (`merge_by_rank`).
`jllama.tokenizers.bpe.ByteLevelBPE` is the tokenizer built on them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Mapping, Sequence

import regex


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


_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_BPE_PATTERN = (
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
_LLAMA3 = PreTokenizer((LLAMA_BPE_PATTERN,), ignore_merges=True, add_bos=True)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 (Qwen2, Qwen2.5, Qwen3 and DeepSeek-R1's Qwen
# distills): Qwen's tokenizer.json regex with its `(?i:...)` contractions spelled out, as
# llama.cpp writes it; digits one at a time; no BOS.
QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = PreTokenizer((QWEN2_PATTERN,))
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
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], _QWEN2),
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT, also used when the key is missing.
    "default": _DEFAULT,
}
"""`tokenizer.ggml.pre` value -> its pre-tokenizer, as llama.cpp maps them (src/llama-vocab.cpp:
the pre-type chosen in `llama_vocab::impl::load`, the regexes in `llm_tokenizer_bpe`)."""


@functools.cache
def compile_patterns(patterns: tuple[str, ...]) -> tuple[regex.Pattern, ...]:
    """The compiled regexes of a pre-tokenizer (cached)."""
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


# bytes.decode("latin-1") gives code points 0..255; this table maps them to GPT-2's characters.
_LATIN1_TO_GPT2 = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}


def byte_level_encode(data: bytes) -> str:
    """`data` written in GPT-2's alphabet: each byte b as BYTE_TO_UNICODE[b]."""
    return data.decode("latin-1").translate(_LATIN1_TO_GPT2)


_GPT2_TO_LATIN1 = {ord(c): chr(b) for c, b in UNICODE_TO_BYTE.items()}
# Characters outside GPT-2's table stand for their own UTF-8 bytes; below U+0100 those bytes
# are written as Latin-1 characters here, so one translate + encode("latin-1") decodes a token.
_GPT2_TO_LATIN1.update({
    c: chr(c).encode("utf-8").decode("latin-1") for c in range(256) if c not in _GPT2_TO_LATIN1
})


def byte_level_decode(token: str) -> bytes:
    """The bytes a token text in GPT-2's alphabet stands for (UNICODE_TO_BYTE of each
    character; a character outside the table, which byte-level vocabularies do not have,
    gives its own UTF-8)."""
    try:
        return token.translate(_GPT2_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a character beyond U+00FF that is not in the table
        return b"".join(
            bytes((UNICODE_TO_BYTE[c],)) if c in UNICODE_TO_BYTE else c.encode("utf-8", "replace")
            for c in token
        )


def merge_by_rank(symbols: list[str | None], ranks: Mapping[str, int]) -> None:
    """BPE of one pre-token's characters: merge `symbols` in place, lowest rank first
    (merged-away entries become None).

    Args:
      symbols: the pre-token's characters in GPT-2's alphabet (`byte_level_encode`).
      ranks: "left right" -> rank of that merge (its index in the merges): the merge texts
        themselves are the keys, so a 280,000-merge vocabulary builds its table without a
        pair of new strings per merge. A pair is looked up as left + " " + right, which finds
        exactly the merge that splits into (left, right) at its first space after position 0
        (llama.cpp's rule), since GPT-2's alphabet has no space: symbols never hold one.

    Nodes are the positions of the initial characters; `after`/`before` link the live
    ones. The heap holds (rank, left node) for every adjacent pair that has a merge, plus
    stale entries; an entry is live iff its left node and that node's successor still form
    a pair of that rank (a rank belongs to one pair). Popping the smallest (rank, node)
    merges the lowest-rank pair, leftmost on ties, as llama.cpp's `llm_bigram_bpe` queue
    (src/llama-vocab.cpp, `llm_tokenizer_bpe_session::tokenize`).
    """
    n = len(symbols)
    after = [*range(1, n), -1]  # the next live node, -1 after the last
    before = list(range(-1, n - 1))  # the previous live node, -1 before the first
    heap = [(r, i) for i in range(n - 1)
            if (r := ranks.get(symbols[i] + " " + symbols[i + 1])) is not None]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        rank, i = pop(heap)
        left = symbols[i]
        j = after[i]
        if left is None or j < 0 or ranks.get(left + " " + symbols[j]) != rank:
            continue
        merged = left + symbols[j]
        symbols[i] = merged
        symbols[j] = None
        k = after[j]
        after[i] = k
        if k >= 0:
            before[k] = i
            r = ranks.get(merged + " " + symbols[k])
            if r is not None:
                push(heap, (r, i))
        h = before[i]
        if h >= 0:
            r = ranks.get(symbols[h] + " " + merged)
            if r is not None:
                push(heap, (r, h))
