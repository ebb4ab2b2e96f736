"""llama.cpp's sampler chain: logit transforms on the whole vector, then filters on candidates.

Logit bias and the repetition / frequency / presence penalties change the whole logit vector
(`apply_logit_bias`, `apply_penalties`, the latter reading the sequence's recent ids); then the
tokens still in the running (`Candidates`: ids, logits, optionally probabilities, in the order a
draw walks them) go through `top_k_filter`, `temperature_scale`, `top_p_filter` and
`min_p_filter` in a configurable order, and `sample_candidates` draws one. With the llama.cpp
steps off, the chain does exactly run.c's arithmetic (temperature, softmax over the whole
vocabulary in index order, then `sample_mult` or `sample_topp`'s steps), so run.c's tokens are
unchanged. `jllama.sampling.sampler.Sampler` assembles the chain from a `SamplerConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jllama.sampling.runc import as_vector, first_above, nucleus, softmax, sort_descending


def apply_logit_bias(logits: np.ndarray, logit_bias: Mapping[int, float]) -> np.ndarray:
    """Adds a bias to the logits of chosen tokens, as llama.cpp's `llama_sampler_logit_bias`
    and OpenAI's `logit_bias` (a bias of -100 in practice bans a token, +100 forces it).

    Args:
        logits: f32[vocab_size]. Not modified.
        logit_bias: {token id: bias}; ids in [0, vocab_size), biases float (-inf bans).

    Returns:
        A new f32[vocab_size]: `logits[id] + bias` (float32) for each given id.

    Raises:
        ValueError: logits not a non-empty vector, or an id outside [0, vocab_size).
    """
    out = as_vector(logits, "logits").copy()
    for token, bias in logit_bias.items():
        if not 0 <= token < out.shape[0]:
            raise ValueError(f"logit_bias: token id {token} is outside [0, {out.shape[0]})")
        out[token] += np.float32(bias)
    return out


def apply_penalties(
    logits: np.ndarray,
    recent_ids: Sequence[int],
    repeat_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> np.ndarray:
    """Repetition, frequency and presence penalties, as llama.cpp's `llama_sampler_penalties`.

    For each token id that occurs c > 0 times in `recent_ids` (llama.cpp's formula; the
    frequency and presence terms are also OpenAI's documented ones):

        logit = logit * repeat_penalty  if logit <= 0  else  logit / repeat_penalty
        logit = logit - c * frequency_penalty - presence_penalty

    Tokens that do not occur are left alone. All arithmetic is float32.

    Args:
        logits: f32[vocab_size]. Not modified.
        recent_ids: the token ids to count (the caller picks the window, e.g. the last 64 of
            the sequence, prompt included, as llama.cpp's `penalty_last_n`); ids >= vocab_size
            or < 0 are ignored.
        repeat_penalty: > 0; 1 = off (llama.cpp's `--repeat-penalty`).
        frequency_penalty: subtracted once per occurrence; 0 = off.
        presence_penalty: subtracted once per token that occurs; 0 = off.

    Returns:
        A new f32[vocab_size].

    Raises:
        ValueError: logits not a non-empty vector.
    """
    out = as_vector(logits, "logits").copy()
    ids = np.asarray(recent_ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    if ids.shape[0] == 0:
        return out
    seen, counts = np.unique(ids, return_counts=True)
    x = out[seen]
    penalty = np.float32(repeat_penalty)
    x = np.where(x <= 0, x * penalty, x / penalty).astype(np.float32)
    x = x - counts.astype(np.float32) * np.float32(frequency_penalty) - np.float32(presence_penalty)
    out[seen] = x
    return out


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The tokens still in the running, in the order a draw walks them (llama.cpp's
    `llama_token_data_array`).

    Attributes:
        ids: intp[k], token ids (k >= 1).
        logits: f32[k], their logits (after any temperature).
        probs: f32[k] or None: set by `top_p_filter` to the probabilities it computed (over the
            candidates before it cut, so not renormalized: a draw scales its coin by their sum,
            as run.c's `sample_topp`); None once the logits change, or before any softmax.
    """

    ids: np.ndarray
    logits: np.ndarray
    probs: np.ndarray | None = None

    @classmethod
    def of(cls, logits: np.ndarray) -> Candidates:
        """Every token of `logits` (f32[vocab_size]) in index order.

        Raises:
            ValueError: logits not a non-empty vector.
        """
        logits = as_vector(logits, "logits")
        return cls(np.arange(logits.shape[0]), logits)

    def take(self, positions: np.ndarray) -> Candidates:
        """The candidates at `positions` (intp[j], j >= 1), in that order."""
        probs = None if self.probs is None else self.probs[positions]
        return Candidates(self.ids[positions], self.logits[positions], probs)


def top_k_filter(c: Candidates, k: int) -> Candidates:
    """Keeps the k candidates with the highest logits, sorted descending, as llama.cpp's
    `llama_sampler_top_k` (ties in logit keep the current order, where llama.cpp's partial sort
    leaves them unspecified). k <= 0 or k >= the number of candidates: unchanged."""
    n = c.ids.shape[0]
    if k <= 0 or k >= n:
        return c
    order = sort_descending(c.logits, np.arange(n))
    return c.take(order[:k])


def temperature_scale(c: Candidates, temperature: float) -> Candidates:
    """Divides the candidates' logits by `temperature` (> 0) in float32, as run.c's sampler and
    llama.cpp's `llama_sampler_temp`. Where the quotient overflows float32 (a vanishing
    temperature), the logits are shifted by their maximum first, which leaves the best token(s)
    at 0 and sends the rest to -inf: the limit as the temperature goes to 0."""
    t = np.float32(temperature)
    with np.errstate(over="ignore"):
        scaled = c.logits / t
        if not np.isfinite(scaled.max()):
            scaled = (c.logits - c.logits.max()) / t
    return Candidates(c.ids, scaled.astype(np.float32, copy=False))


def top_p_filter(c: Candidates, top_p: float) -> Candidates:
    """Nucleus filter: the smallest set of most likely candidates whose probability passes
    `top_p`, in float32 exactly as llama2.c run.c's `sample_topp` (see it for the steps):
    softmax over the candidates, run.c's cutoff shortcut `(1 - top_p) / (k - 1)`, a stable sort
    by probability, and the cut after the first prefix sum that EXCEEDS top_p (llama.cpp's
    `llama_sampler_top_p` cuts at the first that reaches it: the two differ only when a prefix
    sum equals top_p exactly). With no candidate above the cutoff, the most likely one is kept.
    top_p <= 0 or >= 1 (as a float32): unchanged, as run.c.

    Returns:
        The kept candidates, sorted by probability descending, with `probs` set to their
        probabilities before the cut (summing to <= 1).
    """
    p32 = np.float32(top_p)
    if p32 <= 0 or p32 >= 1:
        return c
    probs = softmax(c.logits)
    if probs.shape[0] == 1:
        return Candidates(c.ids, c.logits, probs)
    found = nucleus(probs, p32)
    keep = np.array([int(np.argmax(probs))]) if found is None else found[0]
    return Candidates(c.ids[keep], c.logits[keep], probs[keep])


def min_p_filter(c: Candidates, min_p: float) -> Candidates:
    """Keeps the candidates whose probability is at least `min_p` times the best one's, as
    llama.cpp's `llama_sampler_min_p`, which tests it on logits: `logit >= max_logit +
    log(min_p)` (float32). Order is kept. min_p <= 0: unchanged (the best token always stays)."""
    if min_p <= 0:
        return c
    threshold = c.logits.max() + np.float32(math.log(min_p))
    keep = np.flatnonzero(c.logits >= threshold)
    return c.take(keep)


def sample_candidates(c: Candidates, coin: float) -> int:
    """Draws one candidate with a uniform coin in [0, 1), walking them in their order.

    Without `probs` (no top-p cut): as run.c's `sample_mult` on `softmax(logits)`, the first
    candidate whose cumulative probability exceeds the coin, else the last one. With `probs`
    (after `top_p_filter`): as the end of run.c's `sample_topp`, `r = coin * sum(probs)` and the
    first candidate whose cumulative probability exceeds r, else the last one. Sums are
    sequential float32, as run.c.

    Returns:
        The token id drawn.
    """
    coin32 = np.float32(coin)
    if c.probs is None:
        cdf = np.cumsum(softmax(c.logits), dtype=np.float32)
        r = coin32
    else:
        cdf = np.cumsum(c.probs, dtype=np.float32)
        r = coin32 * cdf[-1]
    return int(c.ids[first_above(cdf, r)])
