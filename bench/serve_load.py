"""Load test of `jllama serve`: requests/s and tokens/s at several numbers of concurrent clients.

    .venv/bin/python bench/serve_load.py --clients=1,4,32 --max_tokens=64
    .venv/bin/python bench/serve_load.py --checkpoint=smollm2 --seq_len=512 --clients=1,4,32 \\
        --max_tokens=32 --requests=32

The server runs as its own process (`jllama serve --port=0` on 127.0.0.1, so the clients do
not share its interpreter); each client is an asyncio task streaming completions over its own
HTTP connection (httpx), one request after another, with `stream_options.include_usage` to
count the tokens the server generated. For each concurrency, `--requests` requests in total
(at least one per client) are sent after one warm-up request, and one JSON object is printed:

    {"clients": 4, "requests": 32, "wall_s": ..., "requests_per_s": ..., "tokens_per_s": ...,
     "completion_tokens": ..., "ttft_s_median": ..., "latency_s_median": ..., "latency_s_max": ...}

tokens_per_s counts completion tokens only (prompt tokens are prefilled, not generated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from run import machine_facts  # bench/ is the script's folder

PROMPTS = ["Once upon a time", "Tom had a dog", "The sun was hot", "Lily saw a bird"]


def start_server(checkpoint: str | None, seq_len: int = 0, dtype: str | None = None,
                 parallel: int = 1, max_waiting: int = 256, extra: tuple[str, ...] = (),
                 env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """`jllama serve --port=0` with these flags (None / 0: its defaults) and the `extra` ones,
    in `env` (None: this process's), its start-up lines echoed to stderr; (process, base URL
    ending in /v1, the model's name) once it serves."""
    script = Path(sys.executable).parent / "jllama"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "jllama"]
    command += ["serve", "--port=0", f"--max_waiting={max_waiting}", f"--parallel={parallel}"]
    if checkpoint:
        command.append(f"--checkpoint={checkpoint}")
    if seq_len:
        command.append(f"--seq_len={seq_len}")
    if dtype:
        command.append(f"--dtype={dtype}")
    command += list(extra)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            raise SystemExit(f"jllama serve exited with {process.returncode}")
        print(line, end="", file=sys.stderr)
        if "jllama: serving " in line:
            name = line.split("serving ")[1].split()[0]
            return process, line.split(" at ")[1].split()[0], name
    process.kill()
    raise SystemExit("jllama serve did not start within 300 s")


def stop_server(process: subprocess.Popen) -> None:
    """Ctrl-C the server (a graceful shutdown); killed if it has not exited in 30 s."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def _piece(choice: dict) -> str:
    """The text a streamed choice carries: a completion's `text`, a chat chunk's delta."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def one_request(http: httpx.AsyncClient, url: str, body: dict,
                      path: str = "/completions") -> dict:
    """One streamed request (a completion, or a chat completion with path
    "/chat/completions"): {"latency", "ttft" (to the first chunk with text), "tokens" (the
    usage's completion_tokens; 0 when the server sent no usage)}."""
    start = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", url + path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and event.get("choices") and _piece(event["choices"][0]):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens}


def completion_body(model: str, i: int, max_tokens: int) -> dict:
    """Request i of a level: a sampled completion of one of PROMPTS."""
    return {
        "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
        "temperature": 0.8, "seed": 1 + i, "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_level(url: str, model: str, clients: int, requests: int, max_tokens: int,
                    body=completion_body, path: str = "/completions") -> dict:
    """`clients` concurrent clients sending `requests` requests in all (at least one each),
    `body(model, i, max_tokens)` the i-th, after one warm-up request; the level's figures.
    short_replies counts the requests that got fewer than max_tokens tokens."""
    total = max(requests, clients)
    counter = iter(range(total))
    results: list[dict] = []

    retries = 0

    async def client() -> None:
        nonlocal retries
        http = httpx.AsyncClient(timeout=600)
        try:
            for i in counter:
                try:
                    results.append(await one_request(http, url, body(model, i, max_tokens), path))
                except httpx.RemoteProtocolError:
                    # The server closed the connection before answering (llama-server did so
                    # now and then under 8 clients here): once more on a new connection.
                    retries += 1
                    await http.aclose()
                    http = httpx.AsyncClient(timeout=600)
                    results.append(await one_request(http, url, body(model, i, max_tokens), path))
        finally:
            await http.aclose()

    async with httpx.AsyncClient(timeout=600) as http:  # warm-up, not counted
        await one_request(http, url, body(model, 0, max_tokens), path)
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {
        "clients": clients, "requests": len(results), "max_tokens": max_tokens,
        "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 2),
        "tokens_per_s": round(tokens / wall, 1), "completion_tokens": tokens,
        "ttft_s_median": round(statistics.median(ttfts), 4) if ttfts else None,
        "latency_s_median": round(statistics.median(latencies), 4),
        "latency_s_max": round(max(latencies), 4),
        "short_replies": sum(r["tokens"] < max_tokens for r in results),
        "retries": retries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="default: the embedded stories260K")
    parser.add_argument("--seq_len", type=int, default=0)
    parser.add_argument("--clients", default="1,4,32", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=64,
                        help="requests per level (at least one per client)")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="jllama serve --dtype (e.g. float32)")
    parser.add_argument("--parallel", default="1", help="comma-separated `jllama serve "
                        "--parallel` values: a server for each, in turn (1: one request at a "
                        "time, first in, first out)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    for parallel in [int(p) for p in args.parallel.split(",")]:
        process, url, model = start_server(args.checkpoint, args.seq_len, args.dtype, parallel,
                                           max_waiting=max(args.clients) * 2 + 8)
        try:
            meta = {"meta": True, "checkpoint": args.checkpoint or "stories260K", "url": url,
                    "parallel": parallel, "cpus": os.cpu_count(), "load1": os.getloadavg()[0],
                    **machine_facts(Path(__file__).resolve().parent / ".cache")}
            print(json.dumps(meta), flush=True)
            for clients in args.clients:
                result = asyncio.run(run_level(url, model, clients, args.requests,
                                               args.max_tokens))
                print(json.dumps({"parallel": parallel, **result}), flush=True)
        finally:
            stop_server(process)


if __name__ == "__main__":
    main()
