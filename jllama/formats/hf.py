"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 checkpoints: a folder with `config.json` and
safetensors weights.

The folder is what `LlamaForCausalLM.save_pretrained(folder, safe_serialization=True)` writes:
`config.json`, then either one `model.safetensors` or shards named by
`model.safetensors.index.json` (its `weight_map`: tensor name -> shard file name), and, when the
tokenizer was saved too, `tokenizer_config.json` / `chat_template.jinja`.

The config.json keys read are `jllama.formats.hf_config`'s; the safetensors container is
`jllama.formats.safetensors_file`'s.

Tensor names (transformers' LlamaForCausalLM state dict) and where they go:
  model.embed_tokens.weight -> token_embedding_table   model.norm.weight -> rms_final_weight
  lm_head.weight -> wcls (absent, or tie_word_embeddings true: the embedding, shared_weights;
    a stored lm_head of a tied model is ignored, as transformers ties over it)
  model.layers.N.input_layernorm.weight -> rms_att_weight[N]
  model.layers.N.post_attention_layernorm.weight -> rms_ffn_weight[N]
  model.layers.N.self_attn.{q,k,v,o}_proj.weight -> wq/wk/wv/wo[N] (q, k permuted, below)
  model.layers.N.mlp.{gate,down,up}_proj.weight -> w1/w2/w3[N]
  model.layers.N.self_attn.{q,k,v}_proj.bias -> bq/bk/bv[N] (Qwen2ForCausalLM; q, k permuted)
  model.layers.N.self_attn.{q,k}_norm.weight -> q_norm/k_norm[N] (Qwen3ForCausalLM; permuted
    within the head as the rows are)
  model.layers.N.mlp.gate.weight -> ffn_gate_inp[N] (Qwen3MoeForCausalLM's router, float32)
  model.layers.N.mlp.experts.E.{gate,down,up}_proj.weight -> w1/w2/w3[N, E] (Qwen3-MoE, as
    save_pretrained writes them; or transformers 5's fused mlp.experts.gate_up_proj
    [E, 2 * hidden, dim] (gate rows first) and mlp.experts.down_proj [E, dim, hidden])
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
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jllama.errors import CheckpointError, ConfigError
from jllama.formats.base import ModelFile
from jllama.formats.hf_config import (  # noqa: F401 (re-exported: names of this module)
    CONFIG_FILE,
    LLAMA_ARCHITECTURE,
    LLAMA_MODEL_TYPE,
    config_from_hf,
    context_length,
    family,
)
from jllama.formats.safetensors_file import (  # noqa: F401 (re-exported)
    SAFETENSORS_DTYPES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    MappedFiles,
    SafetensorsEntry,
    entry_dtype,
    find_tensors,
    read_json,
    read_safetensors_header,
)
from jllama.formats.tensor_names import TensorNames
from jllama.model.rope import rope_row_permutation  # noqa: F401 (re-exported; tests patch it)
from jllama.model.weights import FLOAT32_FIELDS, TransformerWeights, expected_shapes

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_OUTPUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

TENSOR_NAMES = TensorNames(
    global_names={
        "model.embed_tokens.weight": "token_embedding_table",
        "model.norm.weight": "rms_final_weight",
        "lm_head.weight": "wcls",
    },
    layer_names={
        "input_layernorm": "rms_att_weight",
        "self_attn.q_proj": "wq",
        "self_attn.k_proj": "wk",
        "self_attn.v_proj": "wv",
        "self_attn.o_proj": "wo",
        "post_attention_layernorm": "rms_ffn_weight",
        "mlp.gate_proj": "w1",
        "mlp.down_proj": "w2",
        "mlp.up_proj": "w3",
        "self_attn.q_proj.bias": "bq",
        "self_attn.k_proj.bias": "bk",
        "self_attn.v_proj.bias": "bv",
        "self_attn.q_norm": "q_norm",
        "self_attn.k_norm": "k_norm",
        "mlp.gate": "ffn_gate_inp",
    },
    layer_prefix="model.layers.",
)
"""transformers' LlamaForCausalLM state-dict names (and Qwen2's biases, Qwen3's q/k norms;
Mistral's are Llama's)."""
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?"
                     r"(gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?")
_EXPERT_FIELDS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _expert_target(name: str, config) -> tuple[str, int, int | None, str] | None:
    """(field, layer, expert or None for a fused tensor of all experts, part) of a Qwen3-MoE
    expert tensor's name, or None when `name` is not one (or the config has no experts)."""
    m = _EXPERT.fullmatch(name)
    if m is None or not config.moe:
        return None
    layer, expert, part = int(m[1]), m[2], m[3]
    fused = expert is None
    if fused != (part == "gate_up_proj" or name.endswith("experts.down_proj")):
        return None
    if layer >= config.n_layers or (not fused and int(expert) >= config.n_experts):
        return None
    field = "w1" if part == "gate_up_proj" else _EXPERT_FIELDS[part]
    return field, layer, None if fused else int(expert), part


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding a `config.json` (a Hugging Face model folder)."""
    try:
        path = Path(path)
        return path.is_dir() and (path / CONFIG_FILE).is_file()
    except OSError:
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFModel(ModelFile):
    """What a Hugging Face Llama folder holds for jllama: `ModelFile`'s fields, where `weights`
    hold matrices of float32 or bfloat16 (`read_hf`'s dtype) and RMSNorm gains of float32, with
    wq/wk rows permuted for adjacent-pair RoPE (module docstring); `tokenizer` is None (this
    module does not read the folder's tokenizer); `chat_template` is `chat_template.jinja`'s,
    else tokenizer_config.json's `chat_template`; `context_length` is
    `max_position_embeddings`. And:

    Attributes:
      dtypes: {tensor name: safetensors dtype as stored}, e.g. {"model.norm.weight": "BF16"}.
    """

    dtypes: dict[str, str]


def _check_experts(config, experts: dict, source: str) -> set[tuple[str, int]]:
    """The (field, layer) pairs the expert tensors fill, after checking each tensor's shape
    and that every layer has every expert's three matrices (per expert, or fused).

    Raises:
      CheckpointError: a tensor of the wrong shape, or a missing expert matrix (the first
        one named).
    """
    c = config
    filled = {}
    for name, (entry, field, layer, expert, part) in experts.items():
        one = {"w1": (c.hidden_dim, c.dim), "w3": (c.hidden_dim, c.dim),
               "w2": (c.dim, c.hidden_dim)}[field]
        if part == "gate_up_proj":
            one = (2 * c.hidden_dim, c.dim)
        want = one if expert is not None else (c.n_experts, *one)
        if tuple(entry.shape) != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(entry.shape)}, expected {list(want)}"
            )
        fields = ("w1", "w3") if part == "gate_up_proj" else (field,)
        for f in fields:
            for e in range(c.n_experts) if expert is None else (expert,):
                filled[(f, layer, e)] = name
    for layer in range(c.n_layers):
        for e in range(c.n_experts):
            for field, part in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                if (field, layer, e) not in filled:
                    raise CheckpointError(
                        f"{source}: missing tensor model.layers.{layer}.mlp.experts.{e}.{part}"
                        ".weight"
                    )
    return {(field, layer) for field in ("w1", "w2", "w3") for layer in range(c.n_layers)}


def _expert_parts(field: str, part: str, values: np.ndarray, hidden_dim: int):
    """(field, values) of an expert tensor: transformers 5's fused gate_up_proj split into
    gate (w1: its first hidden_dim rows) and up (w3), any other tensor as it is."""
    if part == "gate_up_proj":
        return [("w1", values[..., :hidden_dim, :]), ("w3", values[..., hidden_dim:, :])]
    return [(field, values)]


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
    if not (folder / CONFIG_FILE).exists():
        raise CheckpointError(
            f"{source}: not a model folder: no {CONFIG_FILE} (a Hugging Face model folder holds "
            f"{CONFIG_FILE} and its *.safetensors; a llama2.c or GGUF model is one file)")
    cfg = read_json(folder / CONFIG_FILE, "checkpoint config", CheckpointError)
    config = config_from_hf(cfg, source, seq_len=seq_len)
    kind = family(cfg, source)
    trained_context = context_length(cfg, source)

    found = find_tensors(folder, source)
    targets: dict[str, tuple[SafetensorsEntry, str, int | None]] = {}
    experts: dict[str, tuple[SafetensorsEntry, str, int, int | None, str]] = {}
    for name, entry in found.items():
        if name.endswith(_IGNORED_SUFFIX):
            continue
        expert = _expert_target(name, config)
        if expert is not None:
            experts[name] = (entry, *expert)
            continue
        target = TENSOR_NAMES.target(name, config.n_layers)
        if target is None:
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            if layer.isdecimal() and int(layer) >= config.n_layers:
                raise CheckpointError(
                    f"{source}: tensor {name!r} is of layer {layer}, but config.json says "
                    f"num_hidden_layers={config.n_layers}"
                )
            raise CheckpointError(
                f"{source}: unexpected tensor {name!r} (not part of a {kind} model)"
            )
        if target[0] not in expected_shapes(config):  # a bias or q/k norm of another family
            raise CheckpointError(
                f"{source}: unexpected tensor {name!r} (not part of this {kind} model)"
            )
        if target[0] == "wcls" and config.shared_weights:
            continue  # tied: transformers ties lm_head to the embedding over what is stored
        targets[name] = (entry, *target)

    if "lm_head.weight" not in targets and not config.shared_weights:
        config = dataclasses.replace(config, shared_weights=True)
    present = {(field, layer) for _, field, layer in targets.values()}
    if config.moe:
        present |= _check_experts(config, experts, source)
    TENSOR_NAMES.check_complete(config, present, source)
    shapes = expected_shapes(config)
    stored = {}
    for name, (entry, field, layer) in targets.items():  # every check before any data is read
        stored[name] = entry_dtype(entry, source)
        want = shapes[field] if layer is None else shapes[field][1:]
        if entry.shape != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(entry.shape)}, expected {list(want)}"
            )
    if out_dtype is None:
        matrix_dtypes = {
            stored[name] for name, (_, field, _) in targets.items()
            if field not in FLOAT32_FIELDS
        } | {entry_dtype(entry, source) for entry, *_ in experts.values()}
        bf16 = np.dtype(ml_dtypes.bfloat16)
        out_dtype = bf16 if matrix_dtypes == {bf16} else np.dtype(np.float32)

    mapped = MappedFiles()
    arrays: dict[str, np.ndarray] = {}
    q_perm = rope_row_permutation(config.n_heads, config.head_dim)
    k_perm = rope_row_permutation(config.n_kv_heads, config.head_dim)
    head_perm = rope_row_permutation(1, config.head_dim)
    permutations = {"wq": q_perm, "bq": q_perm, "wk": k_perm, "bk": k_perm,
                    "q_norm": head_perm, "k_norm": head_perm}
    for entry, field, layer in targets.values():
        field_dtype = np.dtype(np.float32) if field in FLOAT32_FIELDS else out_dtype
        values = np.asarray(mapped.array(entry))  # a plain ndarray view, not np.memmap
        if field in permutations:  # rows (or a vector's entries) for adjacent-pair RoPE
            values = values[permutations[field]]
        if layer is None:
            if values.dtype == field_dtype and values.flags.aligned:
                arrays[field] = values  # a read-only view of the mapped file
            else:
                arrays[field] = values.astype(field_dtype)
        else:
            if field not in arrays:
                arrays[field] = np.empty(shapes[field], field_dtype)
            arrays[field][layer] = values
    for entry, field, layer, expert, part in experts.values():
        values = np.asarray(mapped.array(entry))
        for field, part_values in _expert_parts(field, part, values, config.hidden_dim):
            if field not in arrays:
                arrays[field] = np.empty(shapes[field], out_dtype)
            index = (layer,) if expert is None else (layer, expert)
            arrays[field][index] = part_values

    if config.shared_weights:
        arrays["wcls"] = arrays["token_embedding_table"]
    return HFModel(
        config=config,
        weights=TransformerWeights(**arrays),
        tokenizer=None,
        chat_template=read_chat_template(folder),
        context_length=trained_context,
        source=source,
        dtypes={name: entry.dtype for name, entry in found.items()},
    )
