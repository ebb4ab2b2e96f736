"""Transformer weights in two layouts.

`TransformerWeights` is the layout of llama2.c checkpoint files: every per-layer tensor stacked
on a leading `n_layers` axis, matrices row-major with one row per output ("out x in", which is
how run.c's `matmul(xout, x, w, n, d)` reads them: `xout[i] = sum_j w[i, j] * x[j]`).

`GraphWeights` is the layout the compiled JAX programs take: one `LayerWeights` per layer, each
holding its own separate arrays, with wq/wk/wv stacked into one `wqkv` matrix (as the
CHICKEN Scheme `llama` egg's `transformer-weights->am-weights` and gpt-fast's fused QKV).
Separate per-layer arrays matter on XLA CPU: slicing a layer out of a stacked array inside a
compiled program makes XLA copy the whole matrix before the dot (measured in JAX 0.10: a
5632x2048 matrix-vector product fell from 20.5 to 4.3 GB/s).

Both are frozen dataclasses, registered as JAX pytrees by `jllama.model.pytrees` (which the JAX code
imports), so this module imports no JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.model.tensor_stats import TensorStats, tensor_stats  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class TransformerWeights:
    """All weights of a model in llama2.c's file layout (row-major, out x in).

    Shapes (L = n_layers, all float32 as read from a llama2.c file):
      token_embedding_table: [vocab_size, dim]
      rms_att_weight: [L, dim]          attention RMSNorm gains
      wq: [L, q_dim, dim]               q_dim = n_heads * head_dim
      wk: [L, kv_dim, dim]              kv_dim = n_kv_heads * head_dim
      wv: [L, kv_dim, dim]
      wo: [L, dim, q_dim]
      rms_ffn_weight: [L, dim]          feed-forward RMSNorm gains
      w1: [L, hidden_dim, dim]          SwiGLU gate projection
      w2: [L, dim, hidden_dim]          SwiGLU down projection
      w3: [L, hidden_dim, dim]          SwiGLU up projection
      rms_final_weight: [dim]
      wcls: [vocab_size, dim]           classifier; the same array as token_embedding_table
                                        when the config's shared_weights is True
      bq: [L, q_dim], bk, bv: [L, kv_dim]   the q/k/v projections' biases when the config's
                                        qkv_bias is True (Qwen2), else None; bq and bk in the
                                        rows' order (permuted with wq / wk for RoPE's pairs)
      q_norm, k_norm: [L, head_dim]     the per-head RMSNorm gains of queries and keys when the
                                        config's qk_norm is True (Qwen3), else None; in the
                                        order of a head's rows (permuted with wq / wk)
      ffn_gate_inp: f32[L, n_experts, dim]  the MoE router (Qwen3-MoE's mlp.gate) when the
                                        config's n_experts > 0, else None; then w1, w3 are
                                        [L, n_experts, hidden_dim, dim] and w2 is
                                        [L, n_experts, dim, hidden_dim]: expert e's matrices
                                        at [l, e] (hidden_dim = one expert's width)
    """

    token_embedding_table: np.ndarray
    rms_att_weight: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    rms_ffn_weight: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray
    rms_final_weight: np.ndarray
    wcls: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    ffn_gate_inp: np.ndarray | None = None


OPTIONAL_FIELDS = ("bq", "bk", "bv", "q_norm", "k_norm", "ffn_gate_inp")
"""`TransformerWeights` fields a config may leave None (llama2.c models have none of them)."""

GAINS = ("rms_att_weight", "rms_ffn_weight", "rms_final_weight", "q_norm", "k_norm")
"""The RMSNorm gains: float32 in every layout (never quantized)."""

VECTORS = GAINS + ("bq", "bk", "bv")
"""The fields that are vectors per layer (gains and biases): float32, never quantized."""

FLOAT32_FIELDS = VECTORS + ("ffn_gate_inp",)
"""The fields held as float32 whatever the matrices' dtype: the vectors and the MoE router
(llama-quantize keeps ffn_gate_inp in F32 too; the routing is decided by its logits)."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every `TransformerWeights` field for `config`, in llama2.c file order."""
    c = config
    L = c.n_layers
    E = (c.n_experts,) if c.moe else ()  # the experts' axis of w1, w2, w3
    return {
        "token_embedding_table": (c.vocab_size, c.dim),
        "rms_att_weight": (L, c.dim),
        "wq": (L, c.q_dim, c.dim),
        "wk": (L, c.kv_dim, c.dim),
        "wv": (L, c.kv_dim, c.dim),
        "wo": (L, c.dim, c.q_dim),
        "rms_ffn_weight": (L, c.dim),
        "w1": (L, *E, c.hidden_dim, c.dim),
        "w2": (L, *E, c.dim, c.hidden_dim),
        "w3": (L, *E, c.hidden_dim, c.dim),
        "rms_final_weight": (c.dim,),
        "wcls": (c.vocab_size, c.dim),
        **({"bq": (L, c.q_dim), "bk": (L, c.kv_dim), "bv": (L, c.kv_dim)} if c.qkv_bias else {}),
        **({"q_norm": (L, c.head_dim), "k_norm": (L, c.head_dim)} if c.qk_norm else {}),
        **({"ffn_gate_inp": (L, c.n_experts, c.dim)} if c.moe else {}),
    }


def check_shapes(config: ModelConfig, weights: TransformerWeights) -> None:
    """Raise ConfigError naming the first field whose shape does not fit `config` (an optional
    field the config does not use must be None)."""
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        value = getattr(weights, name)
        actual = None if value is None else tuple(np.shape(value))
        if actual != shape:
            raise ConfigError(f"weights.{name} has shape {actual}, expected {shape} for {config}")
    for name in OPTIONAL_FIELDS:
        if name not in shapes and getattr(weights, name) is not None:
            raise ConfigError(f"weights.{name} is given but the config does not use it ({config})")


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.02) -> TransformerWeights:
    """Random float32 weights for `config` (normal(0, scale) matrices, RMSNorm gains near 1).

    For tests and benchmarks: the model is meaningless but every code path is exercised.
    When `config.shared_weights` is True, `wcls` is the embedding table itself.
    """
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in expected_shapes(config).items():
        if name in GAINS:
            arrays[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arrays[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    if config.shared_weights:
        arrays["wcls"] = arrays["token_embedding_table"]
    return TransformerWeights(**arrays)


DTYPES = ("float32", "bfloat16", "int8", "q4")
"""Weight dtypes a model can be held in (`cast_weights`, the CLI's --dtype). int8 is
`jllama.model.quant.Int8Matrix`: int8 values with one float32 scale per row (GGML weights: Q8_0
blocks); q4 is GGML's Q4_0 blocks (`jllama.model.ggml_matrix`)."""

Q4_TYPE = 2
"""The GGML type --dtype=q4 quantizes to (ggml_quants.Q4_0)."""

Q4_KEEP = frozenset({2, 3, 6, 7, 10, 11, 12, 13})
"""GGML types --dtype=q4 keeps as they are: 6 bits a weight or fewer (Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K). Quantizing those to Q4_0 again costs far more than their bytes save:
SmolLM2's Q4_K_M file (mostly Q5_0) went from perplexity 21.9 to 33.9 that way (4 chunks of
512 tokens), against 25.7 for Q4_0 made from its float32 weights."""

_MATRICES = ("token_embedding_table", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wcls")


def matrix_kinds(matrix) -> set[str]:
    """What a weight matrix is held as: {"float32"}, {"bfloat16"}, {"int8"} (`Int8Matrix`), or
    the GGML types of its blocks, e.g. {"Q4_K", "Q6_K"}."""
    from jllama.model.ggml_matrix import is_ggml, type_names

    if is_ggml(matrix):
        return type_names(matrix)
    return {np.dtype(matrix.dtype).name}


def weights_dtype(weights: TransformerWeights) -> str:
    """The dtype name of the weight matrices ("float32", "bfloat16", "int8", or GGML types such
    as "Q4_K" or "Q4_K+Q5_0+Q6_K+Q8_0" when several are held). RMSNorm gains are float32 in
    every layout and do not count."""
    names = set().union(*(matrix_kinds(getattr(weights, f)) for f in _MATRICES))
    return "+".join(sorted(names))


def weights_nbytes(weights: TransformerWeights) -> int:
    """Bytes the weights occupy (a classifier shared with the embedding counted once)."""
    seen, total = set(), 0
    for field in dataclasses.fields(weights):
        array = getattr(weights, field.name)
        if array is not None and id(array) not in seen:
            seen.add(id(array))
            total += array.nbytes
    return total


def cast_weights(weights: TransformerWeights, dtype: str) -> TransformerWeights:
    """The weight matrices converted to `dtype` ("float32", "bfloat16", "int8" or "q4");
    RMSNorm gains stay float32. A shared classifier stays the same array as the embedding.
    Arrays already of `dtype` are kept (no copy).

    Widening bfloat16 to float32 is exact; narrowing rounds to nearest even (as
    `ml_dtypes.bfloat16` and torch's `.to(torch.bfloat16)` do). GGML blocks
    (`jllama.model.ggml_matrix`) to a float dtype dequantize exactly.

    "int8": a float matrix is quantized row by row (`jllama.model.quant.quantize_int8`: error at most
    half a row's step); a GGML one becomes Q8_0 blocks (a GGUF's Q8_0 as stored, Q4_0 exactly,
    other types quantized from their exact values by ggml's reference Q8_0 quantizer,
    `jllama.model.ggml_matrix.quantize`). int8 to a float dtype dequantizes.

    "q4": every matrix becomes Q4_0 blocks (`Q4_TYPE`, ggml's reference quantizer), except GGML
    types of 6 bits a weight or fewer (`Q4_KEEP`), which stay as stored, matrices whose rows
    are not a multiple of 32 long, which stay as they are (llama.cpp's fallback for such
    tensors), and the classifier (with the embedding when they are one matrix), which becomes
    Q8_0 unless it is already a GGML type of at most 8.5 bits a weight (llama.cpp's quantizer
    keeps output.weight wider too).

    Raises:
      ConfigError: an unknown dtype name.
      CheckpointError: a matrix to quantize holds NaN or infinite values (one line naming it).
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    shared = weights.wcls is weights.token_embedding_table
    changes = {}
    for name in _MATRICES:
        if name == "wcls" and shared:
            continue
        array = getattr(weights, name)
        # q4 keeps the classifier (and the embedding it is tied to) at 8 bits, as llama.cpp's
        # quantizer keeps output.weight above the rest: 4-bit there took SmolLM2's perplexity
        # from 23.9 to 26.9 (bench/NOTES.md).
        kind = "int8q8" if dtype == "q4" and name in ("token_embedding_table", "wcls") else dtype
        try:
            changed = _cast_matrix(array, kind)
        except ValueError as e:  # the quantizers refuse non-finite weights
            raise CheckpointError(
                f"weights.{name} cannot be held as {dtype}: {e} (see --verify_checkpoint)"
            ) from None
        if changed is not array:
            changes[name] = changed
    if shared and "token_embedding_table" in changes:
        changes["wcls"] = changes["token_embedding_table"]
    return dataclasses.replace(weights, **changes) if changes else weights


def _cast_matrix(array, dtype: str):
    """One weight matrix (or layer stack) in `dtype` (rules in `cast_weights`); the same object
    when it already is."""
    import ml_dtypes

    from jllama.formats import ggml_quants as gq
    from jllama.model.ggml_matrix import GGMLMatrix, LayerStack, is_ggml, q4_0_as_q8_0, quantize
    from jllama.model.quant import quantize_int8

    kinds = matrix_kinds(array)
    if dtype in ("float32", "bfloat16"):
        if kinds == {dtype}:
            return array
        target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        return np.asarray(array).astype(target)

    def blocks(m, type_id, keep):
        """A GGMLMatrix (or float matrix) as blocks of `type_id`, types in `keep` as they are;
        rows whose length is not a multiple of 32 stay as they are."""
        if isinstance(m, GGMLMatrix) and m.type_id in keep:
            return m
        if isinstance(m, GGMLMatrix) and m.type_id == gq.Q4_0 and type_id == gq.Q8_0:
            return q4_0_as_q8_0(m)  # exact
        if m.shape[-1] % 32:
            return m
        return quantize(np.asarray(m, dtype=np.float32), type_id)

    if dtype == "int8q8":  # 8-bit blocks for q4's classifier: types of 8.5 bits or fewer kept
        keep = {gq.Q8_0, *Q4_KEEP, gq.Q5_0, gq.Q5_1, gq.Q4_K, gq.Q5_K, gq.Q6_K}
        if isinstance(array, LayerStack):
            return LayerStack(tuple(blocks(m, gq.Q8_0, keep) for m in array.layers))
        return blocks(array, gq.Q8_0, keep)
    if dtype == "int8":
        if not is_ggml(array):
            return array if kinds == {"int8"} else quantize_int8(array)
        keep = {gq.Q8_0}
        if isinstance(array, LayerStack):
            return LayerStack(tuple(blocks(m, gq.Q8_0, keep) for m in array.layers))
        return blocks(array, gq.Q8_0, keep)
    # q4
    if isinstance(array, LayerStack):
        return LayerStack(tuple(blocks(m, Q4_TYPE, Q4_KEEP) for m in array.layers))
    return blocks(array, Q4_TYPE, Q4_KEEP)


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer's weights in the compiled programs' layout (out x in).

    Shapes:
      rms_att_weight: [dim]
      wqkv: [q_dim + 2 * kv_dim, dim]   rows: wq's, then wk's, then wv's
      wo: [dim, q_dim]
      rms_ffn_weight: [dim]
      w1: [hidden_dim, dim]
      w2: [dim, hidden_dim]
      w3: [hidden_dim, dim]
      bqkv: f32[q_dim + 2 * kv_dim]     bq, bk, bv end to end, wqkv's row order (None: no bias)
      q_norm, k_norm: f32[head_dim]     per-head q / k RMSNorm gains (None: no q/k norm)
      gate_inp: f32[n_experts, dim]     the MoE router (None: a dense FFN); then w1, w3 are
                                        [n_experts, hidden_dim, dim], w2 [n_experts, dim,
                                        hidden_dim] (the MoE step reads them expert by expert)
    """

    rms_att_weight: np.ndarray
    wqkv: np.ndarray
    wo: np.ndarray
    rms_ffn_weight: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray
    bqkv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    gate_inp: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class GraphWeights:
    """The whole model in the compiled programs' layout.

    Attributes:
      token_embedding_table: [vocab_size, dim], kept where it was (a host array is fine: the
        embedding lookup is one row per token).
      layers: one `LayerWeights` per layer, each with its own arrays.
      rms_final_weight: [dim]
      wcls: [vocab_size, dim]
    """

    token_embedding_table: np.ndarray
    layers: tuple[LayerWeights, ...]
    rms_final_weight: np.ndarray
    wcls: np.ndarray


def to_graph_weights(weights: TransformerWeights) -> GraphWeights:
    """Convert file-layout weights to the per-layer layout, on the host (NumPy).

    The egg's `transformer-weights->am-weights`: splits the stacked tensors into per-layer
    arrays and stacks wq, wk, wv of each layer into one `wqkv` matrix, so the QKV projection
    is a single matrix-vector product. Only `wqkv` is new memory; the other per-layer arrays
    are views of the stacked ones (a layer of a C-contiguous stack is contiguous), so putting
    the result on a device copies each weight once.
    """
    n_layers = weights.rms_att_weight.shape[0]
    layers = tuple(
        LayerWeights(
            rms_att_weight=weights.rms_att_weight[l],
            wqkv=_stack_rows([weights.wq[l], weights.wk[l], weights.wv[l]]),
            wo=weights.wo[l],
            rms_ffn_weight=weights.rms_ffn_weight[l],
            w1=weights.w1[l],
            w2=weights.w2[l],
            w3=weights.w3[l],
            **layer_vectors(weights, l),
        )
        for l in range(n_layers)
    )
    return GraphWeights(
        token_embedding_table=weights.token_embedding_table,
        layers=layers,
        rms_final_weight=weights.rms_final_weight,
        wcls=weights.wcls,
    )


def layer_vectors(weights: TransformerWeights, layer: int) -> dict[str, np.ndarray]:
    """Layer `layer`'s `LayerWeights` fields beyond llama2.c's, as keyword arguments: bqkv
    (bq, bk, bv end to end, f32) and q_norm / k_norm (f32[head_dim]) where the weights have
    them; {} for a Llama model."""
    out = {}
    if weights.bq is not None:
        out["bqkv"] = np.concatenate(
            [np.asarray(weights.bq[layer]), np.asarray(weights.bk[layer]),
             np.asarray(weights.bv[layer])]
        ).astype(np.float32)
    if weights.q_norm is not None:
        out["q_norm"] = np.asarray(weights.q_norm[layer], np.float32)
        out["k_norm"] = np.asarray(weights.k_norm[layer], np.float32)
    if weights.ffn_gate_inp is not None:
        out["gate_inp"] = np.asarray(weights.ffn_gate_inp[layer], np.float32)
    return out


def _stack_rows(matrices):
    from jllama.model.ggml_matrix import from_float, is_ggml, stack_rows
    from jllama.model.quant import Int8Matrix, concatenate_rows

    if all(isinstance(m, Int8Matrix) for m in matrices):
        return concatenate_rows(matrices)
    if any(is_ggml(m) for m in matrices):
        return stack_rows([m if is_ggml(m) else from_float(m) for m in matrices])
    return np.concatenate([np.asarray(m) for m in matrices], axis=0)
