"""Time to first token of a request whose prompt shares a long prefix with a finished one
(`jllama serve --parallel=N` reuses a free slot's cache), against the same request cold.

    .venv/bin/python bench/prefix_reuse.py --checkpoint=smollm2 --seq_len=1024 --prefix=400

Each round sends a cold request (a prompt of about --prefix tokens that no slot holds, since
its first words are new each round) and then a warm one (the same prefix, another ending),
streamed with max_tokens=1, and prints one JSON line: both times to the first token, their
ratio, and the cached_tokens the server reported for each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import httpx
from run import machine_facts  # bench/ is the script's folder
from serve_load import start_server, stop_server

WORDS = ("apple river stone cloud light music garden window paper story morning bridge "
         "forest silver candle winter ocean market letter mountain").split()


def first_token(http: httpx.Client, url: str, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, usage.prompt_tokens_details.cached_tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, cached = None, None
    with http.stream("POST", url + "/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - start
            if event.get("usage"):
                cached = event["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    return (first if first is not None else time.perf_counter() - start), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=400, help="words of shared prefix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="jllama serve --dtype")
    args = parser.parse_args()
    process, url, model = start_server(args.checkpoint, args.seq_len, args.dtype, parallel=4,
                                       max_waiting=10)
    try:
        print(json.dumps({"meta": True, "checkpoint": args.checkpoint or "stories260K",
                          "cpus": os.cpu_count(), "load1": os.getloadavg()[0],
                          **machine_facts(Path(__file__).resolve().parent / ".cache")}),
              flush=True)
        ratios = []
        with httpx.Client(timeout=120) as http:
            first_token(http, url, model, "warm up")  # the programs, compiled once
            for r in range(args.rounds + 1):
                prefix = " ".join(WORDS[(r * 7 + i * 3) % len(WORDS)] for i in range(args.prefix))
                prefix = f"Round {r} begins. " + prefix
                cold, cold_cached = first_token(http, url, model, prefix + " and the end.")
                warm, warm_cached = first_token(http, url, model, prefix + " but then, at last")
                if r == 0:
                    continue  # the first round also compiles the long prompt's chunk programs
                ratios.append(warm / cold)
                print(json.dumps({"round": r, "cold_ttft_s": round(cold, 4),
                                  "warm_ttft_s": round(warm, 4), "ratio": round(warm / cold, 3),
                                  "cold_cached_tokens": cold_cached,
                                  "warm_cached_tokens": warm_cached}), flush=True)
        print(json.dumps({"ratio_median": round(statistics.median(ratios), 3)}), flush=True)
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
