"""How fast any f32 decode could run here: the memory-read ceiling beside llama2.c's run.c.

    .venv/bin/python bench/ceiling.py --shapes=stories15M,stories110M --reps=5 \\
      --vs "bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0"

A decode step of a float32 model reads every weight once (`worker.streamed_bytes_per_token`),
so it cannot run faster than the machine's read bandwidth over those bytes. For each shape
and repetition this builds `stream_read.cc` once (`-O3 -march=native -fopenmp`, into
`bench/.cache/`), times two threads summing a buffer of exactly that many bytes (seven ways:
plain loads, prefetches of several kinds and distances, two streams a thread; the fastest
counts, which if anything flatters the ceiling), then runs the
`--vs` program on the shape, alternating. JSON lines: the read GB/s, the tok/s it allows
(GB/s over the bytes per token), the other program's tok/s, and per pair the ratio of the
ceiling to it: what no f32 decode reading its weights once per token can exceed in that
minute. The buffer is as big as the weights, so a shape that fits in the L3 cache reads from
it here as the model would.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shapes as shapes_mod  # bench/ is not a package: its modules are imported by file name
import vs as vs_mod

SOURCE = HERE / "stream_read.cc"


def f32_bytes_per_token(config) -> int:
    """Bytes of f32 weights one decode step reads: every layer's matrices and norms, the
    final norm, the classifier, and one embedding row when the table is not the classifier
    (as `worker.streamed_bytes_per_token` counts the arrays jllama holds)."""
    c = config
    layer = c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim + 3 * c.dim * c.hidden_dim
    layer += 2 * c.dim
    row = 0 if c.shared_weights else c.dim
    return 4 * (c.n_layers * layer + c.dim + c.vocab_size * c.dim + row)


def build(cache: Path) -> Path:
    """bench/.cache/stream_read, compiled from `stream_read.cc` unless it is newer."""
    binary = cache / "stream_read"
    if binary.is_file() and binary.stat().st_mtime >= SOURCE.stat().st_mtime:
        return binary
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("ceiling: no C++ compiler (g++ or c++) to build stream_read.cc")
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([cxx, "-O3", "-march=native", "-fopenmp", str(SOURCE), "-o", str(binary)],
                   check=True)
    return binary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="stories15M,stories110M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vs", required=True, help="the other program, as run.py's --vs")
    p.add_argument("--cache", type=Path, default=HERE / ".cache")
    p.add_argument("--timeout_s", type=float, default=600)
    args = p.parse_args(argv)
    binary = build(args.cache)
    for name in (s.strip() for s in args.shapes.split(",") if s.strip()):
        shape = shapes_mod.get_shape(name)
        if shape.kind != "random":
            raise SystemExit(f"ceiling: {name} is not a random-weight shape")
        config = shape.config()
        nbytes = f32_bytes_per_token(config)
        other = vs_mod.expand(
            args.vs, checkpoint=str(shapes_mod.llama2c_checkpoint(shape, args.cache)),
            tokenizer=str(shapes_mod.placeholder_tokenizer(config.vocab_size, args.cache)),
        )
        key = {"shape": name, "bytes_per_token": nbytes}
        ceilings, others, ratios = [], [], []
        for rep in range(args.reps):
            read = json.loads(subprocess.run([str(binary), str(nbytes), "9"], check=True,
                                             capture_output=True, text=True).stdout)
            ceiling = read["best_gb_s"] * 1e9 / nbytes
            ran = vs_mod.run_other(other, args.timeout_s)
            if ran["tok_s"] is None:
                raise SystemExit(f"ceiling: no rate from {args.vs!r}: {ran['tail'][-200:]}")
            ceilings.append(ceiling)
            others.append(ran["tok_s"])
            ratios.append(ceiling / ran["tok_s"])
            print(json.dumps({**key, "rep": rep + 1, **read, "ceiling_tok_s": round(ceiling, 1),
                              "other_tok_s": ran["tok_s"], "other": vs_mod.label(args.vs)}),
                  flush=True)
        print(json.dumps({**key, "metric": "ceiling_ratio_vs", "other": vs_mod.label(args.vs),
                          "median": round(statistics.median(ratios), 3),
                          "values": [round(r, 3) for r in ratios],
                          "ceiling_tok_s": round(statistics.median(ceilings), 1),
                          "other_tok_s": round(statistics.median(others), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
