"""`jllama serve --parallel=8` against `llama-server -np 8` on the same file under concurrent
clients, both in one run (A B A B); JSON lines.

    .venv/bin/python bench/serve_vs.py --models=smollm2-Q4_K_M,1B-Q4_K_M --clients=8,16 \\
        --reps=2 --llamacpp_bin=/path/to/llama.cpp-build/bin --out=serve-vs.jsonl

For each repetition, model and server in turn (jllama first), the server starts on a free
port of 127.0.0.1, serves one warm-up request, then each --clients level: that many
concurrent clients (`serve_load.run_level`: asyncio tasks, one HTTP connection each,
requests one after another) send --requests streamed chat completions in all, greedy
(temperature 0), max_tokens 64, `ignore_eos: true` (llama-server's field, which jllama's
server takes too: every reply 64 tokens long; on the random-weight files greedy replies
otherwise end early), `stream_options.include_usage` to count the tokens each reply really
had. Then it
is stopped (SIGINT) before the other starts, so the two never share the cores.

How the two are set up, so that they do the same work:

  jllama serve --parallel=P --seq_len=C                  P slots of C positions each
  llama-server -np P -c P*C -t T --no-webui              P slots: with -np given, llama.cpp
                                                         splits -c among them (kv_unified off),
                                                         so each slot has C positions too

Both keep what the rest of their defaults are: continuous batching (llama-server's `-cb`,
on by default; jllama's slots take turns in one batched step), reuse of a prompt prefix a
free slot holds (llama-server's cache_prompt, on by default), the KV cache type (llama.cpp
f16, jllama its default), llama.cpp's -b 2048 -ub 512 and flash attention auto; jllama uses
every core the process may use, llama-server -t T (default 2) for generation and batches.

Models: a .gguf path, "smollm2-Q4_K_M" (bench/.cache/smollm2-Q4_K_M.gguf, made when missing
with `llama-quantize --allow-requantize` from the fetched SmolLM2-135M-Instruct Q4_1 file,
as bench/NOTES.md's SmolLM2 files were), or "1B-Q4_K_M" style names of bench/scale_models.py.

Output: a "meta" line (machine, read bandwidth, flags, the two command lines), one line per
(rep, model, server, clients) with tokens_per_s, requests_per_s, completion_tokens,
short_replies (replies under max_tokens: the rate then counts fewer tokens), TTFT and
latency medians, the server's peak RSS (VmHWM) so far; at the end one "summary" line per
model and level: medians and per-repetition ratios jllama / llama-server of tokens_per_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scale_models  # bench/ is not a package: its modules by file name
from cli import BenchError, Parser, guarded, positive_int, writable_file
from scale_plan import BUILDS, csv_ints, csv_names, ratios

SERVERS = ("jllama", "llama-server")

CHAT_PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in the morning.",
    "Tell me everything you know about the history of bread.",
]
"""User messages that ask for more than 64 tokens (a reply that ends early is counted)."""

DEFAULT_BIN = {"native": HERE / ".cache" / "llama.cpp-build" / "bin",
               "x86-64-v3": HERE / ".cache" / "llama.cpp-build-v3" / "bin"}
SMOLLM2_Q4_1 = Path.home() / ".cache" / "jllama" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def chat_body(model: str, i: int, max_tokens: int) -> dict:
    """Request i: a greedy chat completion of one of CHAT_PROMPTS, max_tokens long."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }


def resolve_model(name: str, cache: Path) -> Path:
    """The file a --models entry names (module docstring); it may not exist yet."""
    if name.endswith(".gguf"):
        return Path(name)
    if name.startswith("smollm2-"):
        return cache / f"{name}.gguf"
    shape, _, qtype = name.partition("-")
    if shape not in scale_models.SCALE_SHAPES or not qtype:
        raise BenchError(f"--models: {name!r} is not a .gguf path, smollm2-TYPE or one of "
                         f"{', '.join(s + '-TYPE' for s in scale_models.SCALE_SHAPES)}")
    return scale_models.CACHE / scale_models.model_path(shape, qtype).name


def ensure_smollm2(path: Path, quantize: Path) -> None:
    """Make bench/.cache/smollm2-TYPE.gguf from the fetched Q4_1 file with llama-quantize."""
    qtype = path.stem.split("-", 1)[1]
    if not SMOLLM2_Q4_1.is_file():
        raise BenchError(f"{SMOLLM2_Q4_1}: missing (jllama fetch smollm2)")
    if not quantize.is_file():
        raise BenchError(f"{path}: missing, and no {quantize} to make it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    subprocess.run([str(quantize), "--allow-requantize", str(SMOLLM2_Q4_1), str(tmp), qtype],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.replace(tmp, path)


def llama_server_argv(binary: Path, model: Path, port: int, parallel: int, context: int,
                      threads: int) -> list[str]:
    """llama-server with `parallel` slots of `context` positions each (module docstring)."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(parallel * context), "-t", str(threads),
            "--no-webui"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM), 10^6 bytes; None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError):
        return None
    return None


LOG = HERE / ".cache" / "llama-server.log"
"""llama-server's output of the latest run (its crashes leave their reason there)."""


def start_llama_server(argv: list[str], port: int, timeout_s: float = 600,
                       log: Path | None = None) -> subprocess.Popen:
    """Starts it (its stdout and stderr to `log`, when given) and waits for GET /health to
    answer 200 (the model loaded)."""
    import httpx

    out = open(log, "wb") if log is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None:
            out.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"llama-server exited with {process.returncode}: {' '.join(argv)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise BenchError(f"llama-server did not answer /health within {timeout_s:g} s")


def drain(stream) -> None:
    """Read what the server goes on printing, in a thread, so a full pipe never blocks it."""
    import threading

    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def summaries(lines: list[dict]) -> list[dict]:
    """Per (model, clients): medians of tokens_per_s of each server and the per-repetition
    ratios jllama / llama-server."""
    by: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in lines:
        if r.get("metric") != "load":
            continue
        by.setdefault((r["model"], r["clients"]), {}).setdefault(r["server"], {})[r["rep"]] = (
            r["tokens_per_s"])
    out = []
    for (model, clients), servers in by.items():
        ours, theirs = servers.get("jllama", {}), servers.get("llama-server", {})
        if not ours or not theirs:
            continue
        reps = sorted(set(ours) & set(theirs))
        pairs = ratios([ours[i] for i in reps], [theirs[i] for i in reps])
        out.append({"metric": "summary", "model": model, "clients": clients,
                    "jllama_tokens_per_s": statistics.median(ours.values()),
                    "llama_server_tokens_per_s": statistics.median(theirs.values()),
                    "ratio_median": statistics.median(pairs) if pairs else None,
                    "ratios": pairs})
    return out


def main(argv: list[str] | None = None) -> int:
    from run import machine_facts
    from serve_load import run_level, start_server, stop_server

    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="smollm2-Q4_K_M,1B-Q4_K_M")
    p.add_argument("--clients", default="8,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=32, help="requests per level (>= clients)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=8, help="slots of each server")
    p.add_argument("--context", type=int, default=4096, help="positions per slot")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--servers", default="jllama,llama-server",
                   help="which of jllama, llama-server to run (both: the comparison)")
    p.add_argument("--build", default="native", choices=BUILDS)
    p.add_argument("--llamacpp_bin", type=Path, default=None,
                   help="llama.cpp's bin folder (default: bench/.cache/llama.cpp-build[-v3]/bin)")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    try:
        clients = csv_ints("--clients", args.clients, 1)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if not clients:
        raise BenchError("--clients: give at least one level")
    try:
        servers = csv_names("--servers", args.servers, SERVERS)
    except ValueError as e:
        raise BenchError(str(e)) from None
    for flag in ("requests", "max_tokens", "parallel", "context", "threads", "reps"):
        positive_int(f"--{flag}", getattr(args, flag))
    bin_dir = args.llamacpp_bin or DEFAULT_BIN[args.build]
    server_bin = bin_dir / "llama-server"
    if not (server_bin.is_file() and os.access(server_bin, os.X_OK)):
        raise BenchError(f"--llamacpp_bin={bin_dir}: no executable llama-server")
    if args.out:
        writable_file("--out", args.out)
    models = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = resolve_model(name, HERE / ".cache")
        if not path.is_file():
            if name.startswith("smollm2-"):
                ensure_smollm2(path, bin_dir / "llama-quantize")
            else:
                raise BenchError(f"--models: {path} does not exist")
        models[name] = path
    if not models:
        raise BenchError("--models: give at least one")
    if args.build == "x86-64-v3":
        os.environ["JLLAMA_MARCH"] = "x86-64-v3"
    else:
        os.environ.pop("JLLAMA_MARCH", None)

    lines: list[dict] = []

    def emit(record: dict) -> None:
        lines.append(record)
        print(json.dumps(record), flush=True)

    emit({"metric": "meta", "cpus": len(os.sched_getaffinity(0)), "loadavg": list(os.getloadavg()),
          "args": {k: str(v) for k, v in vars(args).items()},
          "jllama_command": f"jllama serve --parallel={args.parallel} --seq_len={args.context}",
          "llama_server_command": " ".join(llama_server_argv(
              server_bin, Path("MODEL"), 0, args.parallel, args.context, args.threads)),
          **machine_facts(HERE / ".cache")})
    for rep in range(1, args.reps + 1):
        for name, path in models.items():
            for server in servers:
                print(f"[rep {rep} {name}] {server}", file=sys.stderr, flush=True)
                if server == "jllama":
                    process, url, model = start_server(
                        str(path), args.context, None, args.parallel,
                        max_waiting=max(clients) * 2 + 8)
                    drain(process.stderr)
                else:
                    port = free_port()
                    process = start_llama_server(llama_server_argv(
                        server_bin, path, port, args.parallel, args.context, args.threads), port,
                        log=LOG)
                    url, model = f"http://127.0.0.1:{port}/v1", name
                try:
                    for n in clients:
                        load1 = round(os.getloadavg()[0], 2)
                        try:
                            result = asyncio.run(run_level(url, model, n, args.requests,
                                                           args.max_tokens, chat_body,
                                                           "/chat/completions"))
                        except Exception as e:  # a server that died mid-level: say so, go on
                            code = process.poll()
                            emit({"metric": "error", "rep": rep, "model": name, "server": server,
                                  "clients": n, "error": f"{type(e).__name__}: {e}",
                                  "server_exit": code,
                                  "log": str(LOG) if server != "jllama" else None})
                            if code is not None:
                                break
                            continue
                        emit({"metric": "load", "rep": rep, "model": name, "server": server,
                              "load1": load1, "parallel": args.parallel,
                              "context": args.context, **result,
                              "peak_rss_mb": peak_rss_mb(process.pid)})
                finally:
                    (stop_server if server == "jllama" else stop)(process)
    for record in summaries(lines):
        emit(record)
    if args.out:
        from run import Emitter

        saver = Emitter()
        saver.lines = [json.dumps(r) for r in lines]
        try:
            saver.save(args.out)  # appended whole, as run.py's --out
        except OSError as e:
            raise BenchError(f"--out={args.out}: could not write: {e}") from None
    return 1 if any(r["metric"] == "error" for r in lines) else 0


if __name__ == "__main__":
    sys.exit(guarded("serve_vs.py", main))
