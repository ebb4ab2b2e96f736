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

Room to grow. llama.cpp's chain (repetition penalties, top-k, top-p, min-p, temperature, then a
draw) fits the same shape: each filter is a function `f32[vocab_size] -> f32[vocab_size]` (or
one that masks logits to -inf) applied in `Sampler.sample` before the draw, configured by new
fields of `SamplerConfig`; penalties also need the recent token ids, which the generation loop
would pass in. None of that is built yet; run.c's order (temperature, then softmax, then top-p
on probabilities) is the one implemented.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Callable

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
# The sampler run.c's generation loop uses.


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How to pick the next token, validated on construction (frozen, hashable).

    Attributes:
        temperature: divides the logits before the softmax; 0 means greedy (argmax, no random
            draw). Finite and >= 0, and finite as a float32 (run.c keeps it as a float).
        top_p: nucleus mass in [0, 1]; 0 or 1 turn top-p off (plain multinomial sampling).
        seed: the `XorShiftRng` seed, an integer in [1, 2**64), or None to take
            `seed_from_clock()` when a `Sampler` is made. (run.c's `-s 0` means "use the
            clock": a CLI that mirrors it passes None for 0.)

    Raises:
        SamplerError (a ValueError): a field out of range; the message names the field.
    """

    temperature: float = 1.0
    top_p: float = 0.9
    seed: int | None = None

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


class Sampler:
    """Picks the next token from logits, as llama2.c run.c `sample()`; holds the rng.

    Per call: if the temperature (as float32) is 0, returns `argmax(logits)` and draws nothing.
    Otherwise divides the logits by the temperature (float32), takes `softmax`, draws ONE coin
    `rng.random_f32()`, and returns `sample_mult(probs, coin)` when `top_p <= 0` or
    `top_p >= 1`, else `sample_topp(probs, top_p, coin)`. The same seed and logits give run.c's
    tokens.

    Args:
        temperature, top_p, seed: as `SamplerConfig` (seed None: from the clock).

    Attributes:
        config: the `SamplerConfig`, with the seed actually used (never None).
        rng: the `XorShiftRng`, advanced by one draw per sampled (non-greedy) token.

    Raises:
        SamplerError (a ValueError): a setting out of range, naming it.
    """

    def __init__(self, temperature: float = 1.0, top_p: float = 0.9, seed: int | None = None):
        config = SamplerConfig(temperature=temperature, top_p=top_p, seed=seed)
        if config.seed is None:
            config = dataclasses.replace(config, seed=seed_from_clock())
        self.config = config
        self.rng = XorShiftRng(config.seed)
        self._temperature = np.float32(config.temperature)
        self._top_p = np.float32(config.top_p)

    @classmethod
    def from_config(cls, config: SamplerConfig) -> Sampler:
        """A sampler for `config` (a None seed is taken from the clock)."""
        return cls(temperature=config.temperature, top_p=config.top_p, seed=config.seed)

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for `logits`, as run.c `sample()`.

        Args:
            logits: f32[vocab_size] for the current position (NumPy, or anything `np.asarray`
                takes, e.g. a JAX array). Not modified.

        Returns:
            A token id, an int in [0, vocab_size).

        Raises:
            ValueError: logits not a non-empty vector.
        """
        logits = _as_vector(logits, "logits")
        if self._temperature == 0:
            return argmax(logits)
        with np.errstate(over="ignore"):
            scaled = logits / self._temperature
        if not np.isfinite(scaled.max()):
            # A temperature so small that logits / temperature overflows float32 (run.c then
            # computes inf - inf = NaN): shift before dividing, which leaves the most likely
            # token(s) at 0 and sends the rest to -inf, the limit of a vanishing temperature.
            with np.errstate(over="ignore"):
                scaled = (logits - logits.max()) / self._temperature
        probs = softmax(scaled)
        coin = self.rng.random_f32()
        if self._top_p <= 0 or self._top_p >= 1:
            return sample_mult(probs, coin)
        return sample_topp(probs, self._top_p, coin)

    __call__ = sample

    def __repr__(self) -> str:
        c = self.config
        return f"Sampler(temperature={c.temperature!r}, top_p={c.top_p!r}, seed={c.seed!r})"


def restrict_to_vocabulary(
    sample: Callable[[np.ndarray], int], n: int
) -> Callable[[np.ndarray], int]:
    """`sample` over the first `n` logits only: for a model whose vocab_size is padded past its
    tokenizer's `n` tokens (common in Hugging Face models), so that an id with no token is never
    drawn. The ids returned are unchanged (they index the full logits).

    Args:
      sample: `sample(logits f32[vocab_size]) -> token id`, e.g. a `Sampler`.
      n: the tokenizer's vocab_size, tokens.
    """

    def restricted(logits: np.ndarray) -> int:
        return sample(logits[:n])

    return restricted
