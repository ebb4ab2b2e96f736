"""`Sampler`: run.c's `sample()` extended with llama.cpp's chain, built once from a
`SamplerConfig` as a list of steps; and `restrict_to_vocabulary` for padded vocabularies."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jllama.errors import SamplerError
from jllama.sampling import chain
from jllama.sampling.chain import Candidates
from jllama.sampling.config import SamplerConfig
from jllama.sampling.rng import XorShiftRng, seed_from_clock
from jllama.sampling.runc import argmax, as_vector

LogitStep = Callable[[np.ndarray, Sequence[int]], np.ndarray]
"""`step(logits f32[vocab_size], history) -> new f32[vocab_size]`: a change of the whole vector."""

CandidateStep = Callable[[Candidates], Candidates]
"""`step(candidates) -> candidates`: a filter or a rescaling of the tokens in the running."""


class HistorySampler(Protocol):
    """What a generation loop calls for the next token: `Sampler`, or one wrapped by
    `restrict_to_vocabulary`.

    Attributes:
        uses_history: True when the draw reads the sequence's ids: the loop then passes them.
    """

    uses_history: bool

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int: ...


def _biased(logits: np.ndarray, history: Sequence[int], *, bias: dict[int, float]) -> np.ndarray:
    return chain.apply_logit_bias(logits, bias)


def _penalized(logits: np.ndarray, history: Sequence[int], *, c: SamplerConfig) -> np.ndarray:
    if not len(history):
        return logits
    n = c.penalty_last_n
    recent = history if n < 0 else history[max(len(history) - n, 0):]
    return chain.apply_penalties(logits, recent, c.repeat_penalty, c.frequency_penalty,
                           c.presence_penalty)


def _logit_steps(c: SamplerConfig) -> list[LogitStep]:
    """Logit bias, then the penalties: each only when it is on."""
    steps: list[LogitStep] = []
    if c.logit_bias:
        steps.append(functools.partial(_biased, bias=dict(c.logit_bias)))
    if c.uses_history:
        steps.append(functools.partial(_penalized, c=c))
    return steps


def _steps_on(c: SamplerConfig) -> list[str]:
    """The names of the candidate steps that are on, in `c.order` (a switched-off filter would
    leave the candidates unchanged)."""
    on = {
        "top_k": c.top_k > 0,
        "temperature": True,
        "top_p": 0 < np.float32(c.top_p) < 1,  # top_p_filter's test, in float32 as run.c
        "min_p": c.min_p > 0,
    }
    return [name for name in c.order if on[name]]


def _candidate_steps(c: SamplerConfig) -> list[CandidateStep]:
    """The candidate steps in `c.order`, those switched off left out."""
    steps = {
        "top_k": functools.partial(chain.top_k_filter, k=c.top_k),
        "temperature": functools.partial(chain.temperature_scale, temperature=c.temperature),
        "top_p": functools.partial(chain.top_p_filter, top_p=c.top_p),
        "min_p": functools.partial(chain.min_p_filter, min_p=c.min_p),
    }
    return [steps[name] for name in _steps_on(c)]


class Sampler:
    """Picks the next token from logits: run.c's `sample()` extended with llama.cpp's chain.

    Per call, in this order (llama.cpp's `common_sampler`, with run.c's arithmetic):

    1. `apply_logit_bias` (when `logit_bias` is given);
    2. `apply_penalties` over the last `penalty_last_n` ids of `history` (when a penalty is on);
    3. temperature 0 (as float32): return the argmax; nothing is drawn;
    4. the candidate steps in `order` (default top_k, temperature, top_p, min_p), the ones
       switched off left out;
    5. one coin `rng.random_f32()` and `sample_candidates`.

    The steps are chosen once, when the sampler is made (`logit_steps`, `candidate_steps`).
    With only temperature, top_p and seed set, steps 1, 2 and the top-k and min-p steps are
    left out, and the result is bit for bit run.c's: softmax of logits / temperature, then
    `sample_mult` (top_p 0 or 1) or `sample_topp`. The same seed and logits give run.c's tokens.

    Args:
        temperature, top_p, seed: as `SamplerConfig` (seed None: from the clock).
        **options: the other `SamplerConfig` fields (top_k, min_p, repeat_penalty,
            frequency_penalty, presence_penalty, penalty_last_n, logit_bias, order).

    Attributes:
        config: the `SamplerConfig`, with the seed actually used (never None).
        rng: the `XorShiftRng`, advanced by one draw per sampled (non-greedy) token.
        uses_history: True when the penalties need the recent ids: the generation loop then
            calls `sample(logits, history)` (see `jllama.generation.generate.Generation`).
        logit_steps: the steps on the whole logit vector (`LogitStep`s), in order.
        candidate_steps: the steps on the candidates (`CandidateStep`s), in order; None for
            greedy sampling (temperature 0 as a float32).
        runc_settings: (temperature, top_p) as float32 when a draw is exactly run.c's
            sampler (no bias, no penalty; temperature then top_p, or greedy: temperature 0),
            so a kernel drawing run.c's way with a coin from `rng` gives this sampler's token
            (`jllama.kernels.batched.sample_batch`); None otherwise.

    Raises:
        SamplerError (a ValueError): a setting out of range or unknown, naming it.
    """

    def __init__(
        self, temperature: float = 1.0, top_p: float = 0.9, seed: int | None = None, **options
    ):
        unknown = set(options) - {f.name for f in dataclasses.fields(SamplerConfig)}
        if unknown:
            raise SamplerError(f"unknown sampler setting(s): {', '.join(sorted(unknown))}")
        config = SamplerConfig(temperature=temperature, top_p=top_p, seed=seed, **options)
        if config.seed is None:
            config = dataclasses.replace(config, seed=seed_from_clock())
        self.config = config
        self.rng = XorShiftRng(config.seed)
        self.uses_history = config.uses_history
        self.logit_steps = tuple(_logit_steps(config))
        self.candidate_steps: tuple[CandidateStep, ...] | None = None
        if np.float32(config.temperature) != 0:
            self.candidate_steps = tuple(_candidate_steps(config))
        self.runc_settings: tuple[np.float32, np.float32] | None = None
        if not self.logit_steps and (self.candidate_steps is None or _steps_on(config) in (
                ["temperature"], ["temperature", "top_p"])):
            self.runc_settings = (np.float32(config.temperature), np.float32(config.top_p))

    @classmethod
    def from_config(cls, config: SamplerConfig) -> Sampler:
        """A sampler for `config` (a None seed is taken from the clock)."""
        return cls(**vars(config))

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id for `logits`.

        Args:
            logits: f32[vocab_size] for the current position (NumPy, or anything `np.asarray`
                takes, e.g. a JAX array). Not modified.
            history: the sequence's token ids so far, oldest first (prompt included); only the
                last `penalty_last_n` are read, and only when a penalty is on.

        Returns:
            A token id, an int in [0, vocab_size).

        Raises:
            ValueError: logits not a non-empty vector, or a logit_bias id beyond it.
        """
        logits = as_vector(logits, "logits")
        for step in self.logit_steps:
            logits = step(logits, history)
        if self.candidate_steps is None:
            return argmax(logits)
        candidates = Candidates.of(logits)
        for step in self.candidate_steps:
            candidates = step(candidates)
        return chain.sample_candidates(candidates, self.rng.random_f32())

    __call__ = sample

    def __repr__(self) -> str:
        defaults = SamplerConfig()
        changed = [
            f"{name}={value!r}"
            for name, value in vars(self.config).items()
            if name in ("temperature", "top_p", "seed") or value != vars(defaults)[name]
        ]
        return f"Sampler({', '.join(changed)})"


class _Restricted:
    """`sample` over the first `n` logits (see `restrict_to_vocabulary`)."""

    def __init__(self, sample: HistorySampler, n: int):
        self._sample = sample
        self._n = n
        self.uses_history = sample.uses_history

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        return self._sample(logits[: self._n], history)


def restrict_to_vocabulary(sample: HistorySampler, n: int) -> HistorySampler:
    """`sample` over the first `n` logits only: for a model whose vocab_size is padded past its
    tokenizer's `n` tokens (common in Hugging Face models), so that an id with no token is never
    drawn. The ids returned are unchanged (they index the full logits); the sampler's
    `uses_history` (and the history argument) pass through.

    Args:
      sample: a `HistorySampler` (`sample(logits f32[vocab_size], history=()) -> token id`
        with an attribute `uses_history`), e.g. a `Sampler`.
      n: the tokenizer's vocab_size, tokens.

    Returns:
      A `HistorySampler`.
    """
    return _Restricted(sample, n)
