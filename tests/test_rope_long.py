"""RoPE at long contexts: the cos and sin jllama rotates by at positions up to 131071, for
Llama 3.1/3.2's llama3 scaling read from a config.json and from a GGUF's rope_freqs.weight,
against transformers' `LlamaRotaryEmbedding`; and the GGUF writer the long-context tests use,
against llama.cpp's own converter.

References: transformers' LlamaRotaryEmbedding (float32, as the models were trained with it);
float64 arithmetic for what the float32 angle costs; llama.cpp's convert_hf_to_gguf.py's output
for the committed tests/data/llama32_tiny model (its F32 file). The GGUF files here are
written as that converter writes them (`gguf_files.write_converted_llama`).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf_files import converter_permute, converter_rope_factors, write_converted_llama
from hf_models import Spec, build

from jllama import kernels
from jllama.formats.gguf import read_gguf
from jllama.formats.hf import config_from_hf
from jllama.graphs.ops import rope
from jllama.model.rope import rope_cos_sin, rope_frequencies

LLAMA31_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
BASE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 259,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
"""A one-layer Llama 3.1-style config; head_dim and rope_scaling come from ROPE_SHAPES."""
POSITIONS = np.array([0, 1, 255, 256, 4095, 8191, 8192, 16383, 16384, 30000, 32000, 32766,
                      32767, 65535, 131071])
"""Positions checked: block and band edges, a 32K context's end, the model's 131072."""


def _transformers_cos_sin(hf_config, positions) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cos and sin at `positions`: f32[T, head_dim // 2] each (its tables repeat
    the half for the rotate-half layout; the first half is taken)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor(positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def _unit_pairs(n_heads: int, head_dim: int) -> np.ndarray:
    """f32[n_heads, head_dim] with every pair (1, 0): rotated by angle a it becomes
    (cos a, sin a), so a RoPE program's output is its cos and sin."""
    heads = np.zeros((n_heads, head_dim), np.float32)
    heads[:, 0::2] = 1.0
    return heads


def _program_cos_sin(inv_freq: np.ndarray, positions, program: str):
    """cos, sin: f32[T, head_dim // 2] as the decode programs rotate: "xla" (the traced RoPE
    of `jllama.graphs.ops.rope`: XLA's cos and sin) or "kernel" (jllama's C++ RoPE and cache
    write, `kernels.rope_write`: cosf and sinf)."""
    head_dim = 2 * inv_freq.shape[0]
    cos, sin = [], []
    if program == "xla":
        rotate = jax.jit(rope)
        for p in positions:
            out = np.asarray(rotate(jnp.asarray(_unit_pairs(1, head_dim)), jnp.int32(p),
                                    jnp.asarray(inv_freq)))
            cos.append(out[0, 0::2])
            sin.append(out[0, 1::2])
        return np.stack(cos), np.stack(sin)
    kernels.load()
    qkv = np.concatenate([_unit_pairs(1, head_dim), np.zeros((2, head_dim), np.float32)])
    block = jnp.zeros((1, 16, head_dim), jnp.float32)
    write = jax.jit(kernels.rope_write)
    for p in positions:
        q, _, _ = write(jnp.asarray(qkv.ravel()), jnp.int32(p), jnp.asarray(inv_freq), block,
                        jnp.zeros_like(block))
        q = np.asarray(q)
        cos.append(q[0, 0::2])
        sin.append(q[0, 1::2])
    return np.stack(cos), np.stack(sin)


ROPE_SHAPES = {
    # (head_dim, llama3 scaling): test_long_context's model; Llama 3.2 1B/3B's; Llama 3.1 8B's.
    "tiny": (32, LLAMA31_ROPE),
    "llama3.2": (64, {**LLAMA31_ROPE, "factor": 32.0}),
    "llama3.1-8b": (128, LLAMA31_ROPE),
}


@pytest.fixture(scope="module", params=list(ROPE_SHAPES))
def rope_configs(request, tmp_path_factory):
    """(transformers' LlamaConfig, jllama's config from its config.json, jllama's config read
    from a converter-style GGUF of a one-layer model with that head_dim: rope_freqs.weight)."""
    from transformers import LlamaConfig

    head_dim, scaling = ROPE_SHAPES[request.param]
    kwargs = {**BASE, "head_dim": head_dim, "rope_scaling": scaling}
    hf_config = LlamaConfig(**kwargs)
    model = build(Spec("rope-only", kwargs, seed=1))
    path = write_converted_llama(tmp_path_factory.mktemp("rope") / "r.gguf", model)
    from_gguf = read_gguf(path, seq_len=32768).config
    assert from_gguf.rope_scaling.rope_type == "freq_factors"
    return hf_config, config_from_hf(hf_config.to_dict(), "config.json"), from_gguf


@pytest.mark.parametrize("source", ["config.json", "gguf"])
@pytest.mark.parametrize("program", ["prefill", "xla", "kernel"])
def test_rope_angles_near_32k_match_transformers(rope_configs, source, program):
    """Every place jllama turns a position into cos and sin (prefill's host tables, the XLA
    decode program, the C++ kernel) against transformers' LlamaRotaryEmbedding, at positions
    up to 131071.

    Both compute the angle pos * inv_freq as one float32 product. From config.json jllama's
    inv_freq are transformers' own bits (`test_hf.test_rope_frequencies_match_transformers`),
    so the angles are the same floats and only the cos/sin routines differ (an ulp, 6e-8).
    From the GGUF they are theta_i / rope_freqs[i] (llama.cpp's way): a few ulp off in the
    blended band, which the position multiplies, plus an ulp of the angle where the products
    round apart; that is the bound there."""
    hf_config, config, from_gguf = rope_configs
    jl_config = config if source == "config.json" else from_gguf
    inv_freq = rope_frequencies(jl_config)
    want_cos, want_sin = _transformers_cos_sin(hf_config, POSITIONS)
    if program == "prefill":
        cos, sin = rope_cos_sin(POSITIONS, inv_freq)
    else:
        cos, sin = _program_cos_sin(inv_freq, POSITIONS, program)
    routines = 2e-7  # two cos/sin routines, an ulp or so each
    limit = np.full(cos.shape, routines)
    if source == "gguf":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_inv = LlamaRotaryEmbedding(config=hf_config).inv_freq.numpy()
        divisors = np.asarray(jl_config.rope_scaling.freq_factors)
        plain = (divisors == 1) | (divisors == hf_config.rope_parameters["factor"])
        np.testing.assert_array_equal(inv_freq[plain], hf_inv[plain])  # divided by 1 or 2^k
        assert np.all(np.abs(inv_freq - hf_inv) <= 4 * np.spacing(hf_inv))
        hf_angle = (POSITIONS[:, None].astype(np.float32) * hf_inv).astype(np.float32)
        limit = (limit + POSITIONS[:, None] * np.abs(inv_freq.astype(np.float64) - hf_inv)
                 + np.spacing(hf_angle))
    for got, want, name in ((cos, want_cos, "cos"), (sin, want_sin, "sin")):
        err = np.abs(got.astype(np.float64) - want)
        worst = np.unravel_index(np.argmax(err - limit), err.shape)
        assert np.all(err <= limit), (
            f"{name} at position {POSITIONS[worst[0]]}, pair {worst[1]}: {err[worst]:.3g} "
            f"(bound {limit[worst]:.3g})")


def test_float32_angles_are_what_transformers_computes_too():
    """The float32 angle pos * inv_freq is off the exact one by up to half an ulp of the angle
    (at 32767 and inv_freq[0] = 1: 2^-9 rad, 2e-3); transformers rounds it the same way, so the
    model sees the same rotation in both (a float64 angle in jllama would *depart* from the
    reference by that much)."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**BASE, head_dim=32, rope_scaling=LLAMA31_ROPE)
    config = config_from_hf(hf_config.to_dict(), "config.json")
    inv_freq = rope_frequencies(config)
    positions = np.arange(32768 - 64, 32768)
    cos, _ = rope_cos_sin(positions, inv_freq)
    want_cos, _ = _transformers_cos_sin(hf_config, positions)
    exact = np.cos(positions[:, None].astype(np.float64) * inv_freq.astype(np.float64))
    assert np.abs(cos - want_cos).max() < 2e-7
    assert np.abs(exact - want_cos).max() > 1e-4  # float32 rounding of the angle matters here


def test_converter_writer_matches_llama_cpps_converter(tmp_path):
    """`write_converted_llama`'s q/k permutation and rope_freqs equal what llama.cpp's own
    convert_hf_to_gguf.py wrote for the committed tests/data/llama32_tiny model (F32 file),
    bit for bit."""
    from safetensors.torch import load_file

    tiny = Path(__file__).resolve().parent / "data" / "llama32_tiny"
    hf_tensors = load_file(tiny / "hf" / "model.safetensors")  # bfloat16, widened below
    path = tmp_path / "f32.gguf"
    with gzip.open(tiny / "llama32-tiny-F32.gguf.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    np.testing.assert_array_equal(
        converter_rope_factors(500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}),
        stored["rope_freqs.weight"],
    )
    for name, heads in (("q_proj", 4), ("k_proj", 2)):
        w = hf_tensors[f"model.layers.1.self_attn.{name}.weight"].float().numpy()
        short = "attn_q" if name == "q_proj" else "attn_k"
        np.testing.assert_array_equal(converter_permute(w, heads), stored[f"blk.1.{short}.weight"])
