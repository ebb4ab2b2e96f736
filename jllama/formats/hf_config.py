"""A Hugging Face Llama, Mistral, Qwen2 or Qwen3 `config.json` as a `ModelConfig`.

The families (`ARCHITECTURES`, each an `architectures` entry with its `model_type`):
  LlamaForCausalLM / "llama", MistralForCausalLM / "mistral" (Llama's block; a sliding
  window), Qwen2ForCausalLM / "qwen2" (Qwen2, Qwen2.5: q/k/v biases, always),
  Qwen3ForCausalLM / "qwen3" (per-head q/k RMSNorm before RoPE; head_dim of its own),
  Qwen3MoeForCausalLM / "qwen3_moe" (Qwen3's attention, a Mixture-of-Experts FFN in every
  layer: num_experts (transformers 5 writes num_local_experts) -> n_experts,
  num_experts_per_tok -> n_experts_per_tok, moe_intermediate_size -> hidden_dim (one
  expert's width), norm_topk_prob (default true); decoder_sparse_step must be 1 and
  mlp_only_layers empty, i.e. no dense layers among the MoE ones).
Any other architecture is refused in one line naming it.

config.json keys read (transformers' `LlamaConfig`; defaults are LlamaConfig's):
  architectures (one of the above) / model_type (its model_type),
  hidden_size -> dim, intermediate_size -> hidden_dim, num_hidden_layers -> n_layers,
  num_attention_heads -> n_heads, num_key_value_heads -> n_kv_heads (default n_heads),
  vocab_size, head_dim (default dim // n_heads), rms_norm_eps -> norm_eps (default 1e-6),
  tie_word_embeddings -> shared_weights (default False),
  max_position_embeddings -> context length, and seq_len capped by the caller (default 2048),
  hidden_act (must be "silu"), attention_bias / mlp_bias (must be false; Qwen2's q/k/v biases
  are not this key's: its config leaves it null and the biases are always there),
  sliding window: `layer_types` (transformers 5: a "sliding_attention" entry), else
  `use_sliding_window` (Qwen, whose layers from `max_window_layers` on slide, as transformers'
  Qwen2Config) or a non-null `sliding_window` (Mistral, whose default is 4096) ->
  sliding_window; without a seq_len the context is capped at the window (exact on every
  backend); a longer seq_len asked for is kept and masked (`ModelConfig.sliding_window`),
  and refused where some layers slide and others do not,
  RoPE: `rope_scaling` (transformers 4) or else `rope_parameters` (transformers 5, which moved
  rope_theta into it). The type is `rope_type` (or the older `type`): "default"/absent is plain
  RoPE; "linear" needs `factor`; "llama3" needs `factor`, `low_freq_factor`,
  `high_freq_factor` and takes `original_max_position_embeddings` (default
  max_position_embeddings, as transformers' `standardize_rope_params`). rope_theta comes from
  the RoPE dict when it has one, else the top level, else 10000. Any other type ("yarn",
  "dynamic", "longrope", ...) and partial rotary embeddings are refused.
Float values are checked as float32, the type the forward pass computes in (JSON's 1e300 is
inf there), by `jllama.model.config`'s `check_norm_eps`, `check_rope_theta` and `check_rope_divisor`,
each message naming the key as config.json spells it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jllama.model.config import (
    ModelConfig,
    RopeScaling,
    check_norm_eps,
    check_rope_divisor,
    check_rope_theta,
)
from jllama.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LLAMA_MODEL_TYPE = "llama"

ARCHITECTURES = {
    LLAMA_ARCHITECTURE: LLAMA_MODEL_TYPE,
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""The `architectures` entries jllama reads, each with its `model_type`."""

DEFAULT_MAX_POSITIONS = 2048
"""LlamaConfig's default max_position_embeddings."""


def context_length(config_json: Mapping[str, Any], source: str) -> int:
    """The context the model was trained for, tokens: `max_position_embeddings` (LlamaConfig's
    default 2048 when absent).

    Raises:
      CheckpointError: a value that is not an int.
    """
    return _get(config_json, "max_position_embeddings", source, int, DEFAULT_MAX_POSITIONS)


def _get(
    cfg: Mapping[str, Any], key: str, source: str, kind: type, default: Any = ...,
    where: str = "config.json",
):
    """cfg[key] checked to be of `kind`; `default` when absent or null (required if none).
    `where` names the object in messages. CheckpointError for a missing key or a wrong type,
    ConfigError for an int too large to be a float."""
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
    try:
        return kind(value)
    except OverflowError:  # JSON's 10^400 as a float: beyond float64, so beyond float32 too
        raise ConfigError(
            f"{source}: {where} {key!r} is an integer of {len(str(abs(value)))} digits, not "
            "finite as float32"
        ) from None


def family(cfg: Mapping[str, Any], source: str) -> str:
    """The model_type of the family config.json names (`ARCHITECTURES`): "llama", "mistral",
    "qwen2" or "qwen3".

    Raises:
      CheckpointError: no architecture and no model_type, or one jllama does not read (one
        line naming it).
    """
    archs = cfg.get("architectures")
    model_type = cfg.get("model_type")
    known = ", ".join(ARCHITECTURES)
    if archs is None and model_type is None:
        raise CheckpointError(
            f"{source}: config.json names no architecture or model_type (jllama reads {known} "
            "checkpoints)"
        )
    if archs is not None:
        ours = [a for a in archs if a in ARCHITECTURES] if isinstance(archs, list) else []
        if not ours:
            shown = ", ".join(map(str, archs)) if isinstance(archs, list) else repr(archs)
            raise CheckpointError(
                f"{source}: architecture {shown} is not supported (jllama reads {known} "
                "checkpoints)"
            )
        want = ARCHITECTURES[ours[0]]
        if model_type is not None and model_type != want:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} is not supported with architecture "
                f"{ours[0]} (whose model_type is {want!r})"
            )
        return want
    if model_type not in ARCHITECTURES.values():
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported (jllama reads "
            f"{', '.join(map(repr, ARCHITECTURES.values()))} checkpoints)"
        )
    return model_type


def _window_layers(cfg: Mapping[str, Any], source: str, kind: str) -> tuple[int, bool]:
    """The attention window of config.json (module docstring), or 0 for none, and whether
    every layer slides."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        used, every = "sliding_attention" in types, set(types) == {"sliding_attention"}
    elif kind in ("qwen2", "qwen3", "qwen3_moe"):
        used = _get(cfg, "use_sliding_window", source, bool, False)
        first = _get(cfg, "max_window_layers", source, int, 0)  # the first layer that slides
        n_layers = _get(cfg, "num_hidden_layers", source, int)
        used, every = used and first < n_layers, first <= 0
    else:
        used = every = kind == "mistral"
    window = _get(cfg, "sliding_window", source, int, 0) if used else 0
    if window < 0:
        raise ConfigError(f"{source}: config.json sliding_window={window} is negative")
    return window, every


def _experts(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A Qwen3-MoE config.json's expert settings as `ModelConfig` keyword arguments (and
    hidden_dim, one expert's width); rules in the module docstring.

    Raises:
      CheckpointError: a key missing or of the wrong type, or dense layers among the MoE
        ones (decoder_sparse_step != 1, mlp_only_layers not empty), one line.
    """
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    step = _get(cfg, "decoder_sparse_step", source, int, 1)
    dense = _get(cfg, "mlp_only_layers", source, list, [])
    if step != 1 or dense:
        raise CheckpointError(
            f"{source}: decoder_sparse_step={step}, mlp_only_layers={dense} is not supported "
            "(jllama's qwen3_moe has a MoE FFN in every layer: step 1, no dense layers)"
        )
    if _get(cfg, "shared_expert_intermediate_size", source, int, 0):
        raise CheckpointError(f"{source}: a shared expert is not supported (Qwen3-MoE has none)")
    return {
        "n_experts": _get(cfg, key, source, int),
        "n_experts_per_tok": _get(cfg, "num_experts_per_tok", source, int),
        "norm_topk_prob": _get(cfg, "norm_topk_prob", source, bool, True),
        "hidden_dim": _get(cfg, "moe_intermediate_size", source, int),
    }


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
    theta_name = f"{where} rope_theta"
    if theta is None:
        theta = _get(cfg, "rope_theta", source, float, 10000.0)
        theta_name = "config.json rope_theta"
    try:
        check_rope_theta(theta, theta_name)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
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
        values = {}
        names = ("factor",) if rope_type == "linear" else (
            "factor", "low_freq_factor", "high_freq_factor")
        for name in names:  # checked here too, so the message names the key as written
            values[name] = _get(rope, name, source, float, where=where)
            check_rope_divisor(values[name], f"{where} {name}")
        if rope_type == "linear":
            return theta, RopeScaling("linear", **values)
        scaling = RopeScaling(
            "llama3",
            **values,
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
      CheckpointError: not a family jllama reads, a required key missing or of the wrong type, or a
        feature jllama does not implement (attention/MLP biases, an activation other than
        SiLU, a RoPE type other than default/linear/llama3, partial rotary embeddings).
      ConfigError: values that do not make a valid model, or seq_len < 1.
    """
    cfg = config_json
    if not isinstance(cfg, Mapping):
        raise CheckpointError(f"{source}: config.json is not a JSON object")
    kind = family(cfg, source)
    experts = _experts(cfg, source) if kind == "qwen3_moe" else {}
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key) and not (kind == "qwen2" and key == "attention_bias"):
            raise CheckpointError(
                f"{source}: {key}=true is not supported (jllama's {kind} block has no such biases)"
            )
    act = _get(cfg, "hidden_act", source, str, "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1")
    n_heads = _get(cfg, "num_attention_heads", source, int)
    max_positions = context_length(cfg, source)
    rope_theta, rope_scaling = _rope_settings(cfg, source, max_positions)
    norm_eps = _get(cfg, "rms_norm_eps", source, float, 1e-6)
    window, every = _window_layers(cfg, source, kind)
    context = min(max_positions, seq_len) if seq_len else max_positions
    if window and not seq_len:
        context = min(context, window)  # exact up to the window on every backend
    if window and context > window and not every:
        raise ConfigError(f"{source}: seq_len={context} is past sliding_window={window}, and "
                          "only some layers slide (max_window_layers / layer_types): jllama's "
                          f"window is every layer's; give seq_len <= {window}")
    try:
        check_norm_eps(norm_eps, "config.json rms_norm_eps")
        return ModelConfig(
            dim=_get(cfg, "hidden_size", source, int),
            hidden_dim=experts.pop("hidden_dim", None) or _get(cfg, "intermediate_size", source,
                                                               int),
            n_layers=_get(cfg, "num_hidden_layers", source, int),
            n_heads=n_heads,
            n_kv_heads=_get(cfg, "num_key_value_heads", source, int, n_heads),
            vocab_size=_get(cfg, "vocab_size", source, int),
            seq_len=context,
            shared_weights=_get(cfg, "tie_word_embeddings", source, bool, False),
            norm_eps=norm_eps,
            rope_theta=rope_theta,
            head_dim=_get(cfg, "head_dim", source, int, 0),
            rope_scaling=rope_scaling,
            qkv_bias=kind == "qwen2",
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            sliding_window=window,
            **experts,
        )
    except ConfigError as e:
        hint = " (cap the context with --seq_len)" if "seq_len" in str(e) and not seq_len else ""
        raise ConfigError(f"{source}: {e}{hint}") from None
