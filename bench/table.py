"""A markdown table (and optionally a PNG bar plot) from `bench/run.py`'s JSON lines.

    .venv/bin/python bench/table.py results.jsonl [more.jsonl ...] [--plot=results.png]
    .venv/bin/python bench/run.py ... | .venv/bin/python bench/table.py
    .venv/bin/python bench/table.py results.jsonl --summary=decode_tok_s   # the README's table

One row per (shape, backend, dtype, prefill mode) with medians; decode tok/s also shows the
range over the repetitions (the machine is shared: the range says how noisy it was). With
--vs results, a row per shape for the other program (its runs pooled over the pairings) and
a column with the median per-pair ratio jllama / other. When the same row and metric appear
in several inputs, the last one read wins. The plot (matplotlib, `pip install -e .[bench]`)
has one panel per mode (decode, prefill N) with tok/s per shape, log scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs import label  # bench/ is not a package: modules by file name


def read_records(paths: list[str]) -> list[dict]:
    """The JSON objects of the files' lines (stdin when no path); other lines are counted
    and reported on stderr."""
    lines: list[str] = []
    for path in paths:
        with open(path) as f:
            lines += f.readlines()
    if not paths:
        lines = sys.stdin.readlines()
    records, bad = [], 0
    for line in filter(str.strip, lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "metric" in record:
            records.append(record)
        else:
            bad += 1
    if bad:
        print(f"table.py: skipped {bad} lines that are not benchmark records", file=sys.stderr)
    return records


def row_key(r: dict) -> tuple:
    return (r.get("shape"), r.get("backend"), r.get("dtype"), r.get("prefill_mode", ""))


def collect(records: list[dict]):
    """(rows, other, shapes, prefill_names, commands): rows maps a row key to
    {metric: record}; other maps (shape, --vs command) to that program's decode rates, pooled
    over the rows it was paired with; commands lists the --vs commands in order."""
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    other: dict[str, dict] = {}
    shapes: list[str] = []
    prefill: set[str] = set()
    commands: list[str] = []
    for r in records:
        metric = r["metric"]
        if metric in ("meta", "error"):
            continue
        shape = r.get("shape")
        if shape not in shapes:
            shapes.append(shape)
        command = r.get("command", "")
        if metric in ("vs_decode_tok_s", "decode_ratio_vs") and command not in commands:
            commands.append(command)
        if metric == "vs_decode_tok_s":
            other.setdefault((shape, command), []).extend(r.get("values", []))
            continue
        if metric == "decode_ratio_vs":
            metric = f"decode_ratio_vs {command}"
        if metric.startswith("prefill_") and metric.endswith("_tok_s"):
            prefill.add(metric)
        rows[row_key(r)][metric] = r
    names = sorted(prefill, key=lambda n: int(n.split("_")[1]))
    return rows, other, shapes, names, commands


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with about `digits` significant figures ("n/a" for None)."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    magnitude = len(str(int(abs(value)))) if abs(value) >= 1 else 0
    decimals = max(digits - magnitude, 0) if abs(value) >= 1 else digits
    return f"{value:.{decimals}f}"


def cell(record: dict | None, scale: float = 1.0, spread: bool = False) -> str:
    if record is None:
        return ""
    if record.get("median") is None:
        return "n/a"
    text = fmt(record["median"] * scale)
    values = record.get("values") or []
    if spread and len(values) > 1:
        text += f" ({fmt(min(values) * scale)}-{fmt(max(values) * scale)})"
    return text


def markdown(records: list[dict], ranges: bool = False) -> str:
    """The table as markdown text."""
    rows, other, shapes, prefill, commands = collect(records)
    header = ["shape", "backend", "dtype", "prefill", "decode tok/s"]
    header += [f"prefill {n.split('_')[1]} tok/s" for n in prefill]
    header += ["TTFT ms", "compile s", "all compiles s", "load s", "peak RSS MB", "weights MB/token",
               "decode GB/s"]
    header += [f"decode / {label(c)} (x)" for c in commands]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for shape in shapes:
        for key in sorted(k for k in rows if k[0] == shape):
            m = rows[key]
            cells = [str(key[0]), str(key[1]), str(key[2]), str(key[3]),
                     cell(m.get("decode_tok_s"), spread=True)]
            cells += [cell(m.get(n), spread=ranges) for n in prefill]
            cells += [
                cell(m.get("ttft_s"), 1e3, ranges), cell(m.get("compile_s"), spread=ranges),
                cell(m.get("compile_total_s"), spread=ranges),
                cell(m.get("load_s"), spread=ranges), cell(m.get("peak_rss_mb"), spread=ranges),
                cell(m.get("weights_mb_per_token")), cell(m.get("decode_gb_s"), spread=ranges),
            ]
            cells += [cell(m.get(f"decode_ratio_vs {c}"), spread=True) for c in commands]
            lines.append("| " + " | ".join(cells) + " |")
        for command in commands:
            values = other.get((shape, command))
            if values:
                pooled = {"median": statistics.median(values), "values": values}
                cells = [str(shape), f"{label(command)} (--vs)", "", "", cell(pooled, spread=True)]
                cells += [""] * (len(header) - len(cells))
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(records: list[dict], metric: str = "decode_tok_s") -> str:
    """The short table for a README: one row per shape, one column per backend and dtype (and
    per --vs program, for decode), each cell the median of `metric` (a row's last input wins,
    whatever its prefill mode)."""
    rows, other, shapes, _, commands = collect(records)
    series = sorted({k[1:3] for k in rows if metric in rows[k]})
    cells_of = {(k[0],) + k[1:3]: m[metric] for k, m in rows.items() if metric in m}
    header = ["shape"] + [f"{b} {d}" for b, d in series]
    if metric == "decode_tok_s":
        header += [label(c) for c in commands]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for shape in shapes:
        cells = [str(shape)] + [cell(cells_of.get((shape,) + ser)) for ser in series]
        if metric == "decode_tok_s":
            for command in commands:
                values = other.get((shape, command))
                cells.append(fmt(statistics.median(values)) if values else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short_label(backend: str, dtype: str, prefill_mode: str) -> str:
    """A plot legend's name for a series: "jax loop f32", "numpy f32 (token prefill)"."""
    dtype = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
    name = f"{backend.replace('jax:decode=', 'jax ')} {dtype}"
    return name + (" (token prefill)" if prefill_mode == "token" else "")


def plot(records: list[dict], path: str) -> None:
    """Bars of tok/s per shape, one panel per mode, one bar per backend/dtype (and --vs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, other, shapes, prefill, commands = collect(records)
    modes = ["decode_tok_s"] + prefill
    series = sorted({k[1:] for k in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        labels = [short_label(b, d, p) for b, d, p in series]
        heights = [
            [((rows.get((s,) + ser) or {}).get(mode) or {}).get("median") or 0 for s in shapes]
            for ser in series
        ]
        if mode == "decode_tok_s":
            for command in commands:
                labels.append(label(command))
                heights.append([
                    statistics.median(other[s, command]) if other.get((s, command)) else 0
                    for s in shapes
                ])
        width = 0.8 / max(len(heights), 1)
        for i, (name, h) in enumerate(zip(labels, heights)):
            xs = [j + (i - (len(heights) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, h, width, label=name)
        ax.set_xticks(range(len(shapes)), [str(s) for s in shapes], rotation=20)
        if any(v > 0 for h in heights for v in h):
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "n/a", transform=ax.transAxes, ha="center")
        ax.set_title(mode.replace("_tok_s", "").replace("_", " ") + " (tok/s, median)")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()  # decode's panel has every series
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * ((len(names) - 1) // 5 + 1), 1, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="markdown table (and PNG plot) of bench JSON lines")
    p.add_argument("inputs", nargs="*", help="JSON-lines files (default: stdin)")
    p.add_argument("--plot", default="", help="write a PNG bar plot here")
    p.add_argument("--ranges", action="store_true", help="show min-max for every column")
    p.add_argument("--summary", default="",
                   help="instead: one row per shape, a column per backend and dtype, of this "
                        "metric's medians (e.g. decode_tok_s, prefill_512_tok_s)")
    args = p.parse_args(argv)
    records = read_records(args.inputs)
    errors = [r for r in records if r["metric"] == "error"]
    for r in errors:
        where = " ".join(str(r.get(k)) for k in ("shape", "backend", "dtype") if r.get(k))
        print(f"table.py: error in {where}: {r.get('error')}", file=sys.stderr)
    print(summary(records, args.summary) if args.summary else markdown(records, ranges=args.ranges))
    if args.plot:
        plot(records, args.plot)
        print(f"table.py: wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
