"""A llama-, qwen2- or qwen3-architecture GGUF's metadata as a `ModelConfig` (and its RoPE
factors tensor).

`general.architecture` picks the family (`ARCHITECTURES`): `llama` (Llama 1/2/3, SmolLM2, and
Mistral as llama.cpp's converter writes it), `qwen2` (Qwen2, Qwen2.5: q/k/v biases), `qwen3`
(Qwen3 dense: per-head q/k RMSNorm, head_dim of its own) or `qwen3moe` (Qwen3's attention and
a Mixture-of-Experts FFN: expert_count -> n_experts, expert_used_count -> n_experts_per_tok,
expert_feed_forward_length -> hidden_dim, one expert's width; the routed weights always
renormalised, as llama.cpp's qwen3moe graph does; expert_shared_count must be 0,
expert_weights_scale 0 or 1); any other is refused naming it. The
keys below are prefixed by that name (`llama.`, `qwen2.`, `qwen3.`).

Metadata keys read (as llama.cpp's `llm_load_hparams` for LLM_ARCH_LLAMA / QWEN2 / QWEN3):
  embedding_length -> dim, feed_forward_length -> hidden_dim, block_count -> n_layers,
  attention.head_count -> n_heads, attention.head_count_kv -> n_kv_heads (default n_heads),
  attention.key_length -> head_dim (default dim // n_heads; value_length must agree),
  context_length -> seq_len (capped by the caller's `seq_len`, and without one by
  attention.sliding_window, which -> sliding_window: `ModelConfig.sliding_window`),
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
    frequency i divided by rope_freqs[i], each factor finite and > 0 with a finite reciprocal
    (>= 2.9e-39). It makes a "freq_factors" `RopeScaling` carrying the factors (and the linear
    factor on top, if any).
Float values are checked as float32, the type the forward pass computes in (a FLOAT64 key's
1e300 is inf there): the RMS epsilon, freq_base and scaling factor by `jllama.model.config`'s
`check_norm_eps`, `check_rope_theta` and `check_rope_divisor`, named by their keys. (llama.cpp
takes these keys only as FLOAT32 and refuses a FLOAT64 one; jllama reads either.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jllama.model.config import (
    ModelConfig,
    RopeScaling,
    check_norm_eps,
    check_rope_divisor,
    check_rope_theta,
)
from jllama.errors import CheckpointError, ConfigError
from jllama.formats import ggml_types


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a GGUF architecture adds to the Llama block (llama.cpp's `llm_build_*` graphs).

    Attributes:
      qkv_bias: blk.N.attn_q/k/v.bias present (`ModelConfig.qkv_bias`).
      qk_norm: blk.N.attn_q_norm / attn_k_norm.weight present (`ModelConfig.qk_norm`).
      moe: a Mixture-of-Experts FFN in every layer (qwen3moe: `moe_settings`).
      rotate_half: RoPE pairs (i, i + head_dim / 2), llama.cpp's LLAMA_ROPE_TYPE_NEOX: the
        converter stores q/k rows in Hugging Face's order, which `jllama.formats.gguf`
        permutes for the adjacent pairs every backend rotates (`llama` files are stored
        permuted already: LLAMA_ROPE_TYPE_NORM).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    rotate_half: bool = False
    moe: bool = False


ARCHITECTURES = {
    "llama": Architecture(),
    "qwen2": Architecture(qkv_bias=True, rotate_half=True),
    "qwen3": Architecture(qk_norm=True, rotate_half=True),
    "qwen3moe": Architecture(qk_norm=True, rotate_half=True, moe=True),
}
"""The `general.architecture` values jllama runs."""


def architecture(meta: Mapping[str, Any], source: str) -> tuple[str, Architecture]:
    """(name, `Architecture`) of a GGUF's `general.architecture`.

    Raises:
      CheckpointError: an architecture jllama does not run, one line naming it.
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: architecture {arch!r} is not supported (jllama runs "
            f"{', '.join(map(repr, ARCHITECTURES))} GGUF files)"
        )
    return arch, ARCHITECTURES[arch]


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
    """`ModelConfig` of a GGUF's metadata (architectures and keys in the module docstring).

    Args:
      meta: metadata keys to values, as `jllama.formats.gguf.read_metadata` gives.
      source: the file, for error messages.
      seq_len: cap on the context (tokens); None = the model's `context_length`.
      vocab_size: the token count when the file has no `llama.vocab_size`.

    Raises:
      CheckpointError: not an architecture jllama runs, a required key missing or of the wrong
        type, or a feature jllama does not implement (partial rotary, YaRN or LongRoPE
        scaling, a RoPE attn_factor).
      ConfigError: values that do not make a valid model.
    """
    arch, family = architecture(meta, source)
    p = arch + "."
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
    rope_scaling = _rope_scaling(meta, source, p)
    context_length = _get(meta, p + "context_length", source, int)
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if isinstance(tokens, list) else None
    vocab_size = _get(meta, p + "vocab_size", source, int, vocab_size)
    if vocab_size is None:
        raise CheckpointError(
            f"{source}: neither {p}vocab_size nor tokenizer.ggml.tokens gives the vocab size"
        )
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1")
    eps_key, theta_key = p + "attention.layer_norm_rms_epsilon", p + "rope.freq_base"
    norm_eps = _get(meta, eps_key, source, float)
    rope_theta = _get(meta, theta_key, source, float, 10000.0)
    experts = moe_settings(meta, source, p) if family.moe else {}
    window = _get(meta, p + "attention.sliding_window", source, int, 0)
    if window < 0:
        raise ConfigError(f"{source}: {p}attention.sliding_window={window} is negative")
    context = min(context_length, seq_len) if seq_len else context_length
    if window and not seq_len:
        context = min(context, window)  # exact up to the window on every backend
    try:
        check_norm_eps(norm_eps, eps_key)
        check_rope_theta(rope_theta, theta_key)
        return ModelConfig(
            dim=dim,
            hidden_dim=experts.pop("hidden_dim", None)
            or _get(meta, p + "feed_forward_length", source, int),
            n_layers=_get(meta, p + "block_count", source, int),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            seq_len=context,
            shared_weights=True,
            norm_eps=norm_eps,
            rope_theta=rope_theta,
            head_dim=head_dim,
            rope_scaling=rope_scaling,
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            sliding_window=window,
            **experts,
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def moe_settings(meta: Mapping[str, Any], source: str, prefix: str) -> dict[str, Any]:
    """A qwen3moe file's expert settings as `ModelConfig` keyword arguments (and hidden_dim);
    keys in the module docstring.

    Raises:
      CheckpointError: a key missing or of the wrong type, a shared expert, or an expert
        weights scale jllama does not apply; one line naming the key.
    """
    p = prefix
    shared = _get(meta, p + "expert_shared_count", source, int, 0)
    if shared:
        raise CheckpointError(f"{source}: {p}expert_shared_count={shared} is not supported "
                              "(Qwen3-MoE has no shared expert)")
    scale = _get(meta, p + "expert_weights_scale", source, float, 0.0)
    if scale not in (0.0, 1.0):
        raise CheckpointError(f"{source}: {p}expert_weights_scale={scale} is not supported "
                              "(only 0 or 1: the routed weights unscaled)")
    return {
        "n_experts": _get(meta, p + "expert_count", source, int),
        "n_experts_per_tok": _get(meta, p + "expert_used_count", source, int),
        "norm_topk_prob": True,
        "hidden_dim": _get(meta, p + "expert_feed_forward_length", source, int),
    }


_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
"""The `rope.scaling.type` values llama.cpp knows (`LLAMA_ROPE_SCALING_TYPES`)."""

ROPE_FREQS = "rope_freqs.weight"
"""The tensor of llama.cpp's per-frequency RoPE divisors (Llama 3.1/3.2 scaled RoPE)."""


def _rope_scaling(meta: Mapping[str, Any], source: str, prefix: str) -> RopeScaling | None:
    """The linear RoPE scaling of `{prefix}rope.scaling.*` (rules in the module docstring), or
    None. The per-frequency factors of rope_freqs.weight are added later (`with_rope_freqs`)."""
    p = prefix + "rope."
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
    try:
        check_rope_divisor(factor, key)  # e.g. 1e-300: not 0 above, but 0 in float32
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return RopeScaling("linear", factor)


def with_rope_freqs(config: ModelConfig, tensor, source: str) -> ModelConfig:
    """`config` with the per-frequency RoPE factors of a GGUF's rope_freqs.weight tensor.

    Args:
      config: the model's config from `config_from_metadata` (its linear factor, if any, is
        kept and applied on top of the factors, as llama.cpp does).
      tensor: the `gguf.ReaderTensor` named rope_freqs.weight: F32[head_dim / 2].
      source: the file, for error messages.

    Raises:
      CheckpointError: not F32, not head_dim / 2 values, a factor that is not finite and
        positive or whose reciprocal is not finite in float32 (RoPE divides by it: 1e-45
        makes inf), or factors that make a RoPE angle overflow within the context; one line
        naming the tensor.
    """
    what = f"{source}: tensor {ROPE_FREQS!r}"
    type_id = int(tensor.tensor_type)
    if type_id != ggml_types.F32:
        raise CheckpointError(
            f"{what} is {ggml_types.type_name(type_id)}; llama.cpp's RoPE factors must be F32"
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
    with np.errstate(divide="ignore", over="ignore"):
        reciprocal = np.float32(1.0) / factors
    bad = np.flatnonzero(~np.isfinite(reciprocal))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"{what}: factor [{i}] is {float(factors[i]):g}; its reciprocal is not finite as "
            f"float32 (RoPE divides frequency {i} by it)"
        )
    linear = config.rope_scaling.factor if config.rope_scaling is not None else 1.0
    try:
        scaling = RopeScaling("freq_factors", linear, freq_factors=tuple(factors.tolist()))
        return dataclasses.replace(config, rope_scaling=scaling)
    except ConfigError as e:  # the angles over the context (ModelConfig's last check)
        raise CheckpointError(f"{what}: {e}") from None
