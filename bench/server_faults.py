"""Faults against `jllama serve`, round after round, checking that the server still answers
correctly and that its memory levels off (issue 21).

    .venv/bin/python bench/server_faults.py [--checkpoint=smollm2 --seq_len=1024] [--rounds=20]

The server runs as its own process (`jllama serve --port=0 --parallel=P --max_waiting=W`).
Each round does, in turn:

  - stream_cut: a streamed request whose client closes after a few events;
  - collect_cut: a non-streamed request whose client closes while it runs;
  - body_cut: a client that declares a body and closes half-way through sending it;
  - slow_head: a client that sends its request head a byte at a time (the server closes it);
  - overflow: more requests at once than slots plus --max_waiting (some get 503 and
    Retry-After, none fails otherwise);
  - check: a greedy request, whose text must equal the first round's.

After each round one JSON line: the round, what each fault saw, the server's resident memory
(VmRSS from /proc, MB) and the check's latency. Last, SIGTERM under 8 streams: every stream
must end with an error event or a finish_reason, then [DONE], and the process exit 0. A
summary line says whether the memory levelled off (the second half of the rounds grew by less
than --rss_slack_mb) and whether every check passed; the exit status is 1 when not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve_load import start_server  # bench/ is the script's folder


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid`, MB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def _raw_request(url: str, body: bytes, send: int | None = None) -> socket.socket:
    """A POST /v1/completions on a raw socket, the first `send` bytes of the body (all when
    None); the caller closes it."""
    conn = socket.create_connection(_address(url))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    conn.sendall(head + body[:send])
    return conn


def stream_cut(url: str, model: str) -> int:
    """Events read before closing a streamed request."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
            "temperature": 0.8}
    events = 0
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", url + "/completions", json=body) as reply:
        for line in reply.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break
    return events


def collect_cut(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 200,
                       "temperature": 0.8}).encode()
    conn = _raw_request(url, body)
    time.sleep(0.3)
    conn.close()
    return "closed after 0.3 s"


def body_cut(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "x" * 2000, "max_tokens": 4}).encode()
    conn = _raw_request(url, body, send=len(body) // 2)
    conn.close()
    return "closed half-way"


def slow_head(url: str, seconds: float) -> str:
    """Sends a request head a byte every 0.5 s for `seconds`; whether the server closed it."""
    conn = socket.create_connection(_address(url))
    conn.settimeout(0.5)
    start = time.monotonic()
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx":
            conn.sendall(bytes([byte]))
            try:
                if conn.recv(1) == b"":
                    return f"closed by the server after {time.monotonic() - start:.1f} s"
            except socket.timeout:
                pass
            if time.monotonic() - start > seconds:
                return f"still open after {seconds:.0f} s"
    except OSError:
        return f"closed by the server after {time.monotonic() - start:.1f} s"
    finally:
        conn.close()
    return "head sent"


def overflow(url: str, model: str, n: int) -> dict:
    """n short requests at once: how many got 200, 503 (with Retry-After) and anything else."""
    async def one(http):
        reply = await http.post(url + "/completions", json={
            "model": model, "prompt": "Hi", "max_tokens": 8, "temperature": 0})
        if reply.status_code == 503 and reply.headers.get("retry-after"):
            return "503"
        return str(reply.status_code)

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[one(http) for _ in range(n)])

    seen: dict[str, int] = {}
    for status in asyncio.run(all_of_them()):
        seen[status] = seen.get(status, 0) + 1
    return seen


def check(url: str, model: str) -> tuple[str, float]:
    start = time.monotonic()
    reply = httpx.post(url + "/completions", json={
        "model": model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0},
        timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"], time.monotonic() - start


def sigterm_under_load(process: subprocess.Popen, url: str, model: str) -> dict:
    """8 streams; SIGTERM once one has 10 events. What each stream ended with, and the exit."""
    sent = []

    async def stream(http, i):
        events = []
        body = {"model": model, "prompt": "Once", "max_tokens": 200, "stream": True,
                "temperature": 0.8, "seed": i}
        async with http.stream("POST", url + "/completions", json=body) as reply:
            if reply.status_code != 200:  # refused before it streamed (a full queue)
                return [str(reply.status_code)]
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 10 and not sent:
                        sent.append(process.send_signal(signal.SIGTERM))
        return events

    async def streams():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[stream(http, i) for i in range(8)])

    ends = []
    for events in asyncio.run(streams()):
        if len(events) == 1 and events[0].isdigit():
            ends.append(events[0])
            continue
        if len(events) < 2 or events[-1] != "[DONE]":
            ends.append("cut")
            continue
        last = json.loads(events[-2])
        ends.append(last["error"]["code"] if "error" in last
                    else last["choices"][0]["finish_reason"])
    return {"ends": ends, "exit": process.wait(30)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="default: the embedded stories260K")
    ap.add_argument("--seq_len", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max_waiting", type=int, default=4)
    ap.add_argument("--slow_head_s", type=float, default=12.0,
                    help="how long the slow client keeps sending (the server's deadline: 10 s)")
    ap.add_argument("--rss_slack_mb", type=float, default=20.0)
    args = ap.parse_args()
    process, url, model = start_server(args.checkpoint, args.seq_len, parallel=args.parallel,
                                       max_waiting=args.max_waiting)
    print(json.dumps({"meta": True, "checkpoint": args.checkpoint or "stories260K",
                      "parallel": args.parallel, "max_waiting": args.max_waiting,
                      "cpus": os.cpu_count()}), flush=True)
    reference, rss, failures = None, [], []
    try:
        for r in range(args.rounds):
            row = {"round": r, "stream_cut": stream_cut(url, model),
                   "collect_cut": collect_cut(url, model), "body_cut": body_cut(url, model),
                   "slow_head": slow_head(url, args.slow_head_s) if r == 0 else "round 0 only",
                   "overflow": overflow(url, model, args.parallel + args.max_waiting + 8)}
            text, seconds = check(url, model)
            reference = text if reference is None else reference
            row.update(check_equal=text == reference, check_s=round(seconds, 3),
                       rss_mb=round(rss_mb(process.pid), 1))
            if text != reference:
                failures.append(f"round {r}: the greedy text changed")
            if set(row["overflow"]) - {"200", "503"}:
                failures.append(f"round {r}: overflow answered {row['overflow']}")
            rss.append(row["rss_mb"])
            print(json.dumps(row), flush=True)
        shutdown = sigterm_under_load(process, url, model)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    if shutdown["exit"] != 0 or "cut" in shutdown["ends"]:
        failures.append(f"SIGTERM: {shutdown}")
    half = len(rss) // 2
    growth = rss[-1] - rss[half] if len(rss) > 1 else 0.0
    if growth > args.rss_slack_mb:
        failures.append(f"memory grew {growth:.1f} MB over the second half of the rounds")
    print(json.dumps({"summary": {"sigterm": shutdown, "rss_mb_first": rss[:1],
                                  "rss_mb_last": rss[-1:], "second_half_growth_mb":
                                  round(growth, 1), "failures": failures}}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
