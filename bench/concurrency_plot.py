"""An SVG plot of `bench/serve_load.py`'s JSON lines: aggregate tokens/s and median time to
first token against the number of concurrent clients, one line per `jllama serve --parallel`.

    .venv/bin/python bench/serve_load.py --parallel=1,32 --clients=1,4,8,32 ... > load.jsonl
    .venv/bin/python bench/concurrency_plot.py load.jsonl --out=bench/results/concurrency.svg

No plotting library: the SVG is a few lines and paths written here, so the plot needs nothing
beyond the standard library. Lines that are not result objects (the meta lines, a summary)
are skipped. Clients go on a log2 axis (1, 4, 8, 32 evenly apart by doubling).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

WIDTH, HEIGHT = 360, 240  # one panel, px
MARGIN = dict(left=56, right=16, top=28, bottom=40)
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def series(lines) -> dict[int, list[tuple[int, float, float]]]:
    """{parallel: [(clients, tokens_per_s, ttft_s_median), ...] sorted by clients} from
    serve_load's JSON lines (results only; a level measured twice: the last one)."""
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or row.get("meta") or "clients" not in row:
            continue
        out.setdefault(int(row.get("parallel", 1)), {})[int(row["clients"])] = (
            float(row["tokens_per_s"]), float(row["ttft_s_median"]))
    return {p: sorted((c, *v) for c, v in levels.items()) for p, levels in sorted(out.items())}


def _nice_top(value: float) -> float:
    """The smallest of 1, 2, 5 x 10^k at or above value (an axis' top)."""
    if value <= 0:
        return 1.0
    k = 10 ** math.floor(math.log10(value))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= value)


def _panel(x0: int, title: str, unit: str, data, clients: list[int]) -> list[str]:
    """One panel's SVG elements: axes, ticks, and a polyline with markers per series.
    data: [(parallel, [(clients, value)])]."""
    left, top = x0 + MARGIN["left"], MARGIN["top"]
    w = WIDTH - MARGIN["left"] - MARGIN["right"]
    h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]
    lo, hi = math.log2(min(clients)), math.log2(max(clients))
    ymax = _nice_top(max(v for _, pts in data for _, v in pts))

    def px(c: float) -> float:
        return left + (w * (math.log2(c) - lo) / (hi - lo) if hi > lo else w / 2)

    def py(v: float) -> float:
        return top + h - h * v / ymax

    out = [f'<text x="{left + w / 2}" y="16" text-anchor="middle" font-weight="bold">{title}</text>',
           f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="black"/>',
           f'<text x="{left + w / 2}" y="{HEIGHT - 6}" text-anchor="middle">clients</text>',
           f'<text x="{x0 + 12}" y="{top + h / 2}" text-anchor="middle" '
           f'transform="rotate(-90 {x0 + 12} {top + h / 2})">{unit}</text>']
    for c in clients:
        out.append(f'<text x="{px(c):.1f}" y="{top + h + 16}" text-anchor="middle">{c}</text>')
    for k in range(5):
        v = ymax * k / 4
        out.append(f'<text x="{left - 4}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + w}" y2="{py(v):.1f}" '
                   'stroke="#ddd"/>')
    for i, (parallel, pts) in enumerate(data):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(c):.1f},{py(v):.1f}" for c, v in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        out += [f'<circle cx="{px(c):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}"/>'
                for c, v in pts]
    return out


def svg(data: dict[int, list[tuple[int, float, float]]], title: str = "") -> str:
    """The two panels side by side, with a legend naming each --parallel."""
    if not data:
        raise ValueError("no serve_load results (lines with clients, tokens_per_s, ttft_s_median)")
    clients = sorted({c for pts in data.values() for c, _, _ in pts})
    rate = [(p, [(c, r) for c, r, _ in pts]) for p, pts in data.items()]
    ttft = [(p, [(c, t) for c, _, t in pts]) for p, pts in data.items()]
    legend_h = 20 * len(data) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * WIDTH}" '
             f'height="{HEIGHT + legend_h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{2 * WIDTH}" height="{HEIGHT + legend_h}" fill="white"/>']
    if title:
        parts.append(f"<title>{title}</title>")
    parts += _panel(0, "aggregate generated tokens/s", "tokens/s", rate, clients)
    parts += _panel(WIDTH, "median time to first token", "seconds", ttft, clients)
    for i, parallel in enumerate(data):
        y = HEIGHT + 14 + 20 * i
        colour = COLOURS[i % len(COLOURS)]
        name = "one request at a time (--parallel=1)" if parallel == 1 else f"--parallel={parallel}"
        parts.append(f'<line x1="{MARGIN["left"]}" y1="{y - 4}" x2="{MARGIN["left"] + 24}" '
                     f'y2="{y - 4}" stroke="{colour}" stroke-width="2"/>')
        parts.append(f'<text x="{MARGIN["left"] + 30}" y="{y}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="serve_load.py JSON lines files")
    parser.add_argument("--out", required=True, help="the .svg file to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    if not args.out.endswith(".svg"):
        print(f"concurrency_plot: --out={args.out}: the plot is an SVG; name a .svg file",
              file=sys.stderr)
        return 1
    lines = []
    for name in args.inputs:
        try:
            lines += Path(name).read_text().splitlines()
        except OSError as e:
            print(f"concurrency_plot: {name}: {e.strerror}", file=sys.stderr)
            return 1
    try:
        text = svg(series(lines), args.title)
    except ValueError as e:
        print(f"concurrency_plot: {', '.join(args.inputs)}: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(out)  # never a half-written plot
    except OSError as e:
        print(f"concurrency_plot: --out={args.out}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
