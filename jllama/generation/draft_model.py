"""A smaller model (or the target's own weights at a narrower type) as speculative decoding's
drafter: `--draft=FILE`, `--draft=self:q4`, `--draft=self:int8`.

The draft model decodes greedily k tokens ahead of the sequence; its tokens are a deterministic
function of the sequence, so for the target they are a one-hot proposal and
`jllama.generation.speculative.SpeculativeDecoder`'s rules stay exact (greedy: the target's
argmaxes; sampled: each token's distribution is the target sampler's). Each drafter keeps its
own KV cache on the draft backend and feeds only what changed since its last draft (the
tokens the target accepted, or the last one it chose instead).

The vocabularies must agree, as llama.cpp's `common/speculative.cpp` checks: the same size
and the same bytes for every token (special tokens included), else the draft is refused in one
line naming the difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jllama.backends import prepared_backend
from jllama.backends.base import Prefill
from jllama.errors import JllamaError
from jllama.generation.conversation import common_prefix_length
from jllama.model.cast_nbytes import SELF_TYPES  # the --draft=self:... values
from jllama.sampling import argmax


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A prepared draft model: its backend (with `SlotCaches`: a KV cache per drafter) and
    where it came from (for messages)."""

    backend: object
    source: str


def check_vocabularies(target, draft, where: str) -> None:
    """Refuse a draft model whose tokenizer is not the target's.

    Raises:
      JllamaError: one line naming `where`, on a different vocabulary size or the first token
        whose bytes differ.
    """
    t, d = target.tokenizer, draft.tokenizer
    if t.vocab_size != d.vocab_size or target.config.vocab_size != draft.config.vocab_size:
        raise JllamaError(f"{where}: its vocabulary has {d.vocab_size} tokens "
                          f"({draft.config.vocab_size} logits), the model's {t.vocab_size} "
                          f"({target.config.vocab_size}): a draft must share the tokenizer")
    for token in range(t.vocab_size):
        if t.token_bytes(token) != d.token_bytes(token):
            raise JllamaError(f"{where}: token {token} is {d.token_bytes(token)!r} there and "
                              f"{t.token_bytes(token)!r} in the model: a draft must share the "
                              "tokenizer")


def load_draft(draft: str, target):
    """The draft model `draft` names for `target` (a `jllama.model.loading.Model`), opened and
    checked, not yet prepared: a checkpoint (path or known model name) or `SELF_TYPES`'
    self:q4 / self:int8 / self:bfloat16 (the target's checkpoint read again at that type),
    with its context capped at the target's. The CLI opens a checkpoint's this way before
    its required-memory line, which counts its weights (`memory_plan`'s `draft`).

    Raises:
      JllamaError: an unreadable draft, or one whose vocabulary is not the target's.
    """
    from jllama.model.loading import open_model

    if not draft.strip():
        raise JllamaError("--draft= is empty: give ngram, self:q4, self:int8 or a checkpoint")
    try:
        if draft in SELF_TYPES:
            model = open_model(target.source, seq_len=target.config.seq_len,
                               dtype=SELF_TYPES[draft])
        else:
            model = open_model(draft, seq_len=target.config.seq_len)
    except JllamaError as e:  # the reader's line, said of the flag
        raise type(e)(f"--draft={draft}: {e}") from None
    if draft not in SELF_TYPES:
        check_vocabularies(target, model, f"--draft={draft}")
    if model.config.seq_len < target.config.seq_len:
        raise JllamaError(f"--draft={draft}: its context is {model.config.seq_len} tokens, "
                          f"shorter than the model's {target.config.seq_len}")
    return model


def open_draft(draft, target, backend: str = "jax", **backend_options) -> DraftModel:
    """`load_draft(draft, target)` (or `draft` itself, a `Model` it returned) prepared on
    `backend`.

    Raises:
      JllamaError: as `load_draft`.
    """
    model = load_draft(draft, target) if isinstance(draft, str) else draft
    return DraftModel(prepared_backend(model, backend, **backend_options), str(model.source))


class ModelDrafter:
    """Greedy drafts from a draft model, on a KV cache of its own.

    Args:
      draft: a `DraftModel`.

    Attributes:
      constraint: a generation's `jllama.constrain.ConstrainedSampler`, or None (set by
        `SpeculativeDecoder.constrain`): each draft token is then the draft model's argmax
        among the tokens the grammar allows after the ones drafted before it (the matcher
        advanced over the draft and rolled back after it), so a JSON draft's braces and
        quotes are the grammar's.
    """

    def __init__(self, draft: DraftModel):
        self._backend = draft.backend
        self._caches = self._backend.new_caches()
        self._fed: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.constraint = None

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the draft model decodes greedily after `history` (the sequence so
        far, the last token included: its logits give the first draft token)."""
        if k < 1 or not history:
            return []
        backend = self._backend
        seq_len = backend.config.seq_len
        before = backend.use_caches(self._caches)
        try:
            # Feed what the cache does not hold yet; at least the last token (its logits).
            start = min(common_prefix_length(self._fed, history), len(history) - 1)
            rest = [int(t) for t in history[start:]]
            if len(rest) > 1 and isinstance(backend, Prefill):
                logits = backend.prefill(rest, start)
            else:
                for pos, token in enumerate(rest, start):
                    logits = backend.forward(token, pos)
            fed, out = [int(t) for t in history], []
            advanced = 0  # tokens the matcher consumed tentatively
            try:
                while True:
                    token = self._choose(logits)
                    if token is None:  # the grammar is done (or allows nothing)
                        break
                    out.append(token)
                    if self.constraint is not None:
                        if not self.constraint.matcher.consume_token(token):
                            out.pop()
                            break
                        advanced += 1
                    if len(out) == k or len(fed) >= seq_len:
                        break
                    logits = backend.forward(out[-1], len(fed))
                    fed.append(out[-1])
            finally:
                if advanced:
                    self.constraint.matcher.rollback(advanced)
            self._fed = fed
            return out
        finally:
            self._caches = backend.use_caches(before)

    def _choose(self, logits) -> int | None:
        """The draft model's greedy token: the argmax of `logits`, or of those the grammar
        allows now; None when it allows nothing more (done)."""
        if self.constraint is None:
            return int(argmax(logits))
        if self.constraint.matcher.is_stopped():
            return None
        allowed = self.constraint.allowed()
        if not allowed.any():
            return None
        logits = np.asarray(logits, np.float32)[:allowed.shape[0]]
        return int(argmax(np.where(allowed[:logits.shape[0]], logits, np.float32(-np.inf))))
