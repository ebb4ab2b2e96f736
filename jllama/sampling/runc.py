"""run.c's sampling functions on whole vectors of logits or probabilities, bit for bit.

    logits --(/ temperature)--> softmax --> probs --+-- sample_mult(probs, coin)
                                                    +-- sample_topp(probs, top_p, coin)
    logits --(temperature 0)--> argmax

Bit-exactness with run.c. run.c works in float32 throughout and adds one element at a time, so
every sum here is a sequential float32 accumulation (`np.cumsum(..., dtype=np.float32)`, which
NumPy computes left to right; `np.sum` adds pairwise and can differ in the last bits). One
unavoidable difference: run.c calls libm's `expf`. NumPy's own float32 `exp` (SIMD, a few ULP)
disagrees with glibc's `expf` on a large share of inputs, so `softmax` computes `exp` in float64
and rounds to float32 (the correctly rounded value), which agrees with glibc's `expf` (error
under 0.502 ULP) on all but a tiny fraction of inputs. A last-bit difference in one probability
changes the sampled token only when the coin falls within about 1e-7 of a boundary.

None of these loops over the vocabulary in Python. `nucleus` and `first_above` are the steps of
`sample_topp` that llama.cpp's chain (`jllama.sampling.chain`) reuses on its candidates.
"""

from __future__ import annotations

import math

import numpy as np


def as_vector(x: object, name: str) -> np.ndarray:
    """`x` as a float32 vector (no copy when it already is one).

    Raises:
        ValueError: x is not a non-empty vector ("{name} must be a non-empty vector ...").
    """
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
    return int(np.argmax(as_vector(logits, "logits")))


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
    x = as_vector(x, "x")
    shifted = x - x.max()  # float32, as run.c's `x[i] - max_val`
    exps = np.exp(shifted.astype(np.float64)).astype(np.float32)
    total = np.cumsum(exps, dtype=np.float32)[-1]  # sequential float32 sum
    return exps / total


def first_above(cdf: np.ndarray, r: np.float32) -> int:
    """The first index i with `r < cdf[i]`, else the last index (run.c's draw from a cumulative
    distribution `cdf: f32[k]`, when rounding leaves its end below r)."""
    hit = cdf > r
    i = int(np.argmax(hit))  # first True, or 0 when there is none
    return i if hit[i] else cdf.shape[0] - 1


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
    probs = as_vector(probs, "probs")
    return first_above(np.cumsum(probs, dtype=np.float32), np.float32(coin))


def sort_descending(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
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


def nucleus(probs: np.ndarray, top_p: np.float32) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps 1 to 3 of `sample_topp`: the nucleus of `probs` (f32[k], k >= 2) for a float32
    `top_p` in (0, 1).

    Returns:
        `(kept, cdf)`: kept, intp[j], the positions in `probs` of the kept tokens, most likely
        first; cdf, f32[j], their sequential float32 prefix sums. None when no probability
        reaches run.c's cutoff `(1 - top_p) / (k - 1)`.
    """
    with np.errstate(invalid="ignore"):
        cutoff = (np.float32(1.0) - top_p) / np.float32(probs.shape[0] - 1)
        candidates = np.flatnonzero(probs >= cutoff)
    if candidates.shape[0] == 0:
        return None
    order = sort_descending(probs[candidates], candidates)
    cdf = np.cumsum(probs[order], dtype=np.float32)
    over = cdf > top_p
    last = int(np.argmax(over)) if over.any() else cdf.shape[0] - 1
    return order[: last + 1], cdf[: last + 1]


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
        probs, coin: as `sample_mult`.
        top_p: the nucleus mass, used as a float32; `Sampler` calls this for 0 < top_p < 1.

    Returns, Raises: as `sample_mult`.
    """
    probs = as_vector(probs, "probs")
    if probs.shape[0] == 1:
        return 0
    found = nucleus(probs, np.float32(top_p))
    if found is None:
        return int(np.argmax(probs))
    kept, cdf = found
    return int(kept[first_above(cdf, np.float32(coin) * cdf[-1])])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of the model's distribution (no sampler applied), in float64:
    `logits - max - log(sum(exp(logits - max)))`, the quantity OpenAI's `logprobs` report.

    Args:
        logits: f32[vocab_size].

    Returns:
        f64[vocab_size], each <= 0 (-inf where a logit is -inf).

    Raises:
        ValueError: logits not a non-empty vector.
    """
    x = as_vector(logits, "logits").astype(np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())
