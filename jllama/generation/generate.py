"""The generation loop, as llama2.c run.c's `generate`, apart from any model or sampler.

The loop takes any `forward(token, pos) -> logits` and any `sample(logits) -> token`: the prompt
tokens are fed one position at a time with no sampling while the prompt lasts, then each
position's logits are sampled. It stops after `steps` positions or when a stop token (BOS or
EOS by default) is produced; the stop token itself is not yielded.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jllama.errors import NumericsError

BOS_ID = 1
EOS_ID = 2

Forward = Callable[[int, int], np.ndarray]
Sample = Callable[[np.ndarray], int]


def resolve_steps(steps: int, seq_len: int) -> int:
    """Positions to run, as run.c: values < 1 or > seq_len mean seq_len."""
    return seq_len if steps < 1 or steps > seq_len else steps


@dataclasses.dataclass(frozen=True)
class Token:
    """One token after the first prompt token, in order.

    Attributes:
      id: the token id.
      prev: the token before it (the decoder needs it: a piece after BOS loses its leading
        space).
      pos: its position in the sequence (the first prompt token is at `start_pos`, default 0).
      sampled: False for a prompt token (forced), True for a generated one.
    """

    id: int
    prev: int
    pos: int
    sampled: bool


@dataclasses.dataclass
class GenerationStats:
    """Counts and timings of one generation, filled in as it runs.

    Attributes:
      prompt_tokens: tokens of the prompt fed (BOS included), tokens.
      generated_tokens: tokens sampled (the stop token not counted), tokens.
      prefill_seconds: from the start to the first sampled token: the prompt's forward
        passes, seconds (time to first token).
      decode_seconds: from the first sampled token to the last one (a stop token included),
        seconds.
      decode_steps: tokens sampled after the first one (a stop token included): the forward
        passes that `decode_seconds` covers.
      first_token_seconds: from the generation's `started_at` (default: its own start, then
        equal to prefill_seconds; the CLI passes the process's start) to the first sampled
        token, seconds; 0 until one is sampled.
      startup_seconds, load_seconds, compile_seconds: what the caller spent before the
        generation, filled in by it (0 otherwise): starting the process (interpreter, imports,
        flags), reading and placing the model, and compiling (or loading from the compile
        cache) the programs, seconds. The CLI's are parts of first_token_seconds.
      drafted_tokens, accepted_tokens: with speculative decoding
        (`jllama.generation.speculative`), tokens drafted and drafted tokens accepted, tokens.
    """

    # What was fed and made, tokens.
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Where the time went, seconds.
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_token_seconds: float = 0.0
    startup_seconds: float = 0.0
    load_seconds: float = 0.0
    compile_seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        """accepted_tokens / drafted_tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second (0 when nothing was measured)."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens sampled per second after the first one (0 when fewer than two)."""
        if self.decode_steps == 0 or self.decode_seconds <= 0:
            return 0.0
        return self.decode_steps / self.decode_seconds


def _not_finite(pos: int) -> NumericsError:
    return NumericsError(
        f"the model's logits at position {pos} are not finite (NaN or inf): "
        "the checkpoint's weights may be broken (check with --verify_checkpoint)"
    )


class Generation:
    """An iterator over the tokens of one generation, with its `stats` and `generated_ids`.

    Args:
      forward: the model step, `forward(token, pos) -> logits f32[vocab_size]`.
      prompt_ids: the prompt, BOS included when wanted; at least one token.
      sample: `sample(logits) -> token id`.
      steps: number of positions to run (the prompt's included), >= 1 and at most the model's
        seq_len (`resolve_steps` maps run.c's conventions to that).
      stop_ids: tokens that end the generation when sampled (not yielded).
      start_pos: the position of prompt_ids[0] (tokens): a conversation continues after the
        `start_pos` positions already in the model's KV cache, and `steps` counts from there.
      prefill: optional `prefill(tokens, start_pos) -> logits f32[vocab_size]` of the last
        token (a backend's batched prefill); when given, a prompt of 2 or more tokens that fits
        in `steps` goes through it in one call instead of `forward` token by token.
      clock: seconds as a float (injectable for tests).
      started_at: a `clock` reading from which `stats.first_token_seconds` counts (e.g. the
        process's start, `jllama.platform.runtime.process_start`); None: the generation's start.
      context_ids: the tokens before prompt_ids (at positions 0 .. start_pos-1), for a sampler
        that reads the history (below); the model is not fed them.
      decode_loop: optional `decode_loop(token, pos, n) -> (ids, finite)`: feeds `token` at
        `pos` and samples up to n following tokens on the device (a backend's `loop` decode
        mode, with this generation's sampler bound in), returning them (a list, ending early
        after a stop token) and False if it stopped at non-finite logits. When given, every
        token after the first sampled one comes from it, a chunk per call.

    A `sample` with a true attribute `uses_history` (a `Sampler` with a repetition penalty) is
    called as `sample(logits, history)`, history being every token of the sequence so far:
    context_ids + prompt_ids + the tokens generated.

    Raises:
      ValueError: an empty prompt or steps < 1 (at construction).
      NumericsError: while iterating, logits that are NaN or infinite at a position where a
        token is sampled (a broken checkpoint: `jllama --verify_checkpoint` finds it).
    """

    def __init__(
        self,
        forward: Forward,
        prompt_ids: Sequence[int],
        sample: Sample,
        steps: int,
        stop_ids: Sequence[int] = (BOS_ID, EOS_ID),
        clock: Callable[[], float] = time.perf_counter,
        start_pos: int = 0,
        prefill: Callable[[Sequence[int], int], np.ndarray] | None = None,
        decode_loop: Callable[[int, int, int], tuple[list[int], bool]] | None = None,
        context_ids: Sequence[int] = (),
        started_at: float | None = None,
    ):
        self.prompt_ids = [operator.index(t) for t in prompt_ids]
        self._history = (
            [operator.index(t) for t in context_ids] + self.prompt_ids
            if getattr(sample, "uses_history", False) else None
        )
        if not self.prompt_ids:
            raise ValueError("the prompt must hold at least one token (e.g. BOS)")
        if steps < 1:
            raise ValueError(f"steps={steps} must be at least 1")
        self._prefill = prefill
        self._decode_loop = decode_loop
        self.start_pos = operator.index(start_pos)
        if self.start_pos < 0:
            raise ValueError(f"start_pos={start_pos} must not be negative")
        self.generated_ids: list[int] = []
        self.end_pos = self.start_pos
        self.stop_token: int | None = None
        """The stop token that ended the generation, or None (steps ran out, or not done)."""
        """Positions whose keys and values are in the KV cache once iteration stops: the
        tokens (prompt_ids + generated_ids)[: end_pos - start_pos] went through the model."""
        self.stats = GenerationStats(prompt_tokens=min(len(self.prompt_ids), steps))
        self._started_at = started_at
        self.finished = False
        """True once iteration has ended (steps run out, a stop token, or an error)."""
        self.next_input: tuple[int, int] | None = None
        """While the generation waits after yielding a token: the (token, pos) its next step
        feeds through `forward`, so a caller may compute those logits ahead (a batched step
        over several generations, `jllama.engine`); None when the next step calls no forward
        (a prefill, the device loop, the end)."""
        self.speculation = None
        """The `jllama.generation.speculative.SpeculativeDecoder` of a generation decoded with
        drafts (set by `Session.generate`; its counts are in `stats`), or None."""
        self.constraint = None
        """The `jllama.constrain.ConstrainedSampler` the tokens are sampled through (set by
        `Session.generate` for a generation with a grammar: its mask time and count), or None."""
        self._superseded: str | None = None
        self._tokens = self._run(forward, sample, steps, frozenset(stop_ids), clock)

    def __iter__(self) -> Iterator[Token]:
        return self

    def __next__(self) -> Token:
        if self._superseded is not None and not self.finished:
            raise RuntimeError(self._superseded)
        try:
            return next(self._tokens)
        except BaseException:
            self.finished = True
            raise

    def supersede(self, why: str) -> None:
        """Mark an unfinished generation as overtaken (another sequence now owns the model's
        KV cache): iterating it further raises RuntimeError(why) instead of producing tokens
        from the other sequence's keys and values."""
        self._superseded = why

    def _run(self, forward, sample, steps, stop_ids, clock) -> Iterator[Token]:
        prompt = self.prompt_ids
        stats = self.stats
        start = clock()
        started_at = start if self._started_at is None else self._started_at
        first_sampled_at = None
        token = prompt[0]
        first = 0
        if self._prefill is not None and 1 < len(prompt) <= steps:
            # The whole prompt in one batched call; its tokens are then yielded as forced ones.
            prefilled = self._prefill(prompt, self.start_pos)
            self.end_pos = self.start_pos + len(prompt)
            for i in range(1, len(prompt)):
                yield Token(id=prompt[i], prev=prompt[i - 1], pos=self.start_pos + i, sampled=False)
            first, token = len(prompt) - 1, prompt[-1]
        i = first
        loop_next = False  # decided when the last token was yielded (next_input follows it)
        while i < steps:
            pos = self.start_pos + i
            if loop_next:
                i, token = yield from self._run_loop(token, i, steps, stop_ids, clock,
                                                     first_sampled_at)
                if i is None:
                    return
                loop_next = False  # it stepped aside after setting next_input
                continue
            if first and i == first:
                logits = prefilled
            else:
                logits = forward(token, pos)
                self.end_pos = pos + 1
            if i + 1 < len(prompt):
                next_token, sampled = prompt[i + 1], False
            else:
                if not np.isfinite(logits).all():
                    raise _not_finite(pos)
                if self._history is None:
                    next_token = int(sample(logits))
                else:
                    next_token = int(sample(logits, self._history))
                    self._history.append(next_token)
                sampled = True
                now = clock()
                if first_sampled_at is None:
                    first_sampled_at = now
                    stats.prefill_seconds = now - start
                    stats.first_token_seconds = now - started_at
                else:
                    stats.decode_seconds = now - first_sampled_at
                    stats.decode_steps += 1
                if self._stopped_by(next_token, stop_ids):
                    return
            loop_next = first_sampled_at is not None and self._looping()
            if i + 1 < steps and not loop_next:
                self.next_input = (next_token, pos + 1)
            yield Token(id=next_token, prev=token, pos=pos + 1, sampled=sampled)
            self.next_input = None
            token = next_token
            i += 1
        if first_sampled_at is None:  # the prompt filled every step: all of it was prefill
            stats.prefill_seconds = clock() - start

    def _looping(self) -> bool:
        """Whether the next sampled tokens come from `decode_loop`: there is one and it has
        not stepped aside (a `decode_loop` with an `active()` that says False, e.g. a
        speculative decoder while other sequences share the batched step, leaves the token to
        one `forward`)."""
        loop = self._decode_loop
        if loop is None:
            return False
        active = getattr(loop, "active", None)
        return active is None or active()

    def _stopped_by(self, token: int, stop_ids: frozenset[int]) -> bool:
        """Take a sampled token: True (and `stop_token` set) when it ends the generation, else
        counted and appended to `generated_ids`."""
        if token in stop_ids:
            self.stop_token = token
            return True
        self.stats.generated_tokens += 1
        self.generated_ids.append(token)
        return False

    def _run_loop(self, token, i, steps, stop_ids, clock, first_sampled_at):
        """Steps i.. steps - 1 through `decode_loop`, in chunks, while it is active; `token`
        was sampled last. Returns (i, token) to go on from where it stepped aside, or
        (None, None) once the generation ended."""
        stats = self.stats
        while i < steps:
            pos = self.start_pos + i
            ids, finite = self._decode_loop(token, pos, steps - i)
            self.end_pos = pos + len(ids) + (0 if finite else 1)
            stats.decode_seconds = clock() - first_sampled_at
            for n, next_token in enumerate(ids):
                next_token = int(next_token)
                stats.decode_steps += 1
                if self._stopped_by(next_token, stop_ids):
                    return None, None
                aside = n + 1 == len(ids) and finite and not self._looping()
                if aside and i + 1 < steps:
                    self.next_input = (next_token, pos + 1)  # the next step is a forward
                yield Token(id=next_token, prev=token, pos=pos + 1, sampled=True)
                self.next_input = None
                token, pos, i = next_token, pos + 1, i + 1
                if aside:
                    return i, token
            if not finite:
                raise _not_finite(pos)
        return None, None
