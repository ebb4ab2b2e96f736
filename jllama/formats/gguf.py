"""GGUF files (llama.cpp's model format, version 2 and 3) of the `llama` architecture.

The container is parsed by `jllama.formats.gguf_header` (memory-mapped; the `gguf` package's
GGUFReader gives the same values and views, 50 times slower on a 49152-token vocabulary);
this module maps its metadata to a `ModelConfig` and its tensors to `TransformerWeights`,
dequantizing each tensor to float32 with `jllama.formats.ggml_quants`.

Metadata keys read (prefix `llama.`, as llama.cpp's `llm_load_hparams` for LLM_ARCH_LLAMA):
  embedding_length -> dim, feed_forward_length -> hidden_dim, block_count -> n_layers,
  attention.head_count -> n_heads, attention.head_count_kv -> n_kv_heads (default n_heads),
  attention.key_length -> head_dim (default dim // n_heads; value_length must agree),
  context_length -> seq_len (capped by the caller's `seq_len`),
  attention.layer_norm_rms_epsilon -> norm_eps, rope.freq_base -> rope_theta (default 10000),
  rope.dimension_count (must be head_dim: partial rotary embeddings are not supported),
  vocab_size (default: the tokenizer's token count).
RoPE scaling, as llama.cpp reads it (`llama_model::load_hparams`, `llama_context`'s cparams,
ggml's rope):
  rope.scaling.type (default "linear", llama.cpp's default): "none" (no scaling whatever the
    factor), "linear", or "yarn"/"longrope" (refused: not implemented);
  rope.scaling.factor (else the older rope.scale_linear; default 0, which means 1): every
    frequency divided by it (llama.cpp's freq_scale = 1 / factor);
  rope.scaling.attn_factor: must be 1 if present (llama.cpp multiplies cos and sin by it;
    jllama does not); rope.scaling.original_context_length, .finetuned and the yarn_* keys
    change nothing outside YaRN and are only type-checked;
  tensor rope_freqs.weight (Llama 3.1/3.2, written by convert_hf_to_gguf.py's
    `LlamaModel.generate_extra_tensors` in place of any rope.scaling key): F32[head_dim / 2],
    frequency i divided by rope_freqs[i], each factor finite and > 0. It makes a
    "freq_factors" `RopeScaling` carrying the factors (and the linear factor on top, if any).

Tensor names (llama.cpp's `LLM_TENSOR_NAMES`) and where they go:
  token_embd.weight -> token_embedding_table   output_norm.weight -> rms_final_weight
  output.weight -> wcls (absent: tied to the embedding, shared_weights=True)
  blk.N.attn_norm.weight -> rms_att_weight[N]  blk.N.ffn_norm.weight -> rms_ffn_weight[N]
  blk.N.attn_q/attn_k/attn_v/attn_output.weight -> wq/wk/wv/wo[N]
  blk.N.ffn_gate/ffn_down/ffn_up.weight -> w1/w2/w3[N]
GGUF lists dimensions innermost first (`ne`), so a tensor with ne = [dim, q_dim] is the
row-major matrix f32[q_dim, dim] (out x in), llama2.c's orientation.

RoPE layout: llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) stores the
rows of attn_q and attn_k in the original Meta order, where RoPE rotates adjacent pairs
(x[2i], x[2i+1]) (llama.cpp's LLAMA_ROPE_TYPE_NORM). That is exactly the pairing of llama2.c's
run.c that every jllama backend implements, so those rows are taken as stored: the one forward
pass needs no permutation for GGUF (Hugging Face checkpoints, stored for the rotate-half
layout, are the ones that need it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jllama.config import ModelConfig, RopeScaling
from jllama.errors import CheckpointError, ConfigError, TokenizerError
from jllama.files import require_regular_file
from jllama.formats import ggml_quants
from jllama.weights import TransformerWeights, expected_shapes

_MATRIX_FIELDS = frozenset(
    {"token_embedding_table", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wcls"}
)

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""

_LAYER_TENSORS = {
    "attn_norm": "rms_att_weight",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "rms_ffn_weight",
    "ffn_gate": "w1",
    "ffn_down": "w2",
    "ffn_up": "w3",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "token_embedding_table",
    "output_norm.weight": "rms_final_weight",
    "output.weight": "wcls",
}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file at `path` starts with the GGUF magic (False if it cannot be read, or
    is not a regular file: opening a FIFO would block)."""
    try:
        if not Path(path).is_file():
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds for jllama.

    Attributes:
      config: the model's hyperparameters (seq_len possibly capped by the reader's caller).
      weights: `TransformerWeights`, f32, dequantized (wcls is token_embedding_table when tied).
      tokenizer: the vocabulary (`jllama.tokenizers.gguf.tokenizer_from_gguf`).
      chat_template: the jinja source of `tokenizer.chat_template`, or None.
      tensor_types: {tensor name: GGML type name} as stored, e.g. {"blk.0.attn_q.weight": "Q4_1"}.
      context_length: the context the model was trained for (`llama.context_length`), tokens.
      metadata: every metadata key with its value (arrays as lists), for inspection.
      source: the file's path.
    """

    config: ModelConfig
    weights: TransformerWeights
    tokenizer: Any
    chat_template: str | None
    tensor_types: dict[str, str]
    context_length: int
    metadata: dict[str, Any]
    source: str


def _open(path: Path):
    from jllama.formats.gguf_header import read_header

    require_regular_file(path, "checkpoint", CheckpointError)
    if not is_gguf(path):
        raise CheckpointError(f"{path}: not a GGUF file (no 'GGUF' magic)")
    try:
        return read_header(path)
    except Exception as e:  # ValueError on bad data; numpy's errors from a damaged tensor table
        size = path.stat().st_size
        detail = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, ValueError) and ("reshape" in detail or "dtype" in detail):
            # numpy's words for a tensor whose data runs past the end of the file
            detail = "its tensor data runs past the end of the file"
        raise CheckpointError(
            f"{path}: truncated or malformed GGUF file ({size} bytes): {detail}"
        ) from None


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata field as plain Python values, of what `_open` returns (a
    `gguf_header.GGUFHeader`) or of an open `gguf.GGUFReader`."""
    if hasattr(reader, "metadata"):
        return dict(reader.metadata)
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as e:
            raise CheckpointError(f"metadata key {key!r} cannot be read ({e})") from None
    return out


def _get(meta: Mapping[str, Any], key: str, source: str, kind: type, default: Any = ...):
    if key not in meta:
        if default is ...:
            raise CheckpointError(f"{source}: required metadata key {key!r} is missing")
        return default
    value = meta[key]
    if kind is int:
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise CheckpointError(
            f"{source}: metadata key {key!r} is {value!r}, not a{'n' if kind is int else ''} "
            f"{kind.__name__}"
        )
    return kind(value)


def config_from_metadata(
    meta: Mapping[str, Any], source: str, seq_len: int | None = None, vocab_size: int | None = None
) -> ModelConfig:
    """`ModelConfig` of a llama-architecture GGUF's metadata (keys in the module docstring).

    Args:
      meta: metadata keys to values, as `read_metadata` gives.
      source: the file, for error messages.
      seq_len: cap on the context (tokens); None = the model's `context_length`.
      vocab_size: the token count when the file has no `llama.vocab_size`.

    Raises:
      CheckpointError: not the llama architecture, a required key missing or of the wrong
        type, or a feature jllama does not implement (partial rotary, YaRN or LongRoPE
        scaling, a RoPE attn_factor).
      ConfigError: values that do not make a valid model.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{source}: architecture {arch!r} is not supported (jllama runs 'llama' GGUF files)"
        )
    p = "llama."
    dim = _get(meta, p + "embedding_length", source, int)
    n_heads = _get(meta, p + "attention.head_count", source, int)
    n_kv_heads = _get(meta, p + "attention.head_count_kv", source, int, n_heads)
    head_dim = _get(meta, p + "attention.key_length", source, int, 0)
    value_length = _get(meta, p + "attention.value_length", source, int, head_dim)
    if value_length != head_dim:
        raise CheckpointError(
            f"{source}: attention.key_length={head_dim} differs from "
            f"attention.value_length={value_length}; jllama needs them equal"
        )
    if not head_dim and n_heads > 0 and dim % n_heads == 0:
        head_dim = dim // n_heads
    rope_dims = _get(meta, p + "rope.dimension_count", source, int, head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{source}: rope.dimension_count={rope_dims} differs from head_dim={head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    rope_scaling = _rope_scaling(meta, source)
    context_length = _get(meta, p + "context_length", source, int)
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if isinstance(tokens, list) else None
    vocab_size = _get(meta, p + "vocab_size", source, int, vocab_size)
    if vocab_size is None:
        raise CheckpointError(
            f"{source}: neither llama.vocab_size nor tokenizer.ggml.tokens gives the vocab size"
        )
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1")
    try:
        return ModelConfig(
            dim=dim,
            hidden_dim=_get(meta, p + "feed_forward_length", source, int),
            n_layers=_get(meta, p + "block_count", source, int),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            seq_len=min(context_length, seq_len) if seq_len else context_length,
            shared_weights=True,
            norm_eps=_get(meta, p + "attention.layer_norm_rms_epsilon", source, float),
            rope_theta=_get(meta, p + "rope.freq_base", source, float, 10000.0),
            head_dim=head_dim,
            rope_scaling=rope_scaling,
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
"""The `rope.scaling.type` values llama.cpp knows (`LLAMA_ROPE_SCALING_TYPES`)."""

ROPE_FREQS = "rope_freqs.weight"
"""The tensor of llama.cpp's per-frequency RoPE divisors (Llama 3.1/3.2 scaled RoPE)."""


def _rope_scaling(meta: Mapping[str, Any], source: str) -> RopeScaling | None:
    """The linear RoPE scaling of `llama.rope.scaling.*` (rules in the module docstring), or
    None. The per-frequency factors of rope_freqs.weight are added later (`with_rope_freqs`)."""
    p = "llama.rope."
    kind = _get(meta, p + "scaling.type", source, str, "linear")
    if kind not in _ROPE_SCALING_TYPES:
        raise CheckpointError(
            f"{source}: {p}scaling.type={kind!r} is not a RoPE scaling type llama.cpp knows "
            f"({', '.join(_ROPE_SCALING_TYPES)})"
        )
    if kind in ("yarn", "longrope"):
        raise CheckpointError(
            f"{source}: {p}scaling.type={kind!r} is not supported (supported: none, linear, "
            "and Llama 3's rope_freqs tensor)"
        )
    for key, kind_of in (("scaling.original_context_length", int), ("scaling.finetuned", bool),
                         ("scaling.yarn_log_multiplier", float), ("scaling.yarn_ext_factor", float),
                         ("scaling.yarn_attn_factor", float), ("scaling.yarn_beta_fast", float),
                         ("scaling.yarn_beta_slow", float)):
        _get(meta, p + key, source, kind_of, None)
    attn_factor = _get(meta, p + "scaling.attn_factor", source, float, 1.0)
    if attn_factor != 1.0:
        raise CheckpointError(
            f"{source}: {p}scaling.attn_factor={attn_factor} is not supported (jllama does not "
            "scale RoPE's cos and sin; only 1.0 is)"
        )
    key = p + "scaling.factor" if p + "scaling.factor" in meta else p + "scale_linear"
    factor = _get(meta, key, source, float, 0.0)
    if not np.isfinite(factor) or factor < 0:
        raise CheckpointError(f"{source}: {key}={factor} must be finite and not negative")
    if kind == "none" or factor in (0.0, 1.0):  # llama.cpp: factor 0 means freq_scale 1
        return None
    return RopeScaling("linear", factor)


def with_rope_freqs(config: ModelConfig, tensor, source: str) -> ModelConfig:
    """`config` with the per-frequency RoPE factors of a GGUF's rope_freqs.weight tensor.

    Args:
      config: the model's config from `config_from_metadata` (its linear factor, if any, is
        kept and applied on top of the factors, as llama.cpp does).
      tensor: the `gguf.ReaderTensor` named rope_freqs.weight: F32[head_dim / 2].
      source: the file, for error messages.

    Raises:
      CheckpointError: not F32, not head_dim / 2 values, or a factor that is not finite and
        positive; one line naming the tensor.
    """
    what = f"{source}: tensor {ROPE_FREQS!r}"
    type_id = int(tensor.tensor_type)
    if type_id != ggml_quants.F32:
        raise CheckpointError(
            f"{what} is {ggml_quants.type_name(type_id)}; llama.cpp's RoPE factors must be F32"
        )
    shape = [int(n) for n in reversed(tensor.shape.tolist())]
    want = config.head_dim // 2
    if shape != [want]:
        raise CheckpointError(
            f"{what} has shape {shape}, expected [{want}] (one factor per rotated pair of "
            f"head_dim={config.head_dim})"
        )
    factors = np.asarray(tensor.data, np.float32).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise CheckpointError(
            f"{what}: factor [{int(bad[0])}] is {float(factors[bad[0]])}; RoPE factors must be "
            "finite and positive"
        )
    linear = config.rope_scaling.factor if config.rope_scaling is not None else 1.0
    scaling = RopeScaling("freq_factors", linear, freq_factors=tuple(factors.tolist()))
    return dataclasses.replace(config, rope_scaling=scaling)


def _tensor_target(name: str, n_layers: int) -> tuple[str, int | None] | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[1].isdigit():
        layer = int(parts[1])
        field = _LAYER_TENSORS.get(parts[2])
        if field is not None and layer < n_layers:
            return field, layer
    return None


def read_gguf(
    path: str | os.PathLike, seq_len: int | None = None, stored: bool = False
) -> GGUFModel:
    """Read a llama-architecture GGUF file: config, weights, tokenizer, chat template.

    Args:
      path: the .gguf file.
      seq_len: cap on the context the KV cache is sized for (tokens); None = the model's
        `llama.context_length`.
      stored: keep the weights as the file stores them: each quantized (and F16) weight matrix
        as GGML blocks, `jllama.ggml_matrix.GGMLMatrix` (a [vocab_size, dim] table) or
        `LayerStack` (a matrix per layer, each in its own type), views of the memory-mapped
        file, nothing converted; BF16 as bfloat16, F32 as float32. False: every tensor
        dequantized to float32.

    Returns:
      a `GGUFModel`. Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
      Q6_K) and F16/BF16 read to float32 are dequantized block by block, exactly as ggml's
      reference dequantizers; other types (IQ*, TQ*, MXFP4 ...) are refused.

    Raises:
      CheckpointError: missing/unreadable/truncated file, not GGUF, another architecture, a
        missing metadata key or tensor, a tensor of the wrong shape, an unsupported tensor type
        (the message names the tensor and the type), or an unexpected tensor.
      TokenizerError: missing or malformed tokenizer metadata.
      ConfigError: metadata that does not make a valid model.
    """
    from jllama.tokenizers.gguf import tokenizer_from_gguf

    path = Path(path)
    source = str(path)
    reader = _open(path)
    meta = read_metadata(reader)
    config = config_from_metadata(meta, source, seq_len=seq_len)
    tokenizer = tokenizer_from_gguf(meta, source)
    if tokenizer.vocab_size != config.vocab_size:
        raise TokenizerError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but llama.vocab_size is "
            f"{config.vocab_size}"
        )

    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            config = with_rope_freqs(config, tensor, source)
            continue
        target = _tensor_target(tensor.name, config.n_layers)
        if target is None:
            raise CheckpointError(
                f"{source}: unexpected tensor {tensor.name!r} (not part of a llama model)"
            )
        if tensor.name in tensors:
            raise CheckpointError(f"{source}: tensor {tensor.name!r} appears twice")
        tensors[tensor.name] = (tensor, target)

    shared = "output.weight" not in tensors
    if not shared:
        config = dataclasses.replace(config, shared_weights=False)
    shapes = expected_shapes(config)
    # Per field: the tensor of each layer (or the one global tensor, at key None).
    by_field: dict[str, dict[int | None, Any]] = {}
    tensor_types = {}
    for name, (tensor, (field, layer)) in tensors.items():
        want = shapes[field] if layer is None else shapes[field][1:]
        got = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if got != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(got)}, expected {list(want)} "
                "(row-major, out x in)"
            )
        type_id = int(tensor.tensor_type)
        tensor_types[name] = ggml_quants.type_name(type_id)
        try:  # the block-size and byte-count checks, for every type
            ggml_quants.block_layout(type_id)
            ggml_quants.row_nbytes(type_id, want[-1])
        except CheckpointError as e:
            raise CheckpointError(f"{source}: tensor {name!r}: {e}") from None
        by_field.setdefault(field, {})[layer] = (name, tensor, type_id, want)
    filled = {(field, layer) for field, layers in by_field.items() for layer in layers}

    missing = []
    for field in shapes:
        if field == "wcls" and shared:
            continue
        layers = [None] if field in _GLOBAL_TENSORS.values() else range(config.n_layers)
        for layer in layers:
            if (field, layer) not in filled:
                missing.append(_tensor_name(field, layer))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{source}: missing tensor {', '.join(missing[:3])}{more}")
    arrays = {field: _field_array(field, layers, shapes[field], stored, source)
              for field, layers in by_field.items()}
    if shared:
        arrays["wcls"] = arrays["token_embedding_table"]
    template = meta.get("tokenizer.chat_template")
    return GGUFModel(
        config=config,
        weights=TransformerWeights(**arrays),
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        tensor_types=tensor_types,
        context_length=int(meta["llama.context_length"]),
        metadata=meta,
        source=source,
    )


_FLOAT_TYPES = frozenset({ggml_quants.F32, ggml_quants.BF16})


def _field_array(field: str, layers: dict, shape: tuple[int, ...], stored: bool, source: str):
    """One `TransformerWeights` field from its tensors ({layer or None: (name, tensor, type_id,
    shape)}): float32 (dequantized), bfloat16, or GGML blocks as stored (see `read_gguf`)."""
    from jllama.ggml_matrix import GGMLMatrix, LayerStack

    types = {type_id for _, _, type_id, _ in layers.values()}
    keep_blocks = stored and field in _MATRIX_FIELDS and not types <= _FLOAT_TYPES
    keep_bf16 = stored and field in _MATRIX_FIELDS and types == {ggml_quants.BF16}

    def one(name, tensor, type_id, want):
        try:
            if keep_blocks:
                if type_id in _FLOAT_TYPES:  # a float layer among quantized ones: as its blocks
                    values = ggml_quants.dequantize(tensor.data, type_id, want)
                    return GGMLMatrix(values.view(np.uint8).reshape(want[0], -1),
                                      ggml_quants.F32, want[-1])
                raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
                return GGMLMatrix(raw.reshape(want[0], -1), type_id, want[-1])
            values = ggml_quants.dequantize(tensor.data, type_id, want)
            if keep_bf16:
                import ml_dtypes

                return np.asarray(tensor.data).reshape(-1).view(ml_dtypes.bfloat16).reshape(want)
            return values
        except (CheckpointError, ValueError) as e:
            raise CheckpointError(f"{source}: tensor {name!r}: {e}") from None

    if None in layers:
        return one(*layers[None])
    matrices = [one(*layers[l]) for l in range(len(layers))]
    if keep_blocks:
        return LayerStack(tuple(matrices))
    out = np.empty(shape, matrices[0].dtype)
    for l, m in enumerate(matrices):
        out[l] = m
    return out


def _tensor_name(field: str, layer: int | None) -> str:
    if layer is None:
        return next(k for k, v in _GLOBAL_TENSORS.items() if v == field)
    short = next(k for k, v in _LAYER_TENSORS.items() if v == field)
    return f"blk.{layer}.{short}.weight"
