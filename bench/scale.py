"""jllama against llama.cpp on the models people run: Llama-3.2-1B / 3B and Llama-3.1-8B shapes
(random weights, `bench/scale_models.py`), Q4_K_M and Q8_0, alternated in one run; JSON lines.

    .venv/bin/python bench/scale.py --models=1B,3B,8B --types=Q4_K_M,Q8_0 --reps=3 \\
        --llamacpp_bin=/path/to/llama.cpp-build/bin --out=scale-native.jsonl
    .venv/bin/python bench/scale.py --build=x86-64-v3 \\
        --llamacpp_bin=/path/to/llama.cpp-build-v3/bin --out=scale-avx2.jsonl
    .venv/bin/python bench/scale_table.py scale-native.jsonl scale-avx2.jsonl --plot=scale.png

For each model x type, after reading the file once (page cache warm) and one untimed run of
each first-token program (jllama's compile cache filled), each repetition runs, alternating
jllama and llama.cpp point by point (A B A B; see `scale_plan` for the command lines):

  first token   jllama's CLI, llama-simple -n 1, llama-cli -c C -n 1: wall seconds of the
                whole process and its peak RSS (wait4's ru_maxrss), each a new process;
  prompt points a jllama process (`scale_worker.py`) per prompt length, then llama-bench:
                prefill tok/s of --prefill lengths (`-p L -n 0`), decode tok/s of
                --decode_tokens greedy tokens at each of --depths (`-p 0 -n N -d D`).

Output, on stdout as it goes (progress on stderr): a "meta" line (CPU, SIMD flags, cores,
the kernels' -march, the read bandwidth of bench/ceiling.py's reader, load average, versions,
flags), a "model" line per file (bytes a decode step reads, and the tok/s the read bandwidth
allows), one line per measurement ("first_token", "prefill_tok_s", "decode_tok_s", with
"program", "rep", "load1"), an "error" line per failed run, and at the end "summary" lines:
medians and per-repetition ratios jllama / other (`scale_plan.summaries`). --out gets every
line at the end too (appended whole).

--build picks jllama's kernels (native, or JLLAMA_MARCH=x86-64-v3) and, unless --llamacpp_bin
is given, the llama.cpp build of that name under bench/.cache (`bench/build_llamacpp.sh`).
Points are selectable (--depths, --prefill, --no-first_token): depth 16384 and a 4096-token
prefill take minutes a point on 8B. Bad flags and missing files: one line, exit 1, before
any run. Exit 1 after everything when a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scale_models  # bench/ is not a package: its modules by file name
import scale_plan as plan_mod
from cli import BenchError, Parser, guarded, last_line, positive_int, positive_seconds
from cli import writable_file

DEFAULT_BIN = {"native": HERE / ".cache" / "llama.cpp-build" / "bin",
               "x86-64-v3": HERE / ".cache" / "llama.cpp-build-v3" / "bin"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="1B,3B,8B", help="comma-separated: 1B, 3B, 8B")
    p.add_argument("--types", default="Q4_K_M,Q8_0", help="comma-separated file types")
    p.add_argument("--depths", default="0,4096,16384", help="decode depths (\"none\": no decode)")
    p.add_argument("--prefill", default="512,4096", help="prompt lengths (\"none\": no prefill)")
    p.add_argument("--first_token", action=argparse.BooleanOptionalAction, default=True,
                   help="the new-process first-token runs")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every point")
    p.add_argument("--decode_tokens", type=int, default=64, help="tokens timed after the first")
    p.add_argument("--context", type=int, default=1024, help="first token: the context (-c)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    p.add_argument("--build", default="native", choices=plan_mod.BUILDS)
    p.add_argument("--llamacpp_bin", type=Path, default=None,
                   help="llama.cpp's bin folder (default: bench/.cache/llama.cpp-build[-v3]/bin)")
    p.add_argument("--cache", type=Path, default=scale_models.CACHE,
                   help="folder of the scale_models.py files")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="read each file once and run each first-token program once, untimed")
    p.add_argument("--timeout_s", type=float, default=3600.0, help="limit on one process")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    try:
        args.models = plan_mod.csv_names("--models", args.models, list(scale_models.SCALE_SHAPES))
        args.types = plan_mod.csv_names("--types", args.types, ("Q4_K_M", "Q8_0", "F16"))
        args.depths = plan_mod.csv_ints("--depths", args.depths, 0)
        args.prefill = plan_mod.csv_ints("--prefill", args.prefill, 1)
    except ValueError as e:
        raise BenchError(str(e)) from None
    for flag in ("reps", "decode_tokens", "context", "threads"):
        positive_int(f"--{flag}", getattr(args, flag))
    positive_seconds("--timeout_s", args.timeout_s)
    args.points = plan_mod.plan(args.depths, args.prefill)
    if not args.points and not args.first_token:
        raise BenchError("nothing to measure: --depths=none, --prefill=none and --no-first_token")
    args.llamacpp_bin = args.llamacpp_bin or DEFAULT_BIN[args.build]
    needed = (["llama-bench"] if args.points else []) + (
        ["llama-simple", "llama-cli"] if args.first_token else [])
    for program in needed:
        path = args.llamacpp_bin / program
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BenchError(f"--llamacpp_bin={args.llamacpp_bin}: no executable {program} "
                             "(bench/build_llamacpp.sh builds it)")
    args.files = {}
    for name in args.models:
        for qtype in args.types:
            path = args.cache / scale_models.model_path(name, qtype).name
            if not path.is_file():
                raise BenchError(f"{path}: not there; write it with bench/scale_models.py "
                                 f"--models={name} --types={qtype} --vocab=... --quantize=...")
            args.files[name, qtype] = path
    if args.out:
        writable_file("--out", args.out)
    return args


def run_measured(argv: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Runs argv as a new process (stdin empty, its own session) and waits for it with wait4:
    {"wall_s": from before the start to its exit, "peak_rss_mb": its ru_maxrss in 10^6 bytes,
    "returncode", "stdout", "stderr" (the last 64 KiB of each), "error": None or why it
    failed}. Killed with everything it started past timeout_s, or on Ctrl-C."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, env=env)
        except OSError as e:
            return {"wall_s": None, "peak_rss_mb": None, "returncode": None, "stdout": "",
                    "stderr": "", "error": f"could not start {argv[0]}: {e}"}
        done: dict = {}

        def wait() -> None:
            _, status, usage = os.wait4(proc.pid, 0)
            done.update(end=time.perf_counter(), status=status, usage=usage)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        timed_out = False
        try:
            waiter.join(timeout_s)
            if waiter.is_alive():
                timed_out = True
                os.killpg(proc.pid, 9)
                waiter.join()
        finally:
            if waiter.is_alive():  # Ctrl-C while waiting: take it and everything it started down
                os.killpg(proc.pid, 9)
                waiter.join()
        proc.returncode = os.waitstatus_to_exitcode(done["status"])  # reaped here, not by Popen
        texts = []
        for f in (out, err):
            size = f.seek(0, 2)
            f.seek(max(0, size - 65536))
            texts.append(f.read().decode("utf-8", "replace"))
    result = {"wall_s": done["end"] - start, "peak_rss_mb": done["usage"].ru_maxrss * 1024 / 1e6,
              "returncode": proc.returncode, "stdout": texts[0], "stderr": texts[1], "error": None}
    if timed_out:
        result["error"] = f"{Path(argv[0]).name} ran past --timeout_s={timeout_s:g} and was killed"
    elif proc.returncode != 0:
        result["error"] = (f"{Path(argv[0]).name} exited with status {proc.returncode}: "
                           f"{last_line(texts[1] or texts[0])}")
    return result


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def meta(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    from run import machine_facts

    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        git = ""
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
             if k not in ("points", "files")}
    return {"metric": "meta",
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
            "loadavg": list(os.getloadavg()), "python": platform.python_version(),
            "jax": version("jax"), "git": git, "args": flags,
            **machine_facts(HERE / ".cache")}


def model_line(name: str, qtype: str, path: Path, read_gb_s: float | None) -> dict:
    """The file's size, the bytes a decode step reads and the tok/s the read bandwidth allows."""
    from jllama.formats.gguf_header import read_header

    header = read_header(path)
    tensors = [(t.name, int(t.shape[-1]) if len(t.shape) > 1 else 1, t.n_bytes)
               for t in header.tensors]
    per_token = plan_mod.decode_bytes_per_token(tensors)
    shape = scale_models.SCALE_SHAPES[name]
    return {"metric": "model", "model": name, "type": qtype, "file": str(path),
            "file_bytes": path.stat().st_size, "bytes_per_token": per_token,
            "n_layers": shape.n_layers, "dim": shape.dim,
            "ceiling_tok_s": read_gb_s * 1e9 / per_token if read_gb_s else None}


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


class Run:
    """One run's state: the flags, the lines printed so far, the failures."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lines: list[dict] = []
        self.text: list[str] = []
        self.errors = 0

    def emit(self, record: dict) -> None:
        from worker import finite

        line = json.dumps(finite(record), allow_nan=False)
        print(line, flush=True)
        self.lines.append(record)
        self.text.append(line)
        if record.get("metric") == "error":
            self.errors += 1

    def fail(self, key: dict, program: str, why: str) -> None:
        self.emit({**key, "metric": "error", "program": program, "error": why})
        log(f"  {program}: {why}")

    def first_token(self, key: dict, path: Path, rep: int | None) -> None:
        """The three first-token runs (rep None: untimed warm-up)."""
        from jllama.tokenizers.gguf import read_gguf_tokenizer

        a = self.args
        prompt = plan_mod.FIRST_TOKEN_PROMPT
        n = len(read_gguf_tokenizer(path).encode(prompt))
        for program, argv in plan_mod.first_token_commands(
                sys.executable, a.llamacpp_bin, path, prompt, n, a.context, a.threads):
            load1 = round(os.getloadavg()[0], 2)
            ran = run_measured(argv, a.timeout_s)
            if rep is None:
                if ran["error"]:
                    self.fail(key, program, f"warm-up: {ran['error']}")
                continue
            record = {**key, "metric": "first_token", "program": program, "rep": rep,
                      "load1": load1, "context": a.context, "prompt_tokens": n,
                      "wall_s": ran["wall_s"], "peak_rss_mb": ran["peak_rss_mb"]}
            if ran["error"]:
                self.fail(key, program, ran["error"])
                continue
            if program == "jllama":
                own = _last_json(ran["stdout"])
                if not own or len(own.get("generated_ids", ())) != 1:
                    got = own.get("generated_ids") if own else "no JSON"
                    self.fail(key, program, f"generated {got}, not one token")
                    continue
                record.update({k: own.get(k) for k in ("first_token_seconds", "load_seconds",
                                                       "compile_seconds", "startup_seconds")})
            self.emit(record)
            log(f"  first token {program}: {ran['wall_s']:.2f} s, {ran['peak_rss_mb']:.0f} MB")

    def prompt_point(self, key: dict, path: Path, point: plan_mod.Point, rep: int) -> None:
        """jllama's process for the point, then llama-bench's runs."""
        a = self.args
        argv = [sys.executable, str(HERE / "scale_worker.py"), f"--checkpoint={path}",
                f"--prompt_tokens={point.prompt_tokens}",
                f"--decode_tokens={a.decode_tokens if point.decode_depth is not None else 0}",
                f"--seq_len={plan_mod.jllama_seq_len(point, a.decode_tokens)}"]
        load1 = round(os.getloadavg()[0], 2)
        ran = run_measured(argv, a.timeout_s)
        own = _last_json(ran["stdout"]) if not ran["error"] else None
        if ran["error"] or not own:
            self.fail(key, "jllama", ran["error"] or f"printed no JSON: {last_line(ran['stdout'])}")
        else:
            common = {**key, "program": "jllama", "rep": rep, "load1": load1,
                      "peak_rss_mb": ran["peak_rss_mb"], "load_s": own["load_s"],
                      "decode_mode": own["decode_mode"], "seq_len": own["seq_len"]}
            if point.prefill:
                self.emit({**common, "metric": "prefill_tok_s", "tokens": point.prompt_tokens,
                           "value": own["prefill_tok_s"]})
            if point.decode_depth is not None:
                self.emit({**common, "metric": "decode_tok_s", "depth": point.decode_depth,
                           "tokens": own["decode_tokens"], "value": own["decode_tok_s"]})
            log(f"  jllama {point.name}: prefill {own['prefill_tok_s']:.1f} tok/s"
                + (f", decode {own['decode_tok_s']:.2f} tok/s" if own["decode_tok_s"] else ""))
        for kind, bench_argv in plan_mod.llama_bench_commands(
                a.llamacpp_bin / "llama-bench", path, point, a.threads, a.decode_tokens):
            load1 = round(os.getloadavg()[0], 2)
            ran = run_measured(bench_argv, a.timeout_s)
            if ran["error"]:
                self.fail(key, "llama-bench", ran["error"])
                continue
            try:
                records = plan_mod.parse_llama_bench(ran["stdout"])
                value = plan_mod.bench_rate(records, kind, point, a.decode_tokens)
            except ValueError as e:
                self.fail(key, "llama-bench", str(e))
                continue
            test = records[-1]
            common = {**key, "program": "llama-bench", "rep": rep, "load1": load1,
                      "peak_rss_mb": ran["peak_rss_mb"], "type_k": test.get("type_k"),
                      "flash_attn": test.get("flash_attn"),
                      "build_commit": test.get("build_commit"), "value": value}
            if kind == "prefill":
                self.emit({**common, "metric": "prefill_tok_s", "tokens": point.prompt_tokens})
            else:
                self.emit({**common, "metric": "decode_tok_s", "depth": point.decode_depth,
                           "tokens": a.decode_tokens})
            where = point.prompt_tokens if kind == "prefill" else point.decode_depth
            log(f"  llama-bench {kind} {where}: {value:.2f} tok/s")


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build == "x86-64-v3":
        os.environ["JLLAMA_MARCH"] = "x86-64-v3"  # every jllama process below inherits it
    else:
        os.environ.pop("JLLAMA_MARCH", None)
    run = Run(args)
    head = meta(args)
    run.emit(head)
    for (name, qtype), path in args.files.items():
        key = {"model": name, "type": qtype, "build": args.build}
        run.emit({**model_line(name, qtype, path, head.get("read_gb_s")), "build": args.build})
        log(f"[{name} {qtype}] {path}")
        if args.warmup:
            warm_page_cache(path)
            if args.first_token:
                run.first_token(key, path, None)
        for rep in range(1, args.reps + 1):
            log(f"[{name} {qtype}] rep {rep}/{args.reps}")
            if args.first_token:
                run.first_token(key, path, rep)
            for point in args.points:
                run.prompt_point(key, path, point, rep)
    for record in plan_mod.summaries(run.lines):
        run.emit(record)
    if args.out:
        from run import Emitter

        saver = Emitter()
        saver.lines = run.text
        try:
            saver.save(args.out)
        except OSError as e:
            raise BenchError(f"--out={args.out}: could not write: {e}") from None
    if run.errors:
        log(f"scale.py: {run.errors} runs failed (see the error lines)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(guarded("scale.py", main))
