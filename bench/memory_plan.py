"""The memory line `jllama serve` prints at start against its peak RSS once every slot is full.

    .venv/bin/python bench/memory_plan.py                       # SmolLM2, --parallel=4, --seq_len=2048
    .venv/bin/python bench/memory_plan.py --parallel=2 --seq_len=1024 --out=results.jsonl

Starts `jllama serve --port=0 --checkpoint=C --parallel=P --seq_len=N` (plus --serve_flags),
reads its "required memory: X MB" line, then sends P completions at once, each a different
prompt of about N - 150 tokens (sized with the model's own tokenizer) and --max_tokens more
tokens, so that every slot's KV cache fills to its last block. The server's RSS is sampled
every 50 ms from /proc while they run and its peak (VmHWM) read at the end. One JSON line:

    {"checkpoint", "parallel", "seq_len", "required_mb", "peak_rss_mb", "peak_over_required",
     "prompt_tokens": [...], "machine": {...}}

The acceptance of issue 32 wants peak_over_required within 1 +- 0.10.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cli import BenchError, Parser, guarded

ROOT = Path(__file__).resolve().parent.parent

_REQUIRED = re.compile(r"required memory: ([0-9.]+) MB")

TEXT = ("In the {n}th year of the quiet kingdom, the river keeper counted {m} boats before "
        "dawn, wrote their names in a ledger of grey paper, and asked each sailor where the "
        "wind had taken them since the last full moon. ")


def prompt_of(tokenizer, tokens: int, client: int) -> tuple[str, int]:
    """A text of about `tokens` tokens, different for every client (no shared prefix for the
    server's prefix cache to reuse); and its token count."""
    parts, n = [], 0
    i = 0
    while n < tokens:
        parts.append(TEXT.format(n=client * 1000 + i, m=(i * 7 + client) % 97))
        i += 1
        n = len(tokenizer.encode("".join(parts)))
    while n > tokens and len(parts) > 1:
        parts.pop()
        n = len(tokenizer.encode("".join(parts)))
    return "".join(parts), n


def machine() -> dict:
    """The CPU, its cores, the host's memory and how busy it was."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    from jllama.platform.runtime import available_memory_bytes

    return {"host": platform.node(), "cpu_model": model, "cpus": os.cpu_count(),
            "mem_total_gb": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9, 1),
            "mem_available_gb": round((available_memory_bytes() or 0) / 1e9, 1),
            "load_avg": round(os.getloadavg()[0], 2)}


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1])
    return out


def start(command: list[str]) -> tuple[subprocess.Popen, str, float]:
    """The server process, its base URL, and the MB of its memory line."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    required = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            raise BenchError(f"jllama serve exited with {process.returncode}")
        print(line, end="", file=sys.stderr)
        found = _REQUIRED.search(line)
        if found:
            required = float(found.group(1))
        if "jllama: serving " in line:
            if required is None:
                raise BenchError("jllama serve printed no required-memory line")
            return process, line.split(" at ")[1].split()[0], required
    process.kill()
    raise BenchError("jllama serve did not start in 600 s")


async def fill(base: str, name: str, prompts: list[str], max_tokens: int, pid: int) -> dict:
    peak = {"VmRSS": 0}
    done = asyncio.Event()

    async def sample():
        while not done.is_set():
            now = rss_kib(pid)
            if now["VmRSS"] > peak["VmRSS"]:
                peak.update(now)
            await asyncio.sleep(0.05)

    async def one(client: httpx.AsyncClient, prompt: str):
        r = await client.post(f"{base}/completions", json={
            "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]

    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(timeout=3600) as client:
        usage = await asyncio.gather(*(one(client, p) for p in prompts))
    done.set()
    await sampler
    return {"usage": usage, "peak": peak}


def main(argv=None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--max_tokens", type=int, default=100)
    p.add_argument("--serve_flags", default="", help="more flags for jllama serve")
    p.add_argument("--out", default=None, help="append the JSON line here too")
    args = p.parse_args(argv)
    if args.parallel < 1 or args.seq_len < 512:
        raise BenchError("--parallel must be at least 1 and --seq_len at least 512")
    from jllama.model.loading import open_model

    model = open_model(args.checkpoint, seq_len=args.seq_len, need_tokenizer=True)
    target = args.seq_len - args.max_tokens - 50
    prompts, counts = zip(*(prompt_of(model.tokenizer, target, c) for c in range(args.parallel)))
    del model
    command = [sys.executable, "-m", "jllama", "serve", "--port=0",
               f"--checkpoint={args.checkpoint}", f"--parallel={args.parallel}",
               f"--seq_len={args.seq_len}", *args.serve_flags.split()]
    process, base, required = start(command)
    try:
        name = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        result = asyncio.run(fill(base, name, list(prompts), args.max_tokens, process.pid))
        final = rss_kib(process.pid)
    finally:
        process.terminate()
        process.wait(30)
    peak_mb = final["VmHWM"] * 1024 / 1e6
    record = {
        "checkpoint": args.checkpoint, "parallel": args.parallel, "seq_len": args.seq_len,
        "serve_flags": args.serve_flags, "required_mb": required,
        "peak_rss_mb": round(peak_mb, 1), "peak_over_required": round(peak_mb / required, 3),
        "at_peak": {k: round(v * 1024 / 1e6, 1) for k, v in result["peak"].items()},
        "prompt_tokens": [u["prompt_tokens"] for u in result["usage"]],
        "completion_tokens": [u["completion_tokens"] for u in result["usage"]],
        "machine": machine(),
    }
    line = json.dumps(record)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(guarded("memory_plan.py", main))
