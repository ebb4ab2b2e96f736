"""Tiny random Hugging Face models for tests, built and saved by transformers itself
(`LlamaConfig` + `LlamaForCausalLM`, or Mistral's, Qwen2's, Qwen3's, `save_pretrained` with
safetensors), so the folders are what transformers writes, not what jllama's reader expects.
The in-memory model is the oracle.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _classes(family: str):
    """(config class, model class) of a family: "llama", "mistral", "qwen2", "qwen3" or
    "qwen3_moe"."""
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
              "qwen3_moe": "Qwen3Moe"}[family]
    return (getattr(transformers, prefix + "Config"),
            getattr(transformers, prefix + "ForCausalLM"))


@dataclasses.dataclass(frozen=True)
class Spec:
    """A tiny Llama: LlamaConfig keyword arguments plus how it is saved.

    Attributes:
      name: for test ids.
      config: LlamaConfig keyword arguments (hidden_size, num_attention_heads, ...).
      seed: seeds the weights.
      save_dtype: "float32" or "bfloat16" (the dtype of the stored tensors).
      max_shard_size: save_pretrained's shard limit (e.g. "40KB"); None writes one file.
      family: "llama" (LlamaForCausalLM), "mistral", "qwen2" or "qwen3" (their *ForCausalLM).
    """

    name: str
    config: dict[str, Any]
    seed: int = 0
    save_dtype: str = "float32"
    max_shard_size: str | None = None
    family: str = "llama"


def build(spec: Spec) -> LlamaForCausalLM:
    """The model with seeded random weights, float32, eager attention, in eval mode.

    Every parameter is redrawn (transformers' init sets RMSNorm gains to 1, which would hide a
    swapped norm): matrices normal(0, 1/sqrt(in_features)), the embedding normal(0, 0.5), norm
    gains 1 + normal(0, 0.2) (Qwen3's q/k norms too), biases normal(0, 0.5), so logits spread
    over several units and greedy choices are clear-cut. When the model is saved as bf16, the oracle's weights are rounded to bf16 too.
    """
    config_class, model_class = _classes(spec.family)
    config = config_class(**spec.config)
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name == "model.embed_tokens.weight" or name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
        if spec.save_dtype == "bfloat16":  # the weights the file will hold; not `model.to`,
            for param in model.parameters():  # which would round the RoPE buffer inv_freq too
                param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model


def save(model: LlamaForCausalLM, spec: Spec, folder: Path) -> Path:
    """`save_pretrained(folder, safe_serialization=True)` in `spec.save_dtype` (a bf16 copy is
    saved; the model itself is left as it is)."""
    kwargs = {"safe_serialization": True}
    if spec.max_shard_size is not None:
        kwargs["max_shard_size"] = spec.max_shard_size
    if spec.save_dtype == "bfloat16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    model.save_pretrained(folder, **kwargs)
    return folder


def hf_logits(model: LlamaForCausalLM, tokens: list[int]) -> np.ndarray:
    """Logits of one full-sequence forward: f32[len(tokens), vocab_size]."""
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long))
    return out.logits[0].to(torch.float32).numpy()


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    """`n` greedy tokens after `prompt` (argmax of a full forward of the sequence so far), and
    the smallest gap between the best and second-best logit over those steps."""
    ids, gap = list(prompt), float("inf")
    for _ in range(n):
        last = hf_logits(model, ids)[-1]
        top2 = np.sort(last)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        ids.append(int(np.argmax(last)))
    return ids[len(prompt):], gap


def edit_config(folder: Path, **changes: Any) -> None:
    """Rewrite config.json with keys set (a value of None removes the key)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg, indent=2))
