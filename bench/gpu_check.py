"""The prepared GPU check (issue 38, point 4): one command, JSON lines to a folder.

    .venv/bin/python bench/gpu_check.py --out=bench/results/gpu-check     # on the GPU machine
    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_check.py --scale-down --out=/tmp/gc   # CPU

What it measures, each as one JSON line in OUT/gpu_check.jsonl (and on stdout):

  device      JAX's platform and device kind, versions of jax / torch / transformers
  greedy      SmolLM2 (float32, XLA's products) greedy ids on the default device (the GPU)
              against JAX's CPU device for --greedy_tokens tokens: equal, or where they part
              the CPU logits' top-2 margin (the issue's tolerance: < 1e-3)
  greedy_batch  four prompts decoded side by side by the batched step on the device, each
              against its ids alone on the CPU (the same test)
  decode      a random Llama-3.2-1B-shaped model (dim 2048, 16 layers, 32 heads, 8 KV heads,
              vocabulary 128256, tied classifier) at bfloat16 and int8 (per-row scales):
              decode tok/s at B = 1 (`forward`), 8 and 64 (`decode_batch`, the batched XLA
              step; logits come back to the host each step), compile seconds
  prefill     that model's prefill of --prefill tokens (tok/s, after a warm-up run)
  memory      the device's bytes in use and peak (`Device.memory_stats`) after each model
  torch       the same shape in transformers + torch (bfloat16, random weights) on the same
              device: decode tok/s at B = 1, 8, 64 and the prefill, torch's peak memory

On the GPU machine (no network; SmolLM2's 98 MB GGUF is over what a run may carry, 64 MiB),
from the repository root: `python bench/gpu_check.py --out=$OUT/gpu-check
[--smollm2=PATH]`; without the file the greedy section checks the embedded stories260K
instead and says why (`fallback_because`). It needs jax, numpy and ml_dtypes (jllama is
imported from this checkout), and torch + transformers for the side-by-side figure.

--scale-down runs the same sections on a tiny model (and stories260K for the greedy check)
so that a test runs the whole script on a CPU in seconds. A section that cannot run (no
SmolLM2 file, no torch) writes a line with "skipped" and its reason; the rest go on. Sections
are skipped too once --budget_s seconds have passed (the machine is lent for minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # jllama from this checkout
from jllama.backends import make_backend  # noqa: E402
from jllama.model.config import ModelConfig  # noqa: E402
from jllama.model.weights import cast_weights, random_weights  # noqa: E402

LLAMA_32_1B = ModelConfig(
    dim=2048, hidden_dim=8192, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
    seq_len=4096, shared_weights=True, norm_eps=1e-5, rope_theta=500000.0,
)
"""Llama-3.2-1B's shape (its RoPE scaling left out: the rate does not depend on it)."""

TINY = ModelConfig(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                   vocab_size=256, seq_len=320, shared_weights=True)
"""The --scale-down model: Llama-3.2-1B's structure (GQA, tied classifier) in miniature."""


class Report:
    """JSON lines to OUT/gpu_check.jsonl and stdout; the seconds since the start."""

    def __init__(self, out: Path, budget_s: float):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu_check.jsonl"
        self.path.write_text("")
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def line(self, **fields) -> None:
        fields["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        text = json.dumps(fields)
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")

    def over(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s


def memory(device) -> dict:
    """The device's bytes in use and peak, where its runtime says (GPUs); else {}."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a platform without memory statistics
        stats = {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if k in stats}


def greedy_ids(backend, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy ids after `prompt` on `backend` (prefill, then `forward` a token at a time),
    and the logits each came from."""
    logits = backend.prefill(prompt, 0)
    ids, rows = [], []
    for i in range(n):
        ids.append(int(np.argmax(logits)))
        rows.append(np.asarray(logits))
        if i + 1 < n:
            logits = backend.forward(ids[-1], len(prompt) + i)
    return ids, rows


def batched_greedy_ids(backend, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy ids after each prompt, the prompts decoded side by side in one batch
    (`decode_batch`, the batched XLA step) after each one's prefill."""
    caches, ids = [], []
    for prompt in prompts:
        c = backend.new_caches()
        previous = backend.use_caches(c)
        ids.append([int(np.argmax(backend.prefill(prompt, 0)))])
        backend.use_caches(previous)
        caches.append(c)
    for i in range(1, n):
        logits = backend.decode_batch([r[-1] for r in ids],
                                      [len(p) + i - 1 for p in prompts], caches)
        for r, row in zip(ids, logits, strict=True):
            r.append(int(np.argmax(row)))
    return ids


def parting(a: list[int], c: list[int], rows: list[np.ndarray]) -> tuple[int | None, float | None]:
    """Where ids a and c first differ, and the top-2 margin of rows (c's logits) there."""
    part = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), None)
    if part is None:
        return None, None
    top = np.sort(rows[part])[-2:]
    return part, float(top[1] - top[0])


def check_greedy(report: Report, args) -> None:
    """SmolLM2 (stories260K scaled down) greedy ids: the default device against the CPU."""
    from jllama.model.loading import open_model

    note = None
    try:
        model = open_model(None if args.scale_down else args.smollm2,
                           seq_len=64 if args.scale_down else 512, dtype="float32")
        name = "stories260K" if args.scale_down else "smollm2"
    except Exception as e:  # no SmolLM2 file here (the GPU machine has no network)
        note = f"{args.smollm2}: {type(e).__name__}: {e}"[:300]
        model, name = open_model(None, seq_len=512, dtype="float32"), "stories260K"
    texts = ["Once upon a time, in a small village,", "The capital of France is",
             "def fibonacci(n):", "Water boils at"]
    prompts = [model.tokenizer.encode(t) for t in texts[:2 if args.scale_down else 4]]
    n = 4 if args.scale_down else args.greedy_tokens
    ids, rows, batch = {}, {}, {}
    for where, device in (("device", jax.devices()[0]), ("cpu", jax.devices("cpu")[0])):
        b = make_backend("jax", device=device, matvec="xla")
        b.prepare(model.config, model.weights)
        alone = [greedy_ids(b, p, n) for p in prompts]
        ids[where], rows[where] = [a[0] for a in alone], [a[1] for a in alone]
        if where == "device":
            batch = batched_greedy_ids(b, prompts, n)
        del b
    part, margin = parting(ids["device"][0], ids["cpu"][0], rows["cpu"][0])
    worst = (max(float(np.abs(a - c).max()) for a, c in zip(rows["device"][0], rows["cpu"][0]))
             if part is None else None)
    # The batched step on the device against each prompt alone on the CPU.
    batch_parts = [parting(bi, ci, cr) for bi, ci, cr in zip(batch, ids["cpu"], rows["cpu"])]
    report.line(section="greedy_batch", model=name, prompts=len(prompts), tokens=n,
                equal=all(p is None for p, _ in batch_parts),
                parted_at=[p for p, _ in batch_parts], cpu_top2_margin=[m for _, m in batch_parts],
                ok=all(p is None or m < 1e-3 for p, m in batch_parts))
    ids = {k: v[0] for k, v in ids.items()}
    report.line(section="greedy", model=name, fallback_because=note,
                tokens=n, equal=part is None, parted_at=part, cpu_top2_margin=margin,
                ok=part is None or margin < 1e-3, max_logit_diff=worst,
                device_ids=ids["device"], cpu_ids=ids["cpu"])


def decode_rates(report: Report, backend, config: ModelConfig, label: str, args) -> None:
    """Decode tok/s at each batch size of args.batches (1: `forward`; more: `decode_batch`)."""
    steps = args.steps
    for b in args.batches:
        if report.over():
            report.line(section="decode", model=label, batch=b, skipped="over the budget")
            continue
        rng = np.random.default_rng(b)
        tokens = [int(t) for t in rng.integers(0, config.vocab_size, b)]
        began = time.perf_counter()
        if b == 1:
            backend.forward(tokens[0], 0)  # compiled by prepare; warms the first block
            first = time.perf_counter() - began
            start = time.perf_counter()
            token = tokens[0]
            for pos in range(1, steps + 1):
                token = int(np.argmax(backend.forward(token, pos)))
        else:
            caches = [backend.new_caches() for _ in range(b)]
            backend.decode_batch(tokens, [0] * b, caches)  # compiles this size
            first = time.perf_counter() - began
            start = time.perf_counter()
            for pos in range(1, steps + 1):
                logits = backend.decode_batch(tokens, [pos] * b, caches)
                tokens = [int(t) for t in np.argmax(logits, axis=-1)]
            del caches
        seconds = time.perf_counter() - start
        report.line(section="decode", model=label, batch=b, steps=steps,
                    tok_s=round(b * steps / seconds, 1), step_ms=round(seconds / steps * 1e3, 2),
                    first_call_s=round(first, 2),
                    attention=backend.batch_attention() if b > 1 else None,
                    **memory(backend.device))


def prefill_rate(report: Report, backend, config: ModelConfig, label: str, n: int) -> None:
    """Prefill of n random tokens (from position 0), timed after one untimed run."""
    if report.over():
        report.line(section="prefill", model=label, skipped="over the budget")
        return
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, n)]
    began = time.perf_counter()
    backend.prefill(tokens, 0)  # compiles the chunk programs
    first = time.perf_counter() - began
    start = time.perf_counter()
    np.asarray(backend.prefill(tokens, 0))
    seconds = time.perf_counter() - start
    report.line(section="prefill", model=label, tokens=n, tok_s=round(n / seconds, 1),
                seconds=round(seconds, 3), first_call_s=round(first, 2),
                **memory(backend.device))


def check_jax_model(report: Report, args, config: ModelConfig, dtype: str, weights) -> None:
    label = f"{args.shape_name}-{dtype}"
    if report.over():
        report.line(section="model", model=label, skipped="over the budget")
        return
    began = time.perf_counter()
    backend = make_backend("jax", matvec="xla")
    backend.prepare(config, cast_weights(weights, dtype))
    report.line(section="model", model=label, prepare_s=round(time.perf_counter() - began, 2),
                compile_s=round(backend.compile_seconds, 2), **memory(backend.device))
    decode_rates(report, backend, config, label, args)
    prefill_rate(report, backend, config, label, args.prefill)
    del backend


def check_torch(report: Report, args, config: ModelConfig) -> None:
    """The same shape in transformers + torch, bfloat16, random weights, on torch's GPU (or
    its CPU when there is none)."""
    label = f"{args.shape_name}-bfloat16-torch"
    if report.over():
        report.line(section="torch", model=label, skipped="over the budget")
        return
    try:
        import torch
        import transformers
    except ImportError as e:
        report.line(section="torch", model=label, skipped=f"ImportError: {e}")
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_config = transformers.LlamaConfig(
        hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, vocab_size=config.vocab_size,
        max_position_embeddings=config.seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.shared_weights,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        for b in args.batches:
            if report.over():
                report.line(section="torch", model=label, batch=b, skipped="over the budget")
                continue
            ids = torch.randint(0, config.vocab_size, (b, 1), device=device)
            out = model(input_ids=ids, use_cache=True)  # the cache of position 0; warms up
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            seconds = time.perf_counter() - start
            report.line(section="torch", model=label, batch=b, steps=args.steps,
                        tok_s=round(b * args.steps / seconds, 1),
                        step_ms=round(seconds / args.steps * 1e3, 2))
        if not report.over():
            ids = torch.randint(0, config.vocab_size, (1, args.prefill), device=device)
            model(input_ids=ids)  # warm-up
            sync()
            start = time.perf_counter()
            model(input_ids=ids)
            sync()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
            report.line(section="torch", model=label, prefill_tokens=args.prefill,
                        prefill_tok_s=round(args.prefill / seconds, 1), peak_bytes=peak,
                        torch=torch.__version__, transformers=transformers.__version__,
                        device=str(device))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.jsonl")
    p.add_argument("--scale-down", dest="scale_down", action="store_true",
                   help="a tiny model and few steps (a CPU test of the whole script)")
    p.add_argument("--smollm2", default="smollm2", help="SmolLM2's GGUF (path or name)")
    p.add_argument("--greedy_tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--dtypes", default="bfloat16,int8")
    p.add_argument("--budget_s", type=float, default=420.0,
                   help="skip the sections that start after this many seconds")
    p.add_argument("--no_torch", action="store_true")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.scale_down:
        config, args.shape_name = TINY, "tiny"
        args.steps, args.prefill = min(args.steps, 3), min(args.prefill, 16)
        args.batches = sorted({min(b, 2) for b in args.batches})
    else:
        config, args.shape_name = LLAMA_32_1B, "llama-3.2-1b-shaped"
    report = Report(Path(args.out), args.budget_s)
    device = jax.devices()[0]
    versions = {"jax": jax.__version__}
    for name in ("torch", "transformers"):  # from the installed metadata: no import
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    report.line(section="device", platform=device.platform, kind=device.device_kind,
                devices=jax.device_count(), scale_down=args.scale_down, **versions,
                config=dataclasses.asdict(config))
    sections = [("greedy", lambda: check_greedy(report, args))]
    weights = []

    def jax_model(dtype):
        def run():
            if not weights:
                weights.append(random_weights(config, seed=0, scale=0.02))
            check_jax_model(report, args, config, dtype, weights[0])
        return run

    sections += [(f"jax-{d}", jax_model(d)) for d in args.dtypes.split(",")]
    if not args.no_torch:
        sections.append(("torch", lambda: check_torch(report, args, config)))
    failed = 0
    for name, run in sections:
        try:
            run()
        except Exception as e:  # one section's failure is a line; the others still run
            failed += 1
            report.line(section=name, error=f"{type(e).__name__}: {e}"[:500],
                        trace=traceback.format_exc()[-1500:])
    report.line(section="done", failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
