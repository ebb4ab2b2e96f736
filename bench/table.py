"""A markdown table (and optionally a PNG bar plot) from `bench/run.py`'s JSON lines.

    .venv/bin/python bench/table.py results.jsonl [more.jsonl ...] [--plot=results.png]
    .venv/bin/python bench/run.py ... | .venv/bin/python bench/table.py      # or path "-"
    .venv/bin/python bench/table.py results.jsonl --summary=decode_tok_s   # the README's table

One row per (shape, backend, dtype, prefill mode) with medians; decode tok/s also shows the
range over the repetitions (the machine is shared: the range says how noisy it was). With
--vs results, a row per shape for each other program (its runs pooled over the pairings) and
a column per program with the median per-pair ratio jllama / other; two programs never share
a name (`vs.labels`: "run -t 1", "run -t 2"). When the same row and metric appear in several
inputs, the last one read wins. The plot (matplotlib, `pip install -e .[bench]`) has one
panel per mode (decode, prefill N) with tok/s per shape, log scale.

Bad input is one line on stderr and exit status 1 (`cli.guarded`): a file that does not
exist or is not UTF-8, no benchmark records at all, a --summary metric the input lacks, a
--plot path that cannot take a PNG. Lines that are not JSON objects with a "metric", and
records that are malformed (a median that is not a finite number or null, a row metric
without its shape, backend and dtype, ...), are skipped and counted on stderr. The plot is
written whole (a temporary file renamed onto the path) or not at all.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/ is not a package: its modules are imported by file name
from cli import BenchError, Parser, guarded, writable_file, write_whole
from vs import labels

NOT_MEASURED = ("meta", "error")
"""Metrics that are not measurements: the run's settings, a failed run."""

PREFILL = re.compile(r"prefill_([0-9]+)_tok_s")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _finite(value) -> bool:
    """Whether value is a JSON number (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _text(value) -> bool:
    """Whether value is a non-empty one-line string that stdout can print (no lone
    surrogates, which JSON's \\ud800 escapes can make)."""
    if not isinstance(value, str) or not value.strip() or "\n" in value or "\r" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def problem(record: dict) -> str | None:
    """Why a record (a JSON object with a "metric") cannot be tabulated, or None if it can.
    meta and error records need only their metric."""
    metric = record.get("metric")
    if not _text(metric):
        return f"metric {_short(metric)} is not a name"
    if metric in NOT_MEASURED:
        return None
    prefill_like = metric.startswith("prefill_") and metric.endswith("_tok_s")
    if prefill_like and not PREFILL.fullmatch(metric):
        return f"metric {metric!r}: want prefill_N_tok_s with N a whole number of tokens"
    needed = ("shape",) if metric == "vs_decode_tok_s" else ("shape", "backend", "dtype")
    for key in needed:
        if not _text(record.get(key)):
            what = "missing" if key not in record else f"{_short(record[key])} is not a name"
            return f"{metric}: {key} {what}"
    for key in ("prefill_mode", "command"):
        if key in record and not (isinstance(record[key], str) and (
                record[key] == "" or _text(record[key]))):
            return f"{metric}: {key} {_short(record[key])} is not text"
    try:
        shlex.split(record.get("command", ""))
    except ValueError as e:
        return f"{metric}: command {_short(record['command'])}: {e}"
    if "median" not in record:
        return f"{metric}: no median"
    median = record["median"]
    # every metric run.py writes is a rate, a ratio, a time or a size: none is negative
    if median is not None and not (_finite(median) and median >= 0):
        return f"{metric}: median {_short(median)} is not a finite number >= 0 or null"
    values = record.get("values", [])
    if not isinstance(values, list) or not all(_finite(v) and v >= 0 for v in values):
        return f"{metric}: values {_short(values)} is not a list of finite numbers >= 0"
    return None


def read_text(path: str) -> str:
    """The text of a file ("-": stdin), or BenchError naming it: missing, a folder, not
    UTF-8."""
    if path == "-":
        name, stream = "stdin", sys.stdin
        buffer = getattr(stream, "buffer", None)
        if buffer is None:  # a text stream without bytes underneath (a test's StringIO)
            return stream.read()
        data = buffer.read()
    else:
        name, p = path, Path(path)
        if p.is_dir():
            raise BenchError(f"{path}: is a directory")
        if not p.exists():
            raise BenchError(f"{path}: does not exist")
        if p.is_char_device() or p.is_block_device() or p.is_socket():
            # /dev/zero would be read forever; a pipe (<(...)) is fine
            raise BenchError(f"{path}: is a device or socket, not a file of JSON lines")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise BenchError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BenchError(f"{name}: is not UTF-8 text (byte {e.start})") from None


def read_records(paths: list[str]) -> list[dict]:
    """The benchmark records of the files' JSON lines (stdin when no path, or for "-").
    Lines that are not JSON objects with a "metric", and malformed records (`problem`), are
    counted and reported on stderr, with the first's place."""
    records: list[dict] = []
    not_records: list[str] = []
    malformed: list[str] = []
    for path in paths or ["-"]:
        name = "stdin" if path == "-" else path
        for number, line in enumerate(read_text(path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # not JSON; or nested too deep for Python
                record = None
            if not isinstance(record, dict) or "metric" not in record:
                not_records.append(f"{name}:{number}")
                continue
            why = problem(record)
            if why is None:
                records.append(record)
            else:
                malformed.append(f"{name}:{number}: {why}")
    if not_records:
        print(f"table.py: skipped {len(not_records)} lines that are not benchmark records "
              f"(first: {not_records[0]})", file=sys.stderr)
    if malformed:
        print(f"table.py: skipped {len(malformed)} malformed records; first: {malformed[0]}",
              file=sys.stderr)
    return records


def valid(records: list[dict]) -> list[dict]:
    """The records that are measurements and well-formed (read_records has already reported
    the others; records built in code are checked here too)."""
    return [r for r in records if isinstance(r, dict) and problem(r) is None
            and r["metric"] not in NOT_MEASURED]


def metrics(records: list[dict]) -> list[str]:
    """The metrics of the well-formed measurement records, in the order first seen."""
    return list(dict.fromkeys(r["metric"] for r in valid(records)))


def row_key(r: dict) -> tuple:
    return (r["shape"], r["backend"], r["dtype"], r.get("prefill_mode", ""))


def collect(records: list[dict]):
    """(rows, other, shapes, prefill_names, commands): rows maps a row key to
    {metric: record}; other maps (shape, --vs command) to that program's decode rates, pooled
    over the rows it was paired with; commands lists the --vs commands in order. A row's
    ratio against a --vs command is its metric "decode_ratio_vs COMMAND". Malformed records,
    meta and error are left out."""
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    other: dict[tuple, list] = {}
    shapes: list[str] = []
    prefill: set[str] = set()
    commands: list[str] = []
    for r in valid(records):
        metric = r["metric"]
        shape = r["shape"]
        if shape not in shapes:
            shapes.append(shape)
        command = r.get("command", "")
        if metric in ("vs_decode_tok_s", "decode_ratio_vs") and command not in commands:
            commands.append(command)
        if metric == "vs_decode_tok_s":
            rates = r.get("values") or ([r["median"]] if r["median"] is not None else [])
            other.setdefault((shape, command), []).extend(rates)
            continue
        if metric == "decode_ratio_vs":
            metric = f"decode_ratio_vs {command}"
        if PREFILL.fullmatch(metric):
            prefill.add(metric)
        rows[row_key(r)][metric] = r
    names = sorted(prefill, key=lambda n: int(PREFILL.fullmatch(n).group(1)))
    return rows, other, shapes, names, commands


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with about `digits` significant figures ("n/a" for None)."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
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


def pooled(values: list | None) -> str:
    """The median of a --vs program's pooled rates, or "" where it has none."""
    return fmt(statistics.median(values)) if values else ""


def markdown(records: list[dict], ranges: bool = False) -> str:
    """The table as markdown text."""
    rows, other, shapes, prefill, commands = collect(records)
    names = labels(commands)
    header = ["shape", "backend", "dtype", "prefill", "decode tok/s"]
    header += [f"prefill {PREFILL.fullmatch(n).group(1)} tok/s" for n in prefill]
    header += ["TTFT ms", "compile s", "all compiles s", "load s", "peak RSS MB", "weights MB/token",
               "decode GB/s"]
    header += [f"decode / {names[c]} (x)" for c in commands]
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
                rates = {"median": statistics.median(values), "values": values}
                cells = [str(shape), f"{names[command]} (--vs)", "", "", cell(rates, spread=True)]
                cells += [""] * (len(header) - len(cells))
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(records: list[dict], metric: str = "decode_tok_s") -> str:
    """The short table for a README: one row per shape, one column per backend and dtype
    (and per --vs program, for decode_tok_s), each cell the median of `metric` (a row's last
    input wins, whatever its prefill mode). decode_ratio_vs: a column per backend, dtype and
    --vs program ("numpy float32 / run -t 1") of the per-pair ratios' medians;
    vs_decode_tok_s: a column per --vs program of its pooled rates' median.

    Raises:
      BenchError: `metric` is not one the records carry (the message lists those).
    """
    present = metrics(records)
    if metric not in present:
        raise BenchError(f"--summary={metric}: no such metric in the input; it has: "
                         f"{', '.join(present) or 'none'}")
    rows, other, shapes, _, commands = collect(records)
    names = labels(commands)
    keys = [(metric, "")] if metric != "decode_ratio_vs" else [
        (f"decode_ratio_vs {c}", f" / {names[c]}") for c in commands]
    columns = []  # (header, backend, dtype, the rows' metric)
    for backend, dtype in sorted({k[1:3] for k in rows}):
        for key, suffix in keys:
            if any(k[1:3] == (backend, dtype) and key in m for k, m in rows.items()):
                columns.append((f"{backend} {dtype}{suffix}", backend, dtype, key))
    cells_of = {k[:3] + (key,): record for k, m in rows.items() for key, record in m.items()}
    vs_columns = commands if metric in ("decode_tok_s", "vs_decode_tok_s") else []
    header = ["shape"] + [h for h, *_ in columns] + [names[c] for c in vs_columns]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for shape in shapes:
        cells = [str(shape)]
        cells += [cell(cells_of.get((shape, b, d, key))) for _, b, d, key in columns]
        cells += [pooled(other.get((shape, c))) for c in vs_columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short_label(backend: str, dtype: str, prefill_mode: str) -> str:
    """A plot legend's name for a series: "jax loop f32", "numpy f32 (token prefill)"."""
    dtype = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
    name = f"{backend.replace('jax:decode=', 'jax ')} {dtype}"
    return name + (" (token prefill)" if prefill_mode == "token" else "")


def plot_path(path: str) -> Path:
    """The --plot path, checked before any work: a .png file name in a folder that exists,
    not a folder; BenchError naming --plot otherwise."""
    p = writable_file("--plot", path)
    if p.suffix.lower() != ".png":
        raise BenchError(f"--plot={path}: give a file name ending in .png (the plot is a PNG)")
    return p


def plot(records: list[dict], path: str) -> None:
    """Bars of tok/s per shape, one panel per mode, one bar per backend/dtype (and --vs),
    written whole to `path` as PNG (a temporary file beside it, renamed)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot: needs matplotlib (pip install -e .[bench])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, other, shapes, prefill, commands = collect(records)
    names = labels(commands)
    modes = ["decode_tok_s"] + prefill
    series = sorted({k[1:] for k in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        legend = [short_label(b, d, p) for b, d, p in series]
        heights = [
            [((rows.get((s,) + ser) or {}).get(mode) or {}).get("median") or 0 for s in shapes]
            for ser in series
        ]
        if mode == "decode_tok_s":
            for command in commands:
                legend.append(names[command])
                heights.append([
                    statistics.median(other[s, command]) if other.get((s, command)) else 0
                    for s in shapes
                ])
        width = 0.8 / max(len(heights), 1)
        for i, (name, h) in enumerate(zip(legend, heights)):
            xs = [j + (i - (len(heights) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, h, width, label=name)
        ax.set_xticks(range(len(shapes)), [str(s) for s in shapes], rotation=20)
        if any(v > 0 for h in heights for v in h):
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "n/a", transform=ax.transAxes, ha="center")
        ax.set_title(mode.replace("_tok_s", "").replace("_", " ") + " (tok/s, median)")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, legend = axes[0][0].get_legend_handles_labels()  # decode's panel has every series
    if legend:
        fig.legend(handles, legend, loc="lower center", ncol=min(len(legend), 5), fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * ((max(len(legend), 1) - 1) // 5 + 1), 1, 1))

    def write(tmp: Path) -> None:
        fig.savefig(tmp, dpi=120, format="png")

    try:
        write_whole(Path(path), write)
    except OSError as e:
        raise BenchError(f"--plot={path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description="markdown table (and PNG plot) of bench JSON lines")
    p.add_argument("inputs", nargs="*", help='JSON-lines files; "-" or none: stdin')
    p.add_argument("--plot", default="",
                   help="also write a PNG bar plot to this file (a name ending in .png)")
    p.add_argument("--ranges", action="store_true", help="show min-max for every column")
    p.add_argument("--summary", default=None, metavar="METRIC",
                   help="instead: one row per shape, a column per backend and dtype, of this "
                        "metric's medians (e.g. decode_tok_s, which adds a column per --vs "
                        "program, or prefill_512_tok_s); decode_ratio_vs: a column per "
                        "backend, dtype and --vs program of the median ratio jllama / other; "
                        "vs_decode_tok_s: a column per --vs program of its decode tok/s")
    args = p.parse_args(argv)
    if args.summary is not None and not args.summary.strip():
        raise BenchError("--summary: give a metric, e.g. --summary=decode_tok_s")
    plot_to = plot_path(args.plot) if args.plot else None
    records = read_records(args.inputs)
    for r in records:
        if r["metric"] == "error":
            where = " ".join(str(r.get(k)) for k in ("shape", "backend", "dtype") if r.get(k))
            message = f"table.py: error in {where or '?'}: {r.get('error')}"
            print(message.encode("utf-8", "backslashreplace").decode("utf-8").replace("\n", " "),
                  file=sys.stderr)
    if not valid(records):
        sources = ", ".join("stdin" if i == "-" else i for i in args.inputs or ["-"])
        raise BenchError(f"no benchmark records in {sources} (want bench/run.py's JSON lines)")
    text = (summary(records, args.summary) if args.summary is not None
            else markdown(records, args.ranges))
    if plot_to:
        plot(records, str(plot_to))  # before the table: a failed plot prints no table
    print(text)
    if plot_to:
        print(f"table.py: wrote {plot_to}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("table.py", main))
