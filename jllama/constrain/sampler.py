"""The constraint as a sampler step: `ConstrainedSampler` masks the logits a grammar does not
allow (llguidance's `LLMatcher`), lets any `HistorySampler` pick among the rest, and tells the
matcher the token picked.

The mask comes first, before every other step of the sampler it wraps (logit bias, penalties,
top-k / top-p / min-p, temperature; greedy as well), so the draw is the sampler's own draw
over the allowed tokens. An end-of-generation id is allowed only where the grammar accepts
what was generated, and once the grammar can take nothing more it is the only choice: the
generation ends there (finish_reason "stop").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import numpy as np

from jllama.constrain.grammar import Grammar, short_reason
from jllama.constrain.vocabulary import Vocabulary
from jllama.errors import ConstraintError
from jllama.sampling.sampler import HistorySampler


def masked(logits: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """`logits` with every id whose bit is 0 set to -inf (a new array).

    Args:
      logits: f32[n], n <= 32 * len(bits) (a vocabulary restricted to the tokenizer's ids).
      bits: i32[ceil(n_logits / 32)], llguidance's bitmask (bit i % 32 of word i // 32 is id
        i), little-endian as llguidance writes it.

    Returns:
      f32[n].
    """
    logits = np.asarray(logits, np.float32)
    n = logits.shape[0]
    # One byte per id (unpackbits), not llguidance.numpy's 32x repeat of every word.
    allowed = np.unpackbits(bits.view(np.uint8), count=n, bitorder="little").view(bool)
    return np.where(allowed, logits, np.float32(-np.inf))


class ConstrainedSampler:
    """`sample(logits, history) -> id` that only picks what `grammar` allows.

    Per call: the matcher's mask for the next token (`LLMatcher.unsafe_compute_mask_ptr` into
    one i32 buffer); where the matcher is stopped, `vocabulary.end_id` with nothing drawn;
    else the disallowed logits set to -inf and `sample` called on the result; then the matcher
    consumes the token picked.

    Args:
      sample: the `HistorySampler` that picks among the allowed tokens (a `Sampler`, or one
        restricted to the tokenizer's ids: the logits it is given may be shorter than the
        model's, never longer).
      grammar: the `Grammar`.
      vocabulary: the tokenizer's `Vocabulary` (`jllama.constrain.vocabulary_for`).

    Attributes:
      uses_history: `sample`'s.
      mask_seconds: seconds spent computing and applying masks so far.
      masks: how many masks were computed.
      matcher: the `llguidance.LLMatcher`.

    Raises:
      ConstraintError: at construction, a grammar the matcher cannot start; while sampling,
        a token the matcher refuses (a sampler that picked a masked id) or logits wider than
        the vocabulary.
    """

    def __init__(self, sample: HistorySampler, grammar: Grammar, vocabulary: Vocabulary):
        self._sample = sample
        self.uses_history = bool(sample.uses_history)
        self.grammar = grammar
        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.lltokenizer, grammar.llguidance,
                                            log_level=0)
        self._check()
        self._bits = np.zeros((vocabulary.n_logits + 31) // 32, np.int32)
        self.mask_seconds = 0.0
        self.masks = 0

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the {self.grammar.kind} constraint: "
                                  f"{short_reason(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """True once nothing but the end of generation can follow (the grammar is complete)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when what was generated so far is a whole match of the grammar."""
        return self.matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """The mask for the next token: bool[n_logits] (a fresh computation, not counted)."""
        bits = np.zeros_like(self._bits)
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        n = self.vocabulary.n_logits
        return np.unpackbits(bits.view(np.uint8), count=n, bitorder="little").view(bool)

    def next_mask(self) -> np.ndarray | None:
        """The mask for the next token as llguidance's bits, or None once the grammar is
        done (only `vocabulary.end_id` can follow). Counted in `masks` and `mask_seconds`.

        Returns:
          i32[ceil(n_logits / 32)], bit i % 32 of word i // 32 set where id i is allowed (a
          buffer reused by the next call: copy it to keep it).

        Raises:
          ConstraintError: the matcher is in its error state.
        """
        if self.matcher.is_stopped():
            return None
        started = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        self.masks += 1
        self.mask_seconds += time.perf_counter() - started
        return self._bits

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar allows after what was consumed (the
        matcher's state is left as it is; llguidance's `validate_tokens`): 0 once the grammar
        is done. Speculative decoding cuts a draft there, before its verification (timed
        into `mask_seconds`)."""
        if not tokens or self.matcher.is_stopped():
            return 0
        started = time.perf_counter()
        n = self.matcher.validate_tokens([int(t) for t in tokens])
        self.mask_seconds += time.perf_counter() - started
        return n

    def consume(self, token: int) -> None:
        """Tell the matcher `token` was chosen (timed into `mask_seconds`).

        Raises:
          ConstraintError: the matcher refuses it.
        """
        started = time.perf_counter()
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"the {self.grammar.kind} constraint refused token {token}: "
                                  f"{short_reason(self.matcher.get_error())}")
        self.mask_seconds += time.perf_counter() - started

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id among those the grammar allows.

        Args:
          logits: f32[n] for the position, n <= vocabulary.n_logits (not modified).
          history: passed to the wrapped sampler when it `uses_history`.

        Returns:
          an id in [0, n): one the grammar allows, or `vocabulary.end_id` once it is done.

        Raises:
          ConstraintError: as the class says.
        """
        if np.shape(logits)[0] > self.vocabulary.n_logits:
            raise ConstraintError(f"{np.shape(logits)[0]} logits for a vocabulary of "
                                  f"{self.vocabulary.n_logits} ids")
        bits = self.next_mask()
        if bits is None:
            token = self.vocabulary.end_id
        else:
            started = time.perf_counter()
            logits = masked(logits, bits)
            self.mask_seconds += time.perf_counter() - started
            token = int(self._sample(logits, history) if self.uses_history
                        else self._sample(logits))
        self.consume(token)
        return token
