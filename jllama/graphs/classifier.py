"""Compiled program 4 of the decode step: final RMSNorm and the classifier."""

from __future__ import annotations

import functools

import jax

from jllama.model.config import ModelConfig
from jllama.graphs.ops import norm_matmul


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def classifier(
    config: ModelConfig,
    x: jax.Array,
    rms_final_weight: jax.Array,
    wcls: jax.Array,
    *,
    matvec: str = "xla",
) -> jax.Array:
    """Logits for the next token, as llama2.c run.c.

    Args:
      config: static.
      x: f32[dim], the residual stream after the last layer.
      rms_final_weight: f32[dim]; wcls: f32[vocab_size, dim] (out x in).
      matvec: static; "xla" or "kernel" (`jllama.graphs.ops.matmul`).

    Returns:
      logits: f32[vocab_size].
    """
    with jax.named_scope("classifier"):
        return norm_matmul(wcls, x, rms_final_weight, config.norm_eps, matvec)
