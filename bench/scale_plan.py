"""What `bench/scale.py` runs and how it reads the answers: the points of a model, the command
lines of each program at each point, llama-bench's JSON lines, the bytes a decode step reads.

Pure functions (no process is started here), so `bench/test_scale.py` checks them without a
model. The programs compared at each point (see scale.py's docstring for the whole run):

  first token  a new process to its first generated token, page cache warm: jllama's CLI
               (`python -m jllama ... --steps=<prompt tokens> --temperature=0 --seq_len=C`,
               one token generated), llama.cpp's `llama-simple -n 1` (its context: the prompt
               and one token; its thread count is llama.cpp's default, it has no -t) and
               `llama-cli -c C -n 1 -st -p ...` (this llama.cpp's llama-cli is the chat
               program: `-st` is one turn then exit; the old `-no-cnv` belongs to
               llama-completion now, and the prompt goes through the chat template);
  prompt L     jllama: one process, a prompt of L random ids then greedy tokens (ignore_eos):
               prefill tok/s of the L tokens and, when asked, decode tok/s of the tokens after
               the first (depth L); llama.cpp: `llama-bench -p L -n 0` (prefill) and
               `llama-bench -p 0 -n N -d L` (decode at depth L), each `-r 1 -o jsonl`.

A decode depth of 0 is a one-token prompt (BOS) for jllama: its decode then starts at
position 1, llama-bench's at 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

BUILDS = ("native", "x86-64-v3")
"""--build: jllama's kernels for this CPU (JLLAMA_MARCH unset) or for x86-64-v3 (AVX2), each
against the llama.cpp build of the same name."""

FIRST_TOKEN_PROMPT = "Hello my name is"
"""llama-simple's own default prompt; the three programs get the same text."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One jllama process's work at a prompt length, and what it is compared on.

    Attributes:
      prompt_tokens: L, the prompt's length in tokens (1 for decode at depth 0).
      prefill: whether prefill tok/s of the L tokens is a measurement (vs `llama-bench -p L`).
      decode_depth: the decode depth measured here (vs `llama-bench -d`), or None.
    """

    prompt_tokens: int
    prefill: bool
    decode_depth: int | None

    @property
    def name(self) -> str:
        parts = []
        if self.prefill:
            parts.append(f"prefill {self.prompt_tokens}")
        if self.decode_depth is not None:
            parts.append(f"decode @ {self.decode_depth}")
        return ", ".join(parts)


def plan(depths: Iterable[int], prefills: Iterable[int]) -> list[Point]:
    """The prompt points for decode `depths` and prefill lengths `prefills`, by prompt length:
    a decode depth D and a prefill of D tokens share one jllama process (its prompt gives both);
    depth 0 is a prompt of 1 token.

    Raises:
      ValueError: a negative depth, a prefill length below 1.
    """
    by_length: dict[int, dict] = {}
    for d in depths:
        if d < 0:
            raise ValueError(f"decode depth {d} is negative")
        by_length.setdefault(max(d, 1), {})["depth"] = d
    for p in prefills:
        if p < 1:
            raise ValueError(f"prefill length {p} must be at least 1")
        by_length.setdefault(p, {})["prefill"] = True
    return [Point(n, bool(v.get("prefill")), v.get("depth")) for n, v in sorted(by_length.items())]


def jllama_seq_len(point: Point, decode_tokens: int) -> int:
    """The context a point's jllama process allocates: the prompt and the decoded tokens
    (llama-bench's n_ctx is n_prompt + n_gen + n_depth likewise)."""
    return point.prompt_tokens + (decode_tokens if point.decode_depth is not None else 1)


def llama_bench_commands(bench: Path, model: Path, point: Point, threads: int,
                         decode_tokens: int) -> list[tuple[str, list[str]]]:
    """("prefill" | "decode", argv) of llama-bench for a point: `-p L -n 0` and `-p 0 -n N -d
    D`, one repetition each, JSON lines on stdout; its default cache (f16) and settings."""
    common = [str(bench), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "jsonl"]
    out = []
    if point.prefill:
        out.append(("prefill", common + ["-p", str(point.prompt_tokens), "-n", "0"]))
    if point.decode_depth is not None:
        out.append(("decode", common + ["-p", "0", "-n", str(decode_tokens),
                                        "-d", str(point.decode_depth)]))
    return out


def first_token_commands(python: str, bin_dir: Path, model: Path, prompt: str,
                         prompt_tokens: int, context: int, threads: int
                         ) -> list[tuple[str, list[str]]]:
    """(program, argv) of the three first-token runs (module docstring), jllama first."""
    return [
        ("jllama", [python, "-m", "jllama", f"--checkpoint={model}", f"--prompt={prompt}",
                    f"--steps={prompt_tokens}", "--temperature=0", f"--seq_len={context}",
                    "--output_format=json"]),
        ("llama-simple", [str(bin_dir / "llama-simple"), "-m", str(model), "-n", "1", prompt]),
        ("llama-cli", [str(bin_dir / "llama-cli"), "-m", str(model), "-c", str(context),
                       "-n", "1", "-t", str(threads), "-st", "-p", prompt]),
    ]


def parse_llama_bench(text: str) -> list[dict]:
    """The test records llama-bench printed with `-o jsonl` (one JSON object a line; other
    lines, its log on stderr, skipped): n_prompt, n_gen, n_depth, avg_ts and the rest."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "avg_ts" in record and "n_prompt" in record:
            out.append(record)
    return out


def bench_rate(records: Sequence[dict], kind: str, point: Point, decode_tokens: int) -> float:
    """The tok/s of the llama-bench test that measures `kind` at `point` (prefill: n_prompt L,
    n_gen 0, depth 0; decode: n_prompt 0, n_gen N, n_depth D).

    Raises:
      ValueError: no such test among `records`, or a rate that is not a finite number > 0.
    """
    if kind == "prefill":
        want = (point.prompt_tokens, 0, 0)
    else:
        want = (0, decode_tokens, point.decode_depth)
    for r in records:
        if (r.get("n_prompt"), r.get("n_gen"), r.get("n_depth", 0)) == want:
            rate = r["avg_ts"]
            if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
                raise ValueError(f"llama-bench's rate {rate!r} is not a finite number > 0")
            return float(rate)
    found = ", ".join(f"p{r.get('n_prompt')} n{r.get('n_gen')} d{r.get('n_depth')}"
                      for r in records) or "none"
    raise ValueError(f"llama-bench printed no test with n_prompt {want[0]}, n_gen {want[1]}, "
                     f"n_depth {want[2]} (found: {found})")


def decode_bytes_per_token(tensors: Iterable[tuple[str, int, int]]) -> int:
    """Bytes of weights one decode step reads, from (name, rows, n_bytes) of a GGUF's tensors:
    every tensor, except that a `token_embd.weight` beside an `output.weight` is read one row a
    token (tied models read the whole table: it is the classifier)."""
    tensors = list(tensors)
    untied = any(name == "output.weight" for name, _, _ in tensors)
    total = 0
    for name, rows, n_bytes in tensors:
        total += n_bytes // rows if (untied and name == "token_embd.weight") else n_bytes
    return total


def ratios(ours: Sequence[float | None], theirs: Sequence[float | None]) -> list[float]:
    """Per-pair ratios ours / theirs over the pairs where both are finite numbers > 0."""
    return [a / b for a, b in zip(ours, theirs)
            if a is not None and b is not None and a > 0 and b > 0
            and math.isfinite(a) and math.isfinite(b)]


def csv_ints(flag: str, text: str, low: int) -> list[int]:
    """A comma-separated list of integers >= low, empty allowed ("" or "none": no points).

    Raises:
      ValueError: naming the flag and the bad item.
    """
    if text.strip().lower() in ("", "none"):
        return []
    out = []
    for word in text.split(","):
        word = word.strip()
        try:
            value = int(word)
        except ValueError:
            raise ValueError(f"{flag}: {word!r} is not an integer") from None
        if value < low:
            raise ValueError(f"{flag}: {value} is below {low}")
        out.append(value)
    return list(dict.fromkeys(out))


def csv_names(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma-separated list of names out of `known` (at least one).

    Raises:
      ValueError: naming the flag, the unknown name and those known.
    """
    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise ValueError(f"{flag}={text!r}: give at least one of {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ValueError(f"{flag}: {name!r} is not one of {', '.join(known)}")
    return list(dict.fromkeys(names))


OTHERS = {"first_token": ("llama-simple", "llama-cli"), "decode_tok_s": ("llama-bench",),
          "prefill_tok_s": ("llama-bench",)}
"""The programs each measured metric compares jllama with."""

FIELDS = {"first_token": ("wall_s", "peak_rss_mb"), "decode_tok_s": ("value",),
          "prefill_tok_s": ("value",)}
"""The figures a measurement record of each metric carries."""


def point_key(record: dict) -> tuple:
    """(build, model, type, metric, tokens or depth) of a measurement record: what pairs it
    with the other programs' records of the same point."""
    where = record.get("depth", record.get("tokens"))
    return (record.get("build"), record.get("model"), record.get("type"), record["metric"], where)


def summaries(records: Iterable[dict]) -> list[dict]:
    """One "summary" record per point, figure and other program: the medians of jllama's and
    the other's values and the per-repetition ratios jllama / other (pairs by "rep"; a
    repetition seen twice for a program: the last one read).

    Records that are not measurements (meta, model, error, summary) are ignored; a point
    without jllama or without the other program gives no summary."""
    import statistics

    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in records:
        if r.get("metric") not in OTHERS or "program" not in r:
            continue
        groups.setdefault(point_key(r), {}).setdefault(r["program"], {})[r.get("rep", 0)] = r
    out = []
    for key, programs in groups.items():
        build, model, qtype, metric, where = key
        ours = programs.get("jllama", {})
        for other in OTHERS[metric]:
            theirs = programs.get(other, {})
            if not ours or not theirs:
                continue
            reps = sorted(set(ours) & set(theirs))
            for field in FIELDS[metric]:
                a = [ours[i].get(field) for i in reps]
                b = [theirs[i].get(field) for i in reps]
                pairs = ratios(a, b)
                mine = [v for v in (x.get(field) for x in ours.values()) if _positive(v)]
                them = [v for v in (x.get(field) for x in theirs.values()) if _positive(v)]
                record = {"metric": "summary", "of": metric, "field": field, "build": build,
                          "model": model, "type": qtype, "other": other,
                          "jllama": statistics.median(mine) if mine else None,
                          "other_value": statistics.median(them) if them else None,
                          "ratio_median": statistics.median(pairs) if pairs else None,
                          "ratios": pairs}
                record["depth" if metric == "decode_tok_s" else "tokens"] = where
                out.append(record)
    return out


def _positive(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
