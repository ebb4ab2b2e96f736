"""bench/gpu_check.py end to end on the CPU, scaled down (the GPU machine runs it full size):
every section writes its JSON line, none fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_check


def test_scaled_down_run_writes_every_section(tmp_path):
    assert jax.devices()[0].platform == "cpu"
    code = gpu_check.main(["--scale-down", f"--out={tmp_path}"])
    lines = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert code == 0, [x for x in lines if "error" in x]
    by = {}
    for x in lines:
        by.setdefault(x["section"], []).append(x)
    assert by["device"][0]["platform"] == "cpu" and by["device"][0]["scale_down"]
    greedy = by["greedy"][0]
    assert greedy["ok"] and greedy["equal"] and greedy["device_ids"] == greedy["cpu_ids"]
    batch = by["greedy_batch"][0]
    assert batch["ok"] and batch["equal"] and batch["prompts"] == 2
    models = {x["model"] for x in by["model"]}
    assert models == {"tiny-bfloat16", "tiny-int8"}
    assert {(x["model"], x["batch"]) for x in by["decode"]} == {
        (m, b) for m in models for b in (1, 2)}
    assert all(x["tok_s"] > 0 for x in by["decode"] + by["prefill"])
    assert len(by["prefill"]) == 2
    torch = by["torch"]
    assert "skipped" in torch[0] or {x.get("batch") for x in torch} >= {1, 2}
    assert by["done"][0]["failed"] == 0
