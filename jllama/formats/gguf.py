"""GGUF files (llama.cpp's model format, version 2 and 3) of the `llama`, `qwen2` and `qwen3`
architectures.

The container is parsed by `jllama.formats.gguf_header` (memory-mapped; the `gguf` package's
GGUFReader gives the same values and views, 50 times slower on a 49152-token vocabulary);
this module maps its metadata to a `ModelConfig` and its tensors to `TransformerWeights`,
dequantizing each tensor to float32 with `jllama.formats.ggml_quants`.

The metadata keys read (and RoPE scaling) are `jllama.formats.gguf_config`'s.

Tensor names (llama.cpp's `LLM_TENSOR_NAMES`) and where they go:
  token_embd.weight -> token_embedding_table   output_norm.weight -> rms_final_weight
  output.weight -> wcls (absent: tied to the embedding, shared_weights=True)
  blk.N.attn_norm.weight -> rms_att_weight[N]  blk.N.ffn_norm.weight -> rms_ffn_weight[N]
  blk.N.attn_q/attn_k/attn_v/attn_output.weight -> wq/wk/wv/wo[N]
  blk.N.ffn_gate/ffn_down/ffn_up.weight -> w1/w2/w3[N]
  blk.N.attn_q/attn_k/attn_v.bias -> bq/bk/bv[N] (qwen2)
  blk.N.attn_q_norm/attn_k_norm.weight -> q_norm/k_norm[N] (qwen3, qwen3moe)
  blk.N.ffn_gate_inp.weight -> ffn_gate_inp[N] (qwen3moe's router, float32)
  blk.N.ffn_gate_exps/ffn_down_exps/ffn_up_exps.weight -> w1/w2/w3[N] (qwen3moe: ne =
    [dim, hidden, n_experts], i.e. [n_experts, hidden_dim, dim]; each expert a contiguous
    matrix of the tensor, kept as stored with `stored=True`: a GGMLMatrix of
    u8[n_experts, rows, row_bytes])
GGUF lists dimensions innermost first (`ne`), so a tensor with ne = [dim, q_dim] is the
row-major matrix f32[q_dim, dim] (out x in), llama2.c's orientation.

RoPE layout: llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) stores the
rows of attn_q and attn_k in the original Meta order, where RoPE rotates adjacent pairs
(x[2i], x[2i+1]) (llama.cpp's LLAMA_ROPE_TYPE_NORM). That is exactly the pairing of llama2.c's
run.c that every jllama backend implements, so those rows are taken as stored: the one forward
pass needs no permutation for llama GGUF files (Hugging Face checkpoints, stored for the
rotate-half layout, are the ones that need it). The converter does not permute qwen2 and qwen3
models (llama.cpp rotates them with LLAMA_ROPE_TYPE_NEOX, rotate-half), so their q/k rows,
biases and norm gains are permuted at load as a Hugging Face folder's are
(`jllama.model.rope.rotate_half_to_pairs`; quantized rows are moved whole, not requantized).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from jllama.errors import CheckpointError, TokenizerError
from jllama.platform.files import require_regular_file
from jllama.formats import ggml_quants
from jllama.formats.base import ModelFile
from jllama.formats.gguf_config import (  # noqa: F401 (re-exported: names of this module)
    ROPE_FREQS,
    architecture,
    config_from_metadata,
    with_rope_freqs,
)
from jllama.formats.gguf_header import GGUFHeader, read_header
from jllama.formats.tensor_names import TensorNames
from jllama.model.rope import rotate_half_to_pairs
from jllama.model.weights import TransformerWeights, expected_shapes

_MATRIX_FIELDS = frozenset(
    {"token_embedding_table", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wcls"}
)

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""

TENSOR_NAMES = TensorNames(
    global_names={
        "token_embd.weight": "token_embedding_table",
        "output_norm.weight": "rms_final_weight",
        "output.weight": "wcls",
    },
    layer_names={
        "attn_norm": "rms_att_weight",
        "attn_q": "wq",
        "attn_k": "wk",
        "attn_v": "wv",
        "attn_output": "wo",
        "ffn_norm": "rms_ffn_weight",
        "ffn_gate": "w1",
        "ffn_down": "w2",
        "ffn_up": "w3",
        "attn_q.bias": "bq",
        "attn_k.bias": "bk",
        "attn_v.bias": "bv",
        "attn_q_norm": "q_norm",
        "attn_k_norm": "k_norm",
    },
    layer_prefix="blk.",
)
"""llama.cpp's `LLM_TENSOR_NAMES` for the llama, qwen2 (biases) and qwen3 (q/k norms)
architectures."""

MOE_TENSOR_NAMES = dataclasses.replace(
    TENSOR_NAMES,
    layer_names={
        **{k: v for k, v in TENSOR_NAMES.layer_names.items() if v not in ("w1", "w2", "w3")},
        "ffn_gate_inp": "ffn_gate_inp",
        "ffn_gate_exps": "w1",
        "ffn_down_exps": "w2",
        "ffn_up_exps": "w3",
    },
)
"""The qwen3moe architecture's names: the router and each layer's experts as 3-D tensors."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFModel(ModelFile):
    """What a GGUF file holds for jllama: `ModelFile`'s fields, where `weights` are float32
    (dequantized) or, with `read_gguf(stored=True)`, as the file stores them; `tokenizer` is
    the vocabulary (`jllama.tokenizers.gguf.tokenizer_from_gguf`); `chat_template` is
    `tokenizer.chat_template`; `context_length` is `{arch}.context_length` (`qwen3.` ...).
    And:

    Attributes:
      tensor_types: {tensor name: GGML type name} as stored, e.g. {"blk.0.attn_q.weight": "Q4_1"}.
      metadata: every metadata key with its value (arrays as lists), for inspection.
    """

    tensor_types: dict[str, str]
    metadata: dict[str, Any]


def _open(path: Path) -> GGUFHeader:
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
    if isinstance(reader, GGUFHeader):
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


def read_gguf(
    path: str | os.PathLike, seq_len: int | None = None, stored: bool = False
) -> GGUFModel:
    """Read a llama-, qwen2- or qwen3-architecture GGUF file: config, weights, tokenizer, chat
    template.

    Args:
      path: the .gguf file.
      seq_len: cap on the context the KV cache is sized for (tokens); None = the model's
        `{arch}.context_length`.
      stored: keep the weights as the file stores them: each quantized (and F16) weight matrix
        as GGML blocks, `jllama.model.ggml_matrix.GGMLMatrix` (a [vocab_size, dim] table) or
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
    arch, family = architecture(meta, source)
    tokenizer = tokenizer_from_gguf(meta, source)
    if tokenizer.vocab_size != config.vocab_size:
        raise TokenizerError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but {arch}.vocab_size is "
            f"{config.vocab_size}"
        )

    names = MOE_TENSOR_NAMES if family.moe else TENSOR_NAMES
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            config = with_rope_freqs(config, tensor, source)
            continue
        target = names.target(tensor.name, config.n_layers)
        if target is None or target[0] not in expected_shapes(config):
            raise CheckpointError(
                f"{source}: unexpected tensor {tensor.name!r} (not part of a {arch} model)"
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
    names.check_complete(config, filled, source)
    arrays = {field: _field_array(field, layers, shapes[field], stored, source)
              for field, layers in by_field.items()}
    if family.rotate_half:
        arrays = rotate_half_to_pairs(config, arrays)
    if shared:
        arrays["wcls"] = arrays["token_embedding_table"]
    template = meta.get("tokenizer.chat_template")
    return GGUFModel(
        config=config,
        weights=TransformerWeights(**arrays),
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        tensor_types=tensor_types,
        context_length=int(meta[f"{arch}.context_length"]),
        metadata=meta,
        source=source,
    )


_FLOAT_TYPES = frozenset({ggml_quants.F32, ggml_quants.BF16})


def _field_array(field: str, layers: dict, shape: tuple[int, ...], stored: bool, source: str):
    """One `TransformerWeights` field from its tensors ({layer or None: (name, tensor, type_id,
    shape)}): float32 (dequantized), bfloat16, or GGML blocks as stored (see `read_gguf`)."""
    from jllama.model.ggml_matrix import GGMLMatrix, LayerStack

    types = {type_id for _, _, type_id, _ in layers.values()}
    keep_blocks = stored and field in _MATRIX_FIELDS and not types <= _FLOAT_TYPES
    keep_bf16 = stored and field in _MATRIX_FIELDS and types == {ggml_quants.BF16}

    def one(name, tensor, type_id, want):
        try:
            if keep_blocks:
                if type_id in _FLOAT_TYPES:  # a float layer among quantized ones: as its blocks
                    values = ggml_quants.dequantize(tensor.data, type_id, want)
                    return GGMLMatrix(values.view(np.uint8).reshape(*want[:-1], -1),
                                      ggml_quants.F32, want[-1])
                raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
                return GGMLMatrix(raw.reshape(*want[:-1], -1), type_id, want[-1])
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
