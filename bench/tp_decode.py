"""Decode rate of the jax backend split over N devices (tensor parallelism), one JSON line.

Run it once per device count, each in a process whose XLA sees that many devices, e.g. on CPU:

    for n in 1 2 4; do
      XLA_FLAGS=--xla_force_host_platform_device_count=$n \\
        .venv/bin/python bench/tp_decode.py --shape=TinyLlama-1.1B --devices=$n
    done

The shape's random-weight file is made on first use in bench/.cache (bench/shapes.py; 4.4 GB
for TinyLlama-1.1B). Greedy decode from BOS: one warm-up token (compiles), then --tokens
tokens timed one `forward` each (the sampler's argmax included, as the command does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import jax
import numpy as np
import shapes as shapes_mod

from jllama.backends import make_backend
from jllama.model.loading import open_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="TinyLlama-1.1B")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--decode", default="graph")
    p.add_argument("--cache", default=str(HERE / ".cache"))
    args = p.parse_args()
    shape = shapes_mod.get_shape(args.shape)
    path = shapes_mod.checkpoint(shape, Path(args.cache))
    model = open_model(path, need_tokenizer=False, seq_len=args.seq_len)
    backend = make_backend("jax", decode=args.decode, devices=args.devices)
    start = time.perf_counter()
    backend.prepare(model.config, model.weights)
    prepare_s = time.perf_counter() - start
    token = 1
    token = int(np.argmax(backend.forward(token, 0)))  # warm: position 1 onward is timed
    start = time.perf_counter()
    for pos in range(1, args.tokens + 1):
        token = int(np.argmax(backend.forward(token, pos)))
    seconds = time.perf_counter() - start
    print(json.dumps({
        "shape": args.shape, "devices": args.devices, "device_kind": jax.devices()[0].platform,
        "visible_devices": jax.device_count(), "decode": args.decode,
        "decode_tokens": args.tokens, "decode_tok_s": args.tokens / seconds,
        "prepare_s": prepare_s, "last_token": token,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
