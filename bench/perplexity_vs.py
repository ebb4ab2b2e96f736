"""Perplexity of one text, `jllama perplexity` against llama.cpp's `llama-perplexity`; JSON lines.

    .venv/bin/python bench/perplexity_vs.py --models=smollm2 --ctx=512
    .venv/bin/python bench/perplexity_vs.py --models=a.gguf,b.gguf --chunks=4 \\
      --llama_perplexity=bench/.cache/llama.cpp-build/bin/llama-perplexity

For each GGUF of --models (a path, or a fetched model's name such as smollm2), both programs
score --file (default: bench/data/alice_wonderland_ch1-4.txt) in chunks of --ctx tokens, the
first --chunks of them (-1: all), one after the other:

    jllama perplexity --checkpoint=M --file=F --ctx=N [--chunks=C] --output_format=json
    llama-perplexity -m M -f F -c N [--chunks C] -t THREADS LLAMACPP_ARGS

and one JSON line per model says both PPLs with their errors, the ratio jllama / llama.cpp,
the chunks each evaluated, the largest relative gap between their running PPLs after each
chunk (`[1]x,[2]y,...`), the seconds each took (llama.cpp's: wall time of the whole process,
loading included) and the machine ("machine": host, CPU, CPUs, load, git, as bench/run.py's
meta line names it):

    {"metric": "perplexity_vs", "model": "smollm2", "ctx": 512, "chunks": 24,
     "jllama_ppl": 12.3, "jllama_ppl_error": 0.4, "llamacpp_ppl": 12.3, ..., "ratio": 1.0001,
     "machine": {...}}

llama.cpp's arithmetic differs from jllama's where it quantizes: with quantized weights it
multiplies by 8-bit-quantized activations, by default its KV cache is f16 and its attention
flash attention; `--llamacpp_args="-nr -fa off -ctk f32 -ctv f32"` on a GGUF widened to F32
(`llama-quantize --allow-requantize IN OUT F32`) makes it f32 throughout, where the two agree
to llama.cpp's 4 printed decimals (tests/data/smollm2_perplexity_llamacpp.json). The default
`--llamacpp_args=-nr` (no weight repacking): this machine's native build crashes in its AMX
product (ggml_backend_amx_mul_mat, SIGSEGV) on Q4_1 matrices otherwise.

Bad input (a missing --file or model, a model that is not a GGUF, a llama-perplexity that is
not there, --ctx < 3, --chunks 0) is one line on stderr and exit status 1 before any work. A run
that fails anyway gives a "metric": "error" line naming the model and why; the exit status is
then 1, after every model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from ceiling import run_vs  # bench/ is not a package: its modules are imported by file name
from cli import BenchError, Parser, guarded, last_line, positive_seconds

DEFAULT_TEXT = HERE / "data" / "alice_wonderland_ch1-4.txt"
DEFAULT_LLAMA_PERPLEXITY = "/work/src/llcpp-native/bin/llama-perplexity"

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+|nan|inf) \+/- ([0-9.]+|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over ([0-9]+) chunks")
_RUNNING = re.compile(r"\[([0-9]+)\]([0-9.]+|nan|inf),")
_TOO_SHORT = re.compile(r"you need at least ([0-9]+) tokens")


def parse_llama_perplexity(text: str) -> dict:
    """{"ppl", "ppl_error", "chunks", "chunk_ppl"} from what llama-perplexity printed: its
    `Final estimate: PPL = X +/- Y` line, `calculating perplexity over N chunks` and the
    running values `[1]x,[2]y,...`.

    Raises:
      BenchError: no final estimate (its message when the text was too short, else the last
        line printed).
    """
    final = _FINAL.findall(text)
    if not final:
        short = _TOO_SHORT.search(text)
        if short:
            raise BenchError(f"llama-perplexity: the text is too short, it needs at least "
                             f"{short[1]} tokens for this --ctx")
        raise BenchError(f"llama-perplexity printed no final estimate: {last_line(text)}")
    chunks = _CHUNKS.findall(text)
    running = sorted((int(i), float(v)) for i, v in _RUNNING.findall(text))
    return {
        "ppl": float(final[-1][0]), "ppl_error": float(final[-1][1]),
        "chunks": int(chunks[-1]) if chunks else None,
        "chunk_ppl": [v for _, v in running],
    }


def machine(args: argparse.Namespace) -> dict:
    """The machine as bench/run.py's meta line names it (host, cpu, cpus, loadavg, git,
    time)."""
    from run import meta

    m = meta(args)
    return {k: m[k] for k in ("host", "cpu", "cpus", "loadavg", "git", "time")}


def _checkpoint(text: str) -> Path:
    """The GGUF file of one --models entry (a path or a fetched model's name)."""
    from jllama.errors import JllamaError
    from jllama.platform.fetch import resolve_checkpoint
    from jllama.formats.gguf import is_gguf

    try:
        path = resolve_checkpoint(text)
    except JllamaError as e:
        raise BenchError(f"--models: {text}: {e}") from None
    if not path.is_file():
        raise BenchError(f"--models: {text}: no such file" if not path.exists() else
                         f"--models: {text}: not a file (llama-perplexity reads GGUF files)")
    if not os.access(path, os.R_OK):
        raise BenchError(f"--models: {text}: not readable (permission denied)")
    if not is_gguf(path):
        raise BenchError(f"--models: {text}: not a GGUF file (llama-perplexity reads GGUF only)")
    return path


def run_jllama(args: argparse.Namespace, checkpoint: Path) -> dict:
    """`jllama perplexity ... --output_format=json` in a fresh process: its JSON object."""
    argv = [sys.executable, "-m", "jllama", "perplexity", f"--checkpoint={checkpoint}",
            f"--file={args.file}", f"--ctx={args.ctx}", f"--chunks={args.chunks}",
            f"--dtype={args.dtype}", f"--backend={args.backend}", f"--threads={args.threads}",
            "--output_format=json"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=args.timeout_s, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"jllama perplexity ran longer than --timeout_s={args.timeout_s:g} s "
                         "and was stopped") from None
    if done.returncode != 0:
        raise BenchError(f"jllama perplexity failed: {last_line(done.stderr, 300)}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise BenchError(f"jllama perplexity printed no JSON: {last_line(done.stdout)}") from None


def run_llama_cpp(args: argparse.Namespace, checkpoint: Path) -> dict:
    """llama-perplexity on the same text and settings: `parse_llama_perplexity`'s dict, its
    wall seconds and command."""
    argv = [args.llama_perplexity, "-m", str(checkpoint), "-f", str(args.file), "-c",
            str(args.ctx), "-t", str(args.threads or len(os.sched_getaffinity(0)))]
    if args.chunks != -1:
        argv += ["--chunks", str(args.chunks)]
    argv += shlex.split(args.llamacpp_args)
    start = time.perf_counter()
    text = run_vs(argv, args.timeout_s, flag="llama-perplexity")
    seconds = time.perf_counter() - start
    return {**parse_llama_perplexity(text), "seconds": seconds, "command": shlex.join(argv)}


def compare(args: argparse.Namespace, name: str, checkpoint: Path) -> dict:
    """One model's line: both runs and their ratio."""
    ours = run_jllama(args, checkpoint)
    theirs = run_llama_cpp(args, checkpoint)
    pairs = list(zip(ours["chunk_ppl"], theirs["chunk_ppl"]))
    gap = max((abs(a / b - 1) for a, b in pairs if b), default=None)
    return {
        "metric": "perplexity_vs", "model": name, "checkpoint": str(checkpoint),
        "file": str(args.file), "ctx": args.ctx, "chunks": ours["chunks"],
        "tokens_scored": ours["tokens_scored"],
        "jllama_ppl": ours["ppl"], "jllama_ppl_error": ours["ppl_error"],
        "llamacpp_ppl": theirs["ppl"], "llamacpp_ppl_error": theirs["ppl_error"],
        "ratio": ours["ppl"] / theirs["ppl"],
        "llamacpp_chunks": theirs["chunks"], "max_chunk_ppl_gap": gap,
        "jllama_seconds": ours["seconds"], "jllama_tokens_per_second": ours["tokens_per_second"],
        "jllama_dtype": ours["dtype"], "jllama_backend": ours["backend"],
        "llamacpp_seconds": theirs["seconds"], "llamacpp_command": theirs["command"],
        "machine": machine(args),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from jllama.model.weights import DTYPES

    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2",
                   help="comma-separated GGUF files or fetched model names")
    p.add_argument("--file", default=str(DEFAULT_TEXT), help="the UTF-8 text to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk")
    p.add_argument("--chunks", type=int, default=-1, help="the most chunks; -1 = all")
    p.add_argument("--llama_perplexity", default=DEFAULT_LLAMA_PERPLEXITY,
                   help="the llama-perplexity binary")
    p.add_argument("--llamacpp_args", default="-nr",
                   help="more llama-perplexity arguments, split like a shell line")
    p.add_argument("--threads", type=int, default=0, help="both programs' threads; 0 = all CPUs")
    p.add_argument("--dtype", default="auto", help=f"jllama's weights: auto, {', '.join(DTYPES)}")
    p.add_argument("--backend", default="jax", help="jllama's backend: jax or numpy")
    p.add_argument("--timeout_s", type=float, default=3600, help="limit on each run")
    args = p.parse_args(argv)
    # everything checked before any work
    path = Path(args.file)
    if not path.is_file():
        raise BenchError(f"--file={args.file}: " + ("not a file" if path.exists() else
                                                     "no such file"))
    if args.ctx < 3:
        raise BenchError(f"--ctx={args.ctx}: must be at least 3 (the second half of a chunk "
                         "is scored)")
    if args.chunks == 0 or args.chunks < -1:
        raise BenchError(f"--chunks={args.chunks}: must be at least 1, or -1 for all")
    cpus = len(os.sched_getaffinity(0))
    if not 0 <= args.threads <= cpus:
        raise BenchError(f"--threads={args.threads}: must be 0 (all) up to the {cpus} CPUs")
    if args.dtype not in ("auto", *DTYPES):
        raise BenchError(f"--dtype={args.dtype}: not one of auto, {', '.join(DTYPES)}")
    if args.backend not in ("jax", "numpy"):
        raise BenchError(f"--backend={args.backend}: not jax or numpy")
    positive_seconds("--timeout_s", args.timeout_s)
    binary = Path(args.llama_perplexity)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise BenchError(f"--llama_perplexity={args.llama_perplexity}: no such program "
                         "(bench/build_llamacpp.sh builds one)")
    try:
        shlex.split(args.llamacpp_args)
    except ValueError as e:
        raise BenchError(f"--llamacpp_args={args.llamacpp_args!r}: {e}") from None
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise BenchError(f"--models={args.models!r}: give at least one model")
    args.checkpoints = {name: _checkpoint(name) for name in names}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    errors = 0
    for name, checkpoint in args.checkpoints.items():
        print(f"perplexity_vs.py: {name}: jllama, then llama-perplexity", file=sys.stderr,
              flush=True)
        try:
            line = compare(args, name, checkpoint)
        except BenchError as e:
            errors += 1
            line = {"metric": "error", "model": name, "error": str(e),
                    "machine": machine(args)}
        print(json.dumps(line), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(guarded("perplexity_vs.py", main))
