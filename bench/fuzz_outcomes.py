"""Classifying a finished fuzz case (bench/fuzz.py's "Outcomes"): clean_error, ran (and why a run
of that damage is fine) or failure (and why), from its exit status, stderr and peak RSS.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
import dataclasses

from fuzz_mutations import Mutation  # bench/ is the script's folder
from fuzz_plan import Running

TIME_LIMIT_S = 10.0
RSS_LIMIT_MB = 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a case may take: wall-clock seconds and peak RSS in MB (2^20 bytes)."""

    seconds: float = TIME_LIMIT_S
    rss_mb: float = RSS_LIMIT_MB


SETUP_LIMITS = Limits(60.0, 4096)
"""For the harness's own runs of the seeds (`preload`, `seed_peak_kib`), whatever --time_limit
and --rss_limit say: a seed must not be cut short there."""

# Jllama's own informational stderr lines: allowed beside the one error line or a run.
INFO_PREFIXES = ("jllama: required memory:", "jllama: note:", "jllama: warning:",
                 "jllama: seed ", "achieved tok/s:", "jllama: context full:")


def read_text(path: Path, limit: int = 1 << 20) -> str:
    """A file's first `limit` bytes as text, bad UTF-8 replaced; "" when it cannot be
    read (a case killed before it wrote the file)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def classify(r: Running, status: int, usage, seconds: float, limits: Limits) -> dict:
    """The outcome of a finished case, as its JSON line (rules: bench/fuzz.py's docstring)."""
    m = r.mutation
    lines = [line for line in read_text(r.folder / "stderr").splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith(INFO_PREFIXES)]
    peak_kib = usage.ru_maxrss + r.rss_offset_kib
    start = read_text(r.folder / "rss0").strip()
    growth = usage.ru_maxrss - int(start) if start.isdigit() else None
    exit_code = os.waitstatus_to_exitcode(status)
    shown = next((line for line in others if line.startswith("jllama: error:")),
                 others[0] if others else (lines[0] if lines else ""))
    result = {
        "case": r.case.index, "kind": r.case.kind, "seed": r.case.seed,
        "target": m.target if m else None, "mutation": m.name if m else "seed",
        "expect": m.expect if m else "run", "outcome": "", "reason": "",
        "exit": exit_code, "seconds": round(seconds, 3),
        "peak_rss_mb": round(peak_kib / 1024, 1),
        "rss_growth_mb": None if growth is None else round(max(0, growth) / 1024, 1),
        "stderr_lines": len(lines), "stderr": shown[:400],
    }
    failure = _failure(r, status, exit_code, peak_kib, lines, others, limits)
    if failure:
        result["outcome"], result["reason"] = "failure", failure
    elif exit_code != 0:
        result["outcome"], result["reason"] = "clean_error", "one error line naming the input"
    else:
        result["outcome"], result["reason"] = "ran", why_ran(r)
    return result


def _failure(r: Running, status: int, exit_code: int, peak_kib: int, lines: list[str],
             others: list[str], limits: Limits) -> str | None:
    """Why the case failed, or None."""
    m = r.mutation
    text = "\n".join(lines)
    if r.killed == "timeout":
        return f"timeout: killed after {limits.seconds:g} s"
    if r.killed == "rss" or peak_kib > limits.rss_mb * 1024:
        return (f"peak RSS: {peak_kib / 1024:.0f} MB > {limits.rss_mb:g} MB"
                + (" (killed)" if r.killed else ""))
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"signal: {signal.Signals(number).name}"
        except ValueError:
            return f"signal: {number}"
    if "Traceback (most recent call last)" in text:
        return "traceback on stderr"
    if "internal error" in text:
        return "internal error"
    if exit_code != 0:
        if len(others) != 1:
            return f"stderr lines: {len(others)} besides jllama's notes, expected one error line"
        if not others[0].startswith("jllama: error:"):
            return "not jllama's error line ('jllama: error: ...')"
        if not _names_input(others[0], r):
            return "error names no input file"
        if "--prompt is empty" in others[0]:
            # PROMPT is not empty: the message blames the user's flag for a damaged file.
            return "misleading error: blames --prompt for the input's damage"
        return None
    if others:
        return f"stray stderr output on a run: {others[0][:120]!r}"
    if m is not None and m.expect == "refuse":
        return "accepted: a crafted lie ran (exit 0) instead of being refused"
    if m is not None and m.expect == "refuse_or_warn" and not any("warning" in x for x in lines):
        return "silent: ran without a refusal or a warning line"
    return None


def _names_input(line: str, r: Running) -> bool:
    """Whether an error line names the input: the case folder, one of the seeds' files,
    "the checkpoint" (non-finite logits are found while generating, after the files are read:
    "the checkpoint's weights may be broken (check with --verify_checkpoint)"), or the model's
    context (a legal but tiny seq_len: "--prompt is 10 tokens, longer than the context
    (seq_len=7)"; a chat template that writes a long prompt: "the conversation is 2960 tokens
    with this message, and the context holds 128 (seq_len)")."""
    names = ("config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json",
             "model.gguf", "model.bin", "tokenizer.bin", "the checkpoint", "(seq_len=",
             "(seq_len)")
    return str(r.folder) in line or any(name in line for name in names)


BENIGN = ("tensor data", "weights", "alignment padding", "unused header padding", "RoPE table",
          "token score", "token piece")
"""Seed regions where any bytes are legal: a run after damage there is fine."""


def why_ran(r: Running) -> str:
    """Why a run of damaged input is fine, from the seed regions the mutation touched."""
    m = r.mutation
    if m is None:
        return "the seed itself"
    if r.case.kind == "replay":
        return "a replayed input (its mutation is not known here)"
    if m.expect == "bounded":
        return "a legal but large setting, run within the limits"
    if m.expect == "refuse_or_warn":
        return "ran with a warning line"
    if m.unchanged:
        return "unchanged: the value written was the one already there"
    if m.name.startswith("json.value["):
        return "the JSON value replaced is one jllama does not read, or a legal one"
    if m.name.startswith("template.random["):
        return "a real template with random edits, within the limits"
    if m.name.startswith("file.missing["):
        return "an optional file left out"
    if not m.touched:
        return "a crafted value the format allows"
    labels = sorted(touched_regions(r.case.seed, m))
    if labels and all(label.startswith(BENIGN) for label in labels):
        parts = sorted({b for b in BENIGN for label in labels if label.startswith(b)})
        return f"only {' / '.join(parts)} changed: any bytes there are legal values"
    if m.name.startswith("json.") or any(label.endswith(" text") for label in labels):
        return "the JSON still parses to a valid model (a changed string, or a value unused)"
    if not labels:
        return "only bytes past the end of the seed's regions changed"
    return f"{'; '.join(labels[:3])} changed to values the format allows"


def touched_regions(seed_name: str, m: Mutation) -> set[str]:
    """Labels of the seed regions a mutation's byte ranges overlap."""
    regions = SEED_REGIONS.get(seed_name, {}).get(m.target, [])
    return {label for start, end in m.touched for r_start, r_end, label in regions
            if start < r_end and r_start < end}


SEED_REGIONS: dict[str, dict[str, list[tuple[int, int, str]]]] = {}
"""Seed name -> file -> regions, for `touched_regions` (filled by `fuzz`)."""
