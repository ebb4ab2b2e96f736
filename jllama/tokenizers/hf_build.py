"""A parsed Hugging Face `tokenizer.json` built as one of jllama's tokenizers.

Two kinds of `tokenizer.json` are understood, and built as jllama's own tokenizers (the
`tokenizers` library is only the tests' oracle):

- byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen, ...): no normalizer (or Qwen's NFC) and one
  of the pre-tokenizers of `BYTE_LEVEL_PRE_TOKENIZERS`, built as a
  `jllama.tokenizers.bpe.ByteLevelBPE`. Vocabulary tokens are normal tokens, special added
  tokens control tokens (matched in the text only with parse_special), other added tokens
  user-defined (always matched, as `tokenizers` does);
- SentencePiece-style BPE (Llama 2, Mistral v0.1, TinyLlama): `byte_fallback`, spaces written
  as "▁" by a `Prepend("▁")` + `Replace(" ", "▁")` normalizer (or no prefix at all), built as a
  `jllama.tokenizers.spm.Tokenizer` whose scores are minus the rank of each token's first
  merge. That is exact when every way of cutting a merged token into two tokens is one of its
  merges (true of files converted from a SentencePiece model), which is checked; a file that
  does not meet it, or uses a Metaspace pre-tokenizer that adds the "▁" prefix (its prefix
  depends on whether the text already starts with a space, which the SentencePiece rule does
  not), is refused.

`jllama.tokenizers.hf.read_hf_tokenizer` reads the files into a `Parsed` and calls
`byte_level_tokenizer` or `sentencepiece_tokenizer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jllama.errors import TokenizerError
from jllama.tokenizers.bpe import (
    BYTE_TO_UNICODE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNUSED,
    USER_DEFINED,
    ByteLevelBPE,
)
from jllama.tokenizers.spm import NO_MERGE_SCORE, SPACE_MARK, Tokenizer
from jllama.tokenizers.tiktoken_model import LLAMA3_PATTERN

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen's pre-tokenizer regex as its tokenizer.json writes it (Qwen2, Qwen2.5, Qwen3): Llama 3's
with digits one at a time."""

BYTE_LEVEL_PRE_TOKENIZERS = {
    "llama-bpe": "Sequence[Split(Llama 3 regex, Isolated), ByteLevel(use_regex=False)]",
    "qwen2": "Sequence[Split(Qwen regex, Isolated), ByteLevel(use_regex=False)]",
    "gpt2": "ByteLevel(use_regex=True)",
    "smollm": "Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]",
}
"""jllama pre-tokenizer name (`ByteLevelBPE.pre`) -> the `tokenizer.json` pre_tokenizer it is
recognised from (ByteLevel always with add_prefix_space=False)."""


@dataclasses.dataclass(frozen=True)
class Added:
    """An added token: its text, id, and whether it is special (a control token)."""

    text: str
    id: int
    special: bool


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What `read_hf_tokenizer` has read, for the two builders.

    Attributes:
      data, model: tokenizer.json and its "model" object.
      tokens: token texts by id (None for an id nothing names).
      specials: the added tokens.
      merges: (left, right) pairs in rank order.
      ids: token text -> its lowest id.
      bos_id, eos_id, add_bos, stop_ids: as `read_hf_tokenizer` documents them.
      source: the tokenizer.json path.
    """

    data: dict
    model: dict
    tokens: list[str | None]
    specials: list[Added]
    merges: list[tuple[str, str]]
    ids: dict[str, int]
    bos_id: int
    eos_id: int
    add_bos: bool
    stop_ids: frozenset[int]
    source: str


def _describe(node: Any) -> str:
    """A short description of a normalizer/pre-tokenizer node, for messages."""
    if node is None:
        return "none"
    if not isinstance(node, dict):
        return repr(node)[:60]
    kind = node.get("type", "?")
    if kind == "Sequence":
        children = node.get("pretokenizers") or node.get("normalizers") or []
        return f"Sequence[{', '.join(_describe(c) for c in children)}]"
    if kind == "Split":
        pattern = node.get("pattern") or {}
        text = pattern.get("Regex", pattern.get("String"))
        return f"Split({text!r:.50}, {node.get('behavior')})"
    if kind == "ByteLevel":
        return (f"ByteLevel(add_prefix_space={node.get('add_prefix_space', True)}, "
                f"use_regex={node.get('use_regex', True)})")
    if kind == "Digits":
        return f"Digits(individual_digits={node.get('individual_digits')})"
    if kind == "Metaspace":
        return f"Metaspace(prepend_scheme={node.get('prepend_scheme')}, split={node.get('split')})"
    return str(kind)


def _byte_level_part(node: Any) -> bool | None:
    """use_regex of a ByteLevel pre-tokenizer without a prefix space, else None."""
    if (isinstance(node, dict) and node.get("type") == "ByteLevel"
            and node.get("add_prefix_space", True) is False):
        return bool(node.get("use_regex", True))
    return None


def _recognise_pre(node: Any, src: str) -> tuple[str, str | None]:
    """(jllama pre-tokenizer name, the file's own regex for it or None)."""
    parts = node.get("pretokenizers") if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get("type") == "Sequence" and isinstance(parts, list):
        if len(parts) == 1:
            parts = [None, parts[0]]
    else:
        parts = [None, node]
    if len(parts) == 2:
        head, tail = parts
        use_regex = _byte_level_part(tail)
        if head is None and use_regex is True:
            return "gpt2", None
        if (isinstance(head, dict) and head.get("type") == "Digits"
                and head.get("individual_digits") is True and use_regex is True):
            return "smollm", None
        if (isinstance(head, dict) and head.get("type") == "Split" and use_regex is False
                and head.get("behavior") == "Isolated" and not head.get("invert")):
            pattern = (head.get("pattern") or {}).get("Regex")
            if pattern == LLAMA3_PATTERN:
                return "llama-bpe", pattern
            if (pattern,) == PRE_TOKENIZERS["llama-bpe"].patterns:  # llama.cpp's spelling
                return "llama-bpe", None
            if pattern == QWEN2_PATTERN:
                return "qwen2", pattern
            if (pattern,) == PRE_TOKENIZERS["qwen2"].patterns:
                return "qwen2", None
    raise TokenizerError(
        f"{src}: pre_tokenizer {_describe(node)} is not one jllama knows (known: "
        f"{'; '.join(BYTE_LEVEL_PRE_TOKENIZERS.values())})"
    )


def byte_level_tokenizer(p: Parsed) -> ByteLevelBPE:
    """A byte-level tokenizer.json as a `ByteLevelBPE` (see the module doc)."""
    normalizer = p.data.get("normalizer")
    nfc = isinstance(normalizer, dict) and normalizer.get("type") == "NFC"  # Qwen's
    if normalizer is not None and not nfc:
        raise TokenizerError(
            f"{p.source}: normalizer {_describe(normalizer)}; a byte-level BPE tokenizer.json "
            "with a normalizer is not supported"
        )
    pre, pattern = _recognise_pre(p.data.get("pre_tokenizer"), p.source)
    # Every text is bytes first, each byte one of these 256 characters: without a token for
    # one, the text holding that byte would lose it silently.
    missing = [b for b in range(256) if BYTE_TO_UNICODE[b] not in p.ids]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise TokenizerError(
            f"{p.source}: no token for byte 0x{missing[0]:02x} ({BYTE_TO_UNICODE[missing[0]]!r})"
            f"{more}: a byte-level vocabulary needs all 256, or text with those bytes is lost"
        )
    types = [NORMAL if t is not None else UNUSED for t in p.tokens]
    for token in p.specials:
        types[token.id] = CONTROL if token.special else USER_DEFINED
    tokenizer = ByteLevelBPE(
        tokens=tuple(t if t is not None else "" for t in p.tokens),
        token_types=tuple(types),
        merges=tuple(f"{a} {b}" for a, b in p.merges),
        pre=pre,
        bos_id=p.bos_id,
        eos_id=p.eos_id,
        eot_id=p.ids.get("<|eot_id|>"),
        eom_id=p.ids.get("<|eom_id|>"),
        add_bos=p.add_bos,
        source=p.source,
        # What tokenizer.json states itself, where the `pre` name (llama.cpp's table) would
        # say otherwise: Llama 3's regex there is Meta's `(?i:'s|...)`, which (unlike
        # llama.cpp's spelled-out `'[sS]`) also takes "'ſ" as a contraction; `ignore_merges`
        # may be absent (false) in older Llama 3 files; generation_config.json may list more
        # stop ids.
        pattern=pattern,
        ignore_merges=bool(p.model.get("ignore_merges", False)),
        extra_stop_ids=frozenset(p.stop_ids),
        nfc=nfc,
    )
    return tokenizer


def sentencepiece_tokenizer(p: Parsed) -> Tokenizer:
    """A SentencePiece-style tokenizer.json as a llama2c `Tokenizer` (see the module doc)."""
    src = p.source
    add_space_prefix = _space_prefix(p.data.get("normalizer"), p.data.get("pre_tokenizer"), src)
    if p.model.get("ignore_merges"):
        raise TokenizerError(f"{src}: ignore_merges with byte_fallback is not supported")
    ids = p.ids
    rank_of: dict[str, int] = {}
    pairs: set[tuple[str, str]] = set()
    for rank, (left, right) in enumerate(p.merges):
        for side in (left, right, left + right):
            if side not in ids:
                raise TokenizerError(
                    f"{src}: model.merges[{rank}] {left + ' ' + right!r:.60} uses {side!r:.30}, "
                    "which is not a token"
                )
        rank_of.setdefault(left + right, rank)
        pairs.add((left, right))
    # run.c's merge joins any two adjacent tokens whose concatenation is a token; HF's BPE only
    # the listed pairs. They agree when every cut of a merged token is listed.
    for merged in rank_of:
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids and (left, right) not in pairs:
                raise TokenizerError(
                    f"{src}: {merged!r:.30} is both {left!r:.20} + {right!r:.20} and a merge "
                    "result, but that pair is not among the merges; jllama's SentencePiece "
                    "tokenizer could not reproduce these merges exactly"
                )
    added = {t.id for t in p.specials}
    pieces, scores = [], []
    for i, text in enumerate(p.tokens):
        if text is None:
            pieces.append(b"")
        elif i in added:
            pieces.append(text.encode("utf-8"))
        else:
            pieces.append(text.replace(SPACE_MARK, " ").encode("utf-8"))
        rank = rank_of.get(text) if text is not None and i not in added else None
        scores.append(NO_MERGE_SCORE if rank is None else -float(rank))
    hidden = {t.id for t in p.specials if t.special}
    hidden |= {i for i, t in enumerate(p.tokens) if t is None}
    return Tokenizer(
        pieces=tuple(pieces),
        scores=tuple(scores),
        max_token_length=max(len(piece) for piece in pieces),
        source=src,
        bos_id=p.bos_id,
        eos_id=p.eos_id,
        add_bos=p.add_bos,
        add_space_prefix=add_space_prefix,
        control_ids=frozenset(hidden),
        special_tokens=tuple((t.text, t.id, not t.special) for t in p.specials),
        stop_ids=p.stop_ids,
        space_mark_is_space=True,
        strip_text_start=True,  # as the Strip decoder of SentencePiece-style tokenizer.json
    )


def _is_replace_space(node: Any) -> bool:
    return (isinstance(node, dict) and node.get("type") == "Replace"
            and (node.get("pattern") or {}).get("String") == " "
            and node.get("content") == SPACE_MARK)


def _space_prefix(normalizer: Any, pre_tokenizer: Any, src: str) -> bool:
    """Whether a SentencePiece-style tokenizer.json adds the "▁" dummy prefix to each text run
    (True), or never (False); other layouts raise."""
    if pre_tokenizer is None and isinstance(normalizer, dict):
        parts = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [
            normalizer]
        if isinstance(parts, list) and parts and _is_replace_space(parts[-1]):
            head = parts[:-1]
            if not head:
                return False
            if (len(head) == 1 and head[0].get("type") == "Prepend"
                    and head[0].get("prepend") == SPACE_MARK):
                return True
    if (normalizer is None and isinstance(pre_tokenizer, dict)
            and pre_tokenizer.get("type") == "Metaspace"
            and pre_tokenizer.get("replacement", SPACE_MARK) == SPACE_MARK
            and pre_tokenizer.get("prepend_scheme") == "never"
            and not pre_tokenizer.get("split", True)):
        return False
    raise TokenizerError(
        f"{src}: a byte-fallback BPE with normalizer {_describe(normalizer)} and pre_tokenizer "
        f"{_describe(pre_tokenizer)}; jllama reproduces SentencePiece-style files exactly only "
        "with Sequence[Prepend('▁'), Replace(' ', '▁')] (or Replace alone) and no "
        "pre-tokenizer, or Metaspace(prepend_scheme=never, split=False)"
    )

