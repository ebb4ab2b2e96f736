"""The tiny Qwen2.5-, Qwen3- and Mistral-style models of issue 36's tests: transformers'
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` and `MistralForCausalLM` with seeded random weights
(`hf_models.build`), shared by the tests and by tests/data/make_qwen_tiny.py, which converted
them with llama.cpp's convert_hf_to_gguf.py into tests/data/qwen_tiny/ (and stored transformers'
logits for `TOKENS` beside them, `oracle.npz`).

The vocabulary is tests/data/qwen_tiny/tokenizer.json: Qwen's real byte-level BPE cut to its
first `BASE` tokens (the 256 bytes among them) and the merges among those, with Qwen's special
tokens after them (`SPECIAL_TOKENS`); the models' vocab_size (`VOCAB`) is a little larger, as
Qwen's own are (the converter pads the GGUF vocabulary with [PAD] tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from hf_models import Spec

DATA = Path(__file__).parent / "data" / "qwen_tiny"

BASE = 400
"""Tokens taken from Qwen's vocabulary (ids 0 .. BASE - 1)."""

SPECIAL_TOKENS = [  # (text, special) in id order from BASE, as Qwen3's tokenizer.json
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False),
]
VOCAB = 416
"""The models' vocab_size (BASE + 7 special tokens, padded)."""

_COMMON = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
}
SPECS = {
    # Qwen2.5-0.5B's shape in small: GQA 2:1, tied embeddings, rope_theta 1e6, q/k/v biases.
    "qwen2": Spec("qwen2", {**_COMMON, "rope_theta": 1000000.0, "tie_word_embeddings": True},
                  seed=11, family="qwen2"),
    # Qwen3: q/k RMSNorm per head, head_dim 32 != 64 / 4 (as Qwen3-0.6B's 128 != 1024 / 16).
    "qwen3": Spec("qwen3", {**_COMMON, "head_dim": 32, "rope_theta": 1000000.0,
                            "tie_word_embeddings": True}, seed=12, family="qwen3"),
    # Mistral 7B v0.1's config in small: untied, sliding_window 4096 (past this context).
    "mistral": Spec("mistral", {**_COMMON, "rope_theta": 10000.0, "sliding_window": 4096,
                                "tie_word_embeddings": False}, seed=13, family="mistral"),
}
KQUANT_SPEC = Spec("qwen3-256", {
    **_COMMON, "hidden_size": 256, "intermediate_size": 256, "head_dim": 64,
    "rope_theta": 1000000.0, "tie_word_embeddings": True}, seed=14, family="qwen3")
"""A Qwen3 whose rows are 256 long, so that llama-quantize's Q4_K_M holds K-quant blocks
(tests/data/qwen_tiny/qwen3-256-Q4_K_M.gguf; only that file is kept)."""
MOE_SPEC = Spec("qwen3moe", {
    **_COMMON, "head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    seed=15, family="qwen3_moe")
"""A Qwen3-MoE in small (issue 36's MoE part): Qwen3's attention, and in each layer 8 experts
of width 32 with 2 routed per token (Qwen3-30B-A3B: 128 experts, 8 routed), no shared
expert. Its GGUF files (tests/data/qwen_tiny/qwen3moe-tiny-*) come from
tests/data/make_qwen_moe_tiny.py."""
MOE_KQUANT_SPEC = Spec("qwen3moe-256", {
    **_COMMON, "hidden_size": 256, "head_dim": 64, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "moe_intermediate_size": 256, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True}, seed=16, family="qwen3_moe")
"""A Qwen3-MoE whose expert rows are 256 long (dim and expert width 256), so that
llama-quantize's Q4_K_M stores the experts in K-quant blocks
(tests/data/qwen_tiny/qwen3moe-256-Q4_K_M.gguf; only that file is kept)."""
TOKENS = [int(t) for t in np.random.default_rng(36).integers(0, BASE, size=24)]
"""The token ids whose logits the oracle holds (a prompt of 24 tokens, run one by one)."""

GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
"""The `general.architecture` llama.cpp's converter writes for each."""

TEMPLATES = {"qwen2": "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja",
             "mistral": None}
"""Each model's chat template (tests/data/templates/), None for the base Mistral."""


def gguf_path(name: str) -> Path:
    """The converted F32 GGUF of model `name` (gzipped in tests/data/qwen_tiny/)."""
    return DATA / f"{name}-tiny-F32.gguf.gz"


def tokenizer_files(folder: Path, name: str) -> None:
    """Copy the tiny Qwen tokenizer and model `name`'s tokenizer_config.json into `folder`."""
    shutil.copy(DATA / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(DATA / f"{name}_tokenizer_config.json", folder / "tokenizer_config.json")
