"""bench/table.py on bad input: one line on stderr naming the file, flag or field, a non-zero
exit, no traceback, no half-written plot; and its tables of --vs results, worked out by hand.

    .venv/bin/python -m pytest -q bench/test_table_cli.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import table
from cli import BenchError

RUN1 = "bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 1"
RUN2 = "bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 2"


def rec(shape, backend, dtype, metric, median, values=None, **extra) -> dict:
    return {"shape": shape, "backend": backend, "dtype": dtype, "metric": metric,
            "median": median, "values": [median] if values is None else values, **extra}


GOOD = rec("s", "numpy", "float32", "decode_tok_s", 12.5, [12.0, 13.0])
GOOD_ROW = "| s | numpy | float32 |  | 12.5 (12.0-13.0) |"


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def run_table(*args, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "table.py"), *map(str, args)], cwd=ROOT,
                          input=stdin, capture_output=True, timeout=120, check=False)


def one_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """The one stderr line of a failed run, which must hold each of `words`."""
    err = done.stderr.decode()
    assert done.returncode != 0, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("table.py: "), err
    for w in words:
        assert w in lines[0], err
    return lines[0]


# --- input files -------------------------------------------------------------------------


def test_a_missing_file(tmp_path):
    done = run_table(tmp_path / "nope.jsonl")
    assert one_error(done, "nope.jsonl").endswith(": does not exist")
    assert done.returncode == 1 and not done.stdout


def test_a_directory(tmp_path):
    assert one_error(run_table(tmp_path), str(tmp_path)).endswith(": is a directory")


def test_a_file_that_is_not_utf8(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    assert "is not UTF-8 text" in one_error(run_table(bad), "bad.jsonl")


def test_dash_reads_stdin(tmp_path):
    done = run_table("-", stdin=(json.dumps(GOOD) + "\n").encode())
    assert done.returncode == 0, done.stderr
    assert GOOD_ROW in done.stdout.decode() and not done.stderr
    assert "is not UTF-8 text" in one_error(run_table("-", stdin=b"\xff\n"), "stdin")


# --- no records ----------------------------------------------------------------------------


@pytest.mark.parametrize("lines", [[], ["", "   "]], ids=["empty", "blank"])
def test_no_records_at_all(tmp_path, lines):
    path = write_lines(tmp_path / "in.jsonl", lines)
    one_error(run_table(path), "no benchmark records in", "in.jsonl")
    one_error(run_table(stdin=b""), "no benchmark records in stdin")


def test_only_garbage_meta_and_errors(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [
        "not json", "[1, 2]", {"metric": "meta", "host": "h"},
        {"shape": "s", "backend": "numpy", "dtype": "float32", "metric": "error",
         "error": "worker exited 1: boom"},
    ])
    done = run_table(path)
    err = done.stderr.decode()
    assert done.returncode == 1 and not done.stdout and "Traceback" not in err
    assert err.splitlines() == [
        f"table.py: skipped 2 lines that are not benchmark records (first: {path}:1)",
        "table.py: error in s numpy float32: worker exited 1: boom",
        f"table.py: no benchmark records in {path} (want bench/run.py's JSON lines)",
    ]


# --- --summary -----------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["bogus", "meta", "error"])
def test_summary_of_a_metric_the_input_lacks(tmp_path, metric):
    path = write_lines(tmp_path / "in.jsonl", [
        {"metric": "meta"}, GOOD, rec("s", "numpy", "float32", "load_s", 0.5)])
    line = one_error(run_table(path, f"--summary={metric}"), f"--summary={metric}")
    assert line.endswith("it has: decode_tok_s, load_s")
    assert not run_table(path, f"--summary={metric}").stdout


# --- malformed records ---------------------------------------------------------------------

ROW = '"shape": "s", "backend": "numpy", "dtype": "float32", '
MALFORMED = [  # (a JSON line, what its stderr line says)
    ("{" + ROW + '"metric": "decode_tok_s", "median": "fast"}', "median 'fast'"),
    ("{" + ROW + '"metric": 5, "median": 1}', "metric 5"),
    ("{" + ROW + '"metric": "prefill_abc_tok_s", "median": 1}', "prefill_abc_tok_s"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": Infinity}', "median inf"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": NaN}', "median nan"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": 1e999}', "median inf"),
    ('{"metric": "decode_tok_s"}', "shape missing"),
    ('{"shape": "s", "metric": "decode_tok_s", "median": 1}', "backend missing"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": 1, "values": [1, "x"]}', "values"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": true}', "median True"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": -5}', "median -5"),
    ("{" + ROW + '"metric": "decode_tok_s", "median": 5, "values": [5, -1]}', "values"),
    ('{"metric": "vs_decode_tok_s", "command": "run", "median": 1}', "shape missing"),
    ('{"shape": "s", "metric": "vs_decode_tok_s", "command": "run \'a", "median": 1}',
     "command"),
]


@pytest.mark.parametrize("line,why", MALFORMED, ids=[w for _, w in MALFORMED])
def test_a_malformed_record_is_skipped(tmp_path, line, why):
    path = write_lines(tmp_path / "in.jsonl", [GOOD, line])
    done = run_table(path)
    err = done.stderr.decode()
    assert done.returncode == 0 and "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"table.py: skipped 1 malformed records; first: {path}:2: "), err
    assert why in lines[0]
    out = done.stdout.decode()
    assert GOOD_ROW in out and "None" not in out and len(out.splitlines()) == 3
    # alone, it leaves no records
    only = write_lines(tmp_path / "only.jsonl", [line])
    done = run_table(only)
    assert done.returncode == 1 and "Traceback" not in done.stderr.decode()
    assert done.stderr.decode().splitlines()[-1].startswith("table.py: no benchmark records in")


# --- --plot --------------------------------------------------------------------------------


@pytest.mark.parametrize("target,words", [
    ("nodir/x.png", ["--plot=", "nodir", "does not exist"]),
    ("adir", ["--plot=", "adir", "is a directory"]),
    ("xnoext", ["--plot=", "xnoext", ".png"]),
    ("x.txt", ["--plot=", "x.txt", ".png"]),
])
def test_a_plot_path_that_cannot_take_a_png(tmp_path, target, words):
    path = write_lines(tmp_path / "in.jsonl", [GOOD])
    (tmp_path / "adir").mkdir()
    before = sorted(tmp_path.rglob("*"))
    done = run_table(path, f"--plot={tmp_path / target}")
    one_error(done, *words)
    assert not done.stdout  # checked before the table is printed
    assert sorted(tmp_path.rglob("*")) == before


def test_plot_of_empty_input(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [])
    one_error(run_table(path, f"--plot={tmp_path / 'x.png'}"), "no benchmark records")
    assert sorted(tmp_path.iterdir()) == [path]


def test_plot_is_written_whole_where_asked(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [
        GOOD, rec("s", "numpy", "float32", "decode_ratio_vs", 0.5, command=RUN1),
        rec("s", "numpy", "float32", "vs_decode_tok_s", 25.0, command=RUN1)])
    target = tmp_path / "p.png"
    done = run_table(path, f"--plot={target}")
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().splitlines() == [f"table.py: wrote {target}"]
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(tmp_path.iterdir()) == [path, target]  # no temporary file left
    assert target.stat().st_mode & 0o077 != 0  # not the temporary file's private 0600


# --- tables of --vs results, by hand -------------------------------------------------------

VS = [
    rec("a", "numpy", "float32", "decode_tok_s", 10.0, [9.0, 11.0]),
    rec("a", "numpy", "float32", "decode_ratio_vs", 0.5, [0.4, 0.6], command=RUN1),
    rec("a", "numpy", "float32", "decode_ratio_vs", 0.25, command=RUN2),
    rec("a", "numpy", "float32", "vs_decode_tok_s", 20.0, [19.0, 21.0], command=RUN1),
    rec("a", "numpy", "float32", "vs_decode_tok_s", 40.0, command=RUN2),
    rec("a", "jax", "float32", "decode_tok_s", 30.0),
    rec("a", "jax", "float32", "decode_ratio_vs", 1.5, command=RUN1),
    rec("a", "jax", "float32", "vs_decode_tok_s", 21.0, [20.0, 22.0], command=RUN1),
    rec("b", "numpy", "float32", "decode_tok_s", 5.0),
    rec("b", "numpy", "float32", "decode_ratio_vs", 2.0, command=RUN2),
]


def test_summary_of_decode_ratio_vs_is_a_column_per_series_and_program():
    # jax has no ratio against -t 2: no such column; b has only numpy's against -t 2
    assert table.summary(VS, "decode_ratio_vs").splitlines() == [
        "| shape | jax float32 / run -t 1 | numpy float32 / run -t 1 | numpy float32 / run -t 2 |",
        "| --- | --- | --- | --- |",
        "| a | 1.50 | 0.500 | 0.250 |",
        "| b |  |  | 2.00 |",
    ]


def test_summary_of_vs_decode_tok_s_pools_each_program_per_shape():
    # run -t 1 on a: 19, 21 (paired with numpy) and 20, 22 (with jax): median 20.5
    assert table.summary(VS, "vs_decode_tok_s").splitlines() == [
        "| shape | run -t 1 | run -t 2 |",
        "| --- | --- | --- |",
        "| a | 20.5 | 40.0 |",
        "| b |  |  |",
    ]
    assert table.summary(VS).splitlines() == [
        "| shape | jax float32 | numpy float32 | run -t 1 | run -t 2 |",
        "| --- | --- | --- | --- | --- |",
        "| a | 30.0 | 10.0 | 20.5 | 40.0 |",
        "| b |  | 5.00 |  |  |",
    ]


def test_two_vs_commands_differing_in_threads_get_two_names():
    md = table.markdown(VS).splitlines()
    header = md[0].split(" | ")
    assert header[-2:] == ["decode / run -t 1 (x)", "decode / run -t 2 (x) |"]
    assert "| a | numpy | float32 |  | 10.0 (9.00-11.0) |  |  |  |  |  |  |  | " \
           "0.500 (0.400-0.600) | 0.250 |" in md
    assert "| a | jax | float32 |  | 30.0 |  |  |  |  |  |  |  | 1.50 |  |" in md
    assert "| a | run -t 1 (--vs) |  |  | 20.5 (19.0-22.0) |  |  |  |  |  |  |  |  |  |" in md
    assert "| a | run -t 2 (--vs) |  |  | 40.0 |  |  |  |  |  |  |  |  |  |" in md
    assert not any(l.startswith("| b | run") for l in md)  # no --vs rates on b


def test_summary_of_an_absent_metric_raises():
    with pytest.raises(BenchError, match=r"--summary=meta: .* decode_tok_s, decode_ratio_vs, "
                                         r"vs_decode_tok_s"):
        table.summary(VS + [{"metric": "meta"}], "meta")


BAD_RECORDS = [
    rec("a", "numpy", "float32", "decode_tok_s", "fast"),
    rec("a", "numpy", "float32", 5, 1.0),
    rec("a", "numpy", "float32", "prefill_abc_tok_s", 1.0),
    rec("a", "numpy", "float32", "prefill_tok_s", 1.0),
    rec("a", "numpy", "float32", "decode_tok_s", float("inf")),
    rec("a", "numpy", "float32", "decode_tok_s", float("nan")),
    rec("a", "numpy", "float32", "decode_tok_s", 1.0, [1.0, float("inf")]),
    {"metric": "decode_tok_s", "median": 1.0},
    rec(None, None, None, "decode_tok_s", 1.0),
    rec("a", "numpy", "float32", "decode_ratio_vs", 9.0, command=5),
    {"metric": "vs_decode_tok_s", "command": RUN1, "median": 1.0, "values": [1.0]},
    {"metric": "error", "error": "boom"},
    {"metric": "meta"},
]


def test_malformed_records_are_left_out_of_every_table():
    records = BAD_RECORDS[:6] + VS + BAD_RECORDS[6:]
    for bad in BAD_RECORDS[:-2]:
        assert table.problem(bad), bad
    assert table.markdown(records) == table.markdown(VS)
    for metric in ("decode_tok_s", "decode_ratio_vs", "vs_decode_tok_s"):
        assert table.summary(records, metric) == table.summary(VS, metric)
    assert table.metrics(records) == ["decode_tok_s", "decode_ratio_vs", "vs_decode_tok_s"]


def test_read_records_counts_what_it_skips(tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", [
        "garbage", BAD_RECORDS[0], GOOD, BAD_RECORDS[7],
        '{"metric": "x", "median": ' + "[" * 10**5,  # nested too deep for json.loads
    ])
    assert table.read_records([str(path)]) == [GOOD]
    assert capsys.readouterr().err.splitlines() == [
        f"table.py: skipped 2 lines that are not benchmark records (first: {path}:1)",
        (f"table.py: skipped 2 malformed records; first: {path}:2: decode_tok_s: median 'fast' "
         "is not a finite number >= 0 or null"),
    ]


def test_a_device_is_refused_not_read_forever():
    one_error(run_table("/dev/zero"), "/dev/zero: is a device or socket")


def test_an_empty_summary_and_an_unknown_flag_are_one_line(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [GOOD])
    assert one_error(run_table(path, "--summary=")) == (
        "table.py: --summary: give a metric, e.g. --summary=decode_tok_s")
    one_error(run_table(path, "--bogus"), "unrecognized arguments: --bogus")


def test_a_plot_onto_a_symlink_replaces_its_target_and_a_pipe_is_refused(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [GOOD])
    real = tmp_path / "real.png"
    real.write_text("old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    done = run_table(path, f"--plot={link}")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and real.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fifo = tmp_path / "f.png"
    os.mkfifo(fifo)
    one_error(run_table(path, f"--plot={fifo}"), "is not a regular file")
    assert fifo.is_fifo()
