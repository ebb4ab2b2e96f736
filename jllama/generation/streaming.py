"""A generation's sampled tokens as text as it streams: the tokenizer's stream decoder, stop
strings and log-probs, in one place for the server, chat and scripts.

`Completion` takes the sampled `Token`s of a `Generation` (or of a chat turn) and yields `Text`
pieces: text released as soon as it cannot be part of a stop string (`jllama.generation.stop`), never a
partial UTF-8 character at the end, and the log-probs of the tokens it came from when asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from jllama.generation.generate import Generation, Token
from jllama.sampling import log_softmax
from jllama.generation.stop import StopMatcher


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (`log_softmax` of its logits,
    before any sampler step, as llama.cpp's server reports by default).

    Attributes:
      token: the token's text (its bytes decoded as UTF-8, U+FFFD for a partial character).
      bytes: the token's bytes, as ints.
      logprob: natural log of its probability.
      top: the `top` most likely tokens at that position, as (text, bytes, logprob), most
        likely first.
    """

    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


@dataclasses.dataclass(frozen=True)
class Text:
    """Text released to the reader (never any part of a stop string), the log-probs of the
    tokens it came from (when asked for), and how many sampled tokens it covers (those whose
    text it releases: more than one where a character spans tokens, 0 for a tail that only
    flushes)."""

    text: str
    logprobs: list[TokenLogprob]
    tokens: int = 1


class LogitsRecorder:
    """Wraps a sampler to keep the logits of its last draw (for log-probs).

    Args:
      sample: `sample(logits f32[vocab_size][, history]) -> token id` with a `uses_history`
        attribute (a `jllama.sampling.Sampler`, or one restricted to a vocabulary).
    """

    def __init__(self, sample):
        self._sample = sample
        self.uses_history = bool(sample.uses_history)
        self.logits: np.ndarray | None = None

    def __call__(self, logits, *history) -> int:
        self.logits = logits
        return self._sample(logits, *history)


class Completion:
    """The text of sampled tokens as it streams.

    Args:
      tokens: the sampled `Token`s in order (prompt tokens, if any, are skipped).
      tokenizer: a `jllama.tokenizers.base.Tokenizer` (`stream_decoder`, `printed_bytes`,
        `vocab_size`).
      stop: stop strings; the text ends just before the first one found.
      logprobs: how many top log-probs per token (0: only the chosen token's), or None: none.
      recorder: the `LogitsRecorder` the generation samples through (needed for log-probs).
      cancelled: called before each token; True ends the stream at once
        (`finish_reason` "cancelled").
      generation: the `Generation` the tokens come from, when they do: its stop token counts
        as a "stop".
      each_token: yield a piece for every sampled token, an empty one (no log-probs, which
        wait for the text they belong to) for a token that releases no text yet, so each
        `next()` draws exactly one token (a scheduler stepping many streams in one batched
        decode step); False: only pieces with text or log-probs.

    Attributes:
      finish_reason: once iteration ends: "stop" (a stop string was found, or the
        generation's stop token), "length" (the tokens ran out) or "cancelled"; None before.
      generation: as given.
    """

    def __init__(self, tokens: Iterable[Token], tokenizer, stop: Sequence[str] = (),
                 logprobs: int | None = None, recorder: LogitsRecorder | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 generation: Generation | None = None, each_token: bool = False):
        if logprobs is not None and recorder is None:
            raise ValueError("log-probs need the LogitsRecorder the generation samples with")
        self._tokens = tokens
        self._tokenizer = tokenizer
        self._matcher = StopMatcher(stop)
        self._logprobs = logprobs
        self._recorder = recorder
        self._cancelled = cancelled
        self.generation = generation
        self._each_token = each_token
        self.finish_reason: str | None = None

    @property
    def stop_string(self) -> str | None:
        """The stop string the text ended at (finish_reason "stop" by a string), else None."""
        return self._matcher.matched

    def __iter__(self) -> Iterator[Text]:
        decoder = self._tokenizer.stream_decoder()
        matcher = self._matcher
        pending: list[TokenLogprob] = []
        held = 0  # sampled tokens whose text is not yet released
        for token in self._tokens:
            if self._cancelled is not None and self._cancelled():
                self.finish_reason = "cancelled"
                return
            if not token.sampled:
                continue
            held += 1
            if self._logprobs is not None:
                pending.append(self._logprob(token.prev, token.id))
            text = matcher.push(decoder.push(token.prev, token.id))
            if text or (matcher.stopped and pending):
                yield Text(text, pending, held)
                pending, held = [], 0
            elif self._each_token and not matcher.stopped:
                yield Text("", [], held)
                held = 0
            if matcher.stopped:
                self.finish_reason = "stop"
                return
        # A stream cut (max_tokens, the context) inside a character ends before it, not in
        # U+FFFD: the bytes of a character that was never finished print nothing.
        tail = matcher.push(decoder.flush(drop_incomplete=True))
        if not matcher.stopped:
            tail += matcher.flush()
        if tail or pending:
            yield Text(tail, pending, held)
        by_token = self.generation is not None and self.generation.stop_token is not None
        self.finish_reason = "stop" if matcher.stopped or by_token else "length"

    def _logprob(self, prev: int, token: int) -> TokenLogprob:
        n = self._tokenizer.vocab_size
        lp = log_softmax(np.asarray(self._recorder.logits)[:n])
        best = np.argsort(-lp, kind="stable")[: self._logprobs] if self._logprobs else []
        return TokenLogprob(
            *self._token_text(prev, token), float(lp[token]),
            [(*self._token_text(prev, int(t)), float(lp[t])) for t in best],
        )

    def _token_text(self, prev: int, token: int) -> tuple[str, list[int]]:
        data = self._tokenizer.printed_bytes(prev, token)
        return data.decode("utf-8", "replace"), list(data)
