"""Compiled program 3 of the decode step: attention output projection, residual, FFN RMSNorm,
SwiGLU feed-forward, residual."""

from __future__ import annotations

import functools

import jax

from jllama.model.config import ModelConfig
from jllama.model.ggml_matrix import float_gate_up, gate_up
from jllama.graphs.ops import norm_matmul, residual_matmul, residual_swiglu_matmul


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def block(
    config: ModelConfig,
    x: jax.Array,
    att: jax.Array,
    wo: jax.Array,
    rms_ffn_weight: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    w3: jax.Array,
    *,
    matvec: str = "xla",
) -> jax.Array:
    """The rest of one layer after attention, as llama2.c run.c.

    `x + wo @ att`, then `x + w2 @ (silu(w1 @ h) * (w3 @ h))` with `h = rmsnorm(x)`.

    Args:
      config: static.
      x: f32[dim], the residual stream entering the layer.
      att: f32[q_dim], the attention output.
      wo: f32[dim, q_dim]; rms_ffn_weight: f32[dim];
      w1, w3: f32[hidden_dim, dim]; w2: f32[dim, hidden_dim] (out x in).
      matvec: static; how the products run, "xla" or "kernel" (`jllama.graphs.ops.matmul`;
        with "kernel" the norm, SwiGLU and the residual additions run inside the products'
        kernel calls).

    Returns:
      f32[dim], the residual stream leaving the layer.
    """
    with jax.named_scope("wo"):
        x = residual_matmul(x, wo, att, matvec)
    with jax.named_scope("ffn"):
        eps = config.norm_eps
        both = gate_up(w1, w3)
        if both is None and matvec == "kernel":
            both = float_gate_up(w1, w3)
        if both is not None:  # one kernel call, one RMSNorm (GGML blocks: x quantized once)
            out = norm_matmul(both, x, rms_ffn_weight, eps, matvec)
            up, gate = out[: config.hidden_dim], out[config.hidden_dim :]
        else:
            up = norm_matmul(w1, x, rms_ffn_weight, eps, matvec)
            gate = norm_matmul(w3, x, rms_ffn_weight, eps, matvec)
        return residual_swiglu_matmul(x, w2, up, gate, matvec)
