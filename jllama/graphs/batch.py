"""The batched decode step's compiled programs (matvec="kernel", one CPU device): B sequences,
each at its own position on its own KV cache, one token each.

  layer_batch       one layer for the B tokens: the stacked QKV product for all of them
                    (attention RMSNorm inside), each sequence's RoPE, cache write and attention
                    on its own blocks, wo + residual, FFN RMSNorm + w1 / w3, SwiGLU + w2 +
                    residual
  classifier_batch  final RMSNorm + wcls for the B rows

Each product reads a weight row once for all B vectors (`jllama.batched.matvec_batch`), and
each row's sum is the single-vector kernel's, so row b has the bits of `forward` for that
sequence alone (batch invariance). Compiled once per batch size (the backend pads B up to one
of `BATCH_SIZES`) and, for `layer_batch`, per count K of cache blocks read (the largest
`attention_blocks` among the sequences, as `forward` compiles one attention per K); rows from
`count` on are padding the kernels skip.

`layer_rows` is the layer with its attention step given: `layer_batch` takes the B sequences'
(`jllama.kernels.batched.rope_attend_batch`), the speculative verification step
(`jllama.graphs.verify.layer_verify`) R consecutive positions of one sequence in order.
"""

from __future__ import annotations

import functools

import jax

from jllama.graphs.ops import qkv_extras
from jllama.kernels import batched
from jllama.model.config import ModelConfig
from jllama.model.weights import LayerWeights

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
"""The batch sizes the batched programs are compiled for: a batch of B runs in the smallest
that holds it (more than 32: in parts of 32)."""


@functools.partial(
    jax.jit, static_argnames=("config", "attend"),
    donate_argnames=("key_current", "value_current"),
)
def layer_rows(
    config: ModelConfig,
    x: jax.Array,
    count: jax.Array,
    pos: jax.Array,
    layer: LayerWeights,
    inv_freq: jax.Array,
    key_current,
    value_current,
    key_blocks: tuple,
    value_blocks: tuple,
    *,
    attend,
) -> tuple[jax.Array, object, object]:
    """One layer for the R rows of x, as `qkv` + attention + `block` per row: the stacked QKV
    product for all rows (attention RMSNorm inside), the Qwen biases / q-k norms where the layer
    has them (`jllama.graphs.ops.qkv_extras`, row by row), `attend` for RoPE, the cache writes and
    attention, then wo + residual, FFN RMSNorm + w1 / w3, SwiGLU + w2 + residual for all rows.

    Args:
      config: static.
      x: f32[R, dim], the rows' residual streams.
      count: int32 scalar, the real rows (the rest is padding).
      pos: int32[R], each row's position.
      layer: the layer's arrays (`LayerWeights`; f32, bf16, `Int8Matrix` or GGML blocks).
      inv_freq: f32[head_dim // 2].
      key_current, value_current: the blocks holding the rows' positions (as `attend` takes
        them); donated (updated in place).
      key_blocks, value_blocks: the blocks attention reads (as `attend` takes them).
      attend: static, `attend(qkv, pos, count, inv_freq, key_current, value_current,
        key_blocks, value_blocks) -> (att f32[R, n_heads * head_dim], key_current,
        value_current written)`.

    Returns:
      (x f32[R, dim] leaving the layer, key_current, value_current written).
    """
    eps = config.norm_eps
    with jax.named_scope("qkv_rows"):
        qkv = batched.matvec_batch(layer.wqkv, x, count, norm=layer.rms_att_weight, eps=eps)
        qkv = qkv_extras(config, qkv, layer.bqkv, layer.q_norm, layer.k_norm)  # per row
    with jax.named_scope("attention_rows"):
        att, key_current, value_current = attend(
            qkv, pos, count, inv_freq, key_current, value_current, key_blocks, value_blocks
        )
    with jax.named_scope("wo_rows"):
        x = batched.matvec_batch(layer.wo, att, count, add=x)
    with jax.named_scope("ffn_rows"):
        up = batched.matvec_batch(layer.w1, x, count, norm=layer.rms_ffn_weight, eps=eps)
        gate = batched.matvec_batch(layer.w3, x, count, norm=layer.rms_ffn_weight, eps=eps)
        x = batched.matvec_batch(layer.w2, up, count, gate=gate, add=x)
    return x, key_current, value_current


layer_batch = functools.partial(layer_rows, attend=batched.rope_attend_batch)
"""One layer of the batched decode step (`layer_rows`): x f32[B, dim]; pos int32[B], each
sequence's position; key_current, value_current: B blocks each, sequence b's block holding
pos[b]; key_blocks, value_blocks: B * K blocks each (`jllama.batched.rope_attend_batch`)."""


@functools.partial(jax.jit, static_argnums=0)
def classifier_batch(
    config: ModelConfig, x: jax.Array, count: jax.Array, rms_final_weight: jax.Array, wcls
) -> jax.Array:
    """Logits f32[B, vocab_size] for the B rows of x (f32[B, dim]), as `classifier` per row."""
    with jax.named_scope("classifier_batch"):
        return batched.matvec_batch(wcls, x, count, norm=rms_final_weight, eps=config.norm_eps)
