"""The decode attention kernel alone (`jllama_attention_f32`): GB/s of KV cache read, the
kernel as on another git ref ("old", float32 caches only) against this checkout's ("new"),
for each KV cache type, at several depths, in alternated rounds within one process.

    .venv/bin/python bench/attention_kernel.py [--shapes=llama1b,smollm2]
        [--depths=512,4096,16384] [--types=f32,f16,bf16,q8_0] [--rounds=3] [--calls=20]
        [--old=main] [--max_gb=1.0]

One call of the timed program is one token's attention in every layer of the shape (its own
cache per layer, so the caches are read from wherever a decode would find them: at small
depths they fit in the L2/L3 caches, as a real decode's would not once the weights have
streamed through); "gb_s" is the bytes of the key and value rows of positions 0 .. depth - 1
in the cache's type, over all layers, per second of the median call. Shapes: llama1b
(Llama-3.2-1B: 16 layers, 8 key heads, kv_mul 4, head_dim 64), smollm2 (SmolLM2-135M: 30
layers, 3 key heads, kv_mul 3, head_dim 64). Layers are capped so that one depth's float32
caches take at most --max_gb.

The old kernels are the sources of jllama/kernels/ at --old (git show), compiled with this
checkout's flags (`jllama.kernels.library.flags`) into bench/.cache/attention-old-<hash>.so.
JLLAMA_MARCH=x86-64-v3 in the environment measures both as AVX2 builds. Prints JSON lines:
one naming the machine, one per (round, shape, depth, kernel, type), and a summary line per
(shape, depth, kernel, type) with the median. Timings on a shared machine are noisy: compare
rows of one run, alternated, not runs.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SHAPES = {
    "llama1b": {"layers": 16, "n_kv": 8, "kv_mul": 4, "head_dim": 64},
    "smollm2": {"layers": 30, "n_kv": 3, "kv_mul": 3, "head_dim": 64},
}
BLOCK = 256  # positions per cache block, as jllama.graphs.attention allocates them


def old_library(ref: str, cache: Path) -> Path:
    """The kernels of jllama/kernels/ at git `ref`, compiled (once) with this checkout's flags."""
    import jax

    from jllama.kernels import library

    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref,
                            "jllama/kernels/"], check=True, capture_output=True,
                           text=True).stdout.split()
    sources = {Path(n).name: subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{n}"],
                                            check=True, capture_output=True).stdout
               for n in names if n.endswith((".cc", ".h"))}
    flags = library.flags()
    key = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(sources.items())))
    key.update(" ".join(flags).encode())
    out = cache / f"attention-old-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        print(f"building the kernels of {ref} into {out}", file=sys.stderr, flush=True)
        subprocess.run([*library.compiler(), *flags, "-I", jax.ffi.include_dir(),
                        str(Path(tmp) / "library.cc"), "-o", str(out)], check=True)
    return out


def cache_blocks(rng, kind: str, n_blocks: int, n_kv: int, head_dim: int) -> list:
    """n_blocks random blocks of a cache type (values ~ N(0, 1); q8_0: random q, d = 0.02)."""
    import ml_dtypes

    shape = (n_kv, BLOCK, head_dim)
    if kind == "q8_0":
        out = []
        for _ in range(n_blocks):
            b = rng.integers(-127, 128, (n_kv, BLOCK, head_dim // 32, 34)).astype(np.int8)
            b = b.view(np.uint8)
            b[..., :2] = np.full(b.shape[:-1], 0.02, np.float16)[..., None].view(np.uint8)
            out.append(b.reshape(n_kv, BLOCK, head_dim // 32 * 34))
        return out
    dtype = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[kind]
    return [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(n_blocks)]


def program(target: str, layers: int):
    """One token's attention in each of `layers` layers by the handler `target`."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(q, pos, keys, values):
        outs = [jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                    q, pos, jnp.int32(-1), k[0], v[0], *k, *v) for k, v in zip(keys, values)]
        return jnp.stack(outs)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama1b,smollm2")
    ap.add_argument("--depths", default="512,4096,16384")
    ap.add_argument("--types", default="f32,f16,bf16,q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--old", default="main")
    ap.add_argument("--max_gb", type=float, default=1.0)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    depths = [int(d) for d in args.depths.split(",")]
    kinds = args.types.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})")
    from jllama.model.cache_types import cache_type

    for k in kinds:
        cache_type(k, flag="types")

    import jax
    import jax.numpy as jnp

    from jllama import kernels
    from run import machine_facts

    kernels.load()
    old = ctypes.CDLL(str(old_library(args.old, HERE / ".cache")))
    jax.ffi.register_ffi_target("jllama_attention_old", jax.ffi.pycapsule(old.jllama_attention_f32),
                                platform="cpu")
    print(json.dumps({"bench": "attention_kernel", "machine": platform.machine(),
                      "cores": len(os.sched_getaffinity(0)), "old": args.old,
                      **machine_facts(HERE / ".cache")}), flush=True)
    results: dict[tuple, dict] = {}
    rng = np.random.default_rng(0)
    for name in shapes:
        s = SHAPES[name]
        for depth in depths:
            n_blocks = (depth - 1) // BLOCK + 1
            f32_layer = 2 * n_blocks * BLOCK * s["n_kv"] * s["head_dim"] * 4
            layers = max(1, min(s["layers"], int(args.max_gb * 1e9 // f32_layer)))
            q = jnp.asarray(rng.standard_normal((s["n_kv"], s["kv_mul"], s["head_dim"]),
                                                dtype=np.float32))
            pos = jnp.int32(depth - 1)
            runs = []
            for kind in kinds:
                keys = [tuple(map(jnp.asarray, cache_blocks(rng, kind, n_blocks, s["n_kv"],
                                                            s["head_dim"])))
                        for _ in range(layers)]
                values = [tuple(map(jnp.asarray, cache_blocks(rng, kind, n_blocks, s["n_kv"],
                                                              s["head_dim"])))
                          for _ in range(layers)]
                row = cache_type(kind).row_nbytes(s["head_dim"])
                read = 2 * depth * s["n_kv"] * row * layers
                kernels_here = [("new", kernels.ATTENTION)]
                if kind == "f32":
                    kernels_here.insert(0, ("old", "jllama_attention_old"))
                for label, target in kernels_here:
                    fn = program(target, layers)
                    jax.block_until_ready(fn(q, pos, keys, values))  # compile, warm
                    runs.append((label, kind, fn, keys, values, read))
            for r in range(args.rounds):
                for label, kind, fn, keys, values, read in runs:
                    times = []
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(q, pos, keys, values))
                        times.append(time.perf_counter() - t0)
                    t = statistics.median(times)
                    entry = results.setdefault((name, depth, label, kind),
                                               {"times": [], "read": read, "layers": layers})
                    entry["times"].append(t)
                    print(json.dumps({"round": r, "shape": name, "depth": depth, "layers": layers,
                                      "kernel": label, "type": kind,
                                      "us_per_layer": round(t / layers * 1e6, 2),
                                      "gb_s": round(read / t / 1e9, 2)}), flush=True)
            del runs
    for (name, depth, label, kind), e in results.items():
        t = statistics.median(e["times"])
        print(json.dumps({"summary": True, "shape": name, "depth": depth, "kernel": label,
                          "type": kind, "layers": e["layers"],
                          "us_per_layer": round(t / e["layers"] * 1e6, 2),
                          "gb_s": round(e["read"] / t / 1e9, 2), "rounds": len(e["times"])}),
              flush=True)

if __name__ == "__main__":
    main()
