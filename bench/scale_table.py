"""The README's table and plot of `bench/scale.py`'s JSON lines: jllama beside llama.cpp at every
model size and depth.

    .venv/bin/python bench/scale_table.py scale-native.jsonl scale-avx2.jsonl --plot=scale.png

The table: one row per build, model and type; medians over the repetitions (from the
measurement lines, `scale_plan.summaries`, so a run cut short still tabulates); "a / b (r)"
is jllama's median, llama.cpp's median and the median of the per-repetition ratios jllama /
llama.cpp (for first token and RSS, lower is better: the ratio is still jllama / llama.cpp).
The plot (matplotlib): per type a row of three panels: decode tok/s against the model's
bytes per token (a line per depth), decode tok/s against depth (a line per model), prefill
tok/s against the model's size (a line per prompt length); jllama solid with filled dots,
llama.cpp dashed with open squares, log-scaled tok/s.

Bad input (a missing file, no scale.py measurements in it, a --plot that is not a .png in a
folder that exists) is one line on stderr and exit status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_plan  # bench/ is not a package: its modules by file name
from cli import BenchError, Parser, guarded, writable_file, write_whole
from table import fmt, read_text

MODEL_ORDER = {"1B": 0, "3B": 1, "8B": 2}


def read_lines(paths: list[str]) -> list[dict]:
    """The JSON objects of the files' lines (other lines skipped)."""
    out = []
    for path in paths:
        for line in read_text(path).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "metric" in record:
                out.append(record)
    return out


def _cell(summary: dict | None) -> str:
    if summary is None:
        return ""
    ratio = summary["ratio_median"]
    return (f"{fmt(summary['jllama'])} / {fmt(summary['other_value'])}"
            + (f" ({fmt(ratio)}x)" if ratio is not None else ""))


def _index(summaries: list[dict]) -> dict[tuple, dict]:
    return {(s["build"], s["model"], s["type"], s["of"], s["field"], s["other"],
             s.get("depth", s.get("tokens"))): s for s in summaries}


def rows_of(summaries: list[dict]) -> list[tuple]:
    """(build, model, type) in the order to show them: by build, model size, type."""
    keys = {(s["build"], s["model"], s["type"]) for s in summaries}
    return sorted(keys, key=lambda k: (str(k[0]), MODEL_ORDER.get(k[1], 9), str(k[1]), str(k[2])))


def markdown(records: list[dict]) -> str:
    """The table as markdown (module docstring)."""
    summaries = scale_plan.summaries(records)
    if not summaries:
        raise BenchError("no jllama and llama.cpp measurements of one point to compare "
                         "(want bench/scale.py's JSON lines)")
    index = _index(summaries)
    depths = sorted({s["depth"] for s in summaries if s["of"] == "decode_tok_s"})
    prefills = sorted({s["tokens"] for s in summaries if s["of"] == "prefill_tok_s"})
    first = any(s["of"] == "first_token" for s in summaries)
    ceilings = {(r.get("build"), r.get("model"), r.get("type")): r.get("ceiling_tok_s")
                for r in records if r.get("metric") == "model"}
    header = ["build", "model", "type"]
    if first:
        header += ["first token s: jllama / llama-simple (x)", "llama-cli s",
                   "peak RSS MB: jllama / llama-simple (x)", "llama-cli MB"]
    header += [f"decode @ {d}: jllama / llama.cpp tok/s (x)" for d in depths]
    header += [f"prefill {n}: jllama / llama.cpp tok/s (x)" for n in prefills]
    header += ["read ceiling tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for build, model, qtype in rows_of(summaries):
        def get(of, field, other, where=None):
            return index.get((build, model, qtype, of, field, other, where))

        cells = [str(build), str(model), str(qtype)]
        if first:
            cli_wall = get("first_token", "wall_s", "llama-cli")
            cli_rss = get("first_token", "peak_rss_mb", "llama-cli")
            cells += [_cell(get("first_token", "wall_s", "llama-simple")),
                      fmt(cli_wall["other_value"]) if cli_wall else "",
                      _cell(get("first_token", "peak_rss_mb", "llama-simple")),
                      fmt(cli_rss["other_value"]) if cli_rss else ""]
        cells += [_cell(get("decode_tok_s", "value", "llama-bench", d)) for d in depths]
        cells += [_cell(get("prefill_tok_s", "value", "llama-bench", n)) for n in prefills]
        ceiling = ceilings.get((build, model, qtype))
        cells.append(fmt(ceiling) if ceiling else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def series(records: list[dict]) -> dict:
    """{(build, type): {"decode": {depth: {program: [(model, bytes per token, tok/s)]}},
    "prefill": {tokens: {program: [...]}}}} of the medians, models in size order."""
    sizes = {(r.get("model"), r.get("type")): r.get("bytes_per_token")
             for r in records if r.get("metric") == "model"}
    out: dict = {}
    for s in scale_plan.summaries(records):
        if s["of"] == "first_token":
            continue
        kind = "decode" if s["of"] == "decode_tok_s" else "prefill"
        where = s["depth"] if kind == "decode" else s["tokens"]
        size = sizes.get((s["model"], s["type"]))
        panel = out.setdefault((s["build"], s["type"]), {"decode": {}, "prefill": {}})[kind]
        for program, value in (("jllama", s["jllama"]), ("llama.cpp", s["other_value"])):
            if value is not None and size:
                panel.setdefault(where, {}).setdefault(program, []).append(
                    (s["model"], size, value))
    for panels in out.values():
        for kind in panels.values():
            for programs in kind.values():
                for points in programs.values():
                    points.sort(key=lambda p: p[1])
    return out


def plot(records: list[dict], path: Path) -> None:
    """The PNG of `series` (module docstring), written whole."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot: needs matplotlib (pip install -e .[bench])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(records)
    if not data:
        raise BenchError("--plot: no decode or prefill measurements to plot")
    rows = sorted(data)
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 4.2 * len(rows)), squeeze=False)
    style = {"jllama": "-", "llama.cpp": "--"}
    marker = {"jllama": {"marker": "o"}, "llama.cpp": {"marker": "s", "fillstyle": "none"}}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax_row, (build, qtype) in zip(axes, rows):
        panels = data[build, qtype]
        ax = ax_row[0]
        for i, (depth, programs) in enumerate(sorted(panels["decode"].items())):
            for program, points in programs.items():
                ax.plot([p[1] / 1e9 for p in points], [p[2] for p in points], style[program],
                        **marker[program], color=colours[i % len(colours)],
                        label=f"{program} @ {depth}")
        ax.set_xlabel("GB read per token")
        ax.set_title(f"decode tok/s against model size ({qtype}, {build})")
        ax = ax_row[1]
        by_model: dict = {}
        for depth, programs in panels["decode"].items():
            for program, points in programs.items():
                for model, _, value in points:
                    by_model.setdefault((model, program), []).append((depth, value))
        models = sorted({m for m, _ in by_model}, key=lambda m: MODEL_ORDER.get(m, 9))
        for (model, program), points in sorted(by_model.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], style[program],
                    **marker[program], color=colours[models.index(model) % len(colours)],
                    label=f"{program} {model}")
        ax.set_xlabel("depth (tokens in the cache)")
        ax.set_title(f"decode tok/s against depth ({qtype}, {build})")
        ax = ax_row[2]
        for i, (tokens, programs) in enumerate(sorted(panels["prefill"].items())):
            for program, points in programs.items():
                ax.plot([p[1] / 1e9 for p in points], [p[2] for p in points], style[program],
                        **marker[program], color=colours[i % len(colours)],
                        label=f"{program} pp{tokens}")
        ax.set_xlabel("GB read per token")
        ax.set_title(f"prefill tok/s against model size ({qtype}, {build})")
        for ax in ax_row:
            if ax.has_data():
                ax.set_yscale("log")
                ax.legend(fontsize=7)
            ax.grid(which="both", alpha=0.3)
            ax.set_ylabel("tok/s")
    fig.tight_layout()
    try:
        write_whole(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    except OSError as e:
        raise BenchError(f"--plot={path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="scale.py JSON-lines files")
    p.add_argument("--plot", default="", help="also write a PNG plot here")
    args = p.parse_args(argv)
    plot_to = None
    if args.plot:
        plot_to = writable_file("--plot", args.plot)
        if plot_to.suffix.lower() != ".png":
            raise BenchError(f"--plot={args.plot}: give a file name ending in .png")
    records = read_lines(args.inputs)
    text = markdown(records)
    if plot_to:
        plot(records, plot_to)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("scale_table.py", main))
