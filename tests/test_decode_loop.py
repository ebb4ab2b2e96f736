"""The `loop` decode mode: tokens sampled on the device in chunks.

References: llama2.c run.c's own outputs for stories260K (greedy, multinomial and top-p cases,
tests/data/generate_stories260K.json), the graph and fused modes' tokens, and sampling cases
worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_json

from jllama import graphs
from jllama.backends import make_backend
from jllama.backends.jax_graph import LOOP_CHUNK
from jllama.model.config import ModelConfig
from jllama.generation.device_loop import loop_decoder, sampling_kind
from jllama.generation.generate import Generation
from jllama.sampling import Sampler
from jllama.model.weights import random_weights

ORACLE = load_json("generate_stories260K.json")["cases"]

GQA = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300,
                  seq_len=600, shared_weights=False)


def _loop_backend(config, weights):
    b = make_backend("jax", decode="loop")
    b.prepare(config, weights)
    return b


def _case_id(case):
    return f"{case['prompt'] or 'BOS'}-t{case['temperature']}-p{case['topp']}-s{case['seed']}"


@pytest.fixture(scope="module")
def loop_backend(stories260k):
    return _loop_backend(*stories260k)


@pytest.mark.parametrize("case", ORACLE, ids=_case_id)
def test_loop_reproduces_run_c_generation(loop_backend, case):
    """Greedy, multinomial (top_p 1) and top-p cases: the tokens run.c printed."""
    b = loop_backend
    sampler = Sampler(temperature=case["temperature"], top_p=case["topp"], seed=case["seed"])
    generation = Generation(
        b.forward, case["prompt_ids"], sampler, steps=case["steps"], prefill=b.prefill,
        decode_loop=loop_decoder(b, sampler, (1,)),  # run.c stops at BOS only
    )
    list(generation)
    assert generation.generated_ids == case["generated_ids"]


def test_loop_leaves_the_random_generator_where_token_by_token_sampling_does(stories260k):
    config, weights = stories260k
    prompt = [1, 403, 407, 261, 378]
    runs = []
    for use_loop in (False, True):
        b = _loop_backend(config, weights)
        sampler = Sampler(temperature=1.0, top_p=0.9, seed=99)
        gen = Generation(b.forward, prompt, sampler, steps=150, stop_ids=(),
                         decode_loop=loop_decoder(b, sampler, ()) if use_loop else None)
        ids = [t.id for t in gen]
        runs.append((ids, gen.end_pos, sampler.rng.state, gen.stats.decode_steps))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 150  # one token per position: 4 from the prompt, 146 sampled


def test_loop_greedy_equals_graph_and_fused_across_windows():
    """300 positions cross the 256-position attention window; three modes, one sequence."""
    weights = random_weights(GQA, seed=4, scale=0.1)
    results = []
    for mode in ("graph", "fused", "loop"):
        b = make_backend("jax", decode=mode)
        b.prepare(GQA, weights)
        sampler = Sampler(0.0)
        decode_loop = loop_decoder(b, sampler, ()) if mode == "loop" else None
        gen = Generation(b.forward, [5, 6, 7], sampler, steps=300, stop_ids=(),
                         prefill=b.prefill, decode_loop=decode_loop)
        results.append([t.id for t in gen])
    assert len(results[0]) == 300
    assert results[0] == results[1] == results[2]


def test_loop_stops_at_a_stop_token_and_reports_the_cache_position(stories260k):
    config, weights = stories260k
    b = _loop_backend(config, weights)
    # Greedy from BOS: run.c's story; its 5th generated token used as a stop token.
    story = next(c for c in ORACLE if c["prompt"] == "" and c["temperature"] == 0)
    stop = story["generated_ids"][4]
    first = story["generated_ids"].index(stop)
    ids, finite = b.decode_loop(1, 0, 16, stop_ids=(stop,))
    assert finite and ids == story["generated_ids"][: first + 1]
    sampler = Sampler(0.0)
    gen = Generation(b.forward, [1], sampler, steps=100, stop_ids=(stop,),
                     decode_loop=loop_decoder(b, sampler, (stop,)))
    assert [t.id for t in gen] == story["generated_ids"][:first]
    assert gen.stop_token == stop
    # BOS and the tokens before the stop token went through the model.
    assert gen.end_pos == first + 1


def test_loop_caps_chunks_at_the_context_end():
    config = ModelConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=4,
                         vocab_size=50, seq_len=20)
    b = _loop_backend(config, random_weights(config, seed=1, scale=0.1))
    ids, finite = b.decode_loop(3, 10, 100)  # 10 positions left: 10..19
    assert finite and len(ids) == min(LOOP_CHUNK, 10)
    with pytest.raises(ValueError, match="out of range"):
        b.decode_loop(3, 20, 1)
    with pytest.raises(ValueError, match="needs 5 coins"):
        b.decode_loop(3, 0, 5, kind="mult", coins=[0.5])


def test_loop_reports_non_finite_logits():
    config = ModelConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=4,
                         vocab_size=50, seq_len=40)
    w = random_weights(config, seed=2, scale=0.1)
    wcls = np.array(w.wcls)
    wcls[7, :] = np.nan
    import dataclasses

    b = _loop_backend(config, dataclasses.replace(w, wcls=wcls))
    ids, finite = b.decode_loop(3, 0, 8)
    assert ids == [] and finite is False


def test_sample_on_device_by_hand():
    logits = jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4], jnp.float32))
    one = jnp.float32(1.0)
    sample = jax.jit(graphs.sample_on_device, static_argnums=1)

    def draw(kind, coin, top_p=1.0):
        return int(sample(logits, kind, one, jnp.float32(top_p), jnp.float32(coin)))

    assert draw("greedy", 0.0) == 3
    # Multinomial: cdf 0.1, 0.3, 0.6, 1.0; the first entry above the coin.
    assert [draw("mult", c) for c in (0.05, 0.15, 0.35, 0.65, 0.99)] == [0, 1, 2, 3, 3]
    # Top-p 0.6: sorted 0.4 (id 3), 0.3 (id 2): cumulative 0.4, 0.7 > 0.6, so ids 3 and 2
    # are kept with mass 0.7; coin 0.5 -> r = 0.35 < 0.4 -> id 3; coin 0.6 -> r = 0.42 -> id 2.
    assert draw("topp", 0.5, 0.6) == 3 and draw("topp", 0.6, 0.6) == 2
    # Ties sort by id: two equal maxima, greedy takes the first.
    tied = jnp.array([0.0, 2.0, 2.0, 1.0], jnp.float32)
    assert int(sample(tied, "greedy", one, one, jnp.float32(0))) == 1


@pytest.mark.parametrize(("temperature", "top_p", "kind"), [
    (0.0, 0.9, "greedy"), (1.0, 1.0, "mult"), (0.8, 0.0, "mult"), (1.0, 0.9, "topp"),
])
def test_sampling_kind_follows_run_c_branches(temperature, top_p, kind):
    assert sampling_kind(temperature, top_p) == kind


def test_loop_refuses_samplers_it_does_not_implement(stories260k):
    b = _loop_backend(*stories260k)
    with pytest.raises(ValueError, match="temperature, top_p and seed only"):
        loop_decoder(b, lambda logits: 0, ())


def test_loop_refuses_llama_cpp_samplers(stories260k):
    b = _loop_backend(*stories260k)
    with pytest.raises(ValueError, match="temperature, top_p and seed only"):
        loop_decoder(b, Sampler(temperature=1.0, top_p=0.9, seed=3, top_k=40), ())


def test_vanishing_temperature_shares_the_mass_among_the_maxima():
    """As the host sampler: logits / 1e-45 overflows (and XLA CPU flushes the subnormal
    temperature to 0), so the maxima share the mass: probs 0, 1/2, 1/2, 0 here."""
    logits = jnp.array([1.0, 3.0, 3.0, 2.0], jnp.float32)
    sample = jax.jit(graphs.sample_on_device, static_argnums=1)
    t, one = jnp.float32(1e-45), jnp.float32(1.0)
    assert [int(sample(logits, "mult", t, one, jnp.float32(c))) for c in (0.2, 0.7)] == [1, 2]
    host = [Sampler(temperature=1e-45, top_p=1.0, seed=1) for _ in range(2)]
    assert int(sample(logits, "mult", t, one, host[0].rng.random_f32())) == host[1].sample(
        np.asarray(logits))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_loop_samples_the_host_samplers_tokens_over_a_large_vocabulary(top_p):
    """49152 tokens (SmolLM2's vocabulary) and near-flat logits: probability boundaries lie
    ~2e-5 apart, so a cumulative sum off in the 5th digit (XLA's tree-shaped cumsum was, by up
    to 1e-4) draws another token within a few steps. The loop's kernel sampler does the host
    sampler's sums in its order: the loop gives the graph mode's (host-sampled) tokens."""
    config = ModelConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2,
                         vocab_size=49152, seq_len=80, shared_weights=False)
    weights = random_weights(config, seed=6, scale=0.2)
    results = []
    for mode in ("graph", "loop"):
        b = make_backend("jax", decode=mode, matvec="kernel")
        b.prepare(config, weights)
        sampler = Sampler(0.9, top_p=top_p, seed=7)
        loop = loop_decoder(b, sampler, ()) if mode == "loop" else None
        gen = Generation(b.forward, [5, 6], sampler, steps=64, stop_ids=(), decode_loop=loop)
        results.append([t.id for t in gen])
    assert len(results[0]) == 64 and len(set(results[0])) > 20  # a varied draw, not argmax
    assert results[0] == results[1]
