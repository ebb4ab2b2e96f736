"""A new process to its first token, beside llama.cpp's: wall time and peak RSS, alternated.

    .venv/bin/python bench/first_token.py --checkpoint=bench/.cache/scale/Llama-3.2-1B-random-Q4_K_M.gguf \\
        --reps=5 --out=results.jsonl

Each repetition runs, one after another: jllama (`python -m jllama --checkpoint=FILE
--prompt=PROMPT --steps=N+1 --temperature=0 --seq_len=CTX --output_format=json`, N the prompt's
tokens, so it generates one), llama.cpp's `llama-simple -m FILE -n 1 PROMPT` and `llama-cli -m
FILE -c CTX -n 1 -p PROMPT -st --simple-io -t THREADS` (the binaries in --llamacpp; this
llama-cli has no -no-cnv: one conversation turn, so its prompt is the chat template's). For
each: the process's wall time (from fork to exit, as `/usr/bin/time` counts it), its CPU time
and its peak RSS (`wait4`'s rusage); for jllama also its own account of the time to the first
token and of the load (the JSON). Before the first repetition the file is read once (page cache warm) and
jllama runs once, untimed (its compile cache warm), as the acceptance of issue 32 asks.

One JSON line per run, then a summary per program (medians) on stderr. Timings on a shared
machine are noise unless the runs alternate and repeat; say when others were working.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli import BenchError, Parser, guarded

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP = Path("/work/llamacpp/build-avx512/bin")


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` (stdin empty); its wall seconds, CPU seconds (user + system), peak RSS (bytes),
    exit status, stdout and stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        # wait4 gives the child's own rusage (its peak RSS); files, not pipes, so that a child
        # writing a lot never blocks on a pipe nobody reads yet.
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
                "peak_rss_bytes": usage.ru_maxrss * 1024,
                "status": proc.returncode, "stdout": out.read().decode("utf-8", "replace"),
                "stderr": err.read().decode("utf-8", "replace")}


def prompt_tokens(checkpoint: str, prompt: str) -> int:
    from jllama.tokenizers.gguf import read_gguf_tokenizer

    tokenizer = read_gguf_tokenizer(checkpoint)
    return len(tokenizer.encode(prompt))


def main(argv=None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llamacpp", default=str(LLAMACPP))
    p.add_argument("--only", default="jllama,llama-simple,llama-cli",
                   help="programs to run, comma-separated")
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    p.add_argument("--jllama_flags", default="", help="more flags for jllama, space-separated")
    args = p.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        raise BenchError(f"--checkpoint={args.checkpoint}: no such file")
    if args.reps < 1:
        raise BenchError(f"--reps={args.reps} must be at least 1")
    n = prompt_tokens(args.checkpoint, args.prompt)
    bin_dir = Path(args.llamacpp)
    programs = {
        "jllama": [sys.executable, "-m", "jllama", f"--checkpoint={args.checkpoint}",
                   f"--prompt={args.prompt}", f"--steps={n + 1}", "--temperature=0",
                   f"--seq_len={args.seq_len}", "--output_format=json",
                   *args.jllama_flags.split()],
        "llama-simple": [str(bin_dir / "llama-simple"), "-m", args.checkpoint, "-n", "1",
                         args.prompt],
        # This llama-cli is conversation-only (no -no-cnv): one turn, the prompt in the
        # model's chat template, then it exits.
        "llama-cli": [str(bin_dir / "llama-cli"), "-m", args.checkpoint, "-c", str(args.seq_len),
                      "-n", "1", "-p", args.prompt, "-st", "--simple-io", "-t",
                      str(args.threads)],
    }
    chosen = [name for name in args.only.split(",") if name]
    for name in chosen:
        if name not in programs:
            raise BenchError(f"--only: unknown program {name!r} (known: {', '.join(programs)})")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(args.checkpoint, "rb") as f:  # the page cache warm
        while f.read(1 << 24):
            pass
    if "jllama" in chosen:
        warm = timed(programs["jllama"], env)
        if warm["status"] != 0:
            raise BenchError(f"jllama failed: {warm['stderr'].strip().splitlines()[-1:]}")
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}
    runs = []
    out = open(args.out, "a") if args.out else None
    try:
        for rep in range(args.reps):
            for name in chosen:
                r = timed(programs[name], env)
                record = {"program": name, "rep": rep, "checkpoint": Path(args.checkpoint).name,
                          "seq_len": args.seq_len, "wall_s": round(r["wall_s"], 3),
                          "cpu_s": round(r["cpu_s"], 3),
                          "peak_rss_mb": round(r["peak_rss_bytes"] / 1e6, 1),
                          "status": r["status"], **machine,
                          "load_avg_now": round(os.getloadavg()[0], 2)}
                if name == "jllama" and r["status"] == 0:
                    result = json.loads(r["stdout"].strip().splitlines()[-1])
                    for key in ("first_token_seconds", "startup_seconds", "load_seconds",
                                "compile_seconds", "prefill_seconds"):
                        record[key] = round(result[key], 3)
                line = json.dumps(record)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                runs.append(record)
    finally:
        if out:
            out.close()
    for name in chosen:
        mine = [r for r in runs if r["program"] == name and r["status"] == 0]
        if not mine:
            print(f"{name}: every run failed", file=sys.stderr)
            continue
        wall = statistics.median(r["wall_s"] for r in mine)
        cpu = statistics.median(r["cpu_s"] for r in mine)
        rss = statistics.median(r["peak_rss_mb"] for r in mine)
        extra = ""
        if name == "jllama":
            extra = (f", first token {statistics.median(r['first_token_seconds'] for r in mine):.2f} s"
                     f" (load {statistics.median(r['load_seconds'] for r in mine):.2f} s)")
        print(f"{name}: wall {wall:.2f} s (CPU {cpu:.2f} s), peak RSS {rss:.0f} MB{extra} "
              f"(median of {len(mine)})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("first_token.py", main))
