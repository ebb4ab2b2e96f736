"""Aggregate decode rate of the jax backend's batched decode step (`decode_batch`, issue 20):
B sequences at different positions, one token each per step, for B = 1, 2, 4, 8, 16, in
alternating rounds within one process. Prints JSON lines: one naming the machine, one per
(round, B), and a summary with each B's median rate and its ratio to B = 1.

  .venv/bin/python bench/batch_decode.py [--model=smollm2] [--dtype=float32] [--steps=64]
      [--rounds=3] [--batches=1,2,4,8,16] [--seq_len=512]

The model is read as `jllama.model.loading.open_model(model, seq_len, dtype=dtype)` (smollm2: the
Q4_1 GGUF dequantized to float32; `jllama fetch smollm2` first). JLLAMA_MARCH=x86-64-v3 in the
environment measures the kernels' AVX2 build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from run import machine_facts  # bench/ is the script's folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4,8,16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from jllama.backends import prepared_backend
    from jllama.model.loading import open_model

    model = open_model(args.model, seq_len=args.seq_len, dtype=args.dtype, need_tokenizer=False)
    backend = prepared_backend(model, "jax")
    info = {"machine": platform.machine(), "cores": os.cpu_count(),
            **machine_facts(Path(__file__).resolve().parent / ".cache")}
    info.update(bench="batch_decode", model=args.model, dtype=args.dtype, seq_len=args.seq_len,
                steps=args.steps, matvec=backend.matvec, batched=backend.batch_kernels())
    print(json.dumps(info), flush=True)
    config = backend.config
    rng = np.random.default_rng(0)
    top = max(batches)
    # Start positions 0 .. ~190, different per sequence; every round advances them by `steps`
    # (rounds * steps + 190 < seq_len).
    starts = [int(s) for s in rng.integers(0, 190, top)]
    if max(starts) + args.rounds * args.steps + 1 >= config.seq_len:
        raise SystemExit("seq_len too short for these rounds and steps")
    # Each B gets its own B sequences, prefilled to their start positions.
    seqs = {}
    for b in batches:
        caches = []
        for s in starts[:b]:
            c = backend.new_caches()
            if s:
                before = backend.use_caches(c)
                backend.prefill([int(t) for t in rng.integers(0, config.vocab_size, s)], 0)
                backend.use_caches(before)
            caches.append(c)
        seqs[b] = {"caches": caches, "pos": list(starts[:b])}
    # Compile every (size, window) the rounds reach, on throwaway caches.
    for b in batches:
        spare = [backend.new_caches() for _ in range(b)]
        backend.decode_batch([0] * b, [0] * b, spare)
        far = max(starts) + args.rounds * args.steps
        if far >= backend.block_length:
            backend.decode_batch([0] * b, [far] * b, spare)
    results = {b: [] for b in batches}
    for r in range(args.rounds):
        for b in batches:
            s = seqs[b]
            tokens = [int(t) for t in rng.integers(0, config.vocab_size, b)]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                logits = backend.decode_batch(tokens, s["pos"], s["caches"])
                tokens = [int(t) for t in logits.argmax(axis=1)]
                s["pos"] = [p + 1 for p in s["pos"]]
            dt = time.perf_counter() - t0
            rate = b * args.steps / dt
            results[b].append(rate)
            print(json.dumps({"round": r, "batch": b, "steps": args.steps, "seconds": round(dt, 3),
                              "tokens_per_s": round(rate, 1),
                              "step_ms": round(1000 * dt / args.steps, 2)}), flush=True)
    base = statistics.median(results[batches[0]])
    print(json.dumps({"summary": {str(b): {"median_tokens_per_s": round(statistics.median(v), 1),
                                           "x_vs_first": round(statistics.median(v) / base, 2)}
                                  for b, v in results.items()},
                      "kernel_march": info["kernel_march"]}), flush=True)


if __name__ == "__main__":
    main()
