"""bench/scale.py's own logic, without a model: the points it plans, the command lines it runs,
llama-bench's JSON lines as this llama.cpp prints them, the ratios it reports, its process
measurement, and the table (values worked out by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scale
import scale_plan as sp
import scale_table
from cli import BenchError

# Two lines `llama-bench -m smollm2-Q4_K_M.gguf -t 2 ... -r 1 -o jsonl` printed here
# (llama.cpp 0c1e570), the fields the parser does not read cut out.
BENCH_DECODE = ('{"build_commit": "0c1e570", "type_k": "f16", "flash_attn": -1, "n_prompt": 0, '
                '"n_gen": 4, "n_depth": 8, "avg_ns": 441473475, "stddev_ns": 0, '
                '"avg_ts": 9.060567, "stddev_ts": 0.000000, "samples_ns": [ 441473475 ],'
                '"samples_ts": [ 9.06057 ]}')
BENCH_PREFILL = ('{"build_commit": "0c1e570", "type_k": "f16", "flash_attn": -1, "n_prompt": 16, '
                 '"n_gen": 0, "n_depth": 0, "avg_ns": 510396962, "stddev_ns": 0, '
                 '"avg_ts": 31.348149, "stddev_ts": 0.000000, "samples_ns": [ 510396962 ],'
                 '"samples_ts": [ 31.3481 ]}')


def test_plan_groups_a_depth_and_a_prefill_of_the_same_length():
    points = sp.plan([0, 4096, 16384], [512, 4096])
    assert points == [sp.Point(1, False, 0), sp.Point(512, True, None),
                      sp.Point(4096, True, 4096), sp.Point(16384, False, 16384)]
    assert points[2].name == "prefill 4096, decode @ 4096"
    assert sp.jllama_seq_len(points[0], 64) == 65  # BOS, then 64 more positions
    assert sp.jllama_seq_len(points[1], 64) == 513  # prefill only: one token sampled
    with pytest.raises(ValueError, match="negative"):
        sp.plan([-1], [])
    with pytest.raises(ValueError, match="at least 1"):
        sp.plan([], [0])


def test_llama_bench_command_lines():
    point = sp.Point(4096, True, 4096)
    got = sp.llama_bench_commands(Path("/b/llama-bench"), Path("/m.gguf"), point, 2, 64)
    common = ["/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-r", "1", "-o", "jsonl"]
    assert got == [("prefill", common + ["-p", "4096", "-n", "0"]),
                   ("decode", common + ["-p", "0", "-n", "64", "-d", "4096"])]
    assert [k for k, _ in sp.llama_bench_commands(Path("b"), Path("m"), sp.Point(1, False, 0),
                                                  2, 64)] == ["decode"]


def test_first_token_command_lines():
    got = dict(sp.first_token_commands("py", Path("/b"), Path("/m.gguf"), "Hi there", 3, 1024, 2))
    assert got["jllama"] == ["py", "-m", "jllama", "--checkpoint=/m.gguf", "--prompt=Hi there",
                             "--steps=3", "--temperature=0", "--seq_len=1024",
                             "--output_format=json"]
    assert got["llama-simple"] == ["/b/llama-simple", "-m", "/m.gguf", "-n", "1", "Hi there"]
    assert got["llama-cli"] == ["/b/llama-cli", "-m", "/m.gguf", "-c", "1024", "-n", "1",
                                "-t", "2", "-st", "-p", "Hi there"]


def test_llama_bench_rates_are_read_from_its_json_lines():
    text = "load_backend: loaded CPU\n" + BENCH_DECODE + "\n" + BENCH_PREFILL + "\nnot json {\n"
    records = sp.parse_llama_bench(text)
    assert len(records) == 2
    assert sp.bench_rate(records, "decode", sp.Point(8, False, 8), 4) == 9.060567
    assert sp.bench_rate(records, "prefill", sp.Point(16, True, None), 4) == 31.348149
    with pytest.raises(ValueError, match=r"n_depth 4096 \(found: p0 n4 d8, p16 n0 d0\)"):
        sp.bench_rate(records, "decode", sp.Point(4096, False, 4096), 4)
    bad = json.loads(BENCH_PREFILL) | {"avg_ts": 0}
    with pytest.raises(ValueError, match="not a finite number > 0"):
        sp.bench_rate([bad], "prefill", sp.Point(16, True, None), 4)


def test_decode_bytes_per_token_reads_an_untied_table_one_row_a_token():
    layer = [("blk.0.attn_q.weight", 64, 1000), ("blk.0.attn_norm.weight", 1, 256)]
    tied = [("token_embd.weight", 100, 5000)] + layer
    assert sp.decode_bytes_per_token(tied) == 5000 + 1000 + 256
    untied = tied + [("output.weight", 100, 7000)]
    assert sp.decode_bytes_per_token(untied) == 50 + 1000 + 256 + 7000


def _m(metric, program, rep, **fields):
    return {"metric": metric, "build": "native", "model": "1B", "type": "Q4_K_M",
            "program": program, "rep": rep, **fields}


RECORDS = [
    {"metric": "meta"},
    {"metric": "model", "build": "native", "model": "1B", "type": "Q4_K_M",
     "bytes_per_token": 8e8, "ceiling_tok_s": 38.0},
    {"metric": "model", "build": "x86-64-v3", "model": "1B", "type": "Q4_K_M",
     "bytes_per_token": 8e8, "ceiling_tok_s": 20.0},  # another sitting: not this row's
    _m("decode_tok_s", "jllama", 1, depth=0, value=30.0),
    _m("decode_tok_s", "llama-bench", 1, depth=0, value=20.0),
    _m("decode_tok_s", "jllama", 2, depth=0, value=24.0),
    _m("decode_tok_s", "llama-bench", 2, depth=0, value=16.0),
    _m("decode_tok_s", "jllama", 3, depth=0, value=10.0),  # no pair: in the median only
    _m("prefill_tok_s", "jllama", 1, tokens=512, value=100.0),
    _m("prefill_tok_s", "llama-bench", 1, tokens=512, value=125.0),
    _m("first_token", "jllama", 1, wall_s=2.0, peak_rss_mb=1200.0),
    _m("first_token", "llama-simple", 1, wall_s=1.0, peak_rss_mb=1300.0),
    _m("first_token", "llama-cli", 1, wall_s=1.6, peak_rss_mb=1350.0),
    {"metric": "error", "model": "1B", "type": "Q4_K_M", "program": "jllama", "error": "x"},
]


def test_summaries_pair_repetitions():
    got = {(s["of"], s["field"], s["other"]): s for s in sp.summaries(RECORDS)}
    decode = got["decode_tok_s", "value", "llama-bench"]
    assert decode["ratios"] == [1.5, 1.5] and decode["ratio_median"] == 1.5
    assert decode["jllama"] == 24.0 and decode["other_value"] == 18.0 and decode["depth"] == 0
    assert got["prefill_tok_s", "value", "llama-bench"]["ratio_median"] == 0.8
    assert got["first_token", "wall_s", "llama-simple"]["ratio_median"] == 2.0
    assert got["first_token", "wall_s", "llama-cli"]["ratio_median"] == 1.25
    assert got["first_token", "peak_rss_mb", "llama-cli"]["other_value"] == 1350.0
    assert len(got) == 6
    assert sp.summaries([_m("decode_tok_s", "jllama", 1, depth=0, value=3.0)]) == []


def test_table_cells_and_plot(tmp_path, capsys):
    text = scale_table.markdown(RECORDS)
    lines = text.splitlines()
    assert lines[0].startswith("| build | model | type | first token s: jllama / llama-simple")
    row = lines[2].split(" | ")
    assert row[3] == "2.00 / 1.00 (2.00x)" and row[4] == "1.60"
    assert row[5] == "1200 / 1300 (0.923x)" and row[6] == "1350"
    assert row[7] == "24.0 / 18.0 (1.50x)" and row[8] == "100 / 125 (0.800x)"
    assert row[9] == "38.0 |"
    src = tmp_path / "scale.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    png = tmp_path / "scale.png"
    assert scale_table.main([str(src), f"--plot={png}"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"metric": "meta"}) + "\n")
    with pytest.raises(BenchError, match="no jllama and llama.cpp measurements"):
        scale_table.main([str(empty)])


def test_flags_are_checked_before_any_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("llama-bench", "llama-simple"):
        (bin_dir / program).write_text("#!/bin/sh\n")
        (bin_dir / program).chmod(0o755)
    ok = [f"--llamacpp_bin={bin_dir}", f"--cache={tmp_path}", "--no-first_token"]
    with pytest.raises(BenchError, match="--models: '2B' is not one of 1B, 3B, 8B"):
        scale.parse_args(["--models=2B"] + ok)
    with pytest.raises(BenchError, match="--depths: 'x' is not an integer"):
        scale.parse_args(["--depths=0,x"] + ok)
    with pytest.raises(BenchError, match="nothing to measure"):
        scale.parse_args(["--depths=none", "--prefill=none"] + ok)
    with pytest.raises(BenchError, match="no executable llama-cli"):
        scale.parse_args(ok[:2])
    with pytest.raises(BenchError, match="Llama-3.2-1B-random-Q4_K_M.gguf: not there"):
        scale.parse_args(["--models=1B", "--types=Q4_K_M"] + ok)
    (tmp_path / "Llama-3.2-1B-random-Q8_0.gguf").write_bytes(b"")
    args = scale.parse_args(["--models=1B", "--types=Q8_0", "--depths=0", "--prefill=none"] + ok)
    assert args.points == [sp.Point(1, False, 0)]


def test_run_measured_gives_wall_time_peak_memory_and_failures():
    grow = "x = bytearray(200_000_000); x[::4096] = b'1' * len(x[::4096]); print('done')"
    ran = scale.run_measured([sys.executable, "-c", grow], 60)
    assert ran["error"] is None and ran["stdout"].strip() == "done"
    assert ran["peak_rss_mb"] > 200 and 0 < ran["wall_s"] < 60
    failed = scale.run_measured([sys.executable, "-c", "import sys; sys.exit('bad input')"], 60)
    assert failed["returncode"] == 1 and failed["error"].endswith("status 1: bad input")
    slow = scale.run_measured([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert "ran past --timeout_s=0.5" in slow["error"] and slow["wall_s"] < 10
