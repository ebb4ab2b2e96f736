"""Offline batches through the scheduler: aggregate generated tokens/s of B prompts at once
(`jllama.engine.complete_all` with B slots), B = 1, 2, 4, 8, 16, alternated over rounds.

    .venv/bin/python bench/offline_batch.py --checkpoint=smollm2 --dtype=float32 --tokens=64

Each measurement runs B short prompts to exactly --tokens new tokens each (greedy, end-of-
generation tokens ignored, as llama.cpp's and vLLM's benchmarks do), after one untimed run of
the same B (its programs compiled). `decode_tokens_per_s` counts the tokens after every
stream's first one over the steps that made them (the prompts' prefill apart);
`tokens_per_s` is everything from submission to the last token. One JSON line per
measurement, then a summary of each B's median decode rate and its ratio to B=1's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from run import machine_facts  # bench/ is the script's folder

HERE = Path(__file__).resolve().parent

PROMPTS = ["Once upon a time", "The capital of France", "Write a poem about", "My favourite food",
           "In the year 2050", "The best way to learn", "A cat and a dog", "Science is"]


def run_batch(session, b: int, tokens: int) -> tuple[float, int, float, int]:
    """(seconds, tokens generated, decode seconds, tokens generated in them)."""
    from jllama.engine import Request, Scheduler
    from jllama.sampling import SamplerConfig

    tok = session.tokenizer
    scheduler = Scheduler(session, n_slots=b)
    start = time.perf_counter()
    streams = [scheduler.submit(Request(tok.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})"),
                                        SamplerConfig(temperature=0.0), max_tokens=tokens,
                                        ignore_eos=True)) for i in range(b)]
    while not all(s.generated_ids for s in streams):  # prefill and every first token
        scheduler.step()
    decode_start = time.perf_counter()
    first = sum(len(s.generated_ids) for s in streams)
    scheduler.run()
    end = time.perf_counter()
    generated = sum(len(s.generated_ids) for s in streams)
    return end - start, generated, end - decode_start, generated - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from jllama.generation.session import Session

    session = Session.open(args.checkpoint, seq_len=args.seq_len,
                           dtype=None if args.dtype == "auto" else args.dtype,
                           device_sampling=False)
    sizes = [int(b) for b in args.batches.split(",")]
    print(json.dumps({"meta": True, "checkpoint": args.checkpoint, "dtype": args.dtype,
                      "tokens": args.tokens, "cpus": os.cpu_count(),
                      **machine_facts(HERE / ".cache")}), flush=True)
    for b in sizes:
        run_batch(session, b, args.tokens)  # compiles this size's programs
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(args.rounds):
        for b in sizes:
            seconds, generated, decode_seconds, decoded = run_batch(session, b, args.tokens)
            rates[b].append(decoded / decode_seconds)
            print(json.dumps({"round": r, "batch": b, "seconds": round(seconds, 3),
                              "generated": generated,
                              "tokens_per_s": round(generated / seconds, 1),
                              "decode_tokens_per_s": round(decoded / decode_seconds, 1)}),
                  flush=True)
    base = statistics.median(rates[sizes[0]])
    print(json.dumps({"summary": {str(b): {
        "median_decode_tokens_per_s": round(statistics.median(v), 1),
        "x_vs_first": round(statistics.median(v) / base, 2)} for b, v in rates.items()}}),
        flush=True)


if __name__ == "__main__":
    main()
