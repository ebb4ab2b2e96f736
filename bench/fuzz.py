"""Fuzz jllama's file readers as an attacker would (issue 21, "Hardening").

Every case is one input a user could pass to `jllama --checkpoint=...`: a seed file of each
reader (a GGUF file, a llama2.c checkpoint and its tokenizer.bin, a Hugging Face folder),
damaged by one mutation, run through the real command line in a process of its own under a
wall-clock limit (10 s) and a peak-RSS limit (1 GB). Prints one JSON line per case and a
summary line; failing inputs are kept in --out so they can be replayed.

  .venv/bin/python bench/fuzz.py --cases=300                     # a fresh seed, every reader
  .venv/bin/python bench/fuzz.py --cases=2000 --seed=7 --jobs=2 --out=fuzz-failures
  .venv/bin/python bench/fuzz.py --kinds=gguf,hf --cases=100
  .venv/bin/python bench/fuzz.py --kinds=http --cases=500        # the server's HTTP edges
  .venv/bin/python bench/fuzz.py --replay=fuzz-failures/0042-gguf  # one kept case again
  .venv/bin/python bench/fuzz.py --mode=cli --cases=20           # `python -m jllama` per case

Seeds (written here into a temporary folder, the same bytes for every run):
  gguf           model.gguf: a tiny llama (dim 64, 2 layers, 4 heads / 2 KV heads, vocab 300
                 byte-level tokens with a chat template; blk.1.attn_q stored Q8_0), written by
                 the `gguf` package's GGUFWriter through tests/gguf_files.py's `write_gguf`.
  llama2c        model.bin (llama2.c version 0, and a version 2 / Q8_0 one) by jllama's
                 `write_checkpoint`, with llama2.c's own tok512.bin (jllama's embedded copy).
  tokenizer_bin  the same pair, the tokenizer.bin damaged instead of the checkpoint.
  hf             config.json, model.safetensors (the `safetensors` package's `save_file`),
                 tokenizer.json (the `tokenizers` package's byte-level BPE, saved by it) and
                 tokenizer_config.json.
  template       the gguf seed in chat mode (`--mode=chat`, the prompt its first message), its
                 tokenizer.chat_template replaced (bench/fuzz_templates.py): template bombs
                 (huge strings, endless recursion, 5,000 nested parentheses, ...) that must be
                 refused, and real models' templates (tests/data/templates) randomly edited.

Mutations: random damage (bit flips, truncation, byte insertion and deletion, an interesting
integer written over a header word, a JSON value replaced) and crafted header lies per format
(fuzz_plan.crafted): GGUF arrays and strings declaring 10^7 .. 2^64-1 items or bytes, tensor offsets
of 2^64-1, overlapping or misaligned tensors, a type id over bytes sized for another type,
huge dims and counts, non-finite float metadata, a token list nested in an array; llama2.c
headers with zero, negative and huge sizes; tokenizer.json ids of 10^6 .. 10^12; JSON nested
10^5 deep or holding a 5,000-digit integer; rms_norm_eps / rope_theta = inf (`1e999`); a
tokenizer.json without its single-byte tokens. Every crafted lie is run once; the rest of
--cases are drawn at random: byte damage, or a random header field (a GGUF metadata entry's
or tensor info's word, a llama2.c header int, a safetensors entry's dtype / shape / offsets,
any JSON value) set to a hostile value.

Outcomes:
  clean_error  a non-zero exit and exactly one line on stderr, "jllama: error: ...", naming
               the input (a path in the case folder, or "the checkpoint"); jllama's own
               informational lines ("jllama: required memory/note/warning ...") aside.
  ran          exit 0, allowed for random damage, and the line says why that is fine (e.g.
               only weight bytes changed: any bit pattern is a weight; or the value written
               was the one already there).
  failure      over the time or RSS limit, killed by a signal, a traceback or "internal
               error" on stderr, a stray stderr line (e.g. a numpy RuntimeWarning), an error
               line that names no input or blames --prompt for a damaged file, or a crafted
               lie that ran: "refuse" lies must be refused, "refuse_or_warn" ones may run
               with a warning line, "bounded" ones (a 4M-token context) may run within the
               limits.

Two ways to run a case (--mode):
  fork  (default) this process imports what the command line imports, once, then forks a child
        per case that runs `jllama.cli.run()` with the case's argv: the same code as the
        `jllama` command (its flag parsing and error handling), about 30 ms a case.
  cli   `python -m jllama ...` in a fresh process per case: exactly what a user runs, 0.3 s
        (an error before JAX is imported) to 0.7 s a case. Both modes gave the same outcome,
        exit status and error line on 60 cases (--seed=5).
Peak RSS comes from the child's `ru_maxrss` (os.wait4's rusage, KiB on Linux), not from
RLIMIT_AS, which JAX's address reservation defeats; the parent also polls the child's VmRSS and
kills it past the limit, so a runaway case cannot take the machine's memory. A child's count
starts from what it inherits. A forked child counts the parent's private pages but only those
of the shared libraries it touches, about 70 MB less than a fresh `jllama` process holds (its
imports touched more): that difference, measured once per run on the first seed both ways
(summary: rss_offset_mb), is added, so `peak_rss_mb` is what the command would reach and the
1 GB limit applies to that; `rss_growth_mb` is what the case added to what the fork gave it.
A posix_spawn child (cli mode) starts from its parent's resident pages, so there
`peak_rss_mb` is at least the harness's own (about 55 MB; a `jllama` run takes ~155 MB).

Cases run `--backend=numpy` (no compile) with a short prompt and a few greedy steps: what is
under test is reading the files, which is the same for every backend.

HTTP (kind "http", bench/fuzz_http.py and fuzz_http_cases.py): one `jllama serve` on the gguf
seed for the run, and cases that each send raw bytes over a fresh TCP connection: crafted framing
(huge, negative and duplicate Content-Length, bad chunks, 1 MB header lines, 10,000 headers,
bodies that never arrive, slow senders, wrong Content-Types and encodings, trailing slashes,
JSON nested 10^5 deep, 5,000-digit numbers, pipelining) and random damage of valid requests.
Outcomes "clean" or "failure" (rules in fuzz_http's docstring: answered within 5 s with a 2xx
or a 4xx holding OpenAI's error object, and the server healthy, under the RSS limit and with no
traceback in its log after each case). In a run of several kinds it takes 1/len(kinds) of
--cases; its failures are kept as request.bin and case.json, and --replay runs one again.

This file is the command line and the run; the rest is in its siblings: fuzz_seeds.py (the seed
files and their byte maps), fuzz_mutations.py (random damage), fuzz_lies.py (the crafted lies),
fuzz_plan.py (the cases of a run), fuzz_runner.py (a case's process and its limits),
fuzz_outcomes.py (classification) and fuzz_replay.py (--out and --replay).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from fuzz_http import keep as keep_http  # bench/ is the script's folder
from fuzz_http import replay as replay_http
from fuzz_http import run_http
from fuzz_outcomes import RSS_LIMIT_MB, SEED_REGIONS, SETUP_LIMITS, TIME_LIMIT_S, Limits
from fuzz_plan import Running, plan
from fuzz_replay import keep, replay
from fuzz_runner import preload, rss_kib, run_all, seed_peak_kib
from fuzz_seeds import KINDS, make_seeds

ALL_KINDS = KINDS + ("http",)


def summarize(results: list[dict], **extra) -> dict:
    """The summary line: counts per kind and outcome, failures per reason (its first words),
    the slowest case and the largest peak RSS."""
    counts: dict[str, Counter] = defaultdict(Counter)
    reasons: Counter = Counter()
    for r in results:
        counts[r["kind"]][r["outcome"]] += 1
        counts["all"][r["outcome"]] += 1
        if r["outcome"] == "failure":
            reasons[r["reason"].split(":")[0]] += 1
    return {"summary": True, **extra, "cases": len(results),
            "counts": {k: dict(v) for k, v in counts.items()}, "failure_reasons": dict(reasons),
            "max_seconds": max((r["seconds"] for r in results), default=0),
            "max_peak_rss_mb": max((r["peak_rss_mb"] for r in results), default=0)}


def fuzz(n: int, seed: int, kinds: tuple[str, ...] = ALL_KINDS, mode: str = "fork",
         jobs: int = 1, limits: Limits | None = None, out: Path | None = None,
         on_result: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
    """Run `n` cases drawn with `seed`; returns (results in case order, the summary line).
    Failing inputs are copied into `out` when given."""
    limits = limits or Limits()
    began = time.monotonic()
    file_kinds = tuple(k for k in kinds if k != "http")
    n_http = 0 if "http" not in kinds else n // len(kinds) if file_kinds else n
    results, offset, parent_mb, extra = [], 0, rss_kib() / 1024, {}
    with tempfile.TemporaryDirectory(prefix="jllama-fuzz-") as tmp:
        root = Path(tmp)
        seeds = make_seeds(root / "seeds")
        for s in seeds.values():
            SEED_REGIONS[s.name] = s.regions
        if file_kinds:
            results, offset, parent_mb = _fuzz_files(
                n - n_http, seed, file_kinds, seeds, root, mode, jobs, limits, out, on_result)
        if n_http:
            checkpoint = root / "http" / "model.gguf"
            checkpoint.parent.mkdir()
            checkpoint.write_bytes(seeds["gguf"].files["model.gguf"])

            def done_http(result: dict, case) -> None:
                if result["outcome"] == "failure" and out is not None:
                    result["replay"] = str(keep_http(result, case, out))
                if on_result:
                    on_result(result)

            more, extra = run_http(n_http, seed, checkpoint, root / "http", limits.seconds,
                                   limits.rss_mb, len(results), done_http)
            results += more
    summary = summarize(results, seed=seed, kinds=",".join(kinds), mode=mode, jobs=jobs,
                        seconds=round(time.monotonic() - began, 1),
                        parent_rss_mb=round(parent_mb, 1),
                        rss_offset_mb=round(offset / 1024, 1),
                        limits={"seconds": limits.seconds, "rss_mb": limits.rss_mb}, **extra)
    return results, summary


def _fuzz_files(n: int, seed: int, kinds: tuple[str, ...], seeds: dict, root: Path, mode: str,
                jobs: int, limits: Limits, out: Path | None,
                on_result: Callable[[dict], None] | None) -> tuple[list[dict], int, float]:
    """The file readers' cases: (results, the fork's RSS offset in KiB, this process's RSS
    in MB once it is ready to fork)."""
    cases = plan(seeds, n, seed, kinds)
    offset = 0
    if mode == "fork":
        first = seeds[cases[0].seed]
        cli_peak = seed_peak_kib(first, root / "calibrate", "cli", SETUP_LIMITS)
        used = [seeds[name] for name in dict.fromkeys(c.seed for c in cases)]
        preload(used, root / "preload", SETUP_LIMITS)
        fork_peak = seed_peak_kib(first, root / "calibrate", "fork", SETUP_LIMITS)
        offset = max(0, cli_peak - fork_peak)
    parent_mb = rss_kib() / 1024

    def done(result: dict, r: Running) -> None:
        if result["outcome"] == "failure" and out is not None:
            result["replay"] = str(keep(result, r, seeds, out))
        shutil.rmtree(r.folder, ignore_errors=True)
        if on_result:
            on_result(result)

    results = run_all(cases, seeds, root / "cases", mode, jobs, limits, done, offset)
    return results, offset, parent_mb


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); exit status 1 when any case failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300, help="how many inputs (default 300)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed (default: a fresh one, printed in the summary)")
    parser.add_argument("--kinds", default=",".join(ALL_KINDS),
                        help="readers to fuzz, and http for the server, comma-separated "
                        f"(default {','.join(ALL_KINDS)})")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder to keep failing inputs in, each with case.json")
    parser.add_argument("--mode", choices=("fork", "cli"), default=None,
                        help="fork: a forked child per case (the default for runs); cli: "
                        "python -m jllama per case (the default for --replay)")
    parser.add_argument("--jobs", type=int, default=1, help="cases at once (default 1)")
    parser.add_argument("--time_limit", type=float, default=TIME_LIMIT_S,
                        help=f"seconds a case may take (default {TIME_LIMIT_S:g})")
    parser.add_argument("--rss_limit", type=float, default=RSS_LIMIT_MB,
                        help=f"MB of peak RSS a case may take (default {RSS_LIMIT_MB})")
    parser.add_argument("--replay", type=Path, default=None,
                        help="run one kept case folder (or any checkpoint path) again")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the failures and the summary")
    args = parser.parse_args(argv)
    limits = Limits(args.time_limit, args.rss_limit)
    if args.replay is not None and (args.replay / "request.bin").is_file():
        with tempfile.TemporaryDirectory(prefix="jllama-replay-") as tmp:
            checkpoint = Path(tmp) / "model.gguf"
            checkpoint.write_bytes(make_seeds(Path(tmp))["gguf"].files["model.gguf"])
            result = replay_http(args.replay, checkpoint, limits.seconds, limits.rss_mb)
        print(json.dumps(result, ensure_ascii=False), flush=True)
        return 1 if result["outcome"] == "failure" else 0
    if args.replay is not None:
        result = replay(args.replay, args.mode or "cli", limits)
        print(json.dumps(result, ensure_ascii=False), flush=True)
        return 1 if result["outcome"] == "failure" else 0
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown} (known: {', '.join(ALL_KINDS)})")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)

    def show(result: dict) -> None:
        if not args.quiet or result["outcome"] == "failure":
            print(json.dumps(result, ensure_ascii=False), flush=True)

    _, summary = fuzz(args.cases, seed, kinds, args.mode or "fork", args.jobs, limits,
                      args.out, show)
    print(json.dumps(summary), flush=True)
    return 1 if summary["counts"].get("all", {}).get("failure") else 0


if __name__ == "__main__":
    sys.exit(main())
