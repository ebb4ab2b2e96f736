"""Random-weight GGUF files of the shapes people run: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B.

A file of a real model's exact shape costs what the real model costs (every byte of every
matrix is read per token, whatever the values), so speed and memory measured on it hold for
the real weights. Each is written once into `bench/.cache/scale/` (never in CI):

  1. F16, with the `gguf` package's writer (llama.cpp's gguf-py): every tensor of the real
     model's name and shape (tied embeddings for 1B/3B, `output.weight` for 8B, Llama 3.1's
     `rope_freqs.weight`), weights ~ N(0, 0.02) in float16, norms 1, and the tokenizer of
     llama.cpp's vocab-only `models/ggml-vocab-llama-bpe.gguf` (Llama 3's 128,256 tokens,
     its merges and specials) with Llama 3's chat template;
  2. Q4_K_M and Q8_0 by llama.cpp's own `llama-quantize` from that F16 file (its per-tensor
     type mix: Q4_K_M keeps some attn_v / ffn_down in Q6_K, the tied table in Q6_K).

    python bench/scale_models.py --models=1B --types=Q4_K_M \
        --vocab=/path/to/llama.cpp/models/ggml-vocab-llama-bpe.gguf \
        --quantize=bench/.cache/llama.cpp-build/bin/llama-quantize

prints each file's path. The F16 files are kept only with --keep_f16 (16 GB at 8B).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache" / "scale"
POOL = 1 << 24
"""Random float16 values the rows of every matrix are cut from."""


@dataclasses.dataclass(frozen=True)
class ScaleShape:
    """A published model's shape (its config.json), rope scaling as Llama 3.1's ("llama3")."""

    name: str
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    tied: bool
    rope_factor: float
    vocab_size: int = 128256
    context_length: int = 131072
    rope_theta: float = 500000.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SCALE_SHAPES = {
    s.name: s
    for s in (
        ScaleShape("1B", 2048, 8192, 16, 32, 8, tied=True, rope_factor=32.0),
        ScaleShape("3B", 3072, 8192, 28, 24, 8, tied=True, rope_factor=32.0),
        ScaleShape("8B", 4096, 14336, 32, 32, 8, tied=False, rope_factor=8.0),
    )
}
"""Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B (Meta's config.json files)."""

FULL_NAMES = {"1B": "Llama-3.2-1B", "3B": "Llama-3.2-3B", "8B": "Llama-3.1-8B"}


def rope_freq_factors(s: ScaleShape) -> np.ndarray:
    """f32[head_dim / 2]: what convert_hf_to_gguf.py stores as `rope_freqs.weight` for a
    Llama 3.1 rope_scaling (rope_type "llama3"): per frequency the divisor of its inv_freq,
    1 for short wavelengths, `factor` for long ones, interpolated between (Meta's
    `apply_scaling` in llama3's reference code, written out here)."""
    inv_freq = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    factors = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.rope_factor)
        else:
            smooth = (s.original_context / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / s.rope_factor + smooth))
    return np.asarray(factors, np.float32)


def tensor_shapes(s: ScaleShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape [rows, cols], is_norm) of every tensor, in convert_hf_to_gguf's
    order."""
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab_size, s.dim), False)]
    for layer in range(s.n_layers):
        p = f"blk.{layer}."
        out += [
            (p + "attn_norm.weight", (s.dim,), True),
            (p + "attn_q.weight", (q_dim, s.dim), False),
            (p + "attn_k.weight", (kv_dim, s.dim), False),
            (p + "attn_v.weight", (kv_dim, s.dim), False),
            (p + "attn_output.weight", (s.dim, q_dim), False),
            (p + "ffn_norm.weight", (s.dim,), True),
            (p + "ffn_gate.weight", (s.hidden_dim, s.dim), False),
            (p + "ffn_up.weight", (s.hidden_dim, s.dim), False),
            (p + "ffn_down.weight", (s.dim, s.hidden_dim), False),
        ]
    out.append(("output_norm.weight", (s.dim,), True))
    if not s.tied:
        out.append(("output.weight", (s.vocab_size, s.dim), False))
    return out


def _copy_tokenizer(writer, vocab_path: Path) -> None:
    """The tokenizer.* fields of a vocab-only GGUF, copied as they are."""
    import gguf

    reader = gguf.GGUFReader(str(vocab_path))
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i][0].item() for i in field.data]
            writer.add_key_value(key, values, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            writer.add_key_value(key, field.parts[field.data[0]][0].item(), kind)
        copied += 1
    if not copied:
        raise SystemExit(f"{vocab_path}: no tokenizer.* fields (not a vocab GGUF)")


def write_f16(s: ScaleShape, vocab_path: Path, path: Path, seed: int = 0) -> Path:
    """Write shape `s` as an F16 GGUF at `path` (a temporary name renamed when complete)."""
    import gguf

    from jllama.chat import LLAMA3_CHAT_TEMPLATE

    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(FULL_NAMES[s.name] + " (random weights)")
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.hidden_dim)
    w.add_block_count(s.n_layers)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(w, vocab_path)
    w.add_chat_template(LLAMA3_CHAT_TEMPLATE)
    shapes = tensor_shapes(s)
    factors = rope_freq_factors(s)
    w.add_tensor_info("rope_freqs.weight", factors.shape, np.dtype(np.float32), factors.nbytes)
    for name, shape, is_norm in shapes:
        dtype = np.dtype(np.float32 if is_norm else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_data(factors)
    # Fresh normals for 8 billion weights take ~10 minutes; rows cut from one pool of 16M at
    # random offsets take seconds and cost the same to run (no two rows alike in one matrix).
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL, np.float32) * np.float32(0.02)).astype(np.float16)
    for name, shape, is_norm in shapes:
        if is_norm:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        rows = np.empty(shape, np.float16)
        starts = rng.integers(0, POOL - shape[1], shape[0])
        for r, start in enumerate(starts):
            rows[r] = pool[start:start + shape[1]]
        w.write_tensor_data(rows)
        del rows
    w.close()
    os.replace(tmp, path)
    return path


def model_path(name: str, qtype: str) -> Path:
    """Where the file of shape `name` in type `qtype` ("F16", "Q4_K_M", "Q8_0") is cached."""
    return CACHE / f"{FULL_NAMES[name]}-random-{qtype}.gguf"


def ensure(name: str, qtype: str, vocab: Path | None, quantize: Path | None,
           keep_f16: bool = False, threads: int | None = None) -> Path:
    """The cached file of shape `name` in `qtype`, written first if missing (see the module
    docstring); SystemExit naming what is missing to make it."""
    out = model_path(name, qtype)
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = model_path(name, "F16")
    if not f16.exists():
        if vocab is None or not vocab.is_file():
            raise SystemExit(f"{out} is not cached: pass --vocab=.../models/ggml-vocab-llama-bpe.gguf")
        print(f"writing {f16}", file=sys.stderr)
        write_f16(SCALE_SHAPES[name], vocab, f16)
    if qtype == "F16":
        return f16
    if quantize is None or not quantize.is_file():
        raise SystemExit(f"{out} is not cached: pass --quantize=.../llama-quantize")
    tmp = out.with_suffix(".partial")
    cmd = [str(quantize), str(f16), str(tmp), qtype]
    if threads:
        cmd.append(str(threads))
    print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1B", help="comma-separated: 1B, 3B, 8B")
    ap.add_argument("--types", default="Q4_K_M", help="comma-separated: F16, Q4_K_M, Q8_0, ...")
    ap.add_argument("--vocab", type=Path, help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    ap.add_argument("--quantize", type=Path, help="llama.cpp's llama-quantize")
    ap.add_argument("--keep_f16", action="store_true", help="keep the F16 files")
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        if name not in SCALE_SHAPES:
            ap.error(f"--models: {name!r} is not one of {', '.join(SCALE_SHAPES)}")
        for qtype in args.types.split(","):
            print(ensure(name, qtype, args.vocab, args.quantize))
        f16 = model_path(name, "F16")
        if not args.keep_f16 and "F16" not in args.types.split(",") and f16.exists():
            f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
