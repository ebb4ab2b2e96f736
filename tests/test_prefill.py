"""Batched prefill (the jax backend's `prefill`): the same logits as feeding the prompt token
by token, the same tokens in generation, and a fixed set of compiled shapes."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from jllama.backends import make_backend
from jllama.backends.jax_graph import PREFILL_CHUNKS
from jllama.model.config import ModelConfig
from jllama.generation.generate import Generation
from jllama.sampling import Sampler
from jllama.model.weights import random_weights

GQA = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300,
                  seq_len=600, shared_weights=False)


GQA16 = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                    seq_len=600, shared_weights=False)
"""head_dim 16: the prefill attention runs jllama's kernel (`kernels.attention_chunk_fits`);
GQA's head_dim 8 keeps XLA's."""


@pytest.fixture(scope="module")
def gqa():
    return GQA, random_weights(GQA, seed=4, scale=0.1)


@pytest.fixture(scope="module")
def gqa16():
    return GQA16, random_weights(GQA16, seed=5, scale=0.1)


@contextlib.contextmanager
def _compiles():
    """The names of the programs XLA compiles inside the `with` block, in order."""
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _fresh(config, weights, name="jax"):
    b = make_backend(name)
    b.prepare(config, weights)
    return b


@pytest.mark.parametrize("model", ["gqa", "gqa16"])
@pytest.mark.parametrize("start", [0, 5, 250])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 63, 64, 65, 77, 200])
def test_prefill_logits_equal_token_by_token(model, n, start, request):
    config, weights = request.getfixturevalue(model)
    from jllama import kernels

    tokens = [int(t) for t in np.random.default_rng(n).integers(0, config.vocab_size, start + n)]
    batched, stepped = _fresh(config, weights), _fresh(config, weights, "numpy")
    # The attention kernel where it fits (matvec "auto" is the kernels on this CPU).
    fits = kernels.attention_chunk_fits(config.head_dim, batched.block_length)
    assert (batched.matvec, fits) == ("kernel", model == "gqa16" and kernels.vector_width() >= 8)
    for pos in range(start):  # a conversation's earlier turns, already in the cache
        batched.forward(tokens[pos], pos)
        stepped.forward(tokens[pos], pos)
    got = batched.prefill(tokens[start:], start)
    for pos in range(start, start + n):
        want = stepped.forward(tokens[pos], pos)
    assert np.abs(got - want).max() <= 1e-4
    # The cache holds the same keys and values: the next decode step agrees too.
    after = start + n
    assert np.abs(batched.forward(3, after) - stepped.forward(3, after)).max() <= 1e-4


def test_generation_with_prefill_gives_run_c_story(stories260k):
    from test_cli import STORY

    config, weights = stories260k
    from jllama.model.loading import open_model

    tok = open_model().tokenizer
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    runs = []
    for use_prefill in (True, False):
        b = _fresh(config, weights)
        gen = Generation(b.forward, prompt, Sampler(0.0), steps=200,
                         prefill=b.prefill if use_prefill else None)
        tokens = [t for t in gen]
        runs.append(([t.id for t in tokens], [t.sampled for t in tokens], gen.end_pos))
    assert runs[0] == runs[1]
    # And the text is run.c's greedy story (which starts with this very sentence).
    b = _fresh(config, weights)
    gen = Generation(b.forward, prompt, Sampler(0.0), steps=200, prefill=b.prefill)
    text = "Once upon a time, there was a little girl named Lily." + tok.decode(
        [t.id for t in gen if t.sampled], prev=prompt[-1]
    )
    assert STORY.startswith(text) and len(text) > 300


def test_prefill_compiles_only_the_fixed_chunk_shapes(gqa):
    """Prompts of every length 1..seq_len (600): the chunk programs compile once per chunk
    size, the attention programs once per (chunk size or decode, window) pair, and nothing
    per prompt length."""
    from jllama.graphs import attention_window

    config, weights = gqa
    b = _fresh(config, weights)
    jax.clear_caches()
    b = _fresh(config, weights)
    with _compiles() as compiled:
        tokens = [int(t) for t in np.random.default_rng(0).integers(0, 300, config.seq_len)]
        lengths = list(range(1, 80)) + list(range(80, config.seq_len + 1, 13))
        for n in lengths + [256, 512, config.seq_len]:  # 256, 512: ending on a whole chunk
            b.prefill(tokens[:n], 0)
    windows = sorted({attention_window(config.seq_len, p) for p in range(config.seq_len)})
    assert windows == [256, 512, 768]  # 3 blocks of 256 hold the 600 positions
    for program in ("qkv_chunk", "block_chunk", "classifier_last"):
        assert compiled.count(f"jit({program})") == len(PREFILL_CHUNKS), (program, compiled)
    # Each chunk size meets each window whose last block has room for it (the third block
    # holds 88 positions: no 256-token chunk there); the decode attention (the < 8 leftover
    # tokens) meets the windows beyond the first (the first is compiled at prepare).
    pairs = sum(
        1 for size in PREFILL_CHUNKS for b in range(len(windows))
        if min(256, config.seq_len - 256 * b) >= size
    )
    assert pairs == len(PREFILL_CHUNKS) * len(windows) - (256 in PREFILL_CHUNKS)
    assert compiled.count("jit(attention_chunk)") == pairs
    assert compiled.count("jit(attention)") == len(windows) - 1, compiled
    assert len(compiled) == 3 * len(PREFILL_CHUNKS) + pairs + 2


def test_prefill_rejects_what_forward_rejects(gqa):
    config, weights = gqa
    b = _fresh(config, weights)
    with pytest.raises(ValueError, match="at least one token"):
        b.prefill([], 0)
    with pytest.raises(ValueError, match="out of range"):
        b.prefill([1] * 10, config.seq_len - 5)
    with pytest.raises(ValueError, match="token 300"):
        b.prefill([1, 300, 2], 0)


def test_fused_decode_gives_the_same_logits_and_story(gqa, stories260k):
    from test_cli import STORY

    from jllama.model.loading import open_model

    config, weights = gqa
    tokens = [int(t) for t in np.random.default_rng(9).integers(0, config.vocab_size, 300)]
    graph, fused = make_backend("jax"), make_backend("jax", decode="fused")
    graph.prepare(config, weights)
    fused.prepare(config, weights)
    # The fused program adds this position's own score and value outside the cache blocks:
    # the same sums in another order.
    for pos, t in enumerate(tokens):  # crosses the 256-position window
        np.testing.assert_allclose(fused.forward(t, pos), graph.forward(t, pos), atol=1e-5)
    # A conversation's rewind: position 10 again, then on.
    np.testing.assert_allclose(fused.forward(7, 10), graph.forward(7, 10), atol=1e-5)

    b = make_backend("jax", decode="fused")
    b.prepare(*stories260k)
    tok = open_model().tokenizer
    gen = Generation(b.forward, [1], Sampler(0.0), steps=200, prefill=b.prefill)
    assert tok.decode([t.id for t in gen], prev=1) + "\n" == STORY


def test_unknown_decode_mode_is_refused():
    with pytest.raises(ValueError, match="known modes: graph, fused, loop"):
        make_backend("jax", decode="scan")
    with pytest.raises(ValueError, match="takes only cache_type_k and cache_type_v"):
        make_backend("numpy", decode="fused")


@pytest.mark.parametrize("decode", ["graph", "loop"])
@pytest.mark.parametrize("chunked", [True, False])
def test_compile_for_leaves_nothing_to_compile_and_changes_no_token(gqa, decode, chunked):
    """After `compile_for` a generation that crosses two cache blocks compiles nothing, and
    its tokens are those of a backend that compiled as it went."""
    from jllama.generation.device_loop import loop_decoder

    config, weights = gqa
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 300, 300)]
    steps = 560  # positions up to 559: windows of 512 and 768

    def generate(warm: bool):
        jax.clear_caches()  # each run compiles from nothing
        b = make_backend("jax", decode=decode)
        b.prepare(config, weights)
        sampler = Sampler(0.0)
        loop = loop_decoder(b, sampler, ()) if decode == "loop" else None
        if warm:
            b.compile_for(len(prompt), steps - 1, getattr(loop, "kind", None), chunked=chunked)
        with _compiles() as compiled:
            gen = Generation(b.forward, prompt, sampler, steps=steps, stop_ids=(),
                             prefill=b.prefill if chunked else None, decode_loop=loop)
            ids = [t.id for t in gen]
        return ids, compiled

    cold_ids, cold_compiled = generate(warm=False)
    warm_ids, warm_compiled = generate(warm=True)
    assert cold_compiled, "the cold run should compile the windows it grows into"
    assert warm_compiled == []
    assert warm_ids == cold_ids and len(warm_ids) == steps


@pytest.mark.parametrize("decode", ["graph", "loop"])
def test_compile_for_a_later_turn_keeps_the_earlier_positions(gqa, decode):
    """A conversation's second turn (as `Conversation.say`: start_pos after the kept context)
    crosses into the 512-position window. `compile_for(..., start=...)` before it leaves
    nothing to compile in the turn and the same tokens as a backend that compiled as it went:
    the programs it runs write only positions >= start, which the turn writes again."""
    from jllama.generation.device_loop import loop_decoder

    config, weights = gqa
    rng = np.random.default_rng(8)
    first = [int(t) for t in rng.integers(0, 300, 200)]
    second = [int(t) for t in rng.integers(0, 300, 150)]

    def converse(warm: bool):
        jax.clear_caches()
        b = make_backend("jax", decode=decode)
        b.prepare(config, weights)
        sampler = Sampler(0.0)
        loop = loop_decoder(b, sampler, ()) if decode == "loop" else None
        kind = getattr(loop, "kind", None)
        if warm:
            b.compile_for(len(first), 239, kind)
        one = Generation(b.forward, first, sampler, steps=240, stop_ids=(), prefill=b.prefill,
                         decode_loop=loop)
        ids = [t.id for t in one]
        context = (first + ids)[:one.end_pos]
        start, steps = len(context), 560 - len(context)  # positions up to 559
        if warm:
            b.compile_for(len(second), start + steps - 1, kind, start=start)
        with _compiles() as compiled:
            two = Generation(b.forward, second, sampler, steps=steps, stop_ids=(),
                             start_pos=start, prefill=b.prefill, decode_loop=loop,
                             context_ids=context)
            ids += [t.id for t in two]
        return ids, compiled

    cold_ids, cold_compiled = converse(warm=False)
    warm_ids, warm_compiled = converse(warm=True)
    assert cold_compiled, "the cold second turn should compile the window it grows into"
    assert warm_compiled == []
    assert warm_ids == cold_ids
