"""8 clients against 1 on `jllama serve` with XLA's products split over forced CPU devices
(issue 38): the batched XLA decode step's gain, both levels from one server, one JSON line each.

    .venv/bin/python bench/serve_batch_xla.py                  # SmolLM2 float32, 3 devices
    .venv/bin/python bench/serve_batch_xla.py --devices=1 --clients=1,4

The server runs `--matvec=xla --devices=N --parallel=P` in a process whose XLA sees N host
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`). Before the timed levels, one
untimed level at the most clients compiles the batched step's programs for the batch sizes it
meets (each size once, `jllama.graphs.decode_batch_step`: ~10-20 s for SmolLM2 on 2 cores);
then each level sends --requests_per_client requests per client (`serve_load.run_level`:
streamed completions, temperature 0.8, completion tokens counted from the usage). The last
line is {"ratio": tok/s at the most clients / tok/s at 1 client}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import run_level, start_server, stop_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--clients", default="1,8", help="comma-separated levels, 1 first")
    parser.add_argument("--requests_per_client", type=int, default=2)
    parser.add_argument("--max_tokens", type=int, default=32)
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                        f"{args.devices}").strip()
    extra = ("--matvec=xla", f"--devices={args.devices}")
    process, url, model = start_server(args.checkpoint, args.seq_len, args.dtype,
                                       args.parallel, max_waiting=max(levels) * 4, extra=extra,
                                       env=env)
    try:
        print(json.dumps({"meta": True, "checkpoint": args.checkpoint, "dtype": args.dtype,
                          "devices": args.devices, "parallel": args.parallel,
                          "cpus": os.cpu_count(), "load1": os.getloadavg()[0]}), flush=True)
        top = max(levels)
        asyncio.run(run_level(url, model, top, top, args.max_tokens))  # compiles, untimed
        rates = {}
        for clients in levels:
            result = asyncio.run(run_level(url, model, clients,
                                           clients * args.requests_per_client, args.max_tokens))
            rates[clients] = result["tokens_per_s"]
            print(json.dumps({**result, "load1": os.getloadavg()[0]}), flush=True)
        if 1 in rates and top != 1:
            print(json.dumps({"ratio": round(rates[top] / rates[1], 2),
                              "clients": top}), flush=True)
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
