"""Tests of the benchmark's own logic: `.venv/bin/python -m pytest bench/` (about 30 s).

Not part of the project's `tests/` (testpaths): the end-to-end case starts real worker
processes on the embedded stories260K model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The scripts' machine lines measure the read bandwidth over 16 MB, not 400 MB (~5 s a script
# run): these tests check the lines' form, not the figure (bench/run.py's READ_BYTES_ENV).
os.environ.setdefault("JLLAMA_BENCH_READ_BYTES", "16000000")

import run as run_mod
import shapes
import table
import vs
import worker

from jllama.formats.llama2c import read_header
from jllama.tokenizers.llama2c import read_tokenizer
from jllama.model.weights import random_weights


def test_parse_tok_s_reads_runc_and_jllama_lines():
    assert vs.parse_tok_s("once upon\nachieved tok/s: 229.411765\n") == pytest.approx(229.411765)
    jllama = "achieved tok/s: prefill 98.1 (5 tokens, 0.051 s), decode 48.7 (251 tokens, 5.2 s)"
    assert vs.parse_tok_s(jllama) == pytest.approx(48.7)
    assert vs.parse_tok_s("no rate here") is None
    # llama-bench's markdown table (copied from a run here): the tg row's mean.
    table = (
        "| model                          |       size |     params | backend    | threads |"
        "            test |                  t/s |\n"
        "| llama 256M all F32             | 513.13 MiB |   134.52 M | CPU        |       2 |"
        "            tg32 |         67.06 ± 0.00 |\n"
    )
    assert vs.parse_tok_s(table) == pytest.approx(67.06)
    assert vs.parse_tok_s(table.replace("tg32", "pp512")) is None


def test_expand_and_label():
    argv = vs.expand("env OMP_NUM_THREADS=1 'a b/run' {checkpoint} -z {tokenizer}",
                     checkpoint="/c d.bin", tokenizer="/t.bin")
    assert argv == ["env", "OMP_NUM_THREADS=1", "a b/run", "/c d.bin", "-z", "/t.bin"]
    assert vs.label("env OMP_NUM_THREADS=1 bench/.cache/run {checkpoint}") == (
        "run OMP_NUM_THREADS=1"
    )
    assert vs.label("/x/llama-bench -m /tmp/a-F32.gguf -t 2 -p 0 -n 256") == "llama-bench a-F32.gguf"
    with pytest.raises(ValueError, match="placeholder"):
        vs.expand("run {model}", checkpoint="x", tokenizer="y")


def test_placeholder_tokenizer_has_the_vocabulary_size(tmp_path):
    path = shapes.placeholder_tokenizer(1000, tmp_path)
    assert read_tokenizer(path, vocab_size=1000).vocab_size == 1000
    assert shapes.placeholder_tokenizer(1000, tmp_path) == path  # reused


def test_shapes_match_the_published_models():
    assert shapes.get_shape("stories110M").config().n_params() == pytest.approx(110e6, rel=0.05)
    tiny = shapes.get_shape("TinyLlama-1.1B")
    assert tiny.on_request and not tiny.config().shared_weights
    with pytest.raises(ValueError, match="known"):
        shapes.get_shape("nope")


def test_streamed_bytes_count_the_classifier_once():
    config = shapes.Shape("t", "random", (16, 32, 2, 2, 2, 50, 8)).config()
    w = random_weights(config)
    every = sum(getattr(w, n).nbytes for n in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    norms = w.rms_att_weight.nbytes + w.rms_ffn_weight.nbytes + w.rms_final_weight.nbytes
    assert worker.streamed_bytes_per_token(w) == every + norms + w.wcls.nbytes


def test_parse_backend_options():
    assert worker.parse_backend("jax") == ("jax", {})
    assert worker.parse_backend("jax:decode=fused") == ("jax", {"decode": "fused"})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        worker.parse_backend("jax:fused")


def test_metric_lines_take_medians_and_keep_skips():
    runs = [
        {"prefill_mode": "token", "decode_tok_s": v, "decode_tokens": 255, "compile_s": 1.0,
         "prefill_128_tok_s": 2 * v, "skipped": {"prefill_512_tok_s": "too long"}}
        for v in (10.0, 30.0, 20.0)
    ] + [{"error": "boom"}]
    lines = {r["metric"]: r for r in run_mod.metric_lines({"shape": "s"}, runs)}
    assert lines["decode_tok_s"]["median"] == 20.0 and lines["decode_tok_s"]["reps"] == 3
    assert lines["prefill_128_tok_s"]["median"] == 40.0
    assert lines["prefill_512_tok_s"]["median"] is None
    assert list(lines).index("prefill_128_tok_s") < list(lines).index("decode_tok_s")


def test_vs_lines_pair_ratios():
    runs = [{"decode_tok_s": 10.0}, {"decode_tok_s": 20.0}]
    others = [{"tok_s": 5.0}, {"tok_s": 20.0}]
    lines = {r["metric"]: r for r in run_mod.vs_lines({"shape": "s"}, "run", runs, others)}
    assert lines["decode_ratio_vs"]["values"] == [2.0, 1.0]
    assert lines["vs_decode_tok_s"]["median"] == 12.5


def test_end_to_end_json_lines_parse_and_tabulate(tmp_path):
    """run.py on stories260K (numpy, one rep, a --vs that prints a rate) -> table.py."""
    fake = f"{sys.executable} -c \"print('achieved tok/s: 100.0')\" {{checkpoint}} {{tokenizer}}"
    out = subprocess.run(
        [sys.executable, str(HERE / "run.py"), "--shapes=stories260K", "--backends=numpy",
         "--dtypes=float32,bfloat16", "--reps=1", "--decode_tokens=8", "--prefill_lengths=4,600",
         f"--cache={tmp_path}", f"--vs={fake}"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert records[0]["metric"] == "meta"
    metrics = {(r.get("dtype"), r["metric"]) for r in records}
    assert ("bfloat16", "decode_tok_s") in metrics and ("float32", "decode_ratio_vs") in metrics
    assert not any(r["metric"] == "error" for r in records)
    md = table.markdown(records)
    assert "| stories260K | numpy | float32 | token |" in md
    assert "python" in md  # the --vs program's row, named after its program
    table.plot(records, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert read_header(shapes.checkpoint(shapes.get_shape("stories260K"), tmp_path)).dim == 64


def test_summary_is_a_row_per_shape_and_a_column_per_backend_and_dtype():
    """Records written by hand: two shapes, two series, a --vs program on one shape only."""
    run = "bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0"

    def rec(shape, backend, dtype, metric, median, **extra):
        return {"shape": shape, "backend": backend, "dtype": dtype, "metric": metric,
                "median": median, "values": [median], **extra}

    records = [
        rec("a", "jax:decode=loop", "float32", "decode_tok_s", 100.0),
        rec("a", "jax:decode=loop", "float32", "prefill_512_tok_s", 1234.5),
        rec("a", "numpy", "float32", "decode_tok_s", 5.25),
        rec("b", "jax:decode=loop", "float32", "decode_tok_s", 12.0),
        {"shape": "a", "backend": "jax:decode=loop", "dtype": "float32", "metric":
         "vs_decode_tok_s", "command": run, "median": 80.0, "values": [70.0, 80.0, 90.0]},
    ]
    assert table.summary(records).splitlines() == [
        "| shape | jax:decode=loop float32 | numpy float32 | run |",
        "| --- | --- | --- | --- |",
        "| a | 100 | 5.25 | 80.0 |",
        "| b | 12.0 |  |  |",
    ]
    assert table.summary(records, "prefill_512_tok_s").splitlines()[2:] == [
        "| a | 1234 |", "| b |  |"]


def test_ceiling_counts_a_tokens_f32_bytes():
    """By hand, stories15M (dim 288, hidden 768, 6 layers, q_dim = kv_dim = 288, 32000 tokens,
    classifier shared with the embedding): a layer is 288 * 864 + 288 * 288 + 3 * 288 * 768 +
    2 * 288 = 995904 floats, six are 5975424, plus the final norm 288 and the classifier
    9216000: 15191712 floats, 60766848 bytes. TinyLlama's own classifier adds one embedding
    row (2048 floats)."""
    import ceiling

    assert ceiling.f32_bytes_per_token(shapes.get_shape("stories15M").config()) == 60766848
    tiny = shapes.get_shape("TinyLlama-1.1B").config()
    shared = dataclasses.replace(tiny, shared_weights=True)
    assert ceiling.f32_bytes_per_token(tiny) - ceiling.f32_bytes_per_token(shared) == 4 * 2048


def test_stream_read_prints_each_way_and_the_best(tmp_path):
    import ceiling

    binary = ceiling.build(tmp_path)
    done = subprocess.run([str(binary), "1048576", "2"], capture_output=True, text=True,
                          check=True)
    read = json.loads(done.stdout)
    ways = {k: v for k, v in read.items() if k.endswith("_gb_s") and k != "best_gb_s"}
    # seven ways, each over a 4 KiB-page buffer and (on Linux) a huge-page one
    assert len(ways) == 14 and read["best_gb_s"] == max(ways.values()) > 0
    assert {k.removesuffix("_huge_gb_s") for k in ways if "_huge" in k} == {
        k.removesuffix("_gb_s") for k in ways if "_huge" not in k}
    assert read["bytes"] == 1048576
    bad = subprocess.run([str(binary), "0", "1"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 2 and "BYTES" in bad.stderr
