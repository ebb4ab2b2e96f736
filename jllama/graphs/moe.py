"""The Mixture-of-Experts FFN of a decode step (Qwen3-MoE), in two compiled programs around a
routing decision on the host.

Per layer and token, after attention:

  1. `moe_router`: `x + wo @ att`, the FFN's RMSNorm `h`, and the router logits
     `gate_inp @ h` (f32[n_experts]);
  2. on the host, `jllama.backends.numpy_ref.route`: softmax, top-k, renormalised weights
     (transformers' `Qwen3MoeSparseMoeBlock`, llama.cpp's `build_moe_ffn`);
  3. `moe_experts` with the k routed experts' own matrices (each a contiguous slice of the
     file's 3-D tensor, kept as stored): `x + sum_i w2_i @ (silu(w1_i @ h) * (w3_i @ h) *
     weight_i)`.

So a token reads the router and its k experts' rows only, whatever n_experts is; every expert
has the same shapes and types, so `moe_experts` compiles once per layer kind. The routing runs
on the host because the choice decides which arrays a program is given (the step waits for
the router's n_experts floats once per layer).
"""

from __future__ import annotations

import functools

import jax

from jllama.graphs.ops import matmul, residual_matmul, residual_swiglu_matmul, rmsnorm
from jllama.model.config import ModelConfig
from jllama.model.ggml_matrix import RowStack, float_gate_up, gate_up


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def moe_router(
    config: ModelConfig,
    x: jax.Array,
    att: jax.Array,
    wo: jax.Array,
    rms_ffn_weight: jax.Array,
    gate_inp: jax.Array,
    *,
    matvec: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention output projection and residual, the FFN's RMSNorm and the router.

    Args:
      config: static.
      x: f32[dim], the residual stream entering the layer.
      att: f32[q_dim], the attention output.
      wo: [dim, q_dim] (any matrix kind `jllama.graphs.ops.matmul` takes);
      rms_ffn_weight: f32[dim]; gate_inp: f32[n_experts, dim] (out x in).
      matvec: static, "xla" or "kernel" (`jllama.graphs.ops.matmul`).

    Returns:
      (x f32[dim] after the attention residual, h f32[dim] = rmsnorm(x), router logits
      f32[n_experts]).
    """
    x = residual_matmul(x, wo, att, matvec)
    h = rmsnorm(x, rms_ffn_weight, config.norm_eps)
    return x, h, matmul(gate_inp, h, matvec)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("matvec",))
def moe_experts(
    config: ModelConfig,
    x: jax.Array,
    h: jax.Array,
    weights: jax.Array,
    w1: tuple,
    w2: tuple,
    w3: tuple,
    *,
    matvec: str = "xla",
) -> jax.Array:
    """The routed experts' SwiGLU outputs, weighted, added to the residual stream one after
    the other: `x + sum_i w2[i] @ (silu(w1[i] @ h) * (w3[i] @ h) * weights[i])` (a weight
    scales the hidden vector, which is the same as scaling the output; on the kernels it
    rides in the last product's call). One program call for the k experts.

    Args:
      config: static.
      x: f32[dim], the residual stream; h: f32[dim], the FFN's normalized input.
      weights: f32[k], the routing weights.
      w1, w3: k matrices [hidden_dim, dim]; w2: k matrices [dim, hidden_dim]: the routed
        experts' own (out x in), in the order of `weights`.
      matvec: static, "xla" or "kernel".

    Returns:
      f32[dim].
    """
    hidden, k = config.hidden_dim, len(w1)
    gates, ups = [None] * k, [None] * k
    if matvec == "kernel":
        pairs = [gate_up(w1[i], w3[i]) for i in range(k)]
        if all(p is not None and p.parts[0].repacked == pairs[0].parts[0].repacked
               for p in pairs):
            # GGML blocks: two experts' gate and up in one kernel call (a RowStack takes up
            # to 4 parts), h quantized once per call: half the calls of one per expert.
            for i in range(0, k, 2):
                parts = pairs[i].parts + (pairs[i + 1].parts if i + 1 < k else ())
                out = matmul(RowStack(parts), h, matvec)
                for j in range(len(parts) // 2):
                    rows = out[2 * j * hidden:(2 * j + 2) * hidden]
                    gates[i + j], ups[i + j] = rows[:hidden], rows[hidden:]
        else:
            for i in range(k):
                both = float_gate_up(w1[i], w3[i])
                if both is not None:  # one call for an expert's gate and up
                    out = matmul(both, h, matvec)
                    gates[i], ups[i] = out[:hidden], out[hidden:]
    for i in range(k):
        if gates[i] is None:
            gates[i], ups[i] = matmul(w1[i], h, matvec), matmul(w3[i], h, matvec)
        x = residual_swiglu_matmul(x, w2[i], gates[i], ups[i] * weights[i], matvec)
    return x


ROW_BUCKETS = (8, 32, 128, 256)
"""Row counts an expert's share of a prefill chunk is padded to (compiled shapes of
`moe_expert_rows`; capped at the chunk's size): a few programs serve every routing."""


def row_bucket(m: int, chunk: int) -> int:
    """The padded row count for m tokens routed to one expert out of a chunk of `chunk`."""
    return min(next((b for b in ROW_BUCKETS if b >= m), chunk), chunk)


@functools.partial(jax.jit, static_argnums=0)
def moe_router_chunk(
    config: ModelConfig, x: jax.Array, att: jax.Array, wo, rms_ffn_weight: jax.Array,
    gate_inp: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`moe_router` for a prefill chunk of T tokens (matrix-matrix products, as
    `jllama.graphs.prefill`'s programs): x: f32[T, dim], att: f32[T, q_dim] -> (x f32[T, dim]
    after the attention residual, h f32[T, dim] its RMSNorm, logits f32[T, n_experts])."""
    from jllama.graphs.prefill import _rmsnorm_rows, _rows_matmul

    x = x + _rows_matmul(att, wo)
    h = _rmsnorm_rows(x, rms_ffn_weight, config.norm_eps)
    return x, h, _rows_matmul(h, gate_inp)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def moe_expert_rows(
    config: ModelConfig, x: jax.Array, h: jax.Array, rows: jax.Array, weights: jax.Array,
    w1, w2, w3,
) -> jax.Array:
    """One expert over the tokens of a prefill chunk routed to it (prefill grouped by
    expert: its matrices read once for all of them): `x[rows[i]] += weights[i] * w2 @
    (silu(w1 @ h[rows[i]]) * (w3 @ h[rows[i]]))`.

    Args:
      config: static.
      x: f32[T, dim], the chunk's residual streams (donated); h: f32[T, dim], their FFN
        inputs (normalized).
      rows: int32[M], the chunk rows routed to this expert, padded (`row_bucket`) with any row
        of weight 0; weights: f32[M], their routing weights (0 for padding).
      w1, w3: [hidden_dim, dim]; w2: [dim, hidden_dim]: the expert's matrices.

    Returns:
      f32[T, dim].
    """
    from jllama.graphs.prefill import _rows_matmul

    hs = h[rows]
    both = gate_up(w1, w3)
    if both is not None:  # GGML blocks: one kernel call for gate and up
        out = _rows_matmul(hs, both)
        gate, up = out[:, : config.hidden_dim], out[:, config.hidden_dim :]
    else:
        gate, up = _rows_matmul(hs, w1), _rows_matmul(hs, w3)
    return x.at[rows].add(_rows_matmul(jax.nn.silu(gate) * up * weights[:, None], w2))
