"""The two backends against independent references: llama2.c run.c's generations
(tests/data/generate_stories260K.json), a full-sequence forward pass written here without a
KV cache, and each other (logits to 1e-4); and the JAX programs' compile count."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import load_json

from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.generation.generate import Generation
from jllama.sampling import Sampler
from jllama.model.weights import random_weights

ORACLE = load_json("generate_stories260K.json")["cases"]

GQA_UNSHARED = ModelConfig(
    dim=64, hidden_dim=160, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=300, seq_len=80,
    shared_weights=False,
)


@pytest.fixture(scope="module", params=["numpy", "jax"])
def backend(request, stories260k):
    b = make_backend(request.param)
    b.prepare(*stories260k)
    return b


def _case_id(case):
    return f"{case['prompt'] or 'BOS'}-t{case['temperature']}-p{case['topp']}-s{case['seed']}"


@pytest.mark.parametrize("case", ORACLE, ids=_case_id)
def test_reproduces_run_c_generation(backend, case):
    assert case["checkpoint"] == "stories260K.bin" and case["tokenizer"] == "tok512.bin"
    sampler = Sampler(temperature=case["temperature"], top_p=case["topp"], seed=case["seed"])
    generation = Generation(backend.forward, case["prompt_ids"], sampler, steps=case["steps"])
    list(generation)
    assert generation.generated_ids == case["generated_ids"]


def full_sequence_logits(config: ModelConfig, w, tokens: list[int]) -> np.ndarray:
    """Logits at every position of `tokens` computed all at once, in float64, with a causal
    mask and no KV cache: an independent formulation of the Llama forward pass (matrices of
    activations, RoPE as complex rotations of adjacent pairs)."""
    T, hd = len(tokens), config.head_dim
    f64 = lambda a: np.asarray(a, np.float64)
    x = f64(w.token_embedding_table)[tokens]  # [T, dim]

    def norm(h, g):
        return h / np.sqrt((h * h).mean(-1, keepdims=True) + config.norm_eps) * f64(g)

    inv = config.rope_theta ** (-np.arange(0, hd, 2) / hd)
    rot = np.exp(1j * np.outer(np.arange(T), inv))  # [T, hd/2]

    def rope(h, n):
        z = h.reshape(T, n, hd // 2, 2)
        z = (z[..., 0] + 1j * z[..., 1]) * rot[:, None, :]
        return np.stack([z.real, z.imag], -1).reshape(T, n, hd)

    causal = np.tril(np.ones((T, T), bool))
    for l in range(config.n_layers):
        h = norm(x, w.rms_att_weight[l])
        q = rope(h @ f64(w.wq[l]).T, config.n_heads)
        k = rope(h @ f64(w.wk[l]).T, config.n_kv_heads)
        v = (h @ f64(w.wv[l]).T).reshape(T, config.n_kv_heads, hd)
        heads = []
        for head in range(config.n_heads):
            g = head // config.kv_mul
            s = q[:, head] @ k[:, g].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, -1) @ f64(w.wo[l]).T
        h = norm(x, w.rms_ffn_weight[l])
        a = h @ f64(w.w1[l]).T
        x = x + ((a / (1 + np.exp(-a))) * (h @ f64(w.w3[l]).T)) @ f64(w.w2[l]).T
    return norm(x, w.rms_final_weight) @ f64(w.wcls).T


def _step_logits(name, config, weights, tokens):
    b = make_backend(name)
    b.prepare(config, weights)
    return np.stack([b.forward(t, pos) for pos, t in enumerate(tokens)])


@pytest.fixture(scope="module")
def models(stories260k):
    rng = np.random.default_rng(0)
    cfg260k, w260k = stories260k
    weights = random_weights(GQA_UNSHARED, seed=1, scale=0.08)
    return {
        "stories260K": (cfg260k, w260k, [1] + list(rng.integers(3, 512, 63))),
        "random-gqa-unshared": (GQA_UNSHARED, weights, list(rng.integers(0, 300, 64))),
    }


@pytest.mark.parametrize("model", ["stories260K", "random-gqa-unshared"])
@pytest.mark.parametrize("name", ["numpy", "jax"])
def test_cached_decode_equals_full_sequence_forward(models, model, name):
    config, weights, tokens = models[model]
    expected = full_sequence_logits(config, weights, tokens)
    got = _step_logits(name, config, weights, tokens)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["stories260K", "random-gqa-unshared"])
def test_jax_logits_match_numpy_over_64_positions(models, model):
    config, weights, tokens = models[model]
    assert len(tokens) == 64
    if model == "random-gqa-unshared":
        assert config.n_kv_heads < config.n_heads and not config.shared_weights
    ref = _step_logits("numpy", config, weights, tokens)
    got = _step_logits("jax", config, weights, tokens)
    assert np.abs(got - ref).max() <= 1e-4


def test_new_sequence_at_position_zero_forgets_the_old_one(models):
    config, weights, tokens = models["random-gqa-unshared"]
    for name in ("numpy", "jax"):
        b = make_backend(name)
        b.prepare(config, weights)
        first = [b.forward(t, p) for p, t in enumerate(tokens[:10])]
        for p, t in enumerate(tokens[10:30]):  # a different, longer sequence
            b.forward(t, p)
        again = [b.forward(t, p) for p, t in enumerate(tokens[:10])]
        np.testing.assert_array_equal(np.stack(again), np.stack(first))


@pytest.mark.parametrize("name", ["numpy", "jax"])
def test_out_of_range_token_or_position_raises(models, name):
    config, weights, _ = models["random-gqa-unshared"]
    b = make_backend(name)
    b.prepare(config, weights)
    with pytest.raises(ValueError, match="token 300"):
        b.forward(300, 0)
    with pytest.raises(ValueError, match="position 80"):
        b.forward(1, 80)


def test_generating_100_tokens_compiles_each_program_once(stories260k):
    jax.clear_caches()
    traced, compiled = [], []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name"))
        elif event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        b = make_backend("jax")
        b.prepare(*stories260k)
        during_prepare = len(compiled)
        generation = Generation(b.forward, [1], Sampler(1.0, 0.9, seed=5), steps=100)
        assert len(list(generation)) == 100
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for program in ("qkv", "attention", "block", "classifier"):
        assert traced.count(program) == 1, (program, traced)
        assert compiled.count(f"jit({program})") == 1, (program, compiled)
    assert len(compiled) == during_prepare  # generating compiled nothing at all


@pytest.mark.parametrize("name", ["numpy", "jax"])
def test_non_integer_token_or_position_raises_type_error(models, name):
    config, weights, _ = models["random-gqa-unshared"]
    b = make_backend(name)
    b.prepare(config, weights)
    for token, pos in [(1.5, 0), (1, 2.0), (True, 0)]:
        with pytest.raises(TypeError):
            b.forward(token, pos)
    np.testing.assert_array_equal(b.forward(np.int64(3), np.int32(0)), b.forward(3, 0))
