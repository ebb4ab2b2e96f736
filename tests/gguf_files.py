"""Small GGUF files for tests, written with the `gguf` package's own writer (llama.cpp's
gguf-py), so the files are what llama.cpp's tools would produce, not what jllama's reader
expects."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jllama.config import ModelConfig
from jllama.weights import TransformerWeights

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
) -> Path:
    """Write `weights` as a llama-architecture GGUF with a byte-level (gpt2) vocabulary.

    `types` maps a tensor name (e.g. "blk.0.attn_q.weight") or "*" to the GGML type to store
    it as (default F32; norms always F32). `drop_keys` / `drop_tensors` leave metadata keys or
    tensors out; `reshape` stores a tensor with another shape; `raw_tensors` stores bytes as
    given, with a type; `extra_tensors` adds F32 tensors; `alignment` sets
    general.alignment (default: gguf-py's, 32).
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
