"""Array operations shared by the compiled programs (jax.numpy, float32).

The same formulas as the NumPy reference (`jllama.backends.numpy_ref`), written for tracing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jllama import kernels
from jllama.model.ggml_matrix import is_ggml
from jllama.model.quant import Int8Matrix

# f32 matrix products at full f32 precision: the default lets GPUs use TF32 (10-bit mantissa),
# which would break parity with the reference; on XLA CPU it costs nothing.
PRECISION = jax.lax.Precision.HIGHEST


def matmul(w: jax.Array | Int8Matrix, x: jax.Array, matvec: str = "xla") -> jax.Array:
    """w: f32[out, in], bf16[out, in] or `Int8Matrix` (one row per output), x: f32[in] ->
    f32[out].

    matvec: "kernel" computes it with jllama's CPU kernel (`jllama.kernels.matvec`; the
    caller has run `jllama.kernels.load()`); "xla" (the default) as below.

    bfloat16 weights are widened to float32 element by element (exact) inside one
    multiply-and-sum fusion, so activations and sums stay float32 whatever the weights' storage
    type. Written as a dot of widened weights instead, XLA CPU materializes the f32 matrix on
    every call: a 5632x2048 bf16 product took 14.3 ms that way and 1.1 ms this way (f32 dot:
    1.2 ms; measured in JAX 0.10).

    int8 weights (`jllama.model.quant.Int8Matrix`) are widened the same way and each row sum is
    multiplied by the row's scale afterwards: `sum(q * x) * scale`, equal to `(q * scale) @ x`
    up to rounding; the product reads one byte per weight.
    """
    if matvec == "kernel" or is_ggml(w):  # GGML blocks are there only where the kernels are
        return kernels.matvec(w, x)
    if matvec != "xla":
        raise ValueError(f"matvec={matvec!r}; known: {', '.join(kernels.MATVEC_MODES)}")
    if isinstance(w, Int8Matrix) and w.grouped:  # one scale per group: sum each group first
        out, n = w.q.shape
        groups = w.q.reshape(out, -1, w.group_size).astype(jnp.float32)
        return jnp.sum(jnp.sum(groups * x.reshape(-1, w.group_size), axis=-1) * w.scale, -1)
    if isinstance(w, Int8Matrix):
        return jnp.sum(w.q.astype(jnp.float32) * x, axis=-1) * w.scale
    if w.dtype != jnp.float32:
        return jnp.sum(w.astype(jnp.float32) * x, axis=-1)
    return jnp.dot(w, x, precision=PRECISION)


def norm_matmul(
    w: jax.Array | Int8Matrix, x: jax.Array, weight: jax.Array, eps: float, matvec: str = "xla"
) -> jax.Array:
    """`w @ rmsnorm(x, weight, eps)`: f32[n] -> f32[out] (w as `matmul`). With
    matvec="kernel" the norm runs inside the product's kernel call (`jllama.kernels.matvec`),
    not as XLA programs of its own."""
    if matvec == "kernel" or is_ggml(w):
        return kernels.matvec(w, x, norm=weight, eps=eps)
    return matmul(w, rmsnorm(x, weight, eps), matvec)


def residual_matmul(
    residual: jax.Array, w: jax.Array | Int8Matrix, x: jax.Array, matvec: str = "xla"
) -> jax.Array:
    """`residual + w @ x`: residual f32[out], x f32[n] (w as `matmul`); with matvec="kernel"
    the addition runs inside the product's kernel call."""
    if matvec == "kernel" or is_ggml(w):
        return kernels.matvec(w, x, add=residual)
    return residual + matmul(w, x, matvec)


def residual_swiglu_matmul(
    residual: jax.Array, w: jax.Array | Int8Matrix, a: jax.Array, b: jax.Array,
    matvec: str = "xla",
) -> jax.Array:
    """`residual + w @ (silu(a) * b)`, SwiGLU's last product (Shazeer 2020, as llama2.c
    run.c): residual f32[out], a and b f32[n] (w as `matmul`); with matvec="kernel" silu, the
    multiply and the addition run inside the product's kernel call."""
    if matvec == "kernel" or is_ggml(w):
        return kernels.matvec(w, a, gate=b, add=residual)
    return residual + matmul(w, jax.nn.silu(a) * b, matvec)


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as llama2.c run.c: `weight * x / sqrt(mean(x**2) + eps)`; f32[n] -> f32[n]."""
    ms = jnp.dot(x, x, precision=PRECISION) / x.shape[-1] + eps
    return weight * (x * jax.lax.rsqrt(ms))


def rope(heads: jax.Array, pos: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (2i, 2i+1) of each head by `pos * inv_freq[i]` (run.c's RoPE).

    heads: f32[n, head_dim]; pos: int32 scalar; inv_freq: f32[head_dim // 2] -> f32[n, head_dim].
    """
    n, head_dim = heads.shape
    pairs = heads.reshape(n, head_dim // 2, 2)
    angle = pos.astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    v0, v1 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([v0 * cos - v1 * sin, v0 * sin + v1 * cos], axis=-1).reshape(n, head_dim)


def split_qkv(config, out: jax.Array, shards: int = 1):
    """Split the output of the stacked QKV product into q, k and v heads.

    out: f32[..., q_dim + 2 * kv_dim] in `wqkv`'s row order. With shards == 1 (one device)
    that is wq's rows, then wk's, then wv's. With shards == N (tensor parallelism,
    `jllama.platform.sharding.qkv_row_order`) the rows come in N equal groups, group d holding device
    d's query heads, then its key heads, then its value heads, so each device's contiguous
    shard of `wqkv` is all it needs and the split below never moves data between devices.

    Returns (q f32[..., n_heads, head_dim], k and v f32[..., n_kv_heads, head_dim]), heads in
    the model's order.
    """
    c = config
    lead = out.shape[:-1]
    if shards == 1:
        q = out[..., : c.q_dim]
        k = out[..., c.q_dim : c.q_dim + c.kv_dim]
        v = out[..., c.q_dim + c.kv_dim :]
    else:
        groups = out.reshape(*lead, shards, -1)  # [..., device, its rows]
        qs, ks = c.q_dim // shards, c.kv_dim // shards
        q, k, v = groups[..., :qs], groups[..., qs : qs + ks], groups[..., qs + ks :]
    return (
        q.reshape(*lead, c.n_heads, c.head_dim),
        k.reshape(*lead, c.n_kv_heads, c.head_dim),
        v.reshape(*lead, c.n_kv_heads, c.head_dim),
    )


def qkv_extras(config, out: jax.Array, bqkv, q_norm, k_norm, shards: int = 1) -> jax.Array:
    """The Qwen families' steps between the QKV product and RoPE, on the product's output in
    `wqkv`'s row order (`split_qkv`): out + bqkv (Qwen2's q/k/v biases), then each query and
    key head RMSNorm'd over head_dim with the gains q_norm / k_norm (Qwen3, transformers'
    `Qwen3RMSNorm`, eps = norm_eps). A Llama layer (all three None) is returned as it is, so
    its programs trace exactly as before.

    Args:
      config: the model's config.
      out: f32[..., q_dim + 2 * kv_dim].
      bqkv: f32[q_dim + 2 * kv_dim] in the same row order, or None.
      q_norm, k_norm: f32[head_dim], or None.
      shards: the row groups of `split_qkv`.

    Returns:
      f32[..., q_dim + 2 * kv_dim], rows in the same order (the kernels' RoPE and cache write
      take it as they take the product's output).
    """
    if bqkv is not None:
        out = out + bqkv
    if q_norm is None:
        return out
    c = config
    lead = out.shape[:-1]
    groups = out.reshape(*lead, shards, -1)  # one group on one device
    qs, ks = c.q_dim // shards, c.kv_dim // shards
    q, k, v = groups[..., :qs], groups[..., qs : qs + ks], groups[..., qs + ks :]

    def norm_heads(part, weight):
        heads = part.reshape(*part.shape[:-1], -1, c.head_dim)
        ms = jnp.mean(heads * heads, axis=-1, keepdims=True) + c.norm_eps
        return (weight * (heads * jax.lax.rsqrt(ms))).reshape(part.shape)

    q, k = norm_heads(q, q_norm), norm_heads(k, k_norm)
    return jnp.concatenate([q, k, v], axis=-1).reshape(out.shape)
