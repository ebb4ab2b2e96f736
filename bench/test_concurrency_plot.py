"""bench/concurrency_plot.py: the serve_load lines become two panels whose points sit where
the axes put them (worked out by hand below), and bad input is one line and exit 1."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import concurrency_plot

SVG = "{http://www.w3.org/2000/svg}"
LINES = [
    json.dumps({"meta": True, "parallel": 1}),
    json.dumps({"parallel": 1, "clients": 1, "tokens_per_s": 40.0, "ttft_s_median": 0.1}),
    json.dumps({"parallel": 1, "clients": 32, "tokens_per_s": 40.0, "ttft_s_median": 3.0}),
    json.dumps({"meta": True, "parallel": 32}),
    json.dumps({"parallel": 32, "clients": 1, "tokens_per_s": 40.0, "ttft_s_median": 0.1}),
    json.dumps({"parallel": 32, "clients": 32, "tokens_per_s": 160.0, "ttft_s_median": 0.5}),
    "not json",
]


def test_points_where_the_axes_put_them(tmp_path):
    src = tmp_path / "load.jsonl"
    src.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "plot.svg"
    assert concurrency_plot.main([str(src), f"--out={out}"]) == 0
    root = ET.fromstring(out.read_text())
    lines = [p.get("points") for p in root.iter(f"{SVG}polyline")]
    # Panel 1 (tokens/s): x from 56 (1 client) to 56 + 288 (32, log2 axis); y top 200
    # (the next 1-2-5 step above 160) over 172 px from y = 28: 40 -> 165.6, 160 -> 62.4.
    # Panel 2 (first token): x shifted by 360; y top 5 (above 3.0): 0.1 -> 196.56,
    # 3.0 -> 96.8, 0.5 -> 182.8.
    assert lines == ["56.0,165.6 344.0,165.6", "56.0,165.6 344.0,62.4",
                     "416.0,196.6 704.0,96.8", "416.0,196.6 704.0,182.8"]
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "one request at a time (--parallel=1)" in texts and "--parallel=32" in texts


def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"meta": True}) + "\n")
    out = tmp_path / "plot.svg"
    assert concurrency_plot.main([str(empty), f"--out={out}"]) == 1
    assert not out.exists()
    assert concurrency_plot.main([str(tmp_path / "missing.jsonl"), f"--out={out}"]) == 1
    assert concurrency_plot.main([str(empty), f"--out={tmp_path / 'plot.png'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("concurrency_plot: ") for line in err)
