"""Compiled program 1 of the decode step: attention RMSNorm and the stacked QKV projection."""

from __future__ import annotations

import functools

import jax

from jllama.config import ModelConfig
from jllama.graphs.ops import matmul, rmsnorm


@functools.partial(jax.jit, static_argnums=0)
def qkv(
    config: ModelConfig, x: jax.Array, rms_att_weight: jax.Array, wqkv: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalize the residual stream and project it to queries, keys and values in one product.

    Args:
      config: static; the program is traced once per config and replayed for every layer.
      x: f32[dim], the residual stream.
      rms_att_weight: f32[dim], this layer's attention RMSNorm gains.
      wqkv: f32[q_dim + 2 * kv_dim, dim], this layer's wq, wk, wv rows stacked (out x in).

    Returns:
      (q: f32[q_dim], k: f32[kv_dim], v: f32[kv_dim]), before RoPE.
    """
    with jax.named_scope("qkv"):
        qkv_out = matmul(wqkv, rmsnorm(x, rms_att_weight, config.norm_eps))
        q_end = config.q_dim
        k_end = q_end + config.kv_dim
        return qkv_out[:q_end], qkv_out[q_end:k_end], qkv_out[k_end:]
