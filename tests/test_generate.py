"""The generation loop's rules, checked with a scripted model and sampler (values by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from jllama.generation.generate import Generation, resolve_steps


class Script:
    """A fake model: records the (token, pos) calls; logits are irrelevant to the fake sampler."""

    def __init__(self):
        self.calls = []

    def forward(self, token, pos):
        self.calls.append((token, pos))
        return np.zeros(8, np.float32)


def sampler_from(tokens):
    it = iter(tokens)
    return lambda logits: next(it)


def test_prompt_is_forced_then_sampled():
    model = Script()
    g = Generation(model.forward, [1, 5, 6], sampler_from([7, 3, 4]), steps=5)
    tokens = list(g)
    # positions 0,1 feed the prompt; the forward at pos 2 (last prompt token) gives the first
    # sample; 5 positions in all -> 3 sampled tokens.
    assert model.calls == [(1, 0), (5, 1), (6, 2), (7, 3), (3, 4)]
    assert [(t.id, t.prev, t.pos, t.sampled) for t in tokens] == [
        (5, 1, 1, False), (6, 5, 2, False), (7, 6, 3, True), (3, 7, 4, True), (4, 3, 5, True),
    ]
    assert g.generated_ids == [7, 3, 4]
    assert g.stats.prompt_tokens == 3 and g.stats.generated_tokens == 3


@pytest.mark.parametrize("stop", [1, 2])
def test_bos_or_eos_stops_and_is_not_yielded(stop):
    model = Script()
    g = Generation(model.forward, [1], sampler_from([9, 8, stop, 7]), steps=10)
    assert [t.id for t in g] == [9, 8]
    assert g.generated_ids == [9, 8] and len(model.calls) == 3


def test_steps_shorter_than_prompt_generates_nothing():
    model = Script()
    g = Generation(model.forward, [1, 4, 5, 6], sampler_from([]), steps=2)
    assert [t.id for t in g] == [4, 5]
    assert g.generated_ids == [] and model.calls == [(1, 0), (4, 1)]


def test_timing_splits_prefill_and_decode():
    ticks = iter([0.0, 1.0, 1.5, 2.0, 2.5])  # start, then one tick per sampled token
    g = Generation(
        Script().forward, [1, 4], sampler_from([5, 6, 7, 8]), steps=5, clock=lambda: next(ticks)
    )
    list(g)
    assert g.stats.prefill_seconds == 1.0 and g.stats.prefill_tok_s == 2.0
    assert g.stats.decode_seconds == 1.5 and g.stats.decode_steps == 3
    assert g.stats.decode_tok_s == pytest.approx(2.0)
    # Without started_at the wait for the first token is the prefill's.
    assert g.stats.first_token_seconds == 1.0
    assert g.stats.load_seconds == g.stats.compile_seconds == g.stats.startup_seconds == 0.0


def test_first_token_counts_from_started_at():
    # The process started at 3.0 (clock), the generation at 10.0, the first token at 11.5.
    ticks = iter([10.0, 11.5, 12.0, 12.5])
    g = Generation(
        Script().forward, [1, 4], sampler_from([5, 6, 7]), steps=4, clock=lambda: next(ticks),
        started_at=3.0,
    )
    list(g)
    assert g.stats.first_token_seconds == 8.5 and g.stats.prefill_seconds == 1.5


def test_no_first_token_when_the_prompt_fills_every_step():
    ticks = iter([0.0, 2.0])
    g = Generation(Script().forward, [1, 4, 5], sampler_from([]), steps=2,
                   clock=lambda: next(ticks), started_at=-1.0)
    list(g)
    assert g.stats.prefill_seconds == 2.0 and g.stats.first_token_seconds == 0.0


@pytest.mark.parametrize("steps, expected", [(0, 512), (-3, 512), (600, 512), (1, 1), (512, 512)])
def test_resolve_steps_as_run_c(steps, expected):
    assert resolve_steps(steps, 512) == expected


def test_empty_prompt_or_zero_steps_rejected():
    with pytest.raises(ValueError, match="prompt"):
        Generation(Script().forward, [], sampler_from([]), steps=3)
    with pytest.raises(ValueError, match="steps"):
        Generation(Script().forward, [1], sampler_from([]), steps=0)


def test_prompt_may_be_a_numpy_array():
    g = Generation(Script().forward, np.array([1, 5]), sampler_from([6]), steps=2)
    assert [t.id for t in g] == [5, 6] and g.prompt_ids == [1, 5]


def test_non_finite_logits_raise_a_clear_error():
    from jllama.errors import NumericsError

    g = Generation(lambda t, p: np.full(4, np.nan, np.float32), [1], sampler_from([2]), steps=3)
    with pytest.raises(NumericsError, match="position 0 are not finite"):
        list(g)
