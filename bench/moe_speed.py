"""Decode speed of a Mixture-of-Experts model against a dense one with the same active
parameters (issue 36: a MoE token reads only its routed experts, so it should decode at about
the dense model's rate).

Two random-weight qwen3 / qwen3moe GGUF files (F16, written with the `gguf` package's writer,
the tiny Qwen tokenizer of tests/data/qwen_tiny's MoE file; into bench/.cache/moe/, never in
CI), then, with --quantize (llama.cpp's llama-quantize), Q8_0 copies:

  - moe: Qwen3-30B-A3B's expert count and top-k (128 experts, 8 routed per token, no shared
    expert) in a scaled-down body (by default dim 256, 6 layers, experts 128 wide);
  - dense: the same attention, and one SwiGLU FFN of width top_k * expert width (1024), so a
    token multiplies the same number of FFN weights (the MoE adds its router, 128 x dim).

Each is run by the jax backend (its default CPU path: the kernels): a prefill of `--prompt`
random tokens timed (after one that compiles), then a few prompt tokens and `--warmup`
untimed decode steps, then `--tokens` decode steps timed, alternating moe / dense for `--rounds`; one JSON line per run:

    python bench/moe_speed.py [--quantize=/path/to/llama-quantize] [--tokens=64 --rounds=2]

Keep the runs short on a shared machine: the files are ~150 MB (F16) at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache" / "moe"
VOCAB_FILE = ROOT / "tests" / "data" / "qwen_tiny" / "qwen3moe-tiny-Q8_0.gguf"
"""Where the tokenizer.* fields are copied from (Qwen's byte-level BPE cut to 416 tokens)."""


def _copy_tokenizer(writer, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
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


def tensors(args, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor of the moe or dense file (row-major, out x in;
    experts [n_experts, rows, cols])."""
    d, hd = args.dim, args.head_dim
    q_dim, kv_dim = args.n_heads * hd, args.n_kv_heads * hd
    e, w = args.experts, args.expert_width
    out = [("token_embd.weight", (args.vocab, d))]
    for layer in range(args.layers):
        p = f"blk.{layer}."
        out += [(p + "attn_norm.weight", (d,)), (p + "attn_q.weight", (q_dim, d)),
                (p + "attn_k.weight", (kv_dim, d)), (p + "attn_v.weight", (kv_dim, d)),
                (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,)),
                (p + "attn_output.weight", (d, q_dim)), (p + "ffn_norm.weight", (d,))]
        if moe:
            out += [(p + "ffn_gate_inp.weight", (e, d)), (p + "ffn_gate_exps.weight", (e, w, d)),
                    (p + "ffn_up_exps.weight", (e, w, d)),
                    (p + "ffn_down_exps.weight", (e, d, w))]
        else:
            h = args.top_k * w
            out += [(p + "ffn_gate.weight", (h, d)), (p + "ffn_up.weight", (h, d)),
                    (p + "ffn_down.weight", (d, h))]
    return out + [("output_norm.weight", (d,))]


def write_f16(args, moe: bool, path: Path) -> Path:
    """The random F16 file (norms and the router F32), written under a temporary name."""
    import gguf

    arch = "qwen3moe" if moe else "qwen3"
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"random {arch} for bench/moe_speed.py")
    w.add_context_length(args.context)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.top_k * args.expert_width)
    w.add_block_count(args.layers)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(args.experts)
        w.add_expert_used_count(args.top_k)
        w.add_expert_feed_forward_length(args.expert_width)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(w, VOCAB_FILE)
    rng = np.random.default_rng(args.seed)
    shapes = tensors(args, moe)
    for name, shape in shapes:
        f32 = len(shape) == 1 or "gate_inp" in name
        dtype = np.dtype(np.float32 if f32 else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        values = rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[-1]))
        w.write_tensor_data(values if "gate_inp" in name else values.astype(np.float16))
    w.close()
    os.replace(tmp, path)
    return path


def ensure(args, moe: bool) -> Path:
    """The file to run (written once into CACHE): F16, or Q8_0 with --quantize."""
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = (f"{'moe' if moe else 'dense'}-d{args.dim}-l{args.layers}-e{args.experts}"
            f"-k{args.top_k}-w{args.expert_width}-s{args.seed}")
    f16 = CACHE / f"{stem}-F16.gguf"
    if not f16.exists():
        write_f16(args, moe, f16)
    if args.quantize is None:
        return f16
    q8 = CACHE / f"{stem}-Q8_0.gguf"
    if not q8.exists():
        subprocess.run([str(args.quantize), str(f16), str(q8), "Q8_0", "1"], check=True,
                       capture_output=True)
    return q8


def decode_rate(path: Path, args) -> dict:
    """Decode tok/s of the file on the jax backend (the kernels where they build)."""
    from jllama.backends import make_backend
    from jllama.model.loading import open_model

    model = open_model(path, seq_len=args.context)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    long = [int(t) for t in np.random.default_rng(1).integers(1, args.vocab, args.prompt)]
    backend.prefill(long, 0)  # compiles the chunk programs
    backend.use_caches(backend.new_caches())
    start = time.perf_counter()
    backend.prefill(long, 0)
    prefill_seconds = time.perf_counter() - start
    backend.use_caches(backend.new_caches())
    prompt = list(range(1, 9))
    logits = backend.prefill(prompt, 0)
    token, pos = int(np.argmax(logits)), len(prompt)
    for _ in range(args.warmup):  # untimed: the first reads of each expert's pages
        token = int(np.argmax(backend.forward(token, pos)))
        pos += 1
    start = time.perf_counter()
    for _ in range(args.tokens):
        token = int(np.argmax(backend.forward(token, pos)))
        pos += 1
    seconds = time.perf_counter() - start
    c = model.config
    ffn = 3 * c.dim * c.hidden_dim * c.n_layers
    return {
        "model": "moe" if c.moe else "dense", "file": path.name, "matvec": backend.matvec,
        "n_experts": c.n_experts, "top_k": c.n_experts_per_tok,
        "active_ffn_params": ffn * (c.n_experts_per_tok if c.moe else 1),
        "total_params": c.n_params(), "warmup_tokens": args.warmup,
        "decode_tokens": args.tokens,
        "decode_tok_s": round(args.tokens / seconds, 2), "prefill_tokens": args.prompt,
        "prefill_tok_s": round(args.prompt / prefill_seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--n_heads", type=int, default=8)
    parser.add_argument("--n_kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=128, help="Qwen3-30B-A3B: 128")
    parser.add_argument("--top_k", type=int, default=8, help="Qwen3-30B-A3B: 8")
    parser.add_argument("--expert_width", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=416, help="the tokenizer's size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", type=Path, help="llama-quantize: run Q8_0 copies")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prefill tokens timed")
    parser.add_argument("--warmup", type=int, default=32, help="untimed decode steps first")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    files = {moe: ensure(args, moe) for moe in (True, False)}
    for _ in range(args.rounds):
        for moe in (True, False):
            print(json.dumps(decode_rate(files[moe], args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
