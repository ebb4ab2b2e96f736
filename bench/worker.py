"""One measurement of one model on one backend, in a process of its own.

`bench/run.py` starts this script once per repetition so that every figure, peak memory
included, belongs to a single fresh run. It prints one JSON object (the last line of stdout)
with the raw figures of that run; `run.py` gathers the repetitions and reports medians.

Order of work, each timed apart:

  1. load      `open_model` (reading, dequantizing GGUF, casting to --dtype), seconds.
  2. prepare   `backend.prepare`; `compile_s` is the backend's own `compile_seconds` (0 for a
               backend that compiles nothing). `compile_total_s` / `compiled_programs`: every
               XLA compilation of the whole run (JAX's backend_compile_duration events), small
               helper programs included.
  3. warm-up   programs compiled later than `prepare` are compiled here, untimed in the rates:
               the jax backend's attention programs for longer windows (one forward call at
               the first position of each window the measured sequences reach; the cache is
               fixed-size and masked, so these calls leave nothing a later sequence can see);
               in batched mode, one untimed prefill of each prompt length.
  4. prefill   for each prompt length L: a new sequence of BOS + L-1 fixed random tokens, fed
               token by token through `Generation` (mode "token", what the library does
               today) or in one `backend.prefill(tokens, 0)` call (mode "batched"), then the
               first token sampled greedily. prefill tok/s = L / that time; the time for the
               first length is the time to first token (ttft_s).
  5. decode    a new sequence from BOS alone, greedy, no stop tokens: the first sampled token
               ends the prefill, the next `decode_tokens` (fewer when seq_len is shorter) are
               timed: decode tok/s, as `GenerationStats.decode_tok_s`.
  6. peak RSS  `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end, MB (10^6 bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import numpy as np

DTYPES = ("float32", "bfloat16", "int8", "q4", "stored")
"""What --dtype takes: `jllama.model.loading.open_model`'s dtypes, and "stored" for the weights as the
file stores them (a GGUF's quantized blocks; open_model's dtype None)."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a llama2.c or GGUF file")
    p.add_argument("--backend", required=True,
                   help='a backend name, optionally with constructor options: "jax", "numpy", '
                        '"jax:decode=fused"')
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--prefill_lengths", default="128,512", help="prompt lengths, tokens")
    p.add_argument("--decode_tokens", type=int, default=256, help="tokens timed after the first")
    p.add_argument("--prefill_mode", default="token", choices=("token", "batched", "auto"))
    p.add_argument("--warmup", default="windows", choices=("windows", "none"))
    p.add_argument("--seq_len", type=int, default=0, help="cap on the context, 0 = the model's")
    p.add_argument("--threads", type=int, default=0, help="pin to this many cores, 0 = all")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    return p.parse_args(argv)


def prompt_tokens(length: int, vocab_size: int, seed: int) -> list[int]:
    """BOS (1) and `length - 1` tokens drawn uniformly from [3, vocab_size), fixed by `seed`."""
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, vocab_size, size=length - 1).tolist()


def streamed_bytes_per_token(weights) -> int:
    """Bytes of weights one decode step reads, from the arrays' nbytes: every layer matrix and
    norm, the final norm and the classifier, and one row of the embedding table (the whole
    table when it is the classifier, counted once)."""
    shared = weights.wcls is weights.token_embedding_table
    total = 0
    for name in ("rms_att_weight", "wq", "wk", "wv", "wo", "rms_ffn_weight", "w1", "w2", "w3",
                 "rms_final_weight", "wcls"):
        total += getattr(weights, name).nbytes
    table = weights.token_embedding_table
    if not shared:
        total += table.nbytes // table.shape[0]
    return total


def parse_backend(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME[:KEY=VALUE[:KEY=VALUE...]]` as (name, options as written).

    Raises:
      ValueError: an option that is not KEY=VALUE, or a KEY given twice.
    """
    name, *pairs = spec.split(":")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {pair!r} in {spec!r} is not KEY=VALUE")
        if key in options:
            raise ValueError(f"backend option {key!r} is given twice in {spec!r}")
        options[key] = value
    return name, options


def backend_options(name: str, options: dict[str, str]) -> dict:
    """The keyword arguments `make_backend(name, ...)` gets for the options written on the
    command line (`parse_backend`): checked against what the backend's constructor takes,
    `devices` as an integer.

    The numpy backend takes none; the jax backend `decode` (`DECODE_MODES`), `matvec`
    (`MATVEC`) and `devices` (an integer >= 1). Importing the jax backend (to read its mode
    names) happens only when it is given options.

    Raises:
      ValueError: an unknown backend, an option it does not take, or a value it does not
        accept; the message names them and what is known.
    """
    from jllama.backends import backend_names

    if name not in backend_names():
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
    if name == "numpy":
        if options:
            given = ", ".join(f"{k}={v}" for k, v in options.items())
            raise ValueError(f"the numpy backend takes no options, got {given}")
        return {}
    if not options:
        return {}
    from jllama.backends.jax_graph import DECODE_MODES, MATVEC

    out: dict = {}
    for key, value in options.items():
        if key in ("decode", "matvec"):
            known = DECODE_MODES if key == "decode" else MATVEC
            if value not in known:
                raise ValueError(f"{name}:{key}={value!r} is not one of {', '.join(known)}")
            out[key] = value
        elif key == "devices":
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = 0
            if out[key] < 1:
                raise ValueError(f"{name}:devices={value!r} is not an integer >= 1")
        else:
            raise ValueError(f"the {name} backend has no option {key!r}; known: decode, "
                             "matvec, devices")
    return out


def resolve_mode(mode: str, backend) -> str:
    """"token" or "batched": "auto" is batched when the backend has `prefill`.

    Raises:
      ValueError: "batched" for a backend without `prefill`.
    """
    from jllama.backends.base import Prefill

    has = isinstance(backend, Prefill)
    if mode == "auto":
        return "batched" if has else "token"
    if mode == "batched" and not has:
        raise ValueError(f"backend {backend.name!r} has no prefill(tokens, start_pos)")
    return mode


def warm_up(backend, mode: str, lengths: list[int], last_pos: int, seq_len: int) -> float:
    """Compile what `prepare` left uncompiled (see the module docstring); seconds taken."""
    start = time.perf_counter()
    if backend.name == "jax":
        from jllama.graphs import attention_window

        loop = backend.decode == "loop"  # the jax backend's mode
        if loop:
            backend.compile_loop("greedy")
        seen = {attention_window(seq_len, 0)}
        for pos in range(1, last_pos + 1):
            window = attention_window(seq_len, pos)
            if window not in seen:
                seen.add(window)
                backend.forward(1, pos)
                if loop:  # the loop program of this window (one token at this position)
                    backend.decode_loop(1, pos, 1)
    if mode == "batched":
        for length in lengths:
            backend.prefill(prompt_tokens(length, backend.config.vocab_size, 1), 0)
    return time.perf_counter() - start


def time_prefill(backend, mode: str, tokens: list[int]) -> float:
    """Seconds from the first prompt token to the first greedily sampled token."""
    from jllama.generation.generate import Generation
    from jllama.sampling import argmax

    if mode == "batched":
        start = time.perf_counter()
        argmax(backend.prefill(tokens, 0))
        return time.perf_counter() - start
    gen = Generation(backend.forward, tokens, argmax, steps=len(tokens), stop_ids=())
    for _ in gen:
        pass
    return gen.stats.prefill_seconds


def time_decode(backend, tokens: int) -> tuple[float, int]:
    """(tok/s, tokens timed) of greedy decoding from BOS after the first sampled token."""
    from jllama.generation.generate import Generation
    from jllama.sampling import argmax

    steps = min(1 + tokens, backend.config.seq_len)  # BOS's position, then one per token
    decode_loop = None
    from jllama.backends.base import DeviceLoop

    if isinstance(backend, DeviceLoop) and backend.decode == "loop":  # sampled on the device
        from jllama.generation.device_loop import loop_decoder
        from jllama.sampling import Sampler

        argmax = Sampler(temperature=0.0)
        decode_loop = loop_decoder(backend, argmax, ())
    gen = Generation(backend.forward, [1], argmax, steps=steps, stop_ids=(),
                     decode_loop=decode_loop)
    for _ in gen:
        pass
    return gen.stats.decode_tok_s, gen.stats.decode_steps


def _count_compiles() -> list[float]:
    """A list that fills with the seconds of each XLA compilation from now on."""
    import jax

    seconds: list[float] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seconds


def measure(args: argparse.Namespace) -> dict:
    """The figures of one run (keys as in `bench/run.py`'s METRICS, plus context)."""
    if args.threads:
        from jllama.platform.runtime import limit_cpu_threads

        limit_cpu_threads(args.threads)  # before JAX starts its CPU client
    from jllama.backends import make_backend
    from jllama.model.loading import open_model
    from jllama.model.weights import weights_dtype

    out: dict = {}
    compiles = _count_compiles()
    start = time.perf_counter()
    model = open_model(
        args.checkpoint, need_tokenizer=False,
        dtype=None if args.dtype == "stored" else args.dtype, seq_len=args.seq_len or None
    )
    out["load_s"] = time.perf_counter() - start
    config = model.config
    name, options = parse_backend(args.backend)
    backend = make_backend(name, **backend_options(name, options))
    start = time.perf_counter()
    backend.prepare(config, model.weights)
    out["prepare_s"] = time.perf_counter() - start
    mode = resolve_mode(args.prefill_mode, backend)
    out["prefill_mode"] = mode

    # The numpy backend widens bfloat16 to float32 in prepare: count what it actually reads.
    from jllama.backends.numpy_ref import NumpyBackend

    held = backend.weights if isinstance(backend, NumpyBackend) else model.weights
    out["weights_dtype"] = weights_dtype(held)
    out["weights_mb_per_token"] = streamed_bytes_per_token(held) / 1e6
    out["seq_len"] = config.seq_len

    lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
    fitting = [n for n in lengths if n <= config.seq_len]
    decode_positions = min(1 + args.decode_tokens, config.seq_len)
    last_pos = max(fitting + [decode_positions]) - 1
    out["warmup_s"] = (
        warm_up(backend, mode, fitting, last_pos, config.seq_len) if args.warmup == "windows" else 0.0
    )
    # After the warm-up: the loop decode mode compiles its first program there.
    from jllama.backends.base import CompilePlanning

    out["compile_s"] = float(backend.compile_seconds) if isinstance(backend, CompilePlanning) else 0.0

    skipped = {}
    for i, length in enumerate(lengths):
        if length not in fitting:
            skipped[f"prefill_{length}_tok_s"] = f"prompt of {length} > seq_len {config.seq_len}"
            continue
        seconds = time_prefill(backend, mode, prompt_tokens(length, config.vocab_size, args.seed))
        out[f"prefill_{length}_tok_s"] = length / seconds
        if "ttft_s" not in out:
            out["ttft_s"] = seconds
            out["ttft_prompt_tokens"] = length
    rate, steps = time_decode(backend, args.decode_tokens)
    out["decode_tok_s"] = rate
    out["decode_tokens"] = steps
    out["decode_gb_s"] = rate * out["weights_mb_per_token"] / 1e3
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    # Every XLA compilation of the run (prepare, prefill chunk shapes, attention windows,
    # the loop's block buckets), as JAX reports them.
    out["compile_total_s"] = sum(compiles)
    out["compiled_programs"] = len(compiles)
    out["skipped"] = skipped
    return out


def finite(value):
    """`value` with every float that is not finite (inf, nan) replaced by None, in dicts and
    lists too: what JSON can hold (`json.dumps(..., allow_nan=False)`)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    result = measure(args)
    sys.stdout.write(json.dumps(finite(result), allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
