"""Each KV cache type on one GGUF at depth (issue 32): jllama's decode tok/s of 64 greedy tokens
after a prompt of --depth tokens, and its perplexity at --ctx, per cache type, beside
llama.cpp's `llama-bench -d` with the same cache type (flash attention on: llama.cpp quantizes
the value cache only with it), alternated round by round in one run; JSON lines.

    .venv/bin/python bench/cache_types_depth.py --model=bench/.cache/smollm2-Q4_K_M.gguf \\
        --depth=8128 --ctx=2048 --types=f32,f16,bf16,q8_0 --rounds=2 \\
        --llamacpp_bin=/path/to/llama.cpp-build/bin --out=cache-types.jsonl

Each round runs, for every type: a new `scale_worker.py` process (prefill of --depth random
ids, then --decode_tokens greedy, end-of-text ignored, `--cache_type=T` for keys and values),
then `llama-bench -p 0 -n N -d D -fa 1 -ctk T -ctv T -r 1` (omitted with --llamacpp_bin=""),
and once per type (the first round) `jllama perplexity --ctx=C --cache_type=T` on --text
(deterministic: one run is enough). Lines: "meta" (the machine, `scale.meta`), "decode_tok_s"
(program, type, round, load1), "perplexity" (type, ppl, ppl_error, seconds), "error" lines,
and "summary" lines: per type, median decode tok/s of each program and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scale  # bench/ is not a package: its modules by file name
import scale_plan as plan_mod
from cli import BenchError, Parser, guarded, positive_int, writable_file

TYPES = ("f32", "f16", "bf16", "q8_0")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a GGUF file")
    p.add_argument("--depth", type=int, default=8128, help="prompt tokens before decode")
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048, help="perplexity's --ctx")
    p.add_argument("--text", type=Path, default=HERE / "data" / "alice_wonderland_ch1-4.txt")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated cache types")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="llama-bench's -t")
    p.add_argument("--llamacpp_bin", default="", help="llama.cpp's bin folder; empty: jllama alone")
    p.add_argument("--build", default="native", choices=plan_mod.BUILDS)
    p.add_argument("--timeout_s", type=float, default=3600.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        args.types = plan_mod.csv_names("--types", args.types, TYPES)
    except ValueError as e:
        raise BenchError(str(e)) from None
    for flag in ("depth", "decode_tokens", "ctx", "rounds", "threads"):
        positive_int(f"--{flag}", getattr(args, flag))
    for flag in ("model", "text"):
        if not getattr(args, flag).is_file():
            raise BenchError(f"--{flag}={getattr(args, flag)}: no such file")
    if args.llamacpp_bin and not os.access(Path(args.llamacpp_bin) / "llama-bench", os.X_OK):
        raise BenchError(f"--llamacpp_bin={args.llamacpp_bin}: no executable llama-bench")
    if args.out:
        writable_file("--out", args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    if args.build != "native":
        env["JLLAMA_MARCH"] = args.build
    lines: list[dict] = []

    def emit(record: dict) -> None:
        lines.append(record)
        print(json.dumps(record), flush=True)

    emit(scale.meta(args))
    python = sys.executable
    bench = Path(args.llamacpp_bin) / "llama-bench" if args.llamacpp_bin else None
    scale.warm_page_cache(args.model)
    for rnd in range(args.rounds):
        for t in args.types:
            worker = [python, str(HERE / "scale_worker.py"), f"--checkpoint={args.model}",
                      f"--prompt_tokens={args.depth}", f"--decode_tokens={args.decode_tokens}",
                      f"--cache_type={t}"]
            runs = [("jllama", worker)]
            if bench is not None:
                runs.append(("llama.cpp", [
                    str(bench), "-m", str(args.model), "-t", str(args.threads), "-r", "1",
                    "-o", "jsonl", "-p", "0", "-n", str(args.decode_tokens),
                    "-d", str(args.depth), "-fa", "1", "-ctk", t, "-ctv", t]))
            for program, argv_ in runs:
                scale.log(f"round {rnd}: {program} {t} at depth {args.depth}")
                done = scale.run_measured(argv_, args.timeout_s, env)
                base = {"program": program, "type": t, "round": rnd, "depth": args.depth,
                        "load1": os.getloadavg()[0]}
                if done["error"]:
                    emit({"metric": "error", **base, "error": done["error"]})
                    continue
                if program == "jllama":
                    got = scale._last_json(done["stdout"]) or {}
                    rate = got.get("decode_tok_s")
                    extra = {"cache_types": got.get("cache_types"),
                             "peak_rss_mb": done["peak_rss_mb"]}
                else:
                    records = plan_mod.parse_llama_bench(done["stdout"])
                    rate = records[-1]["avg_ts"] if records else None
                    extra = {}
                emit({"metric": "decode_tok_s", **base, "value": rate, **extra})
            if rnd == 0:
                argv_ = [python, "-m", "jllama", "perplexity", f"--checkpoint={args.model}",
                         f"--file={args.text}", f"--ctx={args.ctx}", f"--cache_type={t}",
                         "--output_format=json"]
                scale.log(f"perplexity {t} at ctx {args.ctx}")
                done = scale.run_measured(argv_, args.timeout_s, env)
                if done["error"]:
                    emit({"metric": "error", "program": "perplexity", "type": t,
                          "error": done["error"]})
                    continue
                got = scale._last_json(done["stdout"]) or {}
                emit({"metric": "perplexity", "type": t, "ctx": args.ctx,
                      **{k: got.get(k) for k in ("ppl", "ppl_error", "chunks", "seconds")}})
    for t in args.types:
        medians = {}
        for program in ("jllama", "llama.cpp"):
            values = [r["value"] for r in lines if r.get("metric") == "decode_tok_s"
                      and r["type"] == t and r["program"] == program and r["value"]]
            medians[program] = statistics.median(values) if values else None
        ratio = (medians["jllama"] / medians["llama.cpp"]
                 if medians["jllama"] and medians["llama.cpp"] else None)
        emit({"metric": "summary", "type": t, "depth": args.depth, "jllama": medians["jllama"],
              "llama.cpp": medians["llama.cpp"], "ratio": ratio})
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    return 1 if any(r.get("metric") == "error" for r in lines) else 0


if __name__ == "__main__":
    sys.exit(guarded("cache_types_depth.py", main))
