"""Hugging Face Llama checkpoints: a folder with `config.json` and safetensors weights.

The folder is what `LlamaForCausalLM.save_pretrained(folder, safe_serialization=True)` writes:
`config.json`, then either one `model.safetensors` or shards named by
`model.safetensors.index.json` (its `weight_map`: tensor name -> shard file name), and, when the
tokenizer was saved too, `tokenizer_config.json` / `chat_template.jinja`.

config.json keys read (transformers' `LlamaConfig`; defaults are LlamaConfig's):
  architectures (must hold LlamaForCausalLM) / model_type (must be "llama"),
  hidden_size -> dim, intermediate_size -> hidden_dim, num_hidden_layers -> n_layers,
  num_attention_heads -> n_heads, num_key_value_heads -> n_kv_heads (default n_heads),
  vocab_size, head_dim (default dim // n_heads), rms_norm_eps -> norm_eps (default 1e-6),
  tie_word_embeddings -> shared_weights (default False),
  max_position_embeddings -> context length, and seq_len capped by the caller (default 2048),
  hidden_act (must be "silu"), attention_bias / mlp_bias (must be false),
  RoPE: `rope_scaling` (transformers 4) or else `rope_parameters` (transformers 5, which moved
  rope_theta into it). The type is `rope_type` (or the older `type`): "default"/absent is plain
  RoPE; "linear" needs `factor`; "llama3" needs `factor`, `low_freq_factor`,
  `high_freq_factor` and takes `original_max_position_embeddings` (default
  max_position_embeddings, as transformers' `standardize_rope_params`). rope_theta comes from
  the RoPE dict when it has one, else the top level, else 10000. Any other type ("yarn",
  "dynamic", "longrope", ...) and partial rotary embeddings are refused.

Tensor names (transformers' LlamaForCausalLM state dict) and where they go:
  model.embed_tokens.weight -> token_embedding_table   model.norm.weight -> rms_final_weight
  lm_head.weight -> wcls (absent, or tie_word_embeddings true: the embedding, shared_weights;
    a stored lm_head of a tied model is ignored, as transformers ties over it)
  model.layers.N.input_layernorm.weight -> rms_att_weight[N]
  model.layers.N.post_attention_layernorm.weight -> rms_ffn_weight[N]
  model.layers.N.self_attn.{q,k,v,o}_proj.weight -> wq/wk/wv/wo[N] (q, k permuted, below)
  model.layers.N.mlp.{gate,down,up}_proj.weight -> w1/w2/w3[N]
  model.layers.N.self_attn.rotary_emb.inv_freq (old transformers' buffer) is ignored: the
    frequencies come from config.json.
A torch Linear stores its weight as [out_features, in_features], llama2.c's out x in, so the
matrices are taken in that orientation.

RoPE layout: transformers' Llama applies RoPE in the "rotate-half" layout: within a head of
size hd, entries i and i + hd/2 form the pair rotated by inv_freq[i] (`rotate_half`). jllama's
backends rotate adjacent pairs (2i, 2i + 1) as llama2.c's run.c does. So the rows of q_proj (per
query head) and k_proj (per key/value head) are permuted at load: within each head, new row 2i
= old row i and new row 2i + 1 = old row i + hd/2. Rotating adjacent pairs of the permuted
vector is then the rotate-half rotation of the original, entries reordered, and a dot product
q . k is unchanged by reordering both the same way, so the attention weights (and the output)
are HF's. v_proj and o_proj keep their rows: the values are never rotated.

Reading safetensors: the file is an unsigned 64-bit little-endian header length N, N bytes of
JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}}, plus an optional
"__metadata__"), then the data, offsets counted from the end of the header (the format's
specification in the safetensors repository). This module parses that header itself and maps
the file with `np.memmap`, one path for every dtype: the `safetensors` package's numpy loader
cannot represent BF16 (NumPy has no bfloat16; it fails with "data type 'bfloat16' not
understood"), so BF16 data is viewed as `ml_dtypes.bfloat16`, and F32/F16 take the same path so
that one set of bounds and size checks covers all tensors. (The tests check this reader against
`safetensors.torch.load_file`.) Supported dtypes: F32, F16, BF16.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jllama.config import ModelConfig, RopeScaling
from jllama.errors import CheckpointError, ConfigError
from jllama.files import require_regular_file
from jllama.weights import TransformerWeights, expected_shapes

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LLAMA_MODEL_TYPE = "llama"

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
"""The safetensors dtypes jllama reads, with the NumPy type their data is viewed as."""

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit on N
_DEFAULT_MAX_POSITIONS = 2048  # LlamaConfig's default max_position_embeddings
_OUTPUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

_LAYER_TENSORS = {
    "input_layernorm": "rms_att_weight",
    "self_attn.q_proj": "wq",
    "self_attn.k_proj": "wk",
    "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo",
    "post_attention_layernorm": "rms_ffn_weight",
    "mlp.gate_proj": "w1",
    "mlp.down_proj": "w2",
    "mlp.up_proj": "w3",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embedding_table",
    "model.norm.weight": "rms_final_weight",
    "lm_head.weight": "wcls",
}
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding a `config.json` (a Hugging Face model folder)."""
    try:
        path = Path(path)
        return path.is_dir() and (path / CONFIG_FILE).is_file()
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a Hugging Face Llama folder holds for jllama.

    Attributes:
      config: the model's hyperparameters (seq_len possibly capped by the reader's caller).
      weights: `TransformerWeights`; matrices float32 or bfloat16 (`read_hf`'s dtype), RMSNorm
        gains always float32; wq/wk rows permuted for adjacent-pair RoPE (module docstring);
        wcls is token_embedding_table when shared.
      tokenizer: None (the folder's tokenizer is not read by this module).
      chat_template: the jinja source of the chat template (`chat_template.jinja`, else
        tokenizer_config.json's `chat_template`), or None.
      context_length: the context the model was trained for (`max_position_embeddings`), tokens.
      source: the folder's path.
      dtypes: {tensor name: safetensors dtype as stored}, e.g. {"model.norm.weight": "BF16"}.
    """

    config: ModelConfig
    weights: TransformerWeights
    tokenizer: Any
    chat_template: str | None
    context_length: int
    source: str
    dtypes: dict[str, str]


@dataclasses.dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file, as its header describes it.

    Attributes:
      name: the tensor's name.
      dtype: the safetensors dtype string ("F32", "BF16", "I64", ...).
      shape: dimensions, outermost first (row-major).
      path: the file.
      begin, end: byte offsets of the data in the file (absolute, end exclusive).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    begin: int
    end: int


def read_safetensors_header(path: str | os.PathLike) -> dict[str, SafetensorsEntry]:
    """The tensors of a safetensors file, from its header (the data is not read).

    Raises:
      CheckpointError: a missing or non-regular file, a header length past the end of the file,
        a header that is not a JSON object, or a tensor entry with a bad dtype, shape or
        offsets (data outside the file). One line naming the file (and the tensor).
    """
    path = Path(path)
    size = require_regular_file(path, f"checkpoint {path}", CheckpointError)
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file: header length {n} bytes, file "
                f"{size} bytes"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = " ".join(str(e).split())
        raise CheckpointError(f"{path}: malformed safetensors header ({detail})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info_dict = info if isinstance(info, dict) else {}
        dtype, shape, offsets = (info_dict.get(k) for k in ("dtype", "shape", "data_offsets"))
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        )
        if not ok:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}")
        begin, end = offsets
        if end < begin:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] end before they begin"
            )
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] run outside the "
                f"{data_size} data bytes (truncated file?)"
            )
        entries[name] = SafetensorsEntry(
            name=name, dtype=dtype, shape=tuple(shape), path=path,
            begin=data_start + begin, end=data_start + end,
        )
    # The tensors must tile the data without overlapping (as the safetensors library checks):
    # a header whose offsets overlap would make one tensor silently read another's bytes.
    spans = sorted((e.begin, e.end, e.name) for e in entries.values())
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(
                f"{path}: the data of tensors {name_a!r} and {name_b!r} overlap (a malformed "
                "header)"
            )
    return entries


def _check_dtype(entry: SafetensorsEntry, source: str) -> np.dtype:
    """The NumPy dtype of a supported entry whose byte size fits its shape."""
    if entry.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{source}: tensor {entry.name!r} has dtype {entry.dtype}, not supported "
            f"(supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
    want = math.prod(entry.shape) * dtype.itemsize
    if entry.end - entry.begin != want:
        raise CheckpointError(
            f"{source}: tensor {entry.name!r}: {entry.end - entry.begin} data bytes, but "
            f"{entry.dtype} {list(entry.shape)} needs {want}"
        )
    return dtype


class _Mapped:
    """The files of a checkpoint memory-mapped once each (read-only)."""

    def __init__(self):
        self._maps: dict[Path, np.memmap] = {}

    def array(self, entry: SafetensorsEntry) -> np.ndarray:
        """The entry's data as a read-only array view of the mapped file, in its stored dtype."""
        dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
        if entry.begin == entry.end:
            return np.zeros(entry.shape, dtype)
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        return self._maps[entry.path][entry.begin : entry.end].view(dtype).reshape(entry.shape)


def _read_json(path: Path, what: str, error: type[Exception]) -> Any:
    require_regular_file(path, f"{what} {path}", error)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = " ".join(str(e).split())
        raise error(f"{what} {path}: not valid JSON ({detail})") from None


def _get(
    cfg: Mapping[str, Any], key: str, source: str, kind: type, default: Any = ...,
    where: str = "config.json",
):
    """cfg[key] checked to be of `kind`; `default` when absent or null (required if none).
    `where` names the object in messages."""
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise CheckpointError(f"{source}: {where} has no {key!r}")
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        article = "an" if kind is int else "a"
        raise CheckpointError(
            f"{source}: {where} {key!r} is {value!r}, not {article} {kind.__name__}"
        )
    return kind(value)


def _check_llama(cfg: Mapping[str, Any], source: str) -> None:
    archs = cfg.get("architectures")
    model_type = cfg.get("model_type")
    if archs is None and model_type is None:
        raise CheckpointError(
            f"{source}: config.json names no architecture or model_type (jllama reads "
            f"{LLAMA_ARCHITECTURE} checkpoints)"
        )
    if archs is not None and (not isinstance(archs, list) or LLAMA_ARCHITECTURE not in archs):
        shown = ", ".join(map(str, archs)) if isinstance(archs, list) else repr(archs)
        raise CheckpointError(
            f"{source}: architecture {shown} is not supported (jllama reads "
            f"{LLAMA_ARCHITECTURE} checkpoints)"
        )
    if model_type is not None and model_type != LLAMA_MODEL_TYPE:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported (jllama reads "
            f"{LLAMA_MODEL_TYPE!r} checkpoints)"
        )


def _rope_settings(
    cfg: Mapping[str, Any], source: str, max_positions: int
) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from config.json (rules in the module docstring)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: config.json rope_scaling is {rope!r}, not an object")
    if any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError(
            f"{source}: per-layer-type rope_parameters are not supported (not a Llama layout)"
        )
    where = "config.json " + ("rope_scaling" if cfg.get("rope_scaling") else "rope_parameters")
    theta = _get(rope, "rope_theta", source, float, None, where)
    if theta is None:
        theta = _get(cfg, "rope_theta", source, float, 10000.0)
    partial = _get(rope, "partial_rotary_factor", source, float, None, where)
    if partial is None:
        partial = _get(cfg, "partial_rotary_factor", source, float, 1.0)
    if partial != 1.0:
        raise CheckpointError(
            f"{source}: partial_rotary_factor={partial} is not supported (RoPE on whole heads only)"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise CheckpointError(
            f"{source}: rope_scaling type {rope_type!r} is not supported "
            "(supported: default, linear, llama3)"
        )
    try:
        if rope_type == "linear":
            factor = _get(rope, "factor", source, float, where=where)
            return theta, RopeScaling("linear", factor=factor)
        scaling = RopeScaling(
            "llama3",
            factor=_get(rope, "factor", source, float, where=where),
            low_freq_factor=_get(rope, "low_freq_factor", source, float, where=where),
            high_freq_factor=_get(rope, "high_freq_factor", source, float, where=where),
            original_max_position_embeddings=_get(
                rope, "original_max_position_embeddings", source, int, max_positions, where
            ),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return theta, scaling


def config_from_hf(
    config_json: Mapping[str, Any], source: str, seq_len: int | None = None
) -> ModelConfig:
    """`ModelConfig` of a Hugging Face Llama `config.json` (keys in the module docstring).

    Args:
      config_json: the parsed config.json (transformers 4 or 5 layout).
      source: the folder or file, for error messages.
      seq_len: cap on the context (tokens); None = the model's `max_position_embeddings`.

    Returns:
      the config; `shared_weights` is `tie_word_embeddings` (`read_hf` also sets it when the
      folder has no lm_head.weight).

    Raises:
      CheckpointError: not a Llama model, a required key missing or of the wrong type, or a
        feature jllama does not implement (attention/MLP biases, an activation other than
        SiLU, a RoPE type other than default/linear/llama3, partial rotary embeddings).
      ConfigError: values that do not make a valid model, or seq_len < 1.
    """
    cfg = config_json
    if not isinstance(cfg, Mapping):
        raise CheckpointError(f"{source}: config.json is not a JSON object")
    _check_llama(cfg, source)
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{source}: {key}=true is not supported (Llama has no biases)")
    act = _get(cfg, "hidden_act", source, str, "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1")
    n_heads = _get(cfg, "num_attention_heads", source, int)
    max_positions = _get(cfg, "max_position_embeddings", source, int, _DEFAULT_MAX_POSITIONS)
    rope_theta, rope_scaling = _rope_settings(cfg, source, max_positions)
    try:
        return ModelConfig(
            dim=_get(cfg, "hidden_size", source, int),
            hidden_dim=_get(cfg, "intermediate_size", source, int),
            n_layers=_get(cfg, "num_hidden_layers", source, int),
            n_heads=n_heads,
            n_kv_heads=_get(cfg, "num_key_value_heads", source, int, n_heads),
            vocab_size=_get(cfg, "vocab_size", source, int),
            seq_len=min(max_positions, seq_len) if seq_len else max_positions,
            shared_weights=_get(cfg, "tie_word_embeddings", source, bool, False),
            norm_eps=_get(cfg, "rms_norm_eps", source, float, 1e-6),
            rope_theta=rope_theta,
            head_dim=_get(cfg, "head_dim", source, int, 0),
            rope_scaling=rope_scaling,
        )
    except ConfigError as e:
        hint = " (cap the context with --seq_len)" if "seq_len" in str(e) and not seq_len else ""
        raise ConfigError(f"{source}: {e}{hint}") from None


def _tensor_target(name: str, n_layers: int) -> tuple[str, int | None] | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], None
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer = int(parts[2])
        module, _, leaf = parts[3].rpartition(".")
        field = _LAYER_TENSORS.get(module)
        if field is not None and leaf == "weight" and layer < n_layers:
            return field, layer
    return None


def _tensor_name(field: str, layer: int | None) -> str:
    if layer is None:
        return next(k for k, v in _GLOBAL_TENSORS.items() if v == field)
    module = next(k for k, v in _LAYER_TENSORS.items() if v == field)
    return f"model.layers.{layer}.{module}.weight"


def _check_complete(
    config: ModelConfig, present: set[tuple[str, int | None]], source: str
) -> None:
    """Raise CheckpointError naming the first missing tensors (before any data is read)."""
    missing = []
    for field in expected_shapes(config):
        if field == "wcls" and config.shared_weights:
            continue
        layers = [None] if field in _GLOBAL_TENSORS.values() else range(config.n_layers)
        missing += [_tensor_name(field, layer) for layer in layers if (field, layer) not in present]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{source}: missing tensor {', '.join(missing[:3])}{more}")


def rope_row_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns HF's rotate-half q/k rows into adjacent-pair rows: int[n*head_dim].

    Within each head, new row 2i is old row i and new row 2i + 1 is old row i + head_dim/2
    (module docstring), so `w[perm]` is the permuted f32[n_heads * head_dim, dim] matrix.
    """
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def _find_tensors(folder: Path, source: str) -> dict[str, SafetensorsEntry]:
    """Every tensor of the folder: from model.safetensors, else the index's shards."""
    single = folder / SAFETENSORS_FILE
    if single.exists():
        return read_safetensors_header(single)
    index_path = folder / SAFETENSORS_INDEX
    if not index_path.exists():
        raise CheckpointError(
            f"{source}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors weights "
            "are read, not PyTorch .bin files)"
        )
    index = _read_json(index_path, "checkpoint index", CheckpointError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise CheckpointError(f"{index_path}: no weight_map of tensor names to shard files")
    headers: dict[str, dict[str, SafetensorsEntry]] = {}
    tensors = {}
    for name, shard in weight_map.items():
        if shard not in headers:
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"{index_path}: shard name {shard!r} is not a file name")
            if not (folder / shard).exists():
                raise CheckpointError(
                    f"{source}: shard {shard} (named by {SAFETENSORS_INDEX}) is missing"
                )
            headers[shard] = read_safetensors_header(folder / shard)
        if name not in headers[shard]:
            raise CheckpointError(
                f"{source}: tensor {name!r} is not in shard {shard}, where "
                f"{SAFETENSORS_INDEX} puts it"
            )
        tensors[name] = headers[shard][name]
    return tensors


def _output_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _OUTPUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (None, float32 or bfloat16)")
    return _OUTPUT_DTYPES[name]


def read_chat_template(folder: str | os.PathLike) -> str | None:
    """The folder's chat template (`chat_template.jinja`, else tokenizer_config.json's
    `chat_template`), or None: `jllama.tokenizers.hf.read_hf_chat_template`, which reads it.

    Raises:
      TokenizerError: as `read_hf_chat_template`.
    """
    from jllama.tokenizers.hf import read_hf_chat_template

    return read_hf_chat_template(folder)


def read_hf(
    folder: str | os.PathLike, seq_len: int | None = None, dtype: Any = None
) -> HFModel:
    """Read a Hugging Face Llama folder: config, weights (memory-mapped), chat template.

    Args:
      folder: the model folder (config.json and safetensors weights).
      seq_len: cap on the context the KV cache is sized for (tokens); None = the model's
        `max_position_embeddings`.
      dtype: the matrices' dtype. None keeps bfloat16 when every matrix is stored as BF16 and
        gives float32 otherwise (F16 or mixed files are widened); "float32" widens all;
        "bfloat16" narrows all (round to nearest even, as torch's `.to(torch.bfloat16)`).
        The RMSNorm gains are always float32.

    Returns:
      an `HFModel`. Matrices are copied into the stacked `TransformerWeights` layout (q/k rows
      permuted); the embedding table and classifier are read-only views of the mapped file
      when their stored dtype is the one asked for.

    Raises:
      CheckpointError: not a folder, no or malformed config.json, not a Llama model, an
        unsupported feature (see `config_from_hf`), no weights file, a shard named by the
        index that is missing, a missing or unexpected tensor (a bias, say), a
        tensor of the wrong shape or of an unsupported dtype, or a malformed or truncated
        safetensors file. One line, naming the file or tensor.
      ConfigError: config values that do not make a valid model, seq_len < 1, or an unknown
        `dtype`.
      TokenizerError: an unreadable chat template or tokenizer_config.json.
    """
    folder = Path(folder)
    source = str(folder)
    out_dtype = _output_dtype(dtype)
    if not folder.is_dir():
        what = "no such folder" if not folder.exists() else "not a folder"
        raise CheckpointError(f"{source}: {what} (a Hugging Face model is a folder)")
    cfg = _read_json(folder / CONFIG_FILE, "checkpoint config", CheckpointError)
    config = config_from_hf(cfg, source, seq_len=seq_len)
    context_length = _get(cfg, "max_position_embeddings", source, int, _DEFAULT_MAX_POSITIONS)

    found = _find_tensors(folder, source)
    targets: dict[str, tuple[SafetensorsEntry, str, int | None]] = {}
    for name, entry in found.items():
        if name.endswith(_IGNORED_SUFFIX):
            continue
        target = _tensor_target(name, config.n_layers)
        if target is None:
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            if layer.isdigit() and int(layer) >= config.n_layers:
                raise CheckpointError(
                    f"{source}: tensor {name!r} is of layer {layer}, but config.json says "
                    f"num_hidden_layers={config.n_layers}"
                )
            raise CheckpointError(
                f"{source}: unexpected tensor {name!r} (not part of a Llama model)"
            )
        if target[0] == "wcls" and config.shared_weights:
            continue  # tied: transformers ties lm_head to the embedding over what is stored
        targets[name] = (entry, *target)

    if "lm_head.weight" not in targets and not config.shared_weights:
        config = dataclasses.replace(config, shared_weights=True)
    _check_complete(config, {(field, layer) for _, field, layer in targets.values()}, source)
    shapes = expected_shapes(config)
    stored = {}
    for name, (entry, field, layer) in targets.items():  # every check before any data is read
        stored[name] = _check_dtype(entry, source)
        want = shapes[field] if layer is None else shapes[field][1:]
        if entry.shape != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(entry.shape)}, expected {list(want)}"
            )
    if out_dtype is None:
        matrix_dtypes = {
            stored[name] for name, (_, field, _) in targets.items() if not field.startswith("rms_")
        }
        bf16 = np.dtype(ml_dtypes.bfloat16)
        out_dtype = bf16 if matrix_dtypes == {bf16} else np.dtype(np.float32)

    mapped = _Mapped()
    arrays: dict[str, np.ndarray] = {}
    q_perm = rope_row_permutation(config.n_heads, config.head_dim)
    k_perm = rope_row_permutation(config.n_kv_heads, config.head_dim)
    for entry, field, layer in targets.values():
        field_dtype = np.dtype(np.float32) if field.startswith("rms_") else out_dtype
        values = np.asarray(mapped.array(entry))  # a plain ndarray view, not np.memmap
        if field == "wq":
            values = values[q_perm]
        elif field == "wk":
            values = values[k_perm]
        if layer is None:
            if values.dtype == field_dtype and values.flags.aligned:
                arrays[field] = values  # a read-only view of the mapped file
            else:
                arrays[field] = values.astype(field_dtype)
        else:
            if field not in arrays:
                arrays[field] = np.empty(shapes[field], field_dtype)
            arrays[field][layer] = values

    if config.shared_weights:
        arrays["wcls"] = arrays["token_embedding_table"]
    return HFModel(
        config=config,
        weights=TransformerWeights(**arrays),
        tokenizer=None,
        chat_template=read_chat_template(folder),
        context_length=context_length,
        source=source,
        dtypes={name: entry.dtype for name, entry in found.items()},
    )
