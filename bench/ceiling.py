"""How fast any f32 decode could run here: the memory-read ceiling beside llama2.c's run.c.

    .venv/bin/python bench/ceiling.py --shapes=stories15M,stories110M --reps=5 \\
      --vs "bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0"

A decode step of a float32 model reads every weight once (`worker.streamed_bytes_per_token`),
so it cannot run faster than the machine's read bandwidth over those bytes. For each shape
and repetition this times two threads summing a buffer of exactly that many bytes with
`stream_read.cc` (seven ways: plain loads, prefetches of several kinds and distances, two
streams a thread; the fastest counts, which if anything flatters the ceiling), then runs the
`--vs` program on the shape, alternating. JSON lines: the read GB/s, the tok/s it allows
(GB/s over the bytes per token), the other program's tok/s, and per pair the ratio of the
ceiling to it: what no f32 decode reading its weights once per token can exceed in that
minute. The buffer is as big as the weights, so a shape that fits in the L3 cache reads from
it here as the model would.

`stream_read.cc` is compiled (`-O3 -march=native -fopenmp`) into `--cache` as
`stream_read-<hash>`, the hash of the source and the flags: built once (a line on stderr says
so), never overwritten, so an edited source gets a binary of its own name.

Bad input (an unknown shape, --reps < 1, a --vs line that is empty, names an unknown
placeholder or a program that is not there) is one line on stderr and exit status 1 before
any work; so is a --vs run that fails, times out or prints no positive rate.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shapes as shapes_mod  # bench/ is not a package: its modules are imported by file name
import vs as vs_mod
from cli import (
    BenchError,
    Parser,
    guarded,
    last_line,
    positive_int,
    positive_seconds,
    rate,
    writable_folder,
)

SOURCE = HERE / "stream_read.cc"
CXXFLAGS = ("-O3", "-march=native", "-fopenmp")


def f32_bytes_per_token(config) -> int:
    """Bytes of f32 weights one decode step reads: every layer's matrices and norms, the
    final norm, the classifier, and one embedding row when the table is not the classifier
    (as `worker.streamed_bytes_per_token` counts the arrays jllama holds)."""
    c = config
    layer = c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim + 3 * c.dim * c.hidden_dim
    layer += 2 * c.dim
    row = 0 if c.shared_weights else c.dim
    return 4 * (c.n_layers * layer + c.dim + c.vocab_size * c.dim + row)


def _sig(x: float) -> float:
    """x to 4 significant figures (a tiny rate must not print as 0.0)."""
    return float(f"{x:.4g}")


def binary_name() -> str:
    """`stream_read-<12 hex>`: the first 12 hex digits of the sha256 of the source and the
    compiler flags, so a binary's name says what it was built from."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(b"\0" + "\0".join(CXXFLAGS).encode())
    return f"stream_read-{digest.hexdigest()[:12]}"


def build(cache: Path, quiet: bool = False) -> Path:
    """`cache/stream_read-<hash>` (see `binary_name`), compiled from `stream_read.cc` if that
    file is missing, else left alone.

    The compiler writes into a temporary folder inside `cache` and the binary is renamed
    into place, so the named file is never half-written, and a binary someone else built
    from other source keeps its own name. It says so on stderr unless `quiet`.

    Raises:
      BenchError: no compiler, `cache` cannot be made, or the compiler failed.
    """
    binary = cache / binary_name()
    if binary.is_file():
        return binary
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BenchError(f"no C++ compiler (g++ or c++) on PATH to build {SOURCE.name}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmpdir = Path(tempfile.mkdtemp(dir=cache, prefix=f".{binary.name}."))
    except OSError as e:
        raise BenchError(f"--cache={cache}: cannot write there: {e.strerror or e}") from None
    if not quiet:
        print(f"ceiling.py: building {binary.name} ({Path(cxx).name} {' '.join(CXXFLAGS)} "
              f"{SOURCE.name}) into {cache} ...", file=sys.stderr, flush=True)
    try:
        tmp = tmpdir / binary.name
        done = subprocess.run([cxx, *CXXFLAGS, str(SOURCE), "-o", str(tmp)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", check=False)
        if done.returncode != 0 or not tmp.is_file():
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise BenchError(f"{Path(cxx).name} could not build {SOURCE.name} (status "
                             f"{done.returncode}): {last_line(errors[0] if errors else done.stderr)}")
        os.replace(tmp, binary)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return binary


def check_vs(template: str, **values: str) -> list[str]:
    """The argument list of the `--vs` template with `values` put in (`vs.expand`), after
    `vs.check` with `values`' names as the placeholders (not empty, balanced quotes, known
    placeholders only, the program exists).

    Raises:
      BenchError: naming --vs and what is wrong.
    """
    try:
        vs_mod.check(template, placeholders=tuple(values))
        return vs_mod.expand(template, **values)
    except ValueError as e:
        raise BenchError(str(e)) from None


def run_vs(argv: list[str], timeout_s: float, flag: str = "--vs") -> str:
    """Runs `argv` once (`vs.run_other`: stdin empty, output kept to its last 64 KiB per
    stream, the program killed past `timeout_s`) and returns what it printed, stdout then
    stderr.

    Raises:
      BenchError: it could not start, was stopped (timeout, too much output), was killed by
        a signal or exited with a non-zero status; the message says which, with its last
        line of output (stderr's when it has one).
    """
    ran = vs_mod.run_other(argv, timeout_s)
    if ran["returncode"] != 0:
        if ran["error"].startswith("timed out"):
            raise BenchError(f"{flag} ran longer than --timeout_s={timeout_s:g} s and was "
                             f"stopped: {shlex.join(argv)}")
        raise BenchError(f"{flag} {ran['error']}")
    return ran["text"]


def shape_list(text: str) -> list:
    """The random-weight shapes named in the comma-separated `--shapes`, or BenchError."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise BenchError(f"--shapes={text!r}: give at least one shape")
    random = [s.name for s in shapes_mod.SHAPES.values() if s.kind == "random"]
    out = []
    for name in names:
        try:
            shape = shapes_mod.get_shape(name)
        except ValueError as e:
            raise BenchError(f"--shapes: {e}") from None
        if shape.kind != "random":
            raise BenchError(f"--shapes: {name} is not a random-weight shape (these are: "
                             f"{', '.join(random)})")
        out.append(shape)
    return out


def _read_bandwidth(binary: Path, nbytes: int) -> dict:
    done = subprocess.run([str(binary), str(nbytes), "9"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, errors="replace", check=False)
    if done.returncode != 0:
        raise BenchError(f"{binary.name} exited with status {done.returncode}: "
                         f"{last_line(done.stderr + done.stdout)}")
    try:
        read = json.loads(done.stdout)
        float(read["best_gb_s"])
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{binary.name} printed no best_gb_s: {last_line(done.stdout)}") from None
    return read


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="stories15M,stories110M",
                   help="comma-separated random-weight shapes of bench/shapes.py")
    p.add_argument("--reps", type=int, default=5, help="pairs of measurements per shape")
    p.add_argument("--vs", required=True,
                   help="the other program, as run.py's --vs ({checkpoint}, {tokenizer})")
    p.add_argument("--cache", type=Path, default=HERE / ".cache",
                   help="folder of the checkpoints, tokenizers and stream_read binary")
    p.add_argument("--timeout_s", type=float, default=600, help="limit on one --vs run")
    args = p.parse_args(argv)
    # everything checked before any work
    shapes = shape_list(args.shapes)
    positive_int("--reps", args.reps)
    positive_seconds("--timeout_s", args.timeout_s)
    check_vs(args.vs, checkpoint="CHECKPOINT", tokenizer="TOKENIZER")
    writable_folder("--cache", args.cache)
    binary = build(args.cache)
    other_label = vs_mod.label(args.vs)
    for shape in shapes:
        config = shape.config()
        nbytes = f32_bytes_per_token(config)
        try:
            checkpoint = shapes_mod.llama2c_checkpoint(shape, args.cache)
            tokenizer = shapes_mod.placeholder_tokenizer(config.vocab_size, args.cache)
        except OSError as e:
            raise BenchError(f"--cache={args.cache}: cannot write the {shape.name} files: "
                             f"{e.strerror or e}") from None
        other = check_vs(args.vs, checkpoint=str(checkpoint), tokenizer=str(tokenizer))
        key = {"shape": shape.name, "bytes_per_token": nbytes}
        ceilings, others, ratios = [], [], []
        for rep in range(args.reps):
            read = _read_bandwidth(binary, nbytes)
            ceiling = read["best_gb_s"] * 1e9 / nbytes
            text = run_vs(other, args.timeout_s)
            tok_s = rate(vs_mod.parse_tok_s(text))
            if tok_s is None:
                raise BenchError(f"--vs printed no positive tok/s rate (run.c's `achieved "
                                 f"tok/s: X`, jllama's or llama-bench's): {last_line(text)}")
            ceilings.append(ceiling)
            others.append(tok_s)
            ratios.append(ceiling / tok_s)
            print(json.dumps({**key, "rep": rep + 1, **read, "ceiling_tok_s": _sig(ceiling),
                              "other_tok_s": tok_s, "other": other_label}), flush=True)
        print(json.dumps({**key, "metric": "ceiling_ratio_vs", "other": other_label,
                          "median": _sig(statistics.median(ratios)),
                          "values": [_sig(r) for r in ratios],
                          "ceiling_tok_s": _sig(statistics.median(ceilings)),
                          "other_tok_s": _sig(statistics.median(others))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("ceiling.py", main))
