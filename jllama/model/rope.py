"""Rotary position embedding (RoPE) frequencies, shared by every backend.

RoPE as llama2.c run.c applies it: within each head, the pairs of adjacent entries
(2i, 2i + 1) are rotated by the angle `pos * inv_freq[i]`, with
`inv_freq[i] = rope_theta ** (-2i / head_dim)` (Su et al. 2021, "RoFormer"). Files that
store Q/K for another pairing (GGUF, Hugging Face) are permuted at load time so that this
one convention serves all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # jllama.model.config imports this module to check its RoPE table
    from jllama.model.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies of the rotated pairs: f32[head_dim // 2] (radians per token).

    Computed in float32 as run.c does (`1.0f / powf(theta, 2i / (float)head_dim)`), with the
    power correctly rounded to float32 (taken in float64, then rounded), as glibc's powf and
    torch's `theta ** t` give it, so these are the bits of run.c's and transformers' tables.
    NumPy's own float32 power is not correctly rounded (NumPy 2.4: off by an ulp in 7 of
    Llama 3.2 1B's 32 pairs, 13 of Llama 3.1 8B's 64), and the angle pos * inv_freq carries
    that ulp times the position: 2e-3 rad at position 32767 for inv_freq ~ 0.66.
    With `config.rope_scaling` they are then scaled as
    Hugging Face transformers' `ROPE_INIT_FUNCTIONS` do (`_compute_linear_scaling_parameters`,
    `_compute_llama3_parameters`; attention is not rescaled for either), or, for a GGUF's
    per-frequency factors, as llama.cpp does:

      linear: inv_freq / factor
      llama3: with wavelen = 2 pi / inv_freq, L = original_max_position_embeddings,
        wavelen > L / low_freq_factor        -> inv_freq / factor
        wavelen < L / high_freq_factor       -> inv_freq
        otherwise, s = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor),
                                             -> (1 - s) * inv_freq / factor + s * inv_freq
      freq_factors: inv_freq / freq_factors[i] / factor, as ggml's rope does with a GGUF's
        `rope_freqs.weight` (ggml-cpu `ggml_rope_cache_init`: theta / ff, times freq_scale =
        1 / factor). llama.cpp's converter (`LlamaModel.generate_extra_tensors`) writes
        freq_factors[i] = 1 / (the llama3 formula's multiplier of inv_freq[i]), so with
        factor 1 this is the llama3 row above up to float32 rounding (a few ulp).
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    power = np.power(np.float64(np.float32(config.rope_theta)), exponents.astype(np.float64))
    inv_freq = (np.float32(1.0) / power.astype(np.float32)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    if scaling.rope_type == "linear":
        return (inv_freq / factor).astype(np.float32)
    if scaling.rope_type == "freq_factors":
        divided = inv_freq / np.asarray(scaling.freq_factors, np.float32)
        return (divided / factor).astype(np.float32)
    # llama3, in float32 as transformers computes it. Warnings off: a wavelength or band edge
    # beyond float32 (theta near 3e38, a low_freq_factor near 1e-38) is inf and compares as
    # the formula means, and `blended` is kept only where 0 <= smooth <= 1, so what overflows
    # elsewhere is discarded; ModelConfig checks that the table it returns is finite.
    old = np.float32(scaling.original_max_position_embeddings)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    with np.errstate(all="ignore"):
        wavelen = np.float32(2 * np.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = (old / wavelen - low) / (high - low)
        blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, as run.c computes them: the float32 angle
    `pos * inv_freq[i]`, then its cosine and sine in float32.

    positions: int[T] (tokens); inv_freq: f32[head_dim // 2] (`rope_frequencies`).
    Returns (cos, sin): f32[T, head_dim // 2] each.
    """
    angle = np.asarray(positions).astype(np.float32)[:, None] * inv_freq.astype(np.float32)
    return np.cos(angle), np.sin(angle)


def rope_row_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns rotate-half q/k rows into adjacent-pair rows: int[n*head_dim].

    Hugging Face's Llama, Qwen and Mistral (transformers' `rotate_half`) and llama.cpp's NEOX
    RoPE (its qwen2 / qwen3 GGUF files) rotate entries i and i + head_dim/2 of a head
    together; every jllama backend rotates adjacent pairs (2i, 2i + 1), as llama2.c's run.c.
    Within each head, new row 2i is old row i and new row 2i + 1 is old row i + head_dim/2,
    so `w[perm]` is the permuted f32[n_heads * head_dim, dim] matrix. Rotating adjacent pairs
    of the permuted vector is the rotate-half rotation of the original with its entries
    reordered, and q . k is unchanged when both are reordered alike, so attention is the
    same. A bias or a per-head norm gain of q / k follows its rows (an RMSNorm over a head
    does not depend on the order of its entries).
    """
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def permute_rows(matrix, order: np.ndarray):
    """`matrix`'s rows (its second-to-last axis) in `order`: a float array [..., rows, cols]
    or GGML blocks (a `GGMLMatrix` [rows, cols] or a `LayerStack` of them: whole rows of
    blocks moved, nothing requantized); a new array (copied out of a mapped file)."""
    from jllama.model.ggml_matrix import GGMLMatrix, LayerStack

    if isinstance(matrix, LayerStack):
        return LayerStack(tuple(permute_rows(m, order) for m in matrix.layers))
    if isinstance(matrix, GGMLMatrix):
        return GGMLMatrix(np.ascontiguousarray(np.asarray(matrix.data)[..., order, :]),
                          matrix.type_id, matrix.cols)
    return np.ascontiguousarray(np.asarray(matrix)[..., order, :])


def rotate_half_to_pairs(config: ModelConfig, arrays: dict) -> dict:
    """`TransformerWeights` fields (by name) of a rotate-half file in jllama's adjacent-pair
    order (`rope_row_permutation`): wq, wk [L, rows, dim] (float or GGML blocks) by row, bq,
    bk [L, rows] and q_norm, k_norm [L, head_dim] along their last axis; other fields, and
    those absent, as they are. Returns a new dict."""
    q = rope_row_permutation(config.n_heads, config.head_dim)
    k = rope_row_permutation(config.n_kv_heads, config.head_dim)
    head = rope_row_permutation(1, config.head_dim)
    out = dict(arrays)
    for name, order in (("wq", q), ("wk", k)):
        if out.get(name) is not None:
            out[name] = permute_rows(out[name], order)
    for name, order in (("bq", q), ("bk", k), ("q_norm", head), ("k_norm", head)):
        if out.get(name) is not None:
            out[name] = np.ascontiguousarray(np.asarray(out[name])[..., order])
    return out
