"""Small GGUF files for tests, written with the `gguf` package's own writer (llama.cpp's
gguf-py), so the files are what llama.cpp's tools would produce, not what jllama's reader
expects."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jllama.model.config import ModelConfig
from jllama.model.weights import TransformerWeights

# A byte-level vocabulary: the 256 GPT-2 byte characters, one merge ("ĠĠ"), two specials.
_BYTE_CHARS = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character table written out (printable bytes as themselves, the rest
    mapped to U+0100 upward), in byte order."""
    table, extra = {}, 0
    for b in range(256):
        if b in _BYTE_CHARS:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: TransformerWeights,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    vocab: list[str] | None = None,
    chat_template: str | None = None,
    alignment: int | None = None,
    metadata: dict[str, tuple[str, object]] | None = None,
) -> Path:
    """Write `weights` as a llama-architecture GGUF with a byte-level (gpt2) vocabulary.

    `types` maps a tensor name (e.g. "blk.0.attn_q.weight") or "*" to the GGML type to store
    it as (default F32; norms always F32). `drop_keys` / `drop_tensors` leave metadata keys or
    tensors out; `reshape` stores a tensor with another shape; `raw_tensors` stores bytes as
    given, with a type; `extra_tensors` adds F32 tensors; `alignment` sets
    general.alignment (default: gguf-py's, 32); `metadata` adds keys or replaces the written
    ones, key -> (GGUFWriter's add_ suffix, value), e.g. {"llama.rope.freq_base":
    ("float64", 1e300)}.
    """
    c = config
    types = types or {}
    vocab = vocab or (byte_tokens() + ["ĠĠ", "<|im_start|>", "<|im_end|>"])[: c.vocab_size]
    assert len(vocab) == c.vocab_size
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    keys = {
        "llama.context_length": ("uint32", c.seq_len),
        "llama.embedding_length": ("uint32", c.dim),
        "llama.block_count": ("uint32", c.n_layers),
        "llama.feed_forward_length": ("uint32", c.hidden_dim),
        "llama.attention.head_count": ("uint32", c.n_heads),
        "llama.attention.head_count_kv": ("uint32", c.n_kv_heads),
        "llama.attention.key_length": ("uint32", c.head_dim),
        "llama.attention.value_length": ("uint32", c.head_dim),
        "llama.rope.dimension_count": ("uint32", c.head_dim),
        "llama.rope.freq_base": ("float32", c.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": ("float32", c.norm_eps),
        "llama.vocab_size": ("uint32", c.vocab_size),
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", "smollm"),
        "tokenizer.ggml.bos_token_id": ("uint32", c.vocab_size - 2),
        "tokenizer.ggml.eos_token_id": ("uint32", c.vocab_size - 1),
        "tokenizer.ggml.add_bos_token": ("bool", False),
    }
    keys.update(metadata or {})
    for key, (kind, value) in keys.items():
        if key not in drop_keys:
            getattr(w, f"add_{kind}")(key, value)
    if "tokenizer.ggml.tokens" not in drop_keys:
        w.add_array("tokenizer.ggml.tokens", vocab)
    if "tokenizer.ggml.token_type" not in drop_keys:
        types_list = [3 if t.startswith("<|") else 1 for t in vocab]
        w.add_array("tokenizer.ggml.token_type", types_list)
    if "tokenizer.ggml.merges" not in drop_keys:
        w.add_array("tokenizer.ggml.merges", ["Ġ Ġ"])
    if chat_template is not None:
        w.add_string("tokenizer.chat_template", chat_template)

    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": weights.token_embedding_table,
        "output_norm.weight": weights.rms_final_weight,
    }
    if not c.shared_weights:
        tensors["output.weight"] = weights.wcls
    names = {
        "attn_norm": weights.rms_att_weight, "attn_q": weights.wq, "attn_k": weights.wk,
        "attn_v": weights.wv, "attn_output": weights.wo, "ffn_norm": weights.rms_ffn_weight,
        "ffn_gate": weights.w1, "ffn_down": weights.w2, "ffn_up": weights.w3,
    }
    for layer in range(c.n_layers):
        for short, stacked in names.items():
            tensors[f"blk.{layer}.{short}.weight"] = stacked[layer]
    tensors.update(extra_tensors or {})
    for name, array in tensors.items():
        if name in drop_tensors:
            continue
        array = np.ascontiguousarray(array, np.float32)
        if reshape and name in reshape:
            array = array.reshape(reshape[name])
        qtype = types.get(name, types.get("*", gguf.GGMLQuantizationType.F32))
        if array.ndim == 1:
            qtype = gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, (data, qtype) in (raw_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def converter_rope_factors(rope_theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The `rope_freqs.weight` tensor llama.cpp's convert_hf_to_gguf.py writes for a Hugging
    Face `rope_scaling` of type llama3 (`LlamaModel.generate_extra_tensors`): one divisor per
    rotated pair, f32[head_dim // 2]. The base frequencies are float32 (torch, as the converter
    computes them), and so is the arithmetic on each (the converter iterates over the tensor,
    so every step is a float32 scalar's, Python numbers taken as float32): wavelengths below
    L / high_freq_factor keep 1, above L / low_freq_factor take `factor`, between them
    1 / ((1 - s) / factor + s) with s = (L / wavelen - low) / (high - low),
    L = original_max_position_embeddings."""
    import math

    import torch

    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    divisors = []
    for freq in freqs.numpy():  # np.float32 scalars: NumPy 2 keeps Python numbers "weak"
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, np.float32)


def converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a Hugging Face q_proj / k_proj weight (rotate-half pairing: i with i + hd / 2)
    put back in Meta's order (adjacent pairs), as the converter's `LlamaModel.permute` does
    (n_heads: the projection's heads, n_kv_heads for k_proj)."""
    out = w.shape[0]
    return (w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_converted_llama(path: Path, hf_model) -> Path:
    """A transformers `LlamaForCausalLM` written as llama.cpp's convert_hf_to_gguf.py writes
    it with --outtype f32: context_length = max_position_embeddings, q/k rows by
    `converter_permute`, a llama3 `rope_scaling` as `rope_freqs.weight`
    (`converter_rope_factors`) and no scaling keys, `output.weight` only when untied. The
    vocabulary is `write_gguf`'s byte-level one (vocab_size must be at most 259)."""
    hf = hf_model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    config = ModelConfig(
        dim=hf.hidden_size, hidden_dim=hf.intermediate_size, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
        vocab_size=hf.vocab_size, seq_len=hf.max_position_embeddings,
        shared_weights=bool(hf.tie_word_embeddings), norm_eps=hf.rms_norm_eps,
        rope_theta=theta, head_dim=head_dim,
    )
    state = {k: v.detach().to("cpu").float().numpy() for k, v in hf_model.state_dict().items()}

    def stack(name: str, heads: int | None = None) -> np.ndarray:
        rows = [state[f"model.layers.{i}.{name}"] for i in range(config.n_layers)]
        return np.stack([converter_permute(r, heads) if heads else r for r in rows])

    embedding = state["model.embed_tokens.weight"]
    weights = TransformerWeights(
        token_embedding_table=embedding,
        rms_att_weight=stack("input_layernorm.weight"),
        wq=stack("self_attn.q_proj.weight", config.n_heads),
        wk=stack("self_attn.k_proj.weight", config.n_kv_heads),
        wv=stack("self_attn.v_proj.weight"), wo=stack("self_attn.o_proj.weight"),
        rms_ffn_weight=stack("post_attention_layernorm.weight"),
        w1=stack("mlp.gate_proj.weight"), w2=stack("mlp.down_proj.weight"),
        w3=stack("mlp.up_proj.weight"), rms_final_weight=state["model.norm.weight"],
        wcls=embedding if config.shared_weights else state["lm_head.weight"],
    )
    extra = {}
    if rope.get("rope_type", rope.get("type")) == "llama3":
        extra["rope_freqs.weight"] = converter_rope_factors(theta, head_dim, rope)
    return write_gguf(path, config, weights, extra_tensors=extra)
