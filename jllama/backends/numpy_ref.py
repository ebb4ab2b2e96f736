"""The NumPy reference backend: llama2.c run.c's `forward` spelled out, one public function per
step, in float32.

Each step can be called on its own from a research script, for example::

    from jllama.backends import numpy_ref as ref
    x = ref.embed(weights.token_embedding_table, token)
    xb = ref.rmsnorm(x, weights.rms_att_weight[0], config.norm_eps)
    q, k, v = ref.qkv_projection(xb, weights.wq[0], weights.wk[0], weights.wv[0])

Shapes follow `jllama.model.weights.TransformerWeights` (matrices out x in). A layer's KV cache is
head-major, `key_cache: f32[n_kv_heads, seq_len, head_dim]`, the same layout the JAX backend
uses, so the two can be compared entry by entry. It may hold another KV cache type
(`jllama.model.cache_types`: f16, bf16, q8_0's bytes [n_kv_heads, seq_len, head_dim / 32 * 34]): rows
are rounded to it as they are written (`cache_types.encode`) and widened to float32 as they are
read (`cache_types.decode`), all else float32, as the JAX backend does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.model import cache_types
from jllama.backends.base import check_token_pos
from jllama.model.config import ModelConfig
from jllama.model.rope import rope_cos_sin, rope_frequencies
from jllama.model.weights import (
    TransformerWeights,
    cast_weights,
    check_shapes,
    weights_dtype,
    weights_nbytes,
)

_F32 = np.float32


def embed(token_embedding_table: np.ndarray, token: int) -> np.ndarray:
    """Embedding lookup: the row of `token_embedding_table: f32[vocab_size, dim]`, f32[dim]."""
    return np.array(token_embedding_table[token], dtype=_F32)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019) as run.c: `weight * x / sqrt(mean(x**2) + eps)`.

    x, weight: f32[n] -> f32[n].
    """
    ms = np.dot(x, x) / _F32(x.shape[-1]) + _F32(eps)
    return (weight * (x * (_F32(1.0) / np.sqrt(ms)))).astype(_F32)


def matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Matrix-vector product with an out x in matrix, as run.c's `matmul`:
    w: f32[out, in], x: f32[in] -> f32[out]."""
    return np.dot(w, x)


def qkv_projection(
    x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query, key and value projections of the normalized input.

    x: f32[dim]; wq: f32[q_dim, dim]; wk, wv: f32[kv_dim, dim]
    -> (q: f32[q_dim], k: f32[kv_dim], v: f32[kv_dim]).
    """
    return matmul(wq, x), matmul(wk, x), matmul(wv, x)


def head_rmsnorm(vec: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each head on its own (Qwen3's q_norm / k_norm, transformers'
    `Qwen3RMSNorm` over the last axis of [..., heads, head_dim]): `rmsnorm` per head, the same
    gains for every head.

    vec: f32[n * head_dim] (heads concatenated); weight: f32[head_dim] -> f32[n * head_dim].
    """
    heads = vec.reshape(-1, weight.shape[0])
    ms = np.sum(heads * heads, axis=-1, keepdims=True) / _F32(weight.shape[0]) + _F32(eps)
    return (weight * (heads * (_F32(1.0) / np.sqrt(ms)))).reshape(vec.shape).astype(_F32)


def rope(vec: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotary position embedding, as run.c: rotate each adjacent pair (2i, 2i+1) of every head
    by the angle `pos * inv_freq[i]`.

    vec: f32[n_heads * head_dim] (queries or keys, heads concatenated);
    inv_freq: f32[head_dim // 2] from `jllama.model.rope.rope_frequencies`. Returns a new array.
    """
    half = inv_freq.shape[0]
    pairs = vec.reshape(-1, half, 2)
    cos, sin = rope_cos_sin(np.array([pos]), inv_freq)
    cos, sin = cos[0], sin[0]
    v0, v1 = pairs[..., 0], pairs[..., 1]
    out = np.stack([v0 * cos - v1 * sin, v0 * sin + v1 * cos], axis=-1)
    return out.reshape(vec.shape).astype(_F32)


def cache_write(
    key_cache: np.ndarray, value_cache: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int
) -> None:
    """Store this position's key and value in one layer's cache, IN PLACE (the one step that
    mutates: copying the cache every token would cost O(seq_len) per step), rounded to each
    cache's type (`jllama.model.cache_types.encode`; its dtype says which).

    key_cache, value_cache: f32[n_kv_heads, seq_len, head_dim] (or another cache type's
    [n_kv_heads, seq_len, row_length]); k, v: f32[kv_dim].
    """
    for cache, row in ((key_cache, k), (value_cache, v)):
        n_kv_heads = cache.shape[0]
        rows = row.reshape(n_kv_heads, -1)
        cache[:, pos, :] = cache_types.encode(rows, cache_types.of_dtype(cache.dtype))


def softmax(x: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, float32 (max subtracted first)."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return (e / np.sum(e, axis=-1, keepdims=True)).astype(_F32)


def attention(
    q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, pos: int, window: int = 0
) -> np.ndarray:
    """Causal multi-head attention of one query position over cache positions 0..pos, as run.c:
    scores `q . k / sqrt(head_dim)`, softmax, weighted sum of values. Query head h reads
    key/value head `h // kv_mul` (grouped-query attention). With a sliding window (Mistral
    v0.1's), only the last `window` positions, pos - window + 1 .. pos (transformers' mask:
    key position > query position - window).

    q: f32[n_heads * head_dim]; key_cache, value_cache: f32[n_kv_heads, seq_len, head_dim], or
    another cache type's (widened to float32 by `jllama.model.cache_types.decode`); window: 0
    for none -> f32[n_heads * head_dim].
    """
    start = max(0, pos - window + 1) if window else 0
    keys = cache_types.decode(key_cache[:, start: pos + 1, :])
    values = cache_types.decode(value_cache[:, start: pos + 1, :])
    n_kv_heads, _, head_dim = keys.shape
    qg = q.reshape(n_kv_heads, -1, head_dim)  # [n_kv_heads, kv_mul, head_dim]
    scores = np.matmul(qg, keys.transpose(0, 2, 1)) / np.sqrt(_F32(head_dim))
    weights = softmax(scores)  # [n_kv_heads, kv_mul, pos + 1]
    return np.matmul(weights, values).reshape(q.shape).astype(_F32)


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (swish): `x * sigmoid(x)`, f32."""
    return (x * (_F32(1.0) / (_F32(1.0) + np.exp(-x)))).astype(_F32)


def ffn(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> np.ndarray:
    """SwiGLU feed-forward (Shazeer 2020) as run.c: `w2 @ (silu(w1 @ x) * (w3 @ x))`.

    x: f32[dim]; w1, w3: f32[hidden_dim, dim]; w2: f32[dim, hidden_dim] -> f32[dim].
    """
    return matmul(w2, silu(matmul(w1, x)) * matmul(w3, x))


def route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """A Mixture-of-Experts router's choice (transformers' `Qwen3MoeSparseMoeBlock`, llama.cpp's
    `build_moe_ffn` with softmax gating): the softmax of the router logits, its `k` largest
    entries, and those divided by their sum when `normalize` (norm_topk_prob).

    logits: f32[n_experts] -> (experts int64[k], largest first; weights f32[k]).
    """
    probs = softmax(logits.astype(_F32))
    experts = np.argsort(-probs, kind="stable")[:k]
    weights = probs[experts]
    if normalize:
        weights = weights / np.sum(weights, dtype=_F32)
    return experts, weights.astype(_F32)


def moe_ffn(
    x: np.ndarray, gate_inp: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray,
    k: int, normalize: bool,
) -> np.ndarray:
    """A Mixture-of-Experts SwiGLU FFN (Qwen3-MoE, no shared expert): router logits
    `gate_inp @ x`, `route`'s top-k experts and weights, and the weighted sum of those
    experts' `ffn` outputs. Only the routed experts' matrices are read.

    x: f32[dim]; gate_inp: f32[n_experts, dim]; w1, w3: f32[n_experts, hidden_dim, dim];
    w2: f32[n_experts, dim, hidden_dim]; k: experts per token -> f32[dim].
    """
    experts, weights = route(matmul(gate_inp, x), k, normalize)
    out = np.zeros(x.shape, _F32)
    for e, weight in zip(experts, weights, strict=True):
        out += weight * ffn(x, w1[e], w2[e], w3[e])
    return out


def classifier(
    x: np.ndarray, rms_final_weight: np.ndarray, wcls: np.ndarray, eps: float
) -> np.ndarray:
    """Final RMSNorm and the classifier: x: f32[dim] -> logits f32[vocab_size]."""
    return matmul(wcls, rmsnorm(x, rms_final_weight, eps))


@dataclasses.dataclass
class KVCache:
    """Key and value caches of all layers: f32[n_layers, n_kv_heads, seq_len, head_dim] each,
    or [n_layers, n_kv_heads, seq_len, row_length] of another cache type's dtype
    (`jllama.model.cache_types`)."""

    key_cache: np.ndarray
    value_cache: np.ndarray

    @classmethod
    def zeros(cls, config: ModelConfig, key_type="f32", value_type="f32") -> "KVCache":
        """Zeroed caches of the key and value cache types (names or `CacheType`s)."""
        def zeros(t):
            t = cache_types.cache_type(t)
            shape = (config.n_layers, config.n_kv_heads, config.seq_len,
                     t.row_length(config.head_dim))
            return np.zeros(shape, t.dtype)

        return cls(zeros(key_type), zeros(value_type))


def forward(
    config: ModelConfig,
    weights: TransformerWeights,
    cache: KVCache,
    inv_freq: np.ndarray,
    token: int,
    pos: int,
) -> np.ndarray:
    """One transformer step, as run.c's `forward`: token at `pos` -> logits f32[vocab_size].

    The Qwen families' additions sit between the QKV product and RoPE, as in transformers'
    `Qwen2Attention` (q/k/v biases) and `Qwen3Attention` (q_norm / k_norm per head); a MoE
    config's FFN is `moe_ffn`.

    Writes this position's keys and values into `cache` (in place). `inv_freq` is
    `rope_frequencies(config)`.
    """
    x = embed(weights.token_embedding_table, token)
    for l in range(config.n_layers):
        xb = rmsnorm(x, weights.rms_att_weight[l], config.norm_eps)
        q, k, v = qkv_projection(xb, weights.wq[l], weights.wk[l], weights.wv[l])
        if config.qkv_bias:  # Qwen2: q/k/v biases, before RoPE
            q, k, v = q + weights.bq[l], k + weights.bk[l], v + weights.bv[l]
        if config.qk_norm:  # Qwen3: each head's q and k RMSNorm'd, before RoPE
            q = head_rmsnorm(q, weights.q_norm[l], config.norm_eps)
            k = head_rmsnorm(k, weights.k_norm[l], config.norm_eps)
        q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
        cache_write(cache.key_cache[l], cache.value_cache[l], k, v, pos)
        att = attention(q, cache.key_cache[l], cache.value_cache[l], pos, config.sliding_window)
        x = x + matmul(weights.wo[l], att)
        xb = rmsnorm(x, weights.rms_ffn_weight[l], config.norm_eps)
        if config.moe:  # Qwen3-MoE: the routed experts' FFNs, weighted
            x = x + moe_ffn(xb, weights.ffn_gate_inp[l], weights.w1[l], weights.w2[l],
                            weights.w3[l], config.n_experts_per_tok, config.norm_topk_prob)
        else:
            x = x + ffn(xb, weights.w1[l], weights.w2[l], weights.w3[l])
    return classifier(x, weights.rms_final_weight, weights.wcls, config.norm_eps)


class NumpyBackend:
    """The reference backend: `forward` above over a NumPy KV cache.

    Satisfies `jllama.backends.base.Backend`, `PrefillLogits` and `Described`.

    Args:
      cache_type_k, cache_type_v: the KV cache types of the keys and values
        (`jllama.model.cache_types`; names or `CacheType`s).

    Raises:
      ConfigError: an unknown cache type; (at `prepare`) q8_0 for a head_dim that is not a
        multiple of 32.

    Attributes:
      name: "numpy".
      platform: "cpu".
      weights_note: how `prepare` widened quantized weights (one line), or "".
      cache_types: (key, value) `jllama.model.cache_types.CacheType`s.
    """

    name = "numpy"
    platform = "cpu"

    def __init__(self, cache_type_k="f32", cache_type_v="f32"):
        self.config: ModelConfig | None = None
        self.weights_note = ""
        self.cache_types = (cache_types.cache_type(cache_type_k, "cache_type_k"),
                            cache_types.cache_type(cache_type_v, "cache_type_v"))

    def prepare(self, config: ModelConfig, weights: TransformerWeights) -> None:
        """Keep float32 weights as they are (file layout, possibly memory-mapped), widen others
        (bfloat16) to float32 once, since the reference computes in float32 throughout; and
        allocate the cache: n_layers * n_kv_heads * seq_len rows of head_dim values of the key
        and of the value cache type."""
        check_shapes(config, weights)
        for t, flag in zip(self.cache_types, ("cache_type_k", "cache_type_v"), strict=True):
            t.check(config.head_dim, flag)
        self.config = config
        self.weights = cast_weights(weights, "float32")
        self.weights_note = ""
        held = weights_dtype(weights)
        if held not in ("float32", "bfloat16"):
            self.weights_note = (
                f"the numpy backend computes with {held} weights dequantized to "
                f"float32: weights {weights_nbytes(self.weights) / 1e6:.1f} MB"
            )
        self.cache = KVCache.zeros(config, *self.cache_types)
        self.inv_freq = rope_frequencies(config)

    def new_caches(self) -> KVCache:
        """A zeroed `KVCache` for one more sequence (`SlotCaches`).

        Raises:
          RuntimeError: before `prepare`.
        """
        if self.config is None:
            raise RuntimeError("NumpyBackend.new_caches called before prepare")
        return KVCache.zeros(self.config, *self.cache_types)

    def use_caches(self, caches: KVCache) -> KVCache:
        """Run on `caches` (`SlotCaches`); returns the cache in use before."""
        previous, self.cache = self.cache, caches
        return previous

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits f32[vocab_size] for `token` at `pos` (see `jllama.backends.base.Backend`)."""
        if self.config is None:
            raise RuntimeError("NumpyBackend.forward called before prepare")
        token, pos = check_token_pos(self.config, token, pos)
        # Broken weights overflow to inf/NaN: callers check the logits and say so in one line,
        # as the jax backend's kernels do, rather than numpy warning at every product.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return forward(self.config, self.weights, self.cache, self.inv_freq, token, pos)

    def notes(self) -> list[str]:
        """What `prepare` chose that the user should hear of: the widening of quantized
        weights to float32 (one line), or nothing."""
        return [self.weights_note] if self.weights_note else []

    def prefill_logits(self, tokens, start_pos: int, first: int = 0) -> np.ndarray:
        """`forward` of each token at start_pos, start_pos+1, ... in turn; the logits after
        each of tokens[first:], f32[len(tokens) - first, vocab_size] (as
        `JaxGraphBackend.prefill_logits`).

        Raises:
          ValueError: no tokens, first outside [0, len(tokens)), or a token or position out
            of range.
        """
        tokens = list(tokens)
        if not 0 <= first < len(tokens):
            raise ValueError(f"first={first} must index one of the {len(tokens)} tokens")
        rows = [self.forward(t, start_pos + i) for i, t in enumerate(tokens)]
        return np.stack(rows[first:])
