"""Prefill of one prompt, jllama against llama.cpp's `llama-bench -p N`, alternated; JSON lines.

    .venv/bin/python bench/prefill_vs.py --checkpoint=bench/.cache/smollm2.bin --tokens=512 \\
      --vs "bench/.cache/llama.cpp-build/bin/llama-bench -m /tmp/smollm2-F32.gguf -t 2 -p {tokens} -n 0 -r 3"

Each repetition: a fresh process (`--child`) loads the checkpoint (`--seq_len`, default 1024),
prepares the jax backend, prefills a random prompt of `--tokens` ids once untimed (compiles),
then `--runs` more times timed, and reports the median; then the `--vs` command runs (`{tokens}`
in it becomes --tokens) and its `ppN` row's mean is read (`| ... | pp512 | 1118.78 ± 5.55 |`),
N having to equal --tokens. One JSON line per measurement, then one with the per-pair ratios
jllama / llama.cpp and their median.

Bad input (a missing or unreadable checkpoint, --tokens beyond its context or --seq_len, an
unknown --dtype, a count below 1, a --vs line that is empty, names an unknown placeholder or
a program that is not there) is one line on stderr and exit status 1 before any work. A jllama
run that fails anyway is reported by its last line of stderr; a --vs run that exits non-zero,
prints no ppN row or the wrong N, or either one running past --timeout_s, is one line too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ceiling import check_vs, run_vs  # bench/ is not a package
from cli import (
    BenchError,
    Parser,
    guarded,
    last_line,
    positive_int,
    positive_seconds,
    rate,
)

_PP = re.compile(r"\|\s*pp([0-9]+)\s*\|\s*([0-9]+(?:\.[0-9]*)?)\s*±")


def child(args: argparse.Namespace) -> int:
    from worker import prompt_tokens, time_prefill

    from jllama.backends import make_backend
    from jllama.errors import JllamaError
    from jllama.model.loading import open_model

    try:
        model = open_model(args.checkpoint, need_tokenizer=False,
                           dtype=None if args.dtype == "stored" else args.dtype,
                           seq_len=args.seq_len)
        backend = make_backend("jax")
        backend.prepare(model.config, model.weights)
    except JllamaError as e:  # one line already: the parent prints it
        print(e, file=sys.stderr)
        return 1
    ids = prompt_tokens(args.tokens, model.config.vocab_size, seed=0)
    time_prefill(backend, "batched", ids)  # compiles the chunk programs
    rates = [args.tokens / time_prefill(backend, "batched", ids) for _ in range(args.runs)]
    print(json.dumps({"prefill_tok_s": statistics.median(rates), "runs": rates}))
    return 0


def checkpoint_context(text: str) -> int | None:
    """The context (tokens) of the checkpoint `--checkpoint=text` from its header alone, or
    None where the header cannot be read cheaply (the child then finds what is wrong).

    Raises:
      BenchError: the file is missing or unreadable, or its header is malformed.
    """
    from jllama.errors import JllamaError
    from jllama.platform.fetch import resolve_checkpoint

    flag = f"--checkpoint={text}"
    try:
        path = resolve_checkpoint(text)
    except JllamaError as e:
        raise BenchError(f"{flag}: {e}") from None
    if not path.exists():
        raise BenchError(f"{flag}: no such file")
    if not os.access(path, os.R_OK):
        raise BenchError(f"{flag}: not readable (permission denied)")
    try:
        if path.is_dir():
            from jllama.formats.hf import config_from_hf

            config_json = path / "config.json"
            if not config_json.is_file():
                raise BenchError(f"{flag}: a folder without config.json (not a Hugging Face "
                                 "model folder)")
            try:
                return config_from_hf(json.loads(config_json.read_text()), str(path)).seq_len
            except (OSError, ValueError):
                return None
        from jllama.formats.gguf import is_gguf

        if is_gguf(path):
            try:
                from gguf import GGUFReader

                field = GGUFReader(path, "r").fields.get("llama.context_length")
                return int(field.contents()) if field is not None else None
            except Exception:  # noqa: BLE001 (a malformed file: the child says how, in one line)
                return None
        from jllama.formats.llama2c import read_header

        return read_header(path).seq_len
    except JllamaError as e:
        raise BenchError(f"--checkpoint: {e}") from None


def pp_rate(text: str, tokens: int) -> float:
    """The mean of the `ppN` row with N == tokens that llama-bench printed (the last one).

    Raises:
      BenchError: no ppN row, none with N == tokens (naming those found), or not a positive
        rate.
    """
    rows = _PP.findall(text)
    if not rows:
        raise BenchError("--vs printed no ppN row (llama-bench's `| ... | pp512 | 1118.78 ± "
                         f"5.55 |`): {last_line(text)}")
    same = [value for n, value in rows if int(n) == tokens]
    if not same:
        found = ", ".join(dict.fromkeys(f"pp{n}" for n, _ in rows))
        raise BenchError(f"--vs printed {found}, not pp{tokens}: its -p must equal "
                         f"--tokens={tokens} (or use -p {{tokens}})")
    value = rate(same[-1])
    if value is None:
        raise BenchError(f"--vs printed pp{tokens} rate {same[-1]}, not a positive number")
    return value


def run_jllama(args: argparse.Namespace) -> dict:
    """One `--child` run: {"prefill_tok_s", "runs"}, or BenchError with its last line."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child",
            f"--checkpoint={args.checkpoint}", f"--vs={args.vs}", f"--tokens={args.tokens}",
            f"--seq_len={args.seq_len}", f"--dtype={args.dtype}", f"--runs={args.runs}"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=args.timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"jllama's prefill ran longer than --timeout_s={args.timeout_s:g} s "
                         "and was stopped") from None
    if done.returncode != 0:
        raise BenchError(f"jllama's prefill failed: {last_line(done.stderr, 300)}")
    try:
        ours = json.loads(done.stdout.strip().splitlines()[-1])
        float(ours["prefill_tok_s"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise BenchError(f"jllama's prefill printed no rate: {last_line(done.stdout)}") from None
    return ours


def main(argv: list[str] | None = None) -> int:
    from worker import DTYPES  # jllama's dtypes and "stored" (the file's own blocks)

    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--vs", required=True,
                   help="a llama-bench command line with -p N -n 0 ({tokens} becomes --tokens)")
    p.add_argument("--tokens", type=int, default=512, help="prompt length N")
    p.add_argument("--seq_len", type=int, default=1024, help="cap on jllama's context")
    p.add_argument("--dtype", default="float32", help=f"jllama's weights: {', '.join(DTYPES)}")
    p.add_argument("--reps", type=int, default=3, help="pairs of measurements")
    p.add_argument("--runs", type=int, default=3, help="timed prefills per jllama process")
    p.add_argument("--timeout_s", type=float, default=900,
                   help="limit on one jllama process or one --vs run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    # everything checked before any work
    for flag in ("tokens", "seq_len", "reps", "runs"):
        positive_int(f"--{flag}", getattr(args, flag))
    positive_seconds("--timeout_s", args.timeout_s)
    if args.dtype not in DTYPES:
        raise BenchError(f"--dtype={args.dtype}: not one of {', '.join(DTYPES)}")
    context = checkpoint_context(args.checkpoint)
    if context is not None and args.tokens > context:
        raise BenchError(f"--tokens={args.tokens} is more than the {context}-token context of "
                         f"--checkpoint={args.checkpoint}")
    if args.tokens > args.seq_len:
        raise BenchError(f"--tokens={args.tokens} is more than --seq_len={args.seq_len}")
    other = check_vs(args.vs, tokens=str(args.tokens))
    key = {"checkpoint": args.checkpoint, "dtype": args.dtype, "tokens": args.tokens}
    from run import machine_facts

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "") if os.path.exists("/proc/cpuinfo") else ""
    print(json.dumps({"metric": "machine", "cpu": cpu, "cpus": len(os.sched_getaffinity(0)),
                      "loadavg": list(os.getloadavg()),
                      **machine_facts(HERE / ".cache")}), flush=True)
    ratios = []
    for rep in range(args.reps):
        ours = run_jllama(args)
        theirs = pp_rate(run_vs(other, args.timeout_s), args.tokens)
        ratios.append(ours["prefill_tok_s"] / theirs)
        print(json.dumps({**key, "rep": rep + 1, "metric": f"prefill_{args.tokens}_tok_s",
                          "jllama": ours["prefill_tok_s"], "jllama_runs": ours["runs"],
                          "vs": theirs, "ratio": ratios[-1]}), flush=True)
    print(json.dumps({**key, "metric": f"prefill_{args.tokens}_ratio_vs", "command": args.vs,
                      "median": statistics.median(ratios), "values": ratios}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("prefill_vs.py", main))
