"""Turning logits into the next token id, as llama2.c run.c does it.

A sampler sees one vector of logits (`f32[vocab_size]`) per generated token and knows nothing of
the model. The pieces are small module-level functions on NumPy float32 vectors:

    logits --(/ temperature)--> softmax --> probs --+-- sample_mult(probs, coin)
                                                    +-- sample_topp(probs, top_p, coin)
    logits --(temperature 0)--> argmax

and `Sampler` wires them together exactly as run.c's `sample()`: the same seed gives run.c's
tokens. The random coin comes from `XorShiftRng`, run.c's xorshift64* generator.

Bit-exactness with run.c. run.c works in float32 throughout and adds one element at a time, so
every sum here is a sequential float32 accumulation (`np.cumsum(..., dtype=np.float32)`, which
NumPy computes left to right; `np.sum` adds pairwise and can differ in the last bits). One
unavoidable difference: run.c calls libm's `expf`. NumPy's own float32 `exp` (SIMD, a few ULP)
disagrees with glibc's `expf` on a large share of inputs, so `softmax` computes `exp` in float64
and rounds to float32 (the correctly rounded value), which agrees with glibc's `expf` (error
under 0.502 ULP) on all but a tiny fraction of inputs. A last-bit difference in one probability
changes the sampled token only when the coin falls within about 1e-7 of a boundary.

llama.cpp's chain. `Sampler` also runs llama.cpp's samplers, each a small function: logit
bias and the repetition / frequency / presence penalties change the whole logit vector
(`apply_logit_bias`, `apply_penalties`, the latter reading the sequence's recent ids, which the
generation loop passes in); then the tokens still in the running (`Candidates`: ids, logits,
optionally probabilities, in the order a draw walks them) go through `top_k_filter`,
`temperature_scale`, `top_p_filter` and `min_p_filter` in a configurable order, and
`sample_candidates` draws one. With those steps off, the chain does exactly run.c's arithmetic
(temperature, softmax over the whole vocabulary in index order, `sample_mult` or
`sample_topp`), so run.c's tokens are unchanged. The default order puts temperature before
top-p and min-p as run.c, Hugging Face transformers and vLLM do; llama.cpp's default puts it last
(`LLAMA_CPP_ORDER`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jllama.errors import SamplerError

_U64_MASK = (1 << 64) - 1
_XORSHIFT_MULTIPLIER = 0x2545F4914F6CDD1D

# (u32 >> 8) / 2**24: a float32 in [0, 1) on a grid of 2**-24, exact in float32.
_F32_DENOMINATOR = np.float32(16777216.0)
_F32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# Random numbers: run.c's xorshift64* generator.


def _check_seed(seed: object) -> int:
    try:
        value = operator.index(seed)  # int or NumPy integer; rejects floats and strings
    except TypeError:
        raise SamplerError(f"seed must be an integer in [1, 2**64), got {seed!r}") from None
    if isinstance(seed, bool) or not 1 <= value <= _U64_MASK:
        raise SamplerError(f"seed must be an integer in [1, 2**64), got {seed!r}")
    return value


def xorshift_step(state: int) -> tuple[int, int]:
    """Advances run.c's xorshift64* generator by one draw, as llama2.c run.c `random_u32`.

    Args:
        state: the generator state, an unsigned 64-bit integer (a Python int in [0, 2**64)).

    Returns:
        `(new_state, u32)`: the next state, and the draw, an int in [0, 2**32):
        `state ^= state >> 12; state ^= state << 25; state ^= state >> 27` (mod 2**64), then
        `u32 = (state * 0x2545F4914F6CDD1D mod 2**64) >> 32`.
    """
    state ^= state >> 12
    state = (state ^ (state << 25)) & _U64_MASK
    state ^= state >> 27
    return state, ((state * _XORSHIFT_MULTIPLIER) & _U64_MASK) >> 32


def u32_to_f32(u32: int) -> np.float32:
    """Maps a 32-bit draw to a float32 in [0, 1), as llama2.c run.c `random_f32`.

    Args:
        u32: an int in [0, 2**32).

    Returns:
        `np.float32((u32 >> 8) / 16777216)`: the top 24 bits over 2**24, exact in float32.
    """
    return np.float32(u32 >> 8) / _F32_DENOMINATOR


class XorShiftRng:
    """run.c's random number generator (xorshift64*), a small mutable object: it IS its state.

    The same seed gives the same draws as llama2.c run.c's `random_u32` / `random_f32` with
    `rng_state = seed`. Draws are plain Python integer arithmetic (constant time).

    Args:
        seed: the initial state, an integer in [1, 2**64). Zero is refused: xorshift maps the
            state 0 to itself, so it would draw zeros forever.

    Raises:
        SamplerError (a ValueError): seed not an integer, 0, negative, or >= 2**64.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = _check_seed(seed)

    @property
    def state(self) -> int:
        """The current state, an int in [1, 2**64) (never 0: xorshift keeps nonzero states)."""
        return self._state

    def random_u32(self) -> int:
        """Advances the state and returns a draw, an int in [0, 2**32), as run.c `random_u32`."""
        self._state, u32 = xorshift_step(self._state)
        return u32

    def random_f32(self) -> np.float32:
        """Advances the state and returns an `np.float32` in [0, 1), as run.c `random_f32`."""
        return u32_to_f32(self.random_u32())

    def __repr__(self) -> str:
        return f"XorShiftRng(state={self._state:#018x})"


def seed_from_clock() -> int:
    """A seed from the wall clock, for runs that give none (run.c uses `time(NULL)`).

    Returns:
        An int in [1, 2**64): the clock in nanoseconds since the epoch (never 0).
    """
    return (time.time_ns() & _U64_MASK) or 1


# --------------------------------------------------------------------------------------------
# Pieces on vectors. None loops over the vocabulary in Python.


def _as_vector(x: object, name: str) -> np.ndarray:
    """`x` as a float32 vector (no copy when it already is one); raises ValueError otherwise."""
    v = np.asarray(x, dtype=np.float32)
    if v.ndim != 1 or v.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty vector f32[vocab_size], got shape {v.shape}")
    return v


def argmax(logits: np.ndarray) -> int:
    """The most likely token, as llama2.c run.c `sample_argmax`.

    Args:
        logits: f32[vocab_size] (or anything `np.asarray` turns into a vector, e.g. a JAX array).

    Returns:
        The first index of the maximum: ties go to the lowest index, as run.c's strict `>` scan.
        (With NaNs present the result is unspecified; run.c's differs from NumPy's.)

    Raises:
        ValueError: logits not a non-empty vector.
    """
    return int(np.argmax(_as_vector(logits, "logits")))


def softmax(x: np.ndarray) -> np.ndarray:
    """Probabilities from logits in float32, as llama2.c run.c `softmax`.

    Subtracts the maximum (float32), takes exp, adds the exps one by one in float32 (a
    sequential sum, as run.c's loop), and divides each exp by that sum (float32). The exp is
    computed in float64 and rounded to float32 to match libm's `expf` (see the module docstring).

    Args:
        x: logits, f32[vocab_size]. Not modified (run.c works in place; this returns a new array).

    Returns:
        f32[vocab_size]: nonnegative, summing to 1 up to float32 rounding.

    Raises:
        ValueError: x not a non-empty vector.
    """
    x = _as_vector(x, "x")
    shifted = x - x.max()  # float32, as run.c's `x[i] - max_val`
    exps = np.exp(shifted.astype(np.float64)).astype(np.float32)
    total = np.cumsum(exps, dtype=np.float32)[-1]  # sequential float32 sum
    return exps / total


def sample_mult(probs: np.ndarray, coin: float) -> int:
    """Samples from a distribution with one uniform coin, as llama2.c run.c `sample_mult`.

    Walks the cumulative distribution, accumulated sequentially in float32, and returns the
    first index i with `coin < cdf[i]`; if there is none (the cdf ends below the coin through
    rounding), returns the last index `vocab_size - 1`, as run.c does.

    Args:
        probs: f32[vocab_size], nonnegative, summing to about 1.
        coin: a number in [0, 1), used as a float32 (e.g. `XorShiftRng.random_f32()`).

    Returns:
        The sampled token id, an int in [0, vocab_size).

    Raises:
        ValueError: probs not a non-empty vector.
    """
    probs = _as_vector(probs, "probs")
    cdf = np.cumsum(probs, dtype=np.float32)
    above = cdf > np.float32(coin)
    i = int(np.argmax(above))  # first True, or 0 when there is none
    return i if above[i] else probs.shape[0] - 1


def _sort_descending(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`ids` (int[k], each < 2**32) ordered by `values` (f32[k], no NaN) descending, ties by id.

    The same order as a stable sort when `ids` ascend, but one unstable sort of unique uint64
    keys (value rank in the high half, id in the low half), many times faster than a stable
    argsort at 128K entries.
    """
    bits = (values + np.float32(0.0)).view(np.uint32)  # + 0.0 turns -0.0 into +0.0
    # Unsigned ints that increase with the float: flip every bit of negatives, the sign of others.
    ascending = np.where(bits >> np.uint32(31) != 0, ~bits, bits | np.uint32(0x80000000))
    keys = ((~ascending).astype(np.uint64) << np.uint64(32)) | ids.astype(np.uint64)
    return (np.sort(keys) & np.uint64(0xFFFFFFFF)).astype(np.intp)


def sample_topp(probs: np.ndarray, top_p: float, coin: float) -> int:
    """Nucleus (top-p) sampling with one uniform coin, as llama2.c run.c `sample_topp`.

    All arithmetic is float32, as in run.c:

    1. `cutoff = (1 - top_p) / (vocab_size - 1)`; only tokens with `prob >= cutoff` are
       candidates (run.c's shortcut: smaller ones cannot be in the nucleus).
    2. Candidates are sorted by probability, descending; the sort is stable, so equal
       probabilities keep index order (run.c uses `qsort`: glibc's is a merge sort, stable in
       practice; another C library may order ties differently).
    3. Their probabilities are accumulated sequentially until the sum first exceeds `top_p`;
       that candidate is the last one kept. If the sum never exceeds `top_p`, all candidates
       are kept. `cumulative` is the sum over the kept candidates.
    4. `r = coin * cumulative`; returns the first kept candidate whose cumulative sum exceeds
       `r`, or else the last kept candidate.

    Where run.c is undefined, this returns `argmax(probs)`: with no candidates at all (possible
    when `top_p < 1 / vocab_size`, or `vocab_size == 1`) run.c reads before its array, while the
    nucleus without the cutoff shortcut would be just the most likely token.

    Args:
        probs: f32[vocab_size], nonnegative, summing to about 1.
        top_p: the nucleus mass, used as a float32; `Sampler` calls this for 0 < top_p < 1.
        coin: a number in [0, 1), used as a float32 (e.g. `XorShiftRng.random_f32()`).

    Returns:
        The sampled token id, an int in [0, vocab_size).

    Raises:
        ValueError: probs not a non-empty vector.
    """
    probs = _as_vector(probs, "probs")
    n = probs.shape[0]
    top_p32 = np.float32(top_p)
    if n == 1:
        return 0
    with np.errstate(invalid="ignore"):
        cutoff = (np.float32(1.0) - top_p32) / np.float32(n - 1)
        candidates = np.flatnonzero(probs >= cutoff)
    if candidates.shape[0] == 0:
        return int(np.argmax(probs))
    sorted_ids = _sort_descending(probs[candidates], candidates)
    cdf = np.cumsum(probs[sorted_ids], dtype=np.float32)

    over = cdf > top_p32
    last = int(np.argmax(over)) if over.any() else cdf.shape[0] - 1
    cumulative = cdf[last]
    r = np.float32(coin) * cumulative
    hit = cdf[: last + 1] > r
    i = int(np.argmax(hit)) if hit.any() else last
    return int(sorted_ids[i])


# --------------------------------------------------------------------------------------------
# llama.cpp's sampler chain: logit transforms on the whole vector, then filters on candidates.


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
    out = _as_vector(logits, "logits").copy()
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
    out = _as_vector(logits, "logits").copy()
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
        """Every token of `logits` (f32[vocab_size]) in index order."""
        logits = _as_vector(logits, "logits")
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
    order = _sort_descending(c.logits, np.arange(n))
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
    n = probs.shape[0]
    if n == 1:
        return Candidates(c.ids, c.logits, probs)
    with np.errstate(invalid="ignore"):
        cutoff = (np.float32(1.0) - p32) / np.float32(n - 1)
        above = np.flatnonzero(probs >= cutoff)
    if above.shape[0] == 0:
        best = np.array([int(np.argmax(probs))])
        return Candidates(c.ids[best], c.logits[best], probs[best])
    order = _sort_descending(probs[above], above)
    cdf = np.cumsum(probs[order], dtype=np.float32)
    over = cdf > p32
    last = int(np.argmax(over)) if over.any() else cdf.shape[0] - 1
    keep = order[: last + 1]
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
    hit = cdf > r
    i = int(np.argmax(hit)) if hit.any() else cdf.shape[0] - 1
    return int(c.ids[i])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of the model's distribution (no sampler applied), in float64:
    `logits - max - log(sum(exp(logits - max)))`, the quantity OpenAI's `logprobs` report.

    Args:
        logits: f32[vocab_size].

    Returns:
        f64[vocab_size], each <= 0 (-inf where a logit is -inf).
    """
    x = _as_vector(logits, "logits").astype(np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


# --------------------------------------------------------------------------------------------
# The sampler: run.c's, extended with llama.cpp's chain.

FILTERS = ("top_k", "temperature", "top_p", "min_p")
"""The default order of the candidate steps: temperature before top-p and min-p, as run.c (top-p
on the tempered distribution), Hugging Face transformers and vLLM do. llama.cpp's default order
puts temperature last: `("top_k", "top_p", "min_p", "temperature")`."""

LLAMA_CPP_ORDER = ("top_k", "top_p", "min_p", "temperature")
"""llama.cpp's default order of these four steps (`--samplers top_k;top_p;min_p;temperature`)."""


def _check_number(name: str, value: object, low: float, high: float, *, open_low=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplerError(f"{name} must be a number, got {value!r}")
    v = float(value)
    bad = not math.isfinite(v) or v > high or (v <= low if open_low else v < low)
    if bad:
        bracket = "(" if open_low else "["
        raise SamplerError(f"{name} must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
    return v


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool):
        raise SamplerError(f"{name} must be an integer >= {low}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise SamplerError(f"{name} must be an integer >= {low}, got {value!r}") from None
    if v < low:
        raise SamplerError(f"{name} must be an integer >= {low}, got {value!r}")
    return v


def _normalize_bias(logit_bias: object) -> tuple[tuple[int, float], ...]:
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    try:
        pairs = list(items)
    except TypeError:
        raise SamplerError(f"logit_bias must map token ids to numbers, got {logit_bias!r}") from None
    out = {}
    for pair in pairs:
        try:
            token, bias = pair
        except (TypeError, ValueError):
            raise SamplerError(f"logit_bias must map token ids to numbers, got {pair!r}") from None
        token = _check_int("logit_bias token id", token, 0)
        if isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating)):
            raise SamplerError(f"logit_bias[{token}] must be a number, got {bias!r}")
        if math.isnan(bias) or bias == math.inf:
            raise SamplerError(f"logit_bias[{token}] must be finite or -inf, got {bias!r}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How to pick the next token, validated on construction (frozen, hashable).

    The defaults of the fields after `seed` switch their step off, so a config with only
    temperature, top_p and seed samples exactly as run.c.

    Attributes:
        temperature: divides the logits before the softmax; 0 means greedy (argmax of the
            biased, penalized logits; no random draw). Finite and >= 0, and finite as a
            float32 (run.c keeps it as a float).
        top_p: nucleus mass in [0, 1]; 0 or 1 turn top-p off (plain multinomial sampling).
        seed: the `XorShiftRng` seed, an integer in [1, 2**64), or None to take
            `seed_from_clock()` when a `Sampler` is made. (run.c's `-s 0` means "use the
            clock": a CLI that mirrors it passes None for 0.)
        top_k: keep the k most likely tokens, an integer >= 0; 0 = off.
        min_p: keep tokens at least min_p times as likely as the best, in [0, 1]; 0 = off.
        repeat_penalty: llama.cpp's repetition penalty, > 0 (at most 1e6); 1 = off.
        frequency_penalty, presence_penalty: OpenAI's / llama.cpp's penalties, finite
            numbers (negative ones encourage repeats); 0 = off.
        penalty_last_n: how many of the sequence's last tokens (prompt included) the penalties
            count, as llama.cpp's `--repeat-last-n`: >= 0, or -1 for all of them; 0 = off.
        logit_bias: added to the logits first: a mapping {token id: bias} on input, stored as
            a sorted tuple of (id, bias) pairs. Biases finite or -inf.
        order: the order of the candidate steps, a permutation of `FILTERS` (names "top_k",
            "temperature", "top_p", "min_p"); `LLAMA_CPP_ORDER` is llama.cpp's default.

    Raises:
        SamplerError (a ValueError): a field out of range; the message names the field.
    """

    temperature: float = 1.0
    top_p: float = 0.9
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    order: tuple[str, ...] = FILTERS

    def __post_init__(self) -> None:
        t = self.temperature
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float, np.integer, np.floating))
            or not (math.isfinite(t) and 0 <= t <= _F32_MAX)
        ):
            raise SamplerError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if (
            isinstance(p, bool)
            or not isinstance(p, (int, float, np.integer, np.floating))
            or not 0 <= p <= 1
        ):
            raise SamplerError(f"top_p must be a number in [0, 1], got {p!r}")
        if self.seed is not None:
            _check_seed(self.seed)
        _check_int("top_k", self.top_k, 0)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repeat_penalty", self.repeat_penalty, 0.0, 1e6, open_low=True)
        _check_number("frequency_penalty", self.frequency_penalty, -_F32_MAX, _F32_MAX)
        _check_number("presence_penalty", self.presence_penalty, -_F32_MAX, _F32_MAX)
        _check_int("penalty_last_n", self.penalty_last_n, -1)
        object.__setattr__(self, "logit_bias", _normalize_bias(self.logit_bias))
        order = self.order
        if isinstance(order, str) or not isinstance(order, Sequence) or sorted(order) != sorted(FILTERS):
            raise SamplerError(
                f"order must list each of {', '.join(FILTERS)} once, got {order!r}"
            )
        object.__setattr__(self, "order", tuple(order))

    @property
    def uses_history(self) -> bool:
        """True when a penalty is on, so a draw needs the sequence's recent token ids."""
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class Sampler:
    """Picks the next token from logits: run.c's `sample()` extended with llama.cpp's chain.

    Per call, in this order (llama.cpp's `common_sampler`, with run.c's arithmetic):

    1. `apply_logit_bias` (when `logit_bias` is given);
    2. `apply_penalties` over the last `penalty_last_n` ids of `history` (when a penalty is on);
    3. temperature 0 (as float32): return the argmax; nothing is drawn;
    4. the candidate steps in `order` (default top_k, temperature, top_p, min_p), each a no-op
       when switched off;
    5. one coin `rng.random_f32()` and `sample_candidates`.

    With only temperature, top_p and seed set, steps 1, 2 and the top-k and min-p steps do
    nothing, and the result is bit for bit run.c's: softmax of logits / temperature, then
    `sample_mult` (top_p 0 or 1) or `sample_topp`. The same seed and logits give run.c's tokens.

    Args:
        temperature, top_p, seed: as `SamplerConfig` (seed None: from the clock).
        **options: the other `SamplerConfig` fields (top_k, min_p, repeat_penalty,
            frequency_penalty, presence_penalty, penalty_last_n, logit_bias, order).

    Attributes:
        config: the `SamplerConfig`, with the seed actually used (never None).
        rng: the `XorShiftRng`, advanced by one draw per sampled (non-greedy) token.
        uses_history: True when the penalties need the recent ids: the generation loop then
            calls `sample(logits, history)` (see `jllama.generate.Generation`).

    Raises:
        SamplerError (a ValueError): a setting out of range, naming it.
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
        self._temperature = np.float32(config.temperature)
        self._bias = dict(config.logit_bias)

    @classmethod
    def from_config(cls, config: SamplerConfig) -> Sampler:
        """A sampler for `config` (a None seed is taken from the clock)."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**fields)

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
        c = self.config
        logits = _as_vector(logits, "logits")
        if self._bias:
            logits = apply_logit_bias(logits, self._bias)
        if self.uses_history and len(history):
            n = c.penalty_last_n
            recent = history if n < 0 else history[max(len(history) - n, 0):]
            logits = apply_penalties(
                logits, recent, c.repeat_penalty, c.frequency_penalty, c.presence_penalty
            )
        if self._temperature == 0:
            return argmax(logits)
        candidates = Candidates.of(logits)
        for step in c.order:
            if step == "top_k":
                candidates = top_k_filter(candidates, c.top_k)
            elif step == "temperature":
                candidates = temperature_scale(candidates, c.temperature)
            elif step == "top_p":
                candidates = top_p_filter(candidates, c.top_p)
            else:
                candidates = min_p_filter(candidates, c.min_p)
        return sample_candidates(candidates, self.rng.random_f32())

    __call__ = sample

    def __repr__(self) -> str:
        c = self.config
        changed = [
            f"{f.name}={getattr(c, f.name)!r}"
            for f in dataclasses.fields(c)
            if f.name in ("temperature", "top_p", "seed") or getattr(c, f.name) != f.default
        ]
        return f"Sampler({', '.join(changed)})"


class _Restricted:
    """`sample` over the first `n` logits (see `restrict_to_vocabulary`)."""

    def __init__(self, sample: Callable[..., int], n: int):
        self._sample = sample
        self._n = n
        self.uses_history = getattr(sample, "uses_history", False)

    def __call__(self, logits: np.ndarray, *history) -> int:
        return self._sample(logits[: self._n], *history)


def restrict_to_vocabulary(sample: Callable[..., int], n: int) -> Callable[..., int]:
    """`sample` over the first `n` logits only: for a model whose vocab_size is padded past its
    tokenizer's `n` tokens (common in Hugging Face models), so that an id with no token is never
    drawn. The ids returned are unchanged (they index the full logits); the sampler's
    `uses_history` (and the history argument) pass through.

    Args:
      sample: `sample(logits f32[vocab_size][, history]) -> token id`, e.g. a `Sampler`.
      n: the tokenizer's vocab_size, tokens.
    """
    return _Restricted(sample, n)
