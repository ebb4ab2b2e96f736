"""Prefill of one prompt, jllama against llama.cpp's `llama-bench -p N`, alternated; JSON lines.

    .venv/bin/python bench/prefill_vs.py --checkpoint=bench/.cache/smollm2.bin \\
      --vs "bench/.cache/llama.cpp-build/bin/llama-bench -m /tmp/smollm2-F32.gguf -t 2 -p 512 -n 0 -r 3"

Each repetition: a fresh process (`--child`) loads the checkpoint (`--seq_len`, default 1024),
prepares the jax backend, prefills a random prompt of `--tokens` ids once untimed (compiles),
then `--runs` more times timed, and reports the median; then the `--vs` command runs and its
`ppN` row's mean is read (`| ... | pp512 | 1118.78 ± 5.55 |`). One JSON line per measurement,
then one with the per-pair ratios jllama / llama.cpp and their median.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys

_PP = re.compile(r"\|\s*pp[0-9]+\s*\|\s*([0-9]+(?:\.[0-9]*)?)\s*±")


def child(args: argparse.Namespace) -> None:
    from worker import prompt_tokens, time_prefill

    from jllama.backends import make_backend
    from jllama.loading import open_model

    model = open_model(args.checkpoint, need_tokenizer=False, dtype=args.dtype,
                       seq_len=args.seq_len)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    ids = prompt_tokens(args.tokens, model.config.vocab_size, seed=0)
    time_prefill(backend, "batched", ids)  # compiles the chunk programs
    rates = [args.tokens / time_prefill(backend, "batched", ids) for _ in range(args.runs)]
    print(json.dumps({"prefill_tok_s": statistics.median(rates), "runs": rates}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--vs", required=True, help="a llama-bench command line with -p N -n 0")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    key = {"checkpoint": args.checkpoint, "dtype": args.dtype, "tokens": args.tokens}
    ratios = []
    for rep in range(args.reps):
        argv_child = [sys.executable, __file__, "--child", *(a for a in sys.argv[1:])]
        done = subprocess.run(argv_child, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            print(f"jllama run failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        ours = json.loads(done.stdout.strip().splitlines()[-1])
        other = subprocess.run(shlex.split(args.vs), capture_output=True, text=True,
                               timeout=900)
        found = _PP.findall(other.stdout + other.stderr)
        if not found:
            print(f"--vs printed no ppN row: {(other.stdout + other.stderr)[-500:]!r}",
                  file=sys.stderr)
            return 1
        theirs = float(found[-1])
        ratios.append(ours["prefill_tok_s"] / theirs)
        print(json.dumps({**key, "rep": rep + 1, "metric": f"prefill_{args.tokens}_tok_s",
                          "jllama": ours["prefill_tok_s"], "jllama_runs": ours["runs"],
                          "vs": theirs, "ratio": ratios[-1]}), flush=True)
    print(json.dumps({**key, "metric": f"prefill_{args.tokens}_ratio_vs", "command": args.vs,
                      "median": statistics.median(ratios), "values": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
