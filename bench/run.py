"""jllama's speed benchmark: JSON lines of medians per shape x backend x dtype.

    .venv/bin/python bench/run.py --shapes=stories15M,stories110M --reps=3 > results.jsonl
    .venv/bin/python bench/table.py results.jsonl --plot=results.png

Each repetition of each (shape, backend, dtype) is one fresh process (`bench/worker.py`), so
compile time and peak memory are those of a single run. With `--vs "COMMAND"` another
program (llama2.c's run, see `bench/build_runc.sh`) runs right after each of those processes
(A B A B ...), so both see the same machine conditions, and the ratio jllama / other is
reported per pair. --vs may be given several times (A B C A B C ...), e.g. run.c on one and
on two OpenMP threads.

Output, on stdout, one JSON object a line: first a "meta" line (host, CPUs, load, versions,
flags), then per (shape, backend, dtype) one line per metric ("load1": the 1-minute load
average before each repetition; the machine is shared):

    {"shape": "stories110M", "backend": "jax", "dtype": "float32", "load1": [0.5, ...],
     "prefill_mode": "token", "metric": "decode_tok_s", "unit": "tok/s", "median": 24.1,
     "values": [...], "reps": 3, "tokens": 256}

Metrics: load_s, compile_s, warmup_s, ttft_s (time to first token after the first
--prefill_lengths prompt, seconds), prefill_N_tok_s, decode_tok_s, decode_gb_s (weights streamed per second at that
rate, 10^9 bytes/s), weights_mb_per_token (10^6 bytes), peak_rss_mb (10^6 bytes); with --vs,
vs_decode_tok_s and decode_ratio_vs. A metric that cannot be measured (a prompt longer than
the context) has "median": null and "skipped"; a failed run gives a "metric": "error" line
saying why. Progress goes to stderr.

Every flag is checked before any work: a bad one is one line on stderr naming it, exit status
1, nothing written. `--out` gets all the lines at once when the run ends (a Ctrl-C leaves it as
it was). Exit status 1 too when any run failed (after every line, with a count on stderr),
130 on Ctrl-C (the workers and --vs programs are killed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shapes as shapes_mod  # bench/ is not a package: its modules are imported by file name
import vs as vs_mod
import worker as worker_mod
from cli import (
    BenchError,
    Parser,
    guarded,
    positive_int,
    positive_ints,
    positive_seconds,
    rate,
    writable_file,
    writable_folder,
    write_whole,
)

UNITS = {
    "load_s": "s", "prepare_s": "s", "compile_s": "s", "compile_total_s": "s",
    "compiled_programs": "programs", "warmup_s": "s", "ttft_s": "s",
    "decode_tok_s": "tok/s", "decode_gb_s": "GB/s", "weights_mb_per_token": "MB",
    "peak_rss_mb": "MB",
}
"""Worker figures reported as metrics, with their units; prefill_N_tok_s are added per N."""


def _csv(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every one checked (`check_args`) before any work.

    Raises:
      BenchError: a bad flag; the message names it and what is wrong.
    """
    p = Parser(
        description="jllama speed benchmark (JSON lines on stdout)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shapes", default=",".join(shapes_mod.DEFAULT_SHAPES),
                   help=f"comma-separated, of: {', '.join(shapes_mod.SHAPES)}, or .gguf files")
    p.add_argument("--backends", default="jax,numpy",
                   help='comma-separated; NAME:KEY=VALUE passes an option to the backend, e.g. '
                        '"jax:decode=fused" (jax: decode, matvec, devices; numpy: none)')
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help=f"comma-separated, of: {', '.join(worker_mod.DTYPES)}")
    p.add_argument("--reps", type=int, default=3, help="fresh processes per combination")
    p.add_argument("--prefill_lengths", default="128,512", help="prompt lengths, tokens")
    p.add_argument("--decode_tokens", type=int, default=256,
                   help="greedy tokens timed after the first one")
    p.add_argument("--prefill_mode", default="token", choices=("token", "batched", "auto"),
                   help="token: Generation feeds the prompt through backend.forward one token "
                        "at a time; batched: backend.prefill(tokens, start_pos) -> logits of "
                        "the last token; auto: batched where the backend has prefill")
    p.add_argument("--warmup", default="windows", choices=("windows", "none"),
                   help="compile the programs prepare leaves out before timing (see worker.py)")
    p.add_argument("--vs", action="append", default=[],
                   help='another program to alternate with (repeatable), e.g. '
                        '"bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0"; see vs.py')
    p.add_argument("--timeout_s", type=float, default=1200.0,
                   help="limit for each process (a worker or the --vs program), seconds")
    p.add_argument("--cache", default=str(HERE / ".cache"),
                   help="folder for the random-weight checkpoints")
    p.add_argument("--seq_len", type=int, default=0, help="cap on the context, 0 = the model's")
    p.add_argument("--threads", type=int, default=0, help="cores per worker, 0 = all")
    p.add_argument("--out", default="",
                   help="also append the JSON lines to this file (all at once, at the end)")
    args = p.parse_args(argv)
    check_args(args)
    return args


def _at_least_one(flag: str, text: str) -> list[str]:
    words = _csv(text)
    if not words:
        raise BenchError(f"{flag}={text!r}: give at least one value")
    return words


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before any work starts (and before any output): one BenchError
    naming the flag at the first bad one, so no worker is started to fail on it."""
    positive_int("--reps", args.reps)
    for shape in _at_least_one("--shapes", args.shapes):
        try:
            shapes_mod.get_shape(shape)
        except ValueError as e:
            raise BenchError(f"--shapes: {e}") from None
    for dtype in _at_least_one("--dtypes", args.dtypes):
        if dtype not in worker_mod.DTYPES:
            raise BenchError(f"--dtypes: unknown dtype {dtype!r}; known: "
                             f"{', '.join(worker_mod.DTYPES)}")
    for spec in _at_least_one("--backends", args.backends):
        try:
            name, options = worker_mod.parse_backend(spec)
            worker_mod.backend_options(name, options)
        except ValueError as e:
            raise BenchError(f"--backends: {e}") from None
        if args.prefill_mode == "batched" and name == "numpy":
            from jllama.backends.numpy_ref import NumpyBackend

            if not callable(getattr(NumpyBackend, "prefill", None)):
                raise BenchError("--prefill_mode=batched: the numpy backend has no batched "
                                 "prefill (use token, or auto)")
    positive_ints("--prefill_lengths", args.prefill_lengths)
    positive_int("--decode_tokens", args.decode_tokens)
    if args.seq_len < 0 or args.seq_len == 1:
        raise BenchError(f"--seq_len={args.seq_len}: must be 0 (the model's) or at least 2 "
                         "(the first token and one timed)")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not 0 <= args.threads <= (cpus or 1):
        raise BenchError(f"--threads={args.threads}: must be 0 (all) up to the {cpus} CPUs "
                         "this process may use")
    positive_seconds("--timeout_s", args.timeout_s)
    writable_folder("--cache", Path(args.cache))
    try:
        for template in args.vs:
            vs_mod.check(template)
        vs_mod.check_unique(args.vs)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if args.out:
        out = writable_file("--out", args.out)
        with contextlib.suppress(OSError):  # stdout may be closed, or not a file
            if out.exists() and os.path.samefile(out, f"/proc/self/fd/{sys.stdout.fileno()}"):
                raise BenchError(f"--out={args.out}: is where stdout goes already (every "
                                 "line would be there twice)")


class Emitter:
    """Prints JSON lines to stdout (flushed, so a pipe sees each as it comes) and keeps them
    for --out, which gets them all at once at the end (`save`). Counts the runs made and the
    "error" records among the lines."""

    def __init__(self):
        self.lines: list[str] = []
        self.runs = 0
        self.errors = 0

    def __call__(self, record: dict) -> None:
        line = json.dumps(worker_mod.finite(record), allow_nan=False)
        if record.get("metric") == "error":
            self.errors += 1
        print(line, flush=True)
        self.lines.append(line)

    def save(self, path: str) -> None:
        """Appends every line to `path` in one step: a copy of the file with the lines added
        replaces it, so the file is its old self or has the whole run, never part of one."""
        target = Path(os.path.realpath(path))
        # two runs ending together must not both read the old file and each rename their
        # copy over it (one run's lines would be lost): one saves at a time per folder
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            self._append(target)
        finally:
            os.close(folder)  # releases the lock

    def _append(self, target: Path) -> None:
        old = target.read_bytes() if target.exists() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        new = "".join(line + "\n" for line in self.lines).encode()
        write_whole(target, lambda tmp: tmp.write_bytes(old + new))  # keeps the file's mode


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def meta(args: argparse.Namespace) -> dict:
    """Where and how the run happened: the machine is shared, so say how loaded it was."""
    from importlib.metadata import version

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"], check=False, cwd=HERE, capture_output=True,
            text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        git = ""
    return {
        "metric": "meta",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0)),
        "loadavg": list(os.getloadavg()), "python": platform.python_version(),
        "jax": version("jax"), "numpy": version("numpy"), "git": git, "args": vars(args),
        **machine_facts(Path(getattr(args, "cache", HERE / ".cache"))),
    }


# The bytes machine_facts reads to measure the bandwidth: 400 MB, well past every cache. bench's
# own tests set 16 MB (they check the scripts' machine lines for their form, not the figure,
# and 400 MB costs ~5 s a script run).
READ_BYTES_ENV = "JLLAMA_BENCH_READ_BYTES"


def read_bytes() -> int:
    return int(os.environ.get(READ_BYTES_ENV) or 400_000_000)


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_int8")
"""The CPU flags that decide which of jllama's (and llama.cpp's) kernels run."""


def machine_facts(cache: Path) -> dict:
    """What a speed figure depends on beyond the CPU's name: its SIMD flags, the -march jllama's
    kernels are built for ($JLLAMA_MARCH, else native) and whether they prefetch, and the read
    bandwidth two threads get here now (bench/stream_read.cc, as bench/ceiling.py: "read_gb_s"
    is its best way of reading, "read_plain_gb_s" plain loads; null with the reason when it
    cannot be measured)."""
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        line = next((l for l in lines if l.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
        model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "")
    except OSError:
        pass
    from jllama.kernels import library

    out = {"cpu_model": model, "cpu_flags": [f for f in SIMD_FLAGS if f in flags],
           "kernel_march": os.environ.get(library.MARCH_ENV) or "native",
           "kernel_prefetch": library.prefetch()}
    try:
        from ceiling import _read_bandwidth, build

        read = _read_bandwidth(build(cache, quiet=True), read_bytes())
        out.update(read_gb_s=read["best_gb_s"], read_plain_gb_s=read.get("plain_huge_gb_s"))
    except Exception as e:  # noqa: BLE001  (a figure the meta line can go without)
        out.update(read_gb_s=None, read_error=str(e))
    return out


def run_worker(args: argparse.Namespace, checkpoint: Path, backend: str, dtype: str) -> dict:
    """One measurement in a fresh process: the worker's figures, or {"error": ...}."""
    argv = [
        sys.executable, str(HERE / "worker.py"), f"--checkpoint={checkpoint}",
        f"--backend={backend}", f"--dtype={dtype}", f"--prefill_lengths={args.prefill_lengths}",
        f"--decode_tokens={args.decode_tokens}", f"--prefill_mode={args.prefill_mode}",
        f"--warmup={args.warmup}", f"--seq_len={args.seq_len}", f"--threads={args.threads}",
    ]
    try:
        done = subprocess.run(
            argv, check=False, capture_output=True, text=True, timeout=args.timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {args.timeout_s:g} s"}
    except OSError as e:
        return {"error": f"worker could not start: {e}"}
    lines = [l for l in done.stdout.splitlines() if l.strip()]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        how = (f"was killed by signal {-done.returncode}" if done.returncode < 0
               else f"exited with status {done.returncode}")
        return {"error": f"worker {how}: {tail}"}
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"worker printed no JSON: {lines[-1][:200]}"}
    if not isinstance(result, dict):
        return {"error": f"worker printed no JSON object: {lines[-1][:200]}"}
    if rate(result.get("decode_tok_s")) is None:
        return {"error": f"worker measured no decode rate "
                         f"(decode_tok_s={result.get('decode_tok_s')!r})"}
    return worker_mod.finite(result)


def _number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def metric_lines(key: dict, runs: list[dict]) -> list[dict]:
    """One record per metric over the successful `runs` (medians of the finite values; None
    where there are none), plus skipped metrics."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return []
    prefill = sorted((n for n in ok[0] if n.startswith("prefill_") and n.endswith("_tok_s")),
                     key=lambda n: int(n.split("_")[1]))
    names = [n for n in UNITS if n in ok[0]]
    at = names.index("decode_tok_s") if "decode_tok_s" in names else len(names)
    names[at:at] = prefill
    records = []
    for name in names:
        values = [r[name] for r in ok if name in r and _number(r[name])]
        unit = UNITS.get(name, "tok/s")
        record = {**key, "prefill_mode": ok[0]["prefill_mode"], "metric": name, "unit": unit,
                  "median": statistics.median(values) if values else None, "values": values,
                  "reps": len(values)}
        if name == "decode_tok_s":
            record["tokens"] = ok[0]["decode_tokens"]
        elif name == "ttft_s":
            record["prompt_tokens"] = ok[0]["ttft_prompt_tokens"]
        elif name == "weights_mb_per_token":
            record["weights_dtype"] = ok[0]["weights_dtype"]
        records.append(record)
    for name, why in ok[0].get("skipped", {}).items():
        records.append({**key, "prefill_mode": ok[0]["prefill_mode"], "metric": name,
                        "unit": "tok/s", "median": None, "values": [], "skipped": why})
    return records


def vs_lines(key: dict, command: str, runs: list[dict], others: list[dict]) -> list[dict]:
    """The other program's decode rate and the per-pair ratios jllama / other; an "error"
    record for each run of it that gave no rate (a finite number > 0), saying why."""
    rates = [rate(o["tok_s"]) for o in others if rate(o["tok_s"]) is not None]
    records = []
    if rates:
        records.append({**key, "metric": "vs_decode_tok_s", "unit": "tok/s", "command": command,
                        "median": statistics.median(rates), "values": rates, "reps": len(rates)})
    pairs = [
        r["decode_tok_s"] / rate(o["tok_s"])
        for r, o in zip(runs, others)
        if "error" not in r and rate(r.get("decode_tok_s")) and rate(o["tok_s"])
    ]
    if pairs:
        ours = statistics.median([r["decode_tok_s"] for r in runs if "error" not in r])
        records.append({**key, "metric": "decode_ratio_vs", "unit": "x", "command": command,
                        "median": statistics.median(pairs), "values": pairs, "reps": len(pairs),
                        "ratio_of_medians": ours / statistics.median(rates)})
    for i, o in enumerate(others):
        if rate(o["tok_s"]) is None:
            why = o.get("error") or f"printed no usable tok/s rate ({o['tok_s']!r})"
            records.append({**key, "metric": "error", "rep": i, "command": command,
                            "error": f"--vs {vs_mod.label(command)} {why}"})
    return records


def bench_shape(args, name: str, emit: Emitter) -> None:
    """Every backend x dtype x repetition of one shape (and the --vs programs after each)."""
    shape = shapes_mod.get_shape(name)
    cache = Path(args.cache)
    start = time.perf_counter()
    try:
        checkpoint = shapes_mod.checkpoint(shape, cache)
        vs_argvs = []
        if args.vs:
            from jllama.formats.llama2c import read_header

            other_file = shapes_mod.llama2c_checkpoint(shape, cache)
            tokenizer = (other_file if shape.kind == "file"  # a GGUF holds its vocabulary
                         else shapes_mod.placeholder_tokenizer(read_header(other_file).vocab_size,
                                                               cache))
            vs_argvs = [
                vs_mod.expand(c, checkpoint=str(other_file), tokenizer=str(tokenizer))
                for c in args.vs
            ]
    except Exception as e:  # noqa: BLE001  (a bad shape must not stop the others)
        emit.runs += 1
        emit({"shape": name, "metric": "error", "error": f"{type(e).__name__}: {e}"})
        log(f"[{name}] {type(e).__name__}: {e}")
        return
    names = vs_mod.labels(args.vs)
    log(f"[{name}] {checkpoint} ready in {time.perf_counter() - start:.1f} s")
    for backend in _csv(args.backends):
        for dtype in _csv(args.dtypes):
            key = {"shape": name, "backend": backend, "dtype": dtype, "load1": []}
            runs, others = [], [[] for _ in vs_argvs]
            for rep in range(args.reps):
                key["load1"].append(round(os.getloadavg()[0], 2))  # how busy the machine was
                result = run_worker(args, checkpoint, backend, dtype)
                emit.runs += 1
                runs.append(result)
                what = result.get("error") or f"decode {result['decode_tok_s']:.1f} tok/s"
                log(f"[{name} {backend} {dtype} rep {rep + 1}/{args.reps}] {what}")
                if "error" in result:
                    emit({**key, "metric": "error", "rep": rep, "error": result["error"]})
                for i, argv in enumerate(vs_argvs):
                    other = vs_mod.run_other(argv, args.timeout_s)
                    emit.runs += 1
                    others[i].append(other)
                    what = other["error"] or f"decode {other['tok_s']:.1f} tok/s"
                    log(f"[{name} vs {names[args.vs[i]]} rep {rep + 1}/{args.reps}] {what}")
            for record in metric_lines(key, runs):
                emit(record)
            mode = next((r["prefill_mode"] for r in runs if "error" not in r), args.prefill_mode)
            for command, results in zip(args.vs, others):
                for record in vs_lines({**key, "prefill_mode": mode}, command, runs, results):
                    emit(record)


def main(argv: list[str] | None = None) -> int:
    """Checks every flag, runs every combination, appends the lines to --out at the end; exit
    status 1 when any run failed (its "error" line says why), after everything is printed."""
    args = parse_args(argv)
    emit = Emitter()
    emit(meta(args))
    for name in _csv(args.shapes):
        bench_shape(args, name, emit)
    if args.out:
        try:
            emit.save(args.out)
        except OSError as e:
            raise BenchError(f"--out={args.out}: could not write: {e}") from None
    if emit.errors:
        log(f"run.py: {emit.errors} of {emit.runs} runs failed (see the error lines)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(guarded("run.py", main))
