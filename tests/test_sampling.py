"""Tests for jllama.sampling against independent references written here.

The references are deliberately plain: big-integer arithmetic for the generator, and loop-by-loop
float32 transcriptions (np.float32 scalars, one step at a time, Python's stable `sorted`) of
llama2.c run.c's softmax / sample_mult / sample_topp, compared with the vectorized versions on
hand-made and hypothesis-random inputs. End-to-end checks against run.c's real sampled token
streams live with the generation oracle tests.
"""

import ctypes
import ctypes.util
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jllama import sampling
from jllama.errors import JllamaError
from jllama.sampling import (
    Sampler,
    SamplerConfig,
    SamplerError,
    XorShiftRng,
    argmax,
    sample_mult,
    sample_topp,
    seed_from_clock,
    softmax,
    xorshift_step,
)

F32 = np.float32


# --------------------------------------------------------------------------------------------
# Independent references.


def ref_xorshift_draws(seed, count):
    """run.c's xorshift64* in big-integer arithmetic: (u32, f32 as a Python float) per draw."""
    m = 2**64
    state = seed
    out = []
    for _ in range(count):
        state = (state ^ (state // 2**12)) % m
        state = (state ^ (state * 2**25)) % m
        state = (state ^ (state // 2**27)) % m
        u32 = ((state * 0x2545F4914F6CDD1D) % m) // 2**32
        out.append((u32, (u32 // 2**8) / 2**24))
    return out


def ref_xorshift_numpy(seed, count):
    """The same generator in NumPy uint64 arithmetic (wraps mod 2**64): a second route."""
    state = np.array([seed], dtype=np.uint64)
    out = []
    with np.errstate(over="ignore"):
        for _ in range(count):
            state ^= state >> np.uint64(12)
            state ^= state << np.uint64(25)
            state ^= state >> np.uint64(27)
            out.append(int(((state * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(32))[0]))
    return out


def ref_softmax(x):
    """run.c's softmax, loop by loop in float32; exp correctly rounded (math.exp -> float32)."""
    x = [F32(v) for v in x]
    max_val = x[0]
    for v in x[1:]:
        if v > max_val:
            max_val = v
    exps = []
    total = F32(0.0)
    for v in x:
        e = F32(math.exp(float(F32(v - max_val))))
        exps.append(e)
        total = F32(total + e)
    return np.array([F32(e / total) for e in exps], dtype=np.float32)


def ref_sample_mult(probs, coin):
    """run.c's sample_mult, loop by loop in float32."""
    coin = F32(coin)
    cdf = F32(0.0)
    for i, p in enumerate(probs):
        cdf = F32(cdf + F32(p))
        if coin < cdf:
            return i
    return len(probs) - 1


def ref_topp_candidates(probs, top_p):
    """run.c's sample_topp steps 1-2: candidates (prob, index), stably sorted, descending."""
    n = len(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        cutoff = F32((F32(1.0) - F32(top_p)) / F32(n - 1))
    candidates = [(F32(p), i) for i, p in enumerate(probs) if F32(p) >= cutoff]
    return sorted(candidates, key=lambda c: -c[0])  # Python's sort is stable


def ref_sample_topp(probs, top_p, coin):
    """run.c's sample_topp, loop by loop in float32.

    With no candidates run.c reads before its array (undefined); jllama returns the argmax
    there, and so does this reference.
    """
    candidates = ref_topp_candidates(probs, top_p)
    if not candidates:
        return int(np.argmax(np.asarray(probs, dtype=np.float32)))
    top_p = F32(top_p)
    cumulative = F32(0.0)
    last = len(candidates) - 1
    for k, (p, _) in enumerate(candidates):
        cumulative = F32(cumulative + p)
        if cumulative > top_p:
            last = k
            break
    r = F32(F32(coin) * cumulative)
    cdf = F32(0.0)
    for k in range(last + 1):
        cdf = F32(cdf + candidates[k][0])
        if r < cdf:
            return candidates[k][1]
    return candidates[last][1]


def below(x):
    """The float32 just below x."""
    return np.nextafter(F32(x), F32(0.0))


# --------------------------------------------------------------------------------------------
# XorShiftRng.


@pytest.mark.parametrize("seed", [1, 42, 2**63 + 5, 2**64 - 1])
def test_rng_matches_big_int_reference(seed):
    rng = XorShiftRng(seed)
    got_u32 = [rng.random_u32() for _ in range(8)]
    rng = XorShiftRng(seed)
    got_f32 = [rng.random_f32() for _ in range(8)]
    want = ref_xorshift_draws(seed, 8)
    assert got_u32 == [u for u, _ in want]
    assert got_u32 == ref_xorshift_numpy(seed, 8)
    assert all(isinstance(f, np.float32) for f in got_f32)
    assert [float(f) for f in got_f32] == [f for _, f in want]
    assert all(0.0 <= f < 1.0 for f in got_f32)


def test_rng_seed_1_first_draw_by_hand():
    # state = 1:  1 ^ (1 >> 12) = 1;  1 ^ (1 << 25) = 0x2000001;  0x2000001 >> 27 = 0, so the
    # state is 0x2000001 = 2**25 + 1.
    # state * K mod 2**64 with K = 0x2545F4914F6CDD1D is (K << 25 mod 2**64) + K:
    #   K << 24 mod 2**64 = 0x914F6CDD1D000000, doubled mod 2**64 = 0x229ED9BA3A000000,
    #   + K = 0x47E4CE4B896CDD1D (0x229ED9BA + 0x2545F491 = 0x47E4CE4B; low halves, no carry).
    # u32 = 0x47E4CE4B = 1206177355;  u32 >> 8 = 0x47E4CE = 4711630;  / 2**24 = 0.28083503...
    rng = XorShiftRng(1)
    assert rng.random_u32() == 0x47E4CE4B
    assert rng.state == 0x2000001
    assert float(XorShiftRng(1).random_f32()) == 4711630 / 2**24 == 0.28083503246307373


def test_xorshift_step_is_pure_and_matches_class():
    state, u32 = xorshift_step(42)
    rng = XorShiftRng(42)
    assert rng.random_u32() == u32 and rng.state == state
    assert xorshift_step(42) == (state, u32)  # same input, same output


@pytest.mark.parametrize("seed", [0, -1, 2**64, 2**70, 1.0, 1.5, "3", None, True])
def test_rng_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        XorShiftRng(seed)


def test_rng_accepts_numpy_integer_seed():
    assert XorShiftRng(np.uint64(2**63 + 5)).random_u32() == ref_xorshift_draws(2**63 + 5, 1)[0][0]


def test_seed_from_clock():
    seeds = {seed_from_clock() for _ in range(3)}
    assert all(isinstance(s, int) and 1 <= s < 2**64 for s in seeds)
    XorShiftRng(seed_from_clock())  # always a valid seed


# --------------------------------------------------------------------------------------------
# argmax and softmax.


def test_argmax_ties_go_to_lowest_index():
    assert argmax(np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)) == 1
    assert argmax(np.array([5.0, 5.0, 5.0], dtype=np.float32)) == 0
    assert argmax(np.array([-np.inf, -1.0, -1.0], dtype=np.float32)) == 1
    assert argmax(np.array([7.0], dtype=np.float32)) == 0
    assert isinstance(argmax(np.zeros(4, np.float32)), int)


@pytest.mark.parametrize("bad", [np.zeros(0, np.float32), np.zeros((2, 3), np.float32), 1.0])
def test_vector_functions_reject_non_vectors(bad):
    for fn in (argmax, softmax, lambda x: sample_mult(x, 0.5), lambda x: sample_topp(x, 0.9, 0.5)):
        with pytest.raises(ValueError, match="vector"):
            fn(bad)


def test_softmax_against_float64_math():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 512, 32000):
        x = (rng.standard_normal(n) * 4).astype(np.float32)
        got = softmax(x)
        assert got.dtype == np.float32 and got.shape == (n,)
        e = np.exp(x.astype(np.float64) - x.astype(np.float64).max())
        want = e / e.sum()
        if n <= 512:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        else:
            # run.c's sequential float32 sum drifts with the vocabulary size (relative error up
            # to about n * 2**-24): 4e-5 here, 6e-6 absolute on the largest probability.
            np.testing.assert_allclose(got, want, rtol=n * 2.0**-24, atol=1e-9)


def test_softmax_handles_large_logits_and_minus_inf():
    got = softmax(np.array([1000.0, 1000.0, -np.inf], dtype=np.float32))
    np.testing.assert_array_equal(got, np.array([0.5, 0.5, 0.0], dtype=np.float32))


def test_softmax_does_not_modify_input():
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    softmax(x)
    np.testing.assert_array_equal(x, [1.0, 2.0, 3.0])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=64))
def test_softmax_equals_loop_reference_bit_for_bit(values):
    x = np.array(values, dtype=np.float32)
    np.testing.assert_array_equal(softmax(x), ref_softmax(x))


def test_cumsum_is_a_sequential_float32_sum():
    # The claim sampling.py rests on: np.cumsum(x, dtype=float32) adds left to right in float32,
    # as run.c's loops, unlike np.sum (pairwise), which differs in the last bits.
    rng = np.random.default_rng(1)
    sum_differs = 0
    for n in (10, 1000, 20000):
        x = rng.random(n, dtype=np.float32) / F32(n)
        loop = F32(0.0)
        prefix = np.empty(n, dtype=np.float32)
        for i, v in enumerate(x):
            loop = F32(loop + v)
            prefix[i] = loop
        np.testing.assert_array_equal(np.cumsum(x, dtype=np.float32), prefix)
        sum_differs += np.sum(x, dtype=np.float32) != loop
    assert sum_differs > 0  # else this test would not show why cumsum is used


def test_float64_exp_rounding_matches_libm_expf():
    # Why softmax takes exp in float64 and rounds: run.c calls libm expf, and the correctly
    # rounded value agrees with glibc's expf on nearly all inputs (NumPy's float32 exp does not).
    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no libm")
    libm = ctypes.CDLL(name)
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = -np.random.default_rng(2).random(5000, dtype=np.float32) * F32(30)
    libm_values = np.array([libm.expf(float(v)) for v in x], dtype=np.float32)
    rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    agree = np.mean(rounded == libm_values)
    if agree < 0.99:
        pytest.skip(f"this libm's expf is not nearly correctly rounded ({agree:.3f})")
    assert agree >= 0.99


# --------------------------------------------------------------------------------------------
# sample_mult, on hand-made distributions (dyadic values: every float32 sum is exact).


def test_sample_mult_boundaries():
    probs = np.array([0.25, 0.5, 0.25], dtype=np.float32)  # cdf 0.25, 0.75, 1.0
    assert sample_mult(probs, 0.0) == 0
    assert sample_mult(probs, below(0.25)) == 0
    assert sample_mult(probs, 0.25) == 1  # coin < cdf is strict
    assert sample_mult(probs, below(0.75)) == 1
    assert sample_mult(probs, 0.75) == 2
    assert sample_mult(probs, below(1.0)) == 2


def test_sample_mult_skips_zero_probabilities():
    probs = np.array([0.0, 0.5, 0.0, 0.5], dtype=np.float32)  # cdf 0, 0.5, 0.5, 1
    assert sample_mult(probs, 0.0) == 1  # 0 < 0 is false at index 0
    assert sample_mult(probs, 0.5) == 3


def test_sample_mult_falls_back_to_last_index():
    probs = np.array([0.125, 0.125, 0.25, 0.0], dtype=np.float32)  # sums to 0.5 only
    assert sample_mult(probs, 0.6) == 3
    assert sample_mult(probs, below(0.5)) == 2


# --------------------------------------------------------------------------------------------
# sample_topp, on hand-made distributions.


def test_sample_topp_ties_keep_index_order_and_boundaries():
    # n = 4, top_p = 0.99: cutoff = 0.01 / 3 ~ 0.0033 drops token 3 (0.0). Sorted: token 1 (0.5),
    # then tokens 0 and 2 (0.25 each, index order). cdf 0.5, 0.75, 1.0 first exceeds 0.99 at the
    # third: all three kept, cumulative 1.0, so r = coin.
    probs = np.array([0.25, 0.5, 0.25, 0.0], dtype=np.float32)
    assert sample_topp(probs, 0.99, below(0.5)) == 1
    assert sample_topp(probs, 0.99, 0.5) == 0  # r < cdf strict; the tie puts token 0 first
    assert sample_topp(probs, 0.99, below(0.75)) == 0
    assert sample_topp(probs, 0.99, 0.75) == 2
    assert sample_topp(probs, 0.99, below(1.0)) == 2


def test_sample_topp_cut_point():
    # n = 5, top_p = 0.75: cutoff = 0.25 / 4 = 0.0625, and prob >= cutoff keeps all five.
    # Sorted: 3 (0.5), 1 (0.25), 0 (0.125), 2 (0.0625), 4 (0.0625). cdf 0.5, 0.75 (not > 0.75),
    # 0.875 > 0.75: the last kept is token 0, cumulative 0.875, r = coin * 0.875.
    probs = np.array([0.125, 0.25, 0.0625, 0.5, 0.0625], dtype=np.float32)
    assert sample_topp(probs, 0.75, 0.5) == 3  # r = 0.4375 < 0.5
    assert sample_topp(probs, 0.75, 0.75) == 1  # r = 0.65625 in [0.5, 0.75)
    assert sample_topp(probs, 0.75, below(1.0)) == 0  # r just under 0.875: never tokens 2, 4
    # top_p = 0.5: the first token's 0.5 does not exceed it, the second's 0.75 does.
    assert sample_topp(probs, 0.5, below(1.0)) == 1
    # top_p = 0.25: the first token alone exceeds it.
    assert sample_topp(probs, 0.25, below(1.0)) == 3


def test_sample_topp_drops_candidates_below_cutoff():
    # Unnormalized on purpose, so that the candidates never exceed top_p. n = 4,
    # top_p = 0.875: cutoff = 0.125 / 3 ~ 0.0417 drops token 2 (0.03125). Sorted: 1 (0.25),
    # 0 (0.125), 3 (0.125): cdf 0.25, 0.375, 0.5 never exceeds 0.875, so all are kept and
    # cumulative = 0.5. Just under it, r picks token 3; with token 2 kept it would pick token 2.
    probs = np.array([0.125, 0.25, 0.03125, 0.125], dtype=np.float32)
    assert sample_topp(probs, 0.875, below(1.0)) == 3
    assert sample_topp(probs, 0.875, 0.5) == 0  # r = 0.25: not < 0.25, < 0.375
    kept_too = np.array([0.125, 0.25, 0.0625, 0.125], dtype=np.float32)  # cutoff keeps token 2
    assert sample_topp(kept_too, 0.875, below(1.0)) == 2


def test_sample_topp_keeps_a_candidate_exactly_at_the_cutoff():
    # Unnormalized, n = 5, top_p = 0.75: cutoff = 0.25 / 4 = 0.0625 exactly, and token 2's
    # 0.0625 is kept (prob >= cutoff). Sorted: 1 (0.25), 0 (0.125), 3 (0.125), 2 (0.0625);
    # cdf 0.25, 0.375, 0.5, 0.5625 never exceeds 0.75: all kept, cumulative 0.5625. Just under
    # it, r picks token 2 (with a strict > at the cutoff it would be token 3).
    probs = np.array([0.125, 0.25, 0.0625, 0.125, 0.0], dtype=np.float32)
    assert sample_topp(probs, 0.75, below(1.0)) == 2


def test_sample_topp_cutoff_is_float32():
    # n = 2, top_p = 0.9: in float32, 1 - 0.9f = 0.100000024 (exact), above 0.1f = 0.10000000149,
    # so token 1 is dropped and token 0 alone is kept (its 0.9f never exceeds 0.9f). With the
    # cutoff in float64 (0.09999999999999998) token 1 would be kept and a coin of 0.95 would
    # pick it.
    assert F32(1.0) - F32(0.9) > F32(0.1)
    assert sample_topp(np.array([0.9, 0.1], np.float32), 0.9, 0.95) == 0


def test_sample_topp_rounds_r_to_float32():
    # n = 2, top_p = 0.7: cutoff = 0.3f keeps both; p0 = 0.50409734 alone does not exceed 0.7,
    # p0 + p1 = 0.80575013 does: both kept, cumulative c = 0.80575013. For this grid coin,
    # coin * c is just under p0 in exact arithmetic (0.5040973415...), but rounds to p0 in float32,
    # as run.c's `float r = coin * cumulative_prob`; r < p0 then fails and token 1 is chosen.
    p0 = np.array([1057033350], np.uint32).view(np.float32)[0]
    p1 = np.array([1050309179], np.uint32).view(np.float32)[0]
    coin = F32(10496244 / 2**24)
    c = F32(p0 + p1)
    assert float(coin) * float(c) < float(p0) and F32(coin * c) == p0
    assert sample_topp(np.array([p0, p1], np.float32), 0.7, coin) == 1


def test_descending_sort_equals_a_stable_sort():
    # sample_topp's sort (unique uint64 keys) against NumPy's stable argsort of the negation,
    # on values with ties, zeros of both signs, negatives and infinities.
    rng = np.random.default_rng(4)
    pool = np.array([-np.inf, -2, -0.0, 0.0, 1e-45, 0.25, 0.25, 0.5, 3, np.inf], np.float32)
    for _ in range(100):
        v = rng.choice(pool, size=int(rng.integers(1, 40)))
        got = sampling._sort_descending(v, np.arange(v.shape[0]))
        np.testing.assert_array_equal(got, np.argsort(-v, kind="stable"))


def test_sample_topp_falls_back_to_last_kept():
    # A coin of 1 (never drawn by the rng) passes every cdf: the last kept candidate.
    probs = np.array([0.125, 0.25, 0.0625, 0.5, 0.0625], dtype=np.float32)
    assert sample_topp(probs, 0.75, 1.0) == 0


def test_sample_topp_without_candidates_returns_argmax():
    # Uniform over 4 with top_p = 0.1: cutoff = 0.9 / 3 = 0.3 > 0.25, no candidates (run.c reads
    # out of bounds). The nucleus would be the single most likely token: the argmax.
    assert sample_topp(np.full(4, 0.25, np.float32), 0.1, 0.7) == 0
    assert sample_topp(np.array([0.2, 0.3, 0.3, 0.2], np.float32), 0.05, 0.7) == 1
    assert sample_topp(np.array([1.0], np.float32), 0.9, 0.7) == 0  # vocab of one


# --------------------------------------------------------------------------------------------
# Vectorized == loop-by-loop transcription, on random distributions (with ties) and coins.


@st.composite
def distributions(draw):
    n = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["weights", "softmax", "raw"]))
    if kind == "weights":  # small integer weights: many ties, some zeros
        w = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), np.float32)
        total = w.sum()
        return w / total if total > 0 else w
    if kind == "softmax":
        x = draw(st.lists(st.floats(-8, 8, width=32), min_size=n, max_size=n))
        return ref_softmax(np.array(x, np.float32))
    # raw: arbitrary nonnegative float32s, not normalized
    return np.array(draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n)), np.float32)


def coins(draw, boundaries):
    """A float32 coin in [0, 1): random on run.c's 2**-24 grid, at or just under a boundary, or
    on the grid within two steps of a boundary."""
    boundaries = [F32(b) for b in boundaries if 0 <= b < 1]
    kind = draw(st.sampled_from(["grid", "at", "below", "near"] if boundaries else ["grid"]))
    if kind == "grid":
        return F32(draw(st.integers(0, 2**24 - 1)) / 2**24)
    b = draw(st.sampled_from(boundaries))
    if kind == "near":
        k = int(float(b) * 2**24) + draw(st.integers(-2, 2))
        return F32(min(max(k, 0), 2**24 - 1) / 2**24)
    return b if kind == "at" else below(b)


@settings(max_examples=300, deadline=None)
@given(distributions(), st.data())
def test_sample_mult_equals_loop_reference(probs, data):
    cdf = np.cumsum(probs, dtype=np.float32)
    coin = coins(data.draw, list(cdf))
    assert sample_mult(probs, coin) == ref_sample_mult(probs, coin)


@settings(max_examples=300, deadline=None)
@given(distributions(), st.data())
def test_sample_topp_equals_loop_reference(probs, data):
    draw = data.draw
    sorted_probs = [p for p, _ in ref_topp_candidates(probs, 0.5)]
    prefix = list(np.cumsum(np.array(sorted_probs, np.float32), dtype=np.float32))
    if draw(st.booleans()) and any(0 < s < 1 for s in prefix):  # top_p exactly at a prefix sum
        top_p = float(draw(st.sampled_from([s for s in prefix if 0 < s < 1])))
    else:
        top_p = draw(st.floats(0, 1, exclude_min=True, exclude_max=True, width=32))
    # coins at prefix sums, and at prefix sums over the total (where r = coin * cumulative lands)
    coin = coins(draw, prefix + [s / prefix[-1] for s in prefix if prefix[-1] > 0])
    assert sample_topp(probs, top_p, coin) == ref_sample_topp(probs, top_p, coin)


# --------------------------------------------------------------------------------------------
# Sampler.


def test_temperature_zero_is_argmax_and_draws_nothing():
    sampler = Sampler(temperature=0.0, top_p=0.9, seed=7)
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    for _ in range(3):
        assert sampler(logits) == 1
    assert sampler.rng.state == 7


def test_one_draw_per_sampled_token():
    sampler = Sampler(temperature=1.0, top_p=0.9, seed=42)
    logits = np.array([0.5, 2.0, -1.0, 1.0], dtype=np.float32)
    sampler(logits)
    assert sampler.rng.state == xorshift_step(42)[0]
    sampler.sample(logits)
    assert sampler.rng.state == xorshift_step(xorshift_step(42)[0])[0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=48),
    st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]),
    st.integers(1, 2**64 - 1),
)
def test_sampler_equals_loop_reference(values, temperature, top_p, seed):
    logits = np.array(values, dtype=np.float32)
    sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
    draws = iter(ref_xorshift_draws(seed, 3))
    for _ in range(3):
        if temperature == 0:
            want = int(np.argmax(logits))
        else:
            probs = ref_softmax([F32(v / F32(temperature)) for v in logits])
            coin = F32(next(draws)[1])
            want = (
                ref_sample_mult(probs, coin)
                if top_p in (0.0, 1.0)
                else ref_sample_topp(probs, top_p, coin)
            )
        assert sampler(logits) == want


def test_sampler_rounds_top_p_to_float32_like_run_c():
    # run.c keeps topp as a float: 0.99999999 becomes 1.0f, which turns top-p off.
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32))
    a = Sampler(temperature=1.0, top_p=0.99999999, seed=3)
    b = Sampler(temperature=1.0, top_p=1.0, seed=3)
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]


def test_sampler_frequencies_follow_probabilities():
    probs = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    sampler = Sampler(temperature=1.0, top_p=0.0, seed=12345)
    counts = np.bincount([sampler(np.log(probs)) for _ in range(4000)], minlength=4)
    np.testing.assert_allclose(counts / 4000, probs, atol=0.03)


def test_sampler_does_not_modify_logits_and_accepts_lists():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    Sampler(temperature=0.7, top_p=0.9, seed=1)(logits)
    np.testing.assert_array_equal(logits, [1.0, 2.0, 3.0])
    assert Sampler(temperature=0.0, seed=1)([1.0, 3.0, 2.0]) == 1


def test_sampler_same_seed_same_tokens_on_a_large_vocabulary():
    logits = np.random.default_rng(3).standard_normal(128_256).astype(np.float32) * 3
    a = Sampler(temperature=0.8, top_p=0.9, seed=99)
    b = Sampler.from_config(SamplerConfig(temperature=0.8, top_p=0.9, seed=99))
    tokens = [a(logits) for _ in range(5)]
    assert tokens == [b(logits) for _ in range(5)]
    assert all(0 <= t < 128_256 for t in tokens)


def test_sampler_seed_none_uses_the_clock():
    sampler = Sampler(temperature=1.0, top_p=0.9, seed=None)
    assert isinstance(sampler.config.seed, int) and 1 <= sampler.config.seed < 2**64
    assert sampler.rng.state == sampler.config.seed


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e39), "temperature"),  # infinite as a float32
        (dict(temperature="1"), "temperature"),
        (dict(top_p=-0.01), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed=0), "seed"),
        (dict(seed=-5), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=3.0), "seed"),
    ],
)
def test_bad_settings_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name) as err:
        Sampler(**kwargs)
    assert isinstance(err.value, SamplerError) and isinstance(err.value, JllamaError)
    with pytest.raises(ValueError, match=name):
        SamplerConfig(**kwargs)


def test_config_is_frozen_and_hashable():
    config = SamplerConfig(temperature=0.5, top_p=0.9, seed=1)
    assert hash(config) == hash(SamplerConfig(temperature=0.5, top_p=0.9, seed=1))
    with pytest.raises(AttributeError):
        config.temperature = 1.0  # type: ignore[misc]


def test_module_exports_documented():
    for name in (
        "XorShiftRng",
        "xorshift_step",
        "u32_to_f32",
        "seed_from_clock",
        "argmax",
        "softmax",
        "sample_mult",
        "sample_topp",
        "SamplerConfig",
        "Sampler",
    ):
        assert getattr(sampling, name).__doc__, name


def test_vanishing_temperature_samples_the_argmax_instead_of_nan():
    # logits / 1e-45 overflows float32 (run.c would get inf - inf = NaN); the limit of a
    # temperature going to 0 is the most likely token, and one coin is still drawn.
    logits = np.array([0.5, 2.0, -1.0, 1.9], dtype=np.float32)
    sampler = Sampler(temperature=1e-45, top_p=0.9, seed=11)
    with np.errstate(all="raise"):
        assert sampler.sample(logits) == 1
    assert sampler.rng.state != 11
