"""Special tokens cut out of the text before encoding, as llama.cpp does, for every tokenizer.

A special token (control, unknown or user-defined, as GGUF types them) is matched as text and
becomes its id; the text between matches is encoded as ordinary text. `split_special_tokens`
cuts, `special_order` sorts the tokens the way llama.cpp tries them, and
`encode_around_specials` is the encode of tokenizers whose text runs are encoded apart.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

from jllama.tokenizers.base import Segments


def special_order(specials: Iterable[tuple[str, int, bool]]) -> tuple[tuple[str, int, bool], ...]:
    """(text, id, always) special tokens in the order `split_special_tokens` tries them:
    longest text first, then lowest id (llama.cpp's `cache_special_tokens` sort)."""
    return tuple(sorted(specials, key=lambda s: (-len(s[0]), s[1])))


def split_special_tokens(
    segments: Segments,
    specials: Sequence[tuple[str, int, bool]],
) -> list[str | int]:
    """Cut text at special-token matches, as llama.cpp's `tokenizer_st_partition` does.

    The text is the concatenation of the segments' strings. Each special token is tried in
    the order given (callers pass them longest text first, then lowest id: `special_order`);
    each one cuts every text fragment left by the previous ones at its non-overlapping
    occurrences, leftmost first. A token with `always` set (GGUF user-defined tokens) matches
    anywhere; one without (control and unknown tokens) matches only where the occurrence lies
    wholly inside flagged segments (consecutive flagged segments count as one span), so
    `[(text, True)]` is llama.cpp's `parse_special=true` and `[(text, False)]` its
    `parse_special=false`.

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


def encode_around_specials(
    segments: Segments,
    specials: Sequence[tuple[str, int, bool]],
    encode_text: Callable[[str], Iterable[int]],
    bos_id: int | None,
    eos_id: int | None,
) -> list[int]:
    """`bos_id` (if not None), then the segments' text cut by `split_special_tokens`: each
    special token as its id, each text run between them as `encode_text(run)`; then `eos_id`
    (if not None). The encode_segments of tokenizers whose text runs are encoded independently
    (byte-level BPE, tiktoken: llama.cpp's `tokenize` for BPE vocabularies)."""
    out = [] if bos_id is None else [bos_id]
    for part in split_special_tokens(segments, specials):
        if isinstance(part, int):
            out.append(part)
        else:
            out.extend(encode_text(part))
    if eos_id is not None:
        out.append(eos_id)
    return out
