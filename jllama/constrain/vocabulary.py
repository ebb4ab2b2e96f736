"""A jllama tokenizer as llguidance sees it: `Vocabulary`, each token's bytes as it appears in
the middle of a text, its control tokens special, its end-of-generation ids, and the model's
logit count (a vocabulary padded past the tokenizer's: the extra ids are never allowed).

llguidance (https://github.com/guidance-ai/llguidance) computes a token mask from the bytes of
every token (`LLTokenizer`, built once per tokenizer: about a second on a 128K vocabulary, so
`vocabulary_for` keeps them). It marks a token special by a leading 0xFF byte (its
`llamacpp.py` does the same for llama.cpp vocabularies); a text grammar never allows one. A
byte token 0xFF reads as one too: that byte is never in UTF-8 text, so no text grammar loses it.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence

import llguidance

from jllama.tokenizers.base import Tokenizer

SPECIAL_MARK = b"\xff"
"""llguidance's prefix of a special token's bytes (never the first byte of UTF-8 text)."""


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's tokens for llguidance.

    Attributes:
      lltokenizer: the `llguidance.LLTokenizer` (n_vocab = n_logits).
      n_logits: the model's logit count, >= the tokenizer's vocab_size; the mask has a bit per
        logit, 0 for every id past the tokenizer's.
      stop_ids: the tokenizer's end-of-generation ids, sorted (llguidance's eos tokens: each
        allowed exactly when the grammar accepts).
      end_id: the stop id a constrained generation ends with when the grammar can take nothing
        more (the tokenizer's eos_id when it is a stop id, else the lowest stop id).
      special_ids: the ids no text grammar allows: control ids, BOS, EOS and the stop ids.
    """

    lltokenizer: llguidance.LLTokenizer
    n_logits: int
    stop_ids: tuple[int, ...]
    end_id: int
    special_ids: frozenset[int]


class _Wrapper(llguidance.TokenizerWrapper):
    """llguidance's `TokenizerWrapper` protocol over a jllama tokenizer: `tokens` (bytes per
    id), `eos_token_id`, `bos_token_id`, `special_token_ids`, and `__call__(text) -> ids`
    without BOS (llguidance passes a str). Its own __init__ probes another library's object,
    so it is not called."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: Sequence[int],
                 encode):
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = list(special)
        self.is_tokenizer_wrapper = True
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text)


def mid_text_encoder(tokenizer: Tokenizer):
    """`encode(text) -> ids` of `text` as it would be tokenized in the middle of a text: no
    BOS, and for a SentencePiece-style vocabulary no dummy-prefix space (llguidance tokenizes
    the bytes a grammar forces with it, and " a" for a forced "a" would be wrong)."""
    from jllama.tokenizers.spm import Tokenizer as SentencePieceBPE

    if isinstance(tokenizer, SentencePieceBPE) and tokenizer.add_space_prefix:
        tokenizer = dataclasses.replace(tokenizer, add_space_prefix=False)

    def encode(text: str | bytes) -> list[int]:
        return tokenizer.encode(text, bos=False)

    return encode


def _is_text_token(tokenizer, token: int) -> bool:
    """Whether `token` is ordinary text: its own text encodes to it alone. llama.cpp's Qwen2 and
    Qwen3 GGUFs name "," (id 11) their BOS, which they never add: marked special, it would keep
    every comma out of a grammar's JSON."""
    if token in tokenizer.control_ids or not 0 <= token < tokenizer.vocab_size:
        return False
    try:
        text = tokenizer.token_bytes(token).decode("utf-8")
        return bool(text) and list(tokenizer.encode(text, bos=False)) == [token]
    except (UnicodeDecodeError, ValueError):
        return False


def build_vocabulary(tokenizer: Tokenizer, n_logits: int | None = None) -> Vocabulary:
    """The `Vocabulary` of `tokenizer` for a model with `n_logits` logits (None: the
    tokenizer's vocab_size). Costs about a second for 100K tokens; `vocabulary_for` caches.

    A token's bytes are `token_bytes(id)`: a SentencePiece "▁" as the space it is mid-text,
    a byte-fallback token "<0x0A>" as its byte, a byte-level BPE token as its bytes; a special
    id's as 0xFF + its text.

    Raises:
      ValueError: n_logits below the tokenizer's vocab_size, or a tokenizer without stop ids.
    """
    n = tokenizer.vocab_size
    n_logits = n if n_logits is None else int(n_logits)
    if n_logits < n:
        raise ValueError(f"n_logits={n_logits} is below the tokenizer's {n} tokens")
    stop_ids = tuple(sorted(int(t) for t in tokenizer.stop_ids))
    if not stop_ids:
        raise ValueError(f"the tokenizer of {tokenizer.source} has no end-of-generation id: "
                         "a constrained generation could not end")
    end_id = tokenizer.eos_id if tokenizer.eos_id in stop_ids else stop_ids[0]
    special = frozenset(tokenizer.control_ids) | {tokenizer.eos_id, *stop_ids}
    if not _is_text_token(tokenizer, tokenizer.bos_id):
        special |= {tokenizer.bos_id}
    special = frozenset(t for t in special if 0 <= t < n)
    tokens = [
        SPECIAL_MARK + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
        for i in range(n)
    ]
    # Ids with no token: empty, which no grammar can step over (llguidance's own padding).
    tokens += [b""] * (n_logits - n)
    bos = tokenizer.bos_id if 0 <= tokenizer.bos_id < n else None
    wrapper = _Wrapper(tokens, end_id, bos, sorted(special), mid_text_encoder(tokenizer))
    lltokenizer = llguidance.LLTokenizer(wrapper, n_vocab=n_logits, eos_token=list(stop_ids))
    return Vocabulary(lltokenizer, n_logits, stop_ids, end_id, special)


_cache: dict[tuple[int, int], tuple[weakref.ref, Vocabulary]] = {}
_cache_lock = threading.Lock()


def vocabulary_for(tokenizer: Tokenizer, n_logits: int | None = None) -> Vocabulary:
    """`build_vocabulary(tokenizer, n_logits)`, built once per tokenizer object and logit
    count while the tokenizer lives (the explicit cache of this module). Errors: as
    `build_vocabulary`."""
    n_logits = tokenizer.vocab_size if n_logits is None else int(n_logits)
    key = (id(tokenizer), n_logits)
    with _cache_lock:
        held = _cache.get(key)
        if held is not None and held[0]() is tokenizer:
            return held[1]
    vocabulary = build_vocabulary(tokenizer, n_logits)
    with _cache_lock:
        # The callback holds the dict itself: at interpreter exit the module's globals are
        # already None when the last tokenizers are collected.
        forget = lambda _, key=key, cache=_cache: cache.pop(key, None)  # noqa: E731
        _cache[key] = (weakref.ref(tokenizer, forget), vocabulary)
    return vocabulary
