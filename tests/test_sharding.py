"""Tensor parallelism: the model split over several devices (`jllama.platform.sharding`,
`jllama.graphs.sharded`, `make_backend("jax", devices=N)`, `jllama --devices=N`) and over
several processes (`jllama.platform.distributed`, `--coordinator/--num_processes/--process_id`).

The references are independent of the split: the one-device backend (tokens identical, logits
to 1e-4) and the NumPy reference. Runs with several devices happen in subprocesses started
with XLA_FLAGS=--xla_force_host_platform_device_count=N (JAX in this process already has its
one CPU device); `tests/sharded_check.py` makes the measurements and these tests judge them.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_json

from jllama.model.config import ModelConfig
from jllama.platform.distributed import DistributedError, check_settings
from jllama.graphs.ops import split_qkv
from jllama.platform.sharding import ShardingError, check_divisible, device_memory, qkv_row_order
from jllama.model.weights import random_weights

TESTS = Path(__file__).parent
REPO = TESTS.parent
CHECK = TESTS / "sharded_check.py"
STORY_ARGS = ["--temperature=0", "--steps=60", "--prompt=Once upon a time", "--output_format=json"]


def run_c_greedy(prompt: str) -> dict:
    """llama2.c run.c's greedy run of stories260K on `prompt` (tests/data, 200 positions): the
    one-device reference of the commands below, without a process of our own for it."""
    return next(c for c in load_json("generate_stories260K.json")["cases"]
                if c["prompt"] == prompt and c["temperature"] == 0.0)


def assert_run_c_ids(stdout: str, prompt: str, generated: int) -> None:
    """The JSON output's ids are run.c's: its prompt ids and its first `generated` tokens."""
    got, want = json.loads(stdout), run_c_greedy(prompt)
    assert got["prompt_ids"] == want["prompt_ids"]
    assert got["generated_ids"] == want["generated_ids"][:generated], got["generated_ids"]


def forced_devices_env(n: int | None) -> dict:
    """The environment of a subprocess with n forced host devices (None: JAX's default, 1)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if n is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    return env


def jllama_command() -> list[str]:
    script = Path(sys.executable).parent / "jllama"
    return [str(script)] if script.exists() else [sys.executable, "-m", "jllama"]


def run_jllama(*args: str, devices: int | None = None, timeout: float = 180):
    return subprocess.run(
        jllama_command() + list(args), capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env=forced_devices_env(devices),
    )


def elements(shape: str) -> int:
    """Elements of an HLO shape such as `f32[8,64]{1,0}`."""
    dims = re.search(r"\[([\d,]*)\]", shape).group(1)
    return math.prod(int(d) for d in dims.split(",") if d)


# ---- in this process: the layout's arithmetic ------------------------------------------------

GQA = ModelConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=32,
                  seq_len=8)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_regrouped_qkv_rows_split_back_into_the_same_heads(n):
    """wqkv's rows regrouped by device, multiplied and split with shards=n, give the heads the
    plain stacked layout gives with shards=1."""
    rng = np.random.default_rng(n)
    c = GQA
    wqkv = rng.standard_normal((c.q_dim + 2 * c.kv_dim, c.dim)).astype(np.float32)
    x = rng.standard_normal(c.dim).astype(np.float32)
    order = qkv_row_order(c, n)
    assert sorted(order) == list(range(len(wqkv)))
    plain = split_qkv(c, jnp.asarray(wqkv @ x), 1)
    grouped = split_qkv(c, jnp.asarray(wqkv[order] @ x), n)
    for a, b in zip(plain, grouped, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Chunks (a leading token axis) split the same way.
    xs = rng.standard_normal((3, c.dim)).astype(np.float32)
    for a, b in zip(split_qkv(c, jnp.asarray(xs @ wqkv.T), 1),
                    split_qkv(c, jnp.asarray(xs @ wqkv[order].T), n), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if n > 1:  # the regrouping really moves rows (device 0's block ends with k and v rows)
        assert not np.array_equal(order, np.arange(len(order)))


def test_device_counts_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(ShardingError, match=r"^devices=3 must divide n_kv_heads=4 .*1, 2, 4"):
        check_divisible(GQA, 3)
    with pytest.raises(ShardingError, match="devices=8 must divide n_kv_heads=4"):
        check_divisible(GQA, 8)
    hidden = ModelConfig(dim=64, hidden_dim=90, n_layers=1, n_heads=8, n_kv_heads=4,
                         vocab_size=32, seq_len=8)
    with pytest.raises(ShardingError, match="devices=4 must divide hidden_dim=90"):
        check_divisible(hidden, 4)
    with pytest.raises(ShardingError, match="at least 1"):
        check_divisible(GQA, 0)
    assert check_divisible(GQA, 4) == []


def test_a_vocabulary_that_does_not_split_replicates_the_classifier():
    c = ModelConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=8, n_kv_heads=4,
                    vocab_size=31, seq_len=8, shared_weights=False)
    (note,) = check_divisible(c, 4)
    assert "vocab_size=31" in note and "classifier is replicated" in note
    w = random_weights(c)
    assert device_memory(c, w, 4).weights - device_memory(c, w, 2).weights == (
        sum(getattr(w, f).nbytes for f in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")) // 4
        - sum(getattr(w, f).nbytes for f in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")) // 2
    )  # the classifier counts whole on every device, whatever the count


def test_device_memory_divides_what_is_split():
    c = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=4,
                    vocab_size=32, seq_len=16, shared_weights=False)
    w = random_weights(c)
    per = device_memory(c, w, 4)
    split = sum(getattr(w, f).nbytes for f in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    gains = w.rms_att_weight.nbytes + w.rms_ffn_weight.nbytes + w.rms_final_weight.nbytes
    assert per.weights == split // 4 + gains + w.wcls.nbytes // 4
    assert per.kv_cache == c.kv_cache_nbytes() // 4
    assert per.host_embedding == w.token_embedding_table.nbytes


@pytest.mark.parametrize(
    "coordinator, n, pid, needle",
    [
        (None, 2, 0, "needs a coordinator"),
        ("127.0.0.1:1234", 2, 2, "process_id=2 must be in 0..1"),
        ("no port", 2, 0, "must be HOST:PORT"),
        (None, 0, 0, "at least 1"),
    ],
)
def test_bad_multiprocess_settings_are_named(coordinator, n, pid, needle):
    with pytest.raises(DistributedError, match=needle):
        check_settings(coordinator, n, pid)


# ---- several forced host devices, in a subprocess --------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel") / "report.json"
    done = subprocess.run(
        [sys.executable, str(CHECK), str(out)], capture_output=True, text=True, timeout=1200,
        cwd=REPO, env=forced_devices_env(4),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


MODELS = ["stories260K", "stories260K_int8", "grouped_q8_0", "grouped_kv_q8_0_bf16",
          "tinyllama_2l"]


def _tolerance(report, model) -> float:
    """Logits of two computations that should agree: 1e-4 with f32 caches; with a q8_0 cache
    a value landing by a rounding boundary rounds the other way after the products' float32
    differences (sums split over devices), one step of q8_0 (tests/test_cache_types.py)."""
    return 2e-3 if "q8_0" in report[model].get("cache", ()) else 1e-4


def _cases(report):
    for model in MODELS:
        for n, entry in report[model]["by_devices"].items():
            yield model, n, entry


def test_the_subprocess_saw_four_devices(report):
    assert report["device_count"] == 4
    assert set(report["stories260K"]["by_devices"]) == {"2", "4"}
    assert set(report["tinyllama_2l"]["by_devices"]) == {"2", "4"}
    tiny = report["tinyllama_2l"]["config"]
    assert (tiny["dim"], tiny["hidden_dim"], tiny["n_heads"], tiny["n_kv_heads"],
            tiny["vocab_size"]) == (2048, 5632, 32, 4, 32000)


def test_split_runs_give_the_one_device_tokens_and_logits(report):
    checked = 0
    for model, n, entry in _cases(report):
        single = report[model]["single"]
        assert len(single["tokens"]) > 10
        for mode in ("graph", "fused"):
            if mode not in entry:
                continue
            got = entry[mode]
            assert got["tokens"] == single["tokens"], (model, n, mode)
            assert got["tokens_prefill"] == single["tokens_prefill"], (model, n, mode)
            tol = _tolerance(report, model)
            assert got["max_logit_diff"] < tol, (model, n, mode, got["max_logit_diff"])
            if mode == "graph":
                assert got["prefill_logits_diff"] < tol, (model, n, got["prefill_logits_diff"])
            checked += 1
        if "loop" in entry:
            assert entry["loop"] == single["loop"], (model, n)
    # stories260K, its int8 run, int8 with group scales, q8_0 / bf16 caches, the TinyLlama
    # shape
    assert checked == 2 * 2 + 1 + 2 + 1 + 2 * 2


@pytest.mark.parametrize("model", ["stories260K", "grouped_q8_0", "grouped_kv_q8_0_bf16"])
def test_split_runs_agree_with_the_numpy_reference(report, model):
    stories = report[model]
    tol = _tolerance(report, model)
    assert stories["numpy_tokens"] == stories["single"]["tokens"]
    assert stories["single_vs_numpy"] < tol
    for n, entry in stories["by_devices"].items():
        for mode in ("graph", "fused"):
            if mode in entry:
                assert entry[mode]["max_diff_vs_numpy"] < tol, (n, mode)


def test_weights_and_caches_are_split_not_replicated(report):
    for model, n, entry in _cases(report):
        n = int(n)
        c = report[model]["config"]
        q_dim, kv_dim = c["n_heads"] * (c["dim"] // c["n_heads"]), c["n_kv_heads"] * (
            c["dim"] // c["n_heads"])
        want = {
            "wqkv": [(q_dim + 2 * kv_dim) // n, c["dim"]],
            "wo": [c["dim"], q_dim // n],
            "w1": [c["hidden_dim"] // n, c["dim"]],
            "w3": [c["hidden_dim"] // n, c["dim"]],
            "w2": [c["dim"], c["hidden_dim"] // n],
            "wcls": [c["vocab_size"] // n, c["dim"]],
            "rms_att_weight": [c["dim"]],  # replicated: tiny
        }
        shards = entry["shards"]
        for name, shape in want.items():
            assert shards[name]["shard_shape"] == shape, (model, n, name, shards[name])
            assert shards[name]["shards"] == [shape], (model, n, name)
            assert shards[name]["devices"] == n
        block = shards["key_block"]
        assert block["shard_shape"][0] == c["n_kv_heads"] // n  # split by KV head
        assert block["global"][0] == c["n_kv_heads"]
        if report[model].get("cache", ["f32"])[0] == "q8_0":  # head_dim 32: one block_q8_0
            assert block["global"][2] == block["shard_shape"][2] == 34
        # Device d holds exactly its own heads' q, k and v rows.
        assert entry["wqkv_shards_match"] == [True] * n, (model, n)


def test_memory_per_device_is_what_each_device_holds(report):
    for model, n, entry in _cases(report):
        held = entry["held"]
        assert len(held) == int(n)
        for device, kinds in held.items():
            assert kinds["weights"] == entry["predicted"]["weights"], (model, n, device)
            assert kinds["kv_cache"] == entry["predicted"]["kv_cache"], (model, n, device)


def test_compiled_programs_all_reduce_activations_and_gather_no_weights(report):
    for model, n, entry in _cases(report):
        c = report[model]["config"]
        ops = entry["collectives"]
        # qkv and attention run on each device's own heads: no communication at all.
        assert ops["qkv"] == [] and ops["attention"] == [], (model, n, ops)
        # The block sums the partial products of wo and w2 across devices.
        reduced = [shape for shape, op in ops["block"] if op == "all-reduce"]
        assert len(reduced) >= 1, (model, n, ops["block"])
        assert all(elements(s) == c["dim"] for s in reduced), (model, n, ops["block"])
        assert not [op for _, op in ops["block"] if op == "all-gather"], (model, n, ops)
        # Nothing as large as a weight matrix moves: every collective is a vector of at most
        # max(dim, vocab_size) values.
        largest = max(c["dim"], c["vocab_size"])
        for program, found in ops.items():
            for shape, op in found:
                assert elements(shape) <= largest, (model, n, program, shape, op)
    # The loop program looks the token's embedding up in a table split by vocabulary rows:
    # one row comes back (an all-reduce of dim floats), never the whole table.
    for n, entry in report["stories260K"]["by_devices"].items():
        loop = entry["collectives_loop"]
        assert loop and not [op for _, op in loop if op == "all-gather"], (n, loop)
        assert all(elements(s) <= report["stories260K"]["config"]["dim"] for s, _ in loop)


# ---- the command ------------------------------------------------------------------------------


def _one_line_error(result, *needles):
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jllama: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    "args, devices, needles",
    [
        (["--devices=3"], 4, ["--devices=3 must divide n_kv_heads=4", "1, 2, 4"]),
        (["--devices=8"], None, ["--devices=8 must divide n_kv_heads=4"]),
        (["--devices=4"], None, ["--devices=4", "JAX sees 1 device"]),
        (["--devices=2", "--backend=numpy"], None, ["--devices=2 needs --backend=jax"]),
        (["--num_processes=2"], None, ["--num_processes=2 needs a coordinator"]),
        (["--process_id=1"], None, ["--process_id=1 needs --num_processes > 1"]),
        (["--coordinator=nowhere", "--num_processes=2"], None, ["--coordinator", "HOST:PORT"]),
    ],
)
def test_bad_device_and_process_flags_give_one_line(args, devices, needles):
    _one_line_error(run_jllama(*args, devices=devices), *needles)


def test_command_on_four_devices_tells_the_one_device_story_and_reports_memory():
    four = run_jllama(*STORY_ARGS, "--devices=4", devices=4)
    assert four.returncode == 0, four.stderr
    assert_run_c_ids(four.stdout, "Once upon a time", 60 - 5 + 1)  # 5 prompt ids
    # stories260K: 4 KV heads of 8 floats, 5 layers, 512 positions: 655,360 cache bytes, a
    # quarter per device.
    line = next(l for l in four.stderr.splitlines() if "required memory" in l)
    assert "per device (4 devices): " in line and "KV cache 0.2 MB" in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(args0: list[str], args1: list[str], timeout: float = 240):
    """Run `jllama` as processes 0 and 1 of one run on 127.0.0.1 (one CPU device each);
    both are killed if either overruns. Returns their (returncode, stdout, stderr)."""
    port = _free_port()
    common = [f"--coordinator=127.0.0.1:{port}", "--num_processes=2"]
    procs = [
        subprocess.Popen(
            jllama_command() + args + common + [f"--process_id={i}"], cwd=REPO,
            env=forced_devices_env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for i, args in enumerate((args0, args1))
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_processes_give_the_tokens_of_one():
    """Process 0 reads the prompt and prints; process 1 (given another prompt) follows it and
    prints nothing: run.c's greedy ids. A seed from the clock is agreed on too: process 0's
    printed seed repeats the run in one process."""
    greedy = ["--temperature=0", "--steps=48", "--output_format=json"]
    prompt = "Lily and Tom went to the park"
    (rc0, out0, err0), (rc1, out1, err1) = _two_processes(
        greedy + [f"--prompt={prompt}"], greedy + ["--prompt=something else entirely"]
    )
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    assert out1 == ""
    assert_run_c_ids(out0, prompt, 48 - 12 + 1)  # 12 prompt ids
    assert "per device (2 devices)" in err0

    sampled = ["--temperature=1", "--top_p=0.9", "--steps=48", "--output_format=json"]
    (rc0, out0, err0), (rc1, _, err1) = _two_processes(sampled, sampled)
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    seed = int(re.search(r"--seed=(\d+)", err0).group(1))
    again = run_jllama(*sampled, f"--seed={seed}")
    assert json.loads(out0)["generated_ids"] == json.loads(again.stdout)["generated_ids"]
