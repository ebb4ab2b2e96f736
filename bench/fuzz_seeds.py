"""The fuzz harness's seeds (bench/fuzz.py): one valid input per reader, and a map of its bytes.

Each seed is written by the library that writes its format in the wild (gguf's GGUFWriter, jllama's
`write_checkpoint`, safetensors' `save_file`, tokenizers' `save`), so damage lands on a file laid
out as users get one; `regions` says what each byte range holds, so a case that ran can say what
its damage touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # gguf_files: the tests' GGUF writer, reused

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from jllama.model.config import ModelConfig  # noqa: E402
from jllama.formats.llama2c_layout import header_nbytes, layout  # noqa: E402
from jllama.formats.llama2c_writer import write_checkpoint  # noqa: E402
from jllama.model.weights import random_weights  # noqa: E402

KINDS = ("gguf", "llama2c", "tokenizer_bin", "hf", "template")


@dataclasses.dataclass(frozen=True)
class Seed:
    """One valid input: its files (name -> bytes) and how the command line is given them.

    Attributes:
      name: e.g. "gguf", "llama2c-v0", "hf".
      kind: which reader the seed is for (one of KINDS; llama2c seeds serve "llama2c" and
        "tokenizer_bin" cases).
      files: relative path in the case folder -> content.
      argv: the flags naming the files, with "{dir}" for the case folder.
      regions: file -> [(start, end, label)]: what each byte range of the seed holds, so a
        mutation can say what it touched.
      layout: the GGUF seed's `GGUFLayout` (None for the others).
    """

    name: str
    kind: str
    files: dict[str, bytes]
    argv: tuple[str, ...]
    regions: dict[str, list[tuple[int, int, str]]]
    layout: GGUFLayout | None = None


def tiny_config(vocab_size: int, seq_len: int = 128) -> ModelConfig:
    """The seeds' model: dim 64, 2 layers, 4 query heads over 2 KV heads (so grouped-query
    attention is read too), hidden 192 (a multiple of 32, so GGUF can store Q8_0 blocks)."""
    return ModelConfig(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2,
                       vocab_size=vocab_size, seq_len=seq_len, shared_weights=False)


_MERGES = (
    [("Ġ", "Ġ")] + [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"]
    + [tuple(p) for p in ("th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ou",
                          "es", "is")]
    + [("Ġt", "h"), ("Ġth", "e")]
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def vocabulary() -> list[str]:
    """300 byte-level tokens: GPT-2's 256 byte characters, 42 merged pieces, two specials."""
    from gguf_files import byte_tokens

    return byte_tokens() + ["".join(pair) for pair in _MERGES] + SPECIALS


def gguf_seed(folder: Path) -> Seed:
    """model.gguf through the tests' `write_gguf` (gguf's GGUFWriter), one Q8_0 tensor."""
    from gguf_files import write_gguf

    config = tiny_config(len(vocabulary()))
    path = write_gguf(folder / "model.gguf", config, random_weights(config, seed=1),
                      types={"blk.1.attn_q.weight": gguf.GGMLQuantizationType.Q8_0},
                      vocab=vocabulary(), chat_template="{% for m in messages %}{{ m.content }}"
                      "{% endfor %}")
    lay = gguf_layout(path)
    return Seed("gguf", "gguf", {"model.gguf": path.read_bytes()},
                ("--checkpoint={dir}/model.gguf",), {"model.gguf": lay.regions}, lay)


def llama2c_seed(folder: Path, version: int) -> Seed:
    """model.bin of llama2.c `version` (0: run.c's, 2: runq.c's Q8_0) and llama2.c's tok512.bin,
    passed with --tokenizer so a damaged one is not replaced by a tokenizer found elsewhere."""
    from jllama.model.loading import embedded_tokenizer

    config = tiny_config(512)
    write_checkpoint(folder / f"v{version}.bin", config, random_weights(config, seed=2),
                     version=version, group_size=64)
    files = {"model.bin": (folder / f"v{version}.bin").read_bytes(),
             "tokenizer.bin": embedded_tokenizer().read_bytes()}
    regions = {"model.bin": llama2c_regions(config, version),
               "tokenizer.bin": tokenizer_bin_regions(files["tokenizer.bin"])}
    return Seed(f"llama2c-v{version}", "llama2c", files,
                ("--checkpoint={dir}/model.bin", "--tokenizer={dir}/tokenizer.bin"), regions)


HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 298, "eos_token_id": 299,
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "rms_att_weight", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "rms_ffn_weight",
    "mlp.gate_proj.weight": "w1", "mlp.down_proj.weight": "w2", "mlp.up_proj.weight": "w3",
}


def hf_seed(folder: Path) -> Seed:
    """A Hugging Face folder as transformers saves one, each file by its own library:
    model.safetensors by `safetensors.numpy.save_file`, tokenizer.json by `tokenizers`."""
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    config = tiny_config(HF_CONFIG["vocab_size"], HF_CONFIG["max_position_embeddings"])
    w = random_weights(config, seed=3)
    tensors = {"model.embed_tokens.weight": w.token_embedding_table,
               "model.norm.weight": w.rms_final_weight, "lm_head.weight": w.wcls}
    for layer in range(config.n_layers):
        for name, field in HF_LAYER_NAMES.items():
            tensors[f"model.layers.{layer}.{name}"] = np.ascontiguousarray(
                getattr(w, field)[layer])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    tokens = vocabulary()[:-len(SPECIALS)]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(_MERGES))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))

    files = {
        "hf/config.json": json.dumps(HF_CONFIG, indent=2).encode(),
        "hf/model.safetensors": (folder / "model.safetensors").read_bytes(),
        "hf/tokenizer.json": (folder / "tokenizer.json").read_bytes(),
        "hf/tokenizer_config.json": json.dumps(
            {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "add_bos_token": False}).encode(),
    }
    regions = {name: [(0, len(data), f"{Path(name).name} text")] for name, data in files.items()}
    regions["hf/model.safetensors"] = safetensors_regions(files["hf/model.safetensors"])
    return Seed("hf", "hf", files, ("--checkpoint={dir}/hf",), regions)


def template_seed(gguf: Seed) -> Seed:
    """The GGUF seed in chat mode: a template case's seed."""
    return dataclasses.replace(gguf, name="template", kind="template",
                               argv=(*gguf.argv, "--mode=chat"))


def make_seeds(folder: Path) -> dict[str, Seed]:
    """Every seed, written under `folder` (scratch files; the seeds hold their bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    gguf = gguf_seed(folder)
    seeds = [gguf, llama2c_seed(folder, 0), llama2c_seed(folder, 2), hf_seed(folder),
             template_seed(gguf)]
    return {s.name: s for s in seeds}


# --------------------------------------------------------------------- layouts of the seeds


@dataclasses.dataclass
class GGUFLayout:
    """Where the fields of a (valid) GGUF file are, from `gguf.GGUFReader`'s parts.

    Attributes:
      kv: key -> [(offset, nbytes)] of its parts: key length, key bytes, value type, then the
        value's parts (a string: length, bytes; an array: item type, count, the items' parts).
      tensors: tensor name -> [(offset, nbytes)] of: name length, name, n_dims, dims, type,
        offset.
      info_end: the byte after the last tensor info; data_offset: where the data section
        starts (info_end rounded up to `alignment`).
      regions: (start, end, label) over the whole file.
    """

    kv: dict[str, list[tuple[int, int]]]
    tensors: dict[str, list[tuple[int, int]]]
    tensor_types: dict[str, int]
    info_end: int
    data_offset: int
    alignment: int
    regions: list[tuple[int, int, str]]


def _parts(field) -> list[tuple[int, int]]:
    """(offset, nbytes) of each part of a `gguf.ReaderField`, which lie one after another."""
    offsets, at = [], field.offset
    for part in field.parts:
        offsets.append((at, part.nbytes))
        at += part.nbytes
    return offsets


def gguf_layout(path: Path) -> GGUFLayout:
    """The seed's layout read with the gguf package (the seed is valid, so its reader is the
    reference for where every field sits)."""
    reader = gguf.GGUFReader(str(path))
    kv = {name: _parts(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: _parts(t.field) for t in reader.tensors}
    info_end = max(o + n for parts in tensors.values() for o, n in parts[-1:])
    regions = [(0, 24, "gguf header (magic, version, tensor and kv counts)")]
    regions += [(p[0][0], p[-1][0] + p[-1][1], f"metadata {k}") for k, p in kv.items()]
    regions += [(p[0][0], p[-1][0] + p[-1][1], f"tensor info {k}") for k, p in tensors.items()]
    regions.append((info_end, int(reader.data_offset), "alignment padding before the data"))
    for t in reader.tensors:
        start = int(t.data_offset)
        regions.append((start, start + int(t.n_bytes), f"tensor data {t.name}"))
    ends = sorted((int(t.data_offset) + int(t.n_bytes)) for t in reader.tensors)
    starts = sorted(int(t.data_offset) for t in reader.tensors)
    for end, nxt in zip(ends, starts[1:] + [path.stat().st_size]):
        if nxt > end:
            regions.append((end, nxt, "alignment padding between tensors"))
    return GGUFLayout(kv, tensors, {t.name: int(t.tensor_type) for t in reader.tensors},
                      info_end, int(reader.data_offset), int(reader.alignment), regions)


def llama2c_regions(config: ModelConfig, version: int) -> list[tuple[int, int, str]]:
    """Byte ranges of a llama2.c file: header fields, header padding, each stored tensor."""
    if version == 0:
        regions = [(0, 28, "llama2c header")]
    else:
        regions = [(0, 41, "llama2c header"), (41, 256, "unused header padding (zeros)")]
    at = header_nbytes(version)
    group = 64
    for seg in layout(config, version):
        n = math.prod(seg.shape)
        size = n + 4 * (n // group) if seg.q80 else 4 * n
        label = "RoPE table (run.c skips it)" if seg.name.startswith("freq_cis") else "weights"
        regions.append((at, at + size, f"{label} {seg.name}"))
        at += size
    return regions


def tokenizer_bin_regions(data: bytes) -> list[tuple[int, int, str]]:
    """Byte ranges of a tokenizer.bin: max_token_length, then each token's score, length and
    piece."""
    regions, at = [(0, 4, "max_token_length")], 4
    while at + 8 <= len(data):
        (length,) = struct.unpack_from("<i", data, at + 4)
        regions += [(at, at + 4, "token score"), (at + 4, at + 8, "token length"),
                    (at + 8, at + 8 + length, "token piece")]
        at += 8 + length
    return regions


def safetensors_regions(data: bytes) -> list[tuple[int, int, str]]:
    """Byte ranges of a safetensors file: the u64 header length, the JSON header, each tensor."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    regions = [(0, 8, "safetensors header length"), (8, 8 + n, "safetensors JSON header")]
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            regions.append((8 + n + start, 8 + n + end, f"tensor data {name}"))
    return regions
