"""A new process's way to its first token: the persistent compile cache (`jllama.platform.compile_cache`)
across processes, and the start-up times the CLI reports. Each run is a new `jllama` process
with its own $JLLAMA_HOME; the tokens are checked against run.c's (tests/data)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import load_json
from test_cli import REPO, jllama_command

from jllama.platform.compile_cache import cache_folder
from jllama.platform.fetch import jllama_home
from jllama.kernels.library import compiler, library_path

# run.c's top-p sample from a 12-token prompt: a prefill chunk, the decode programs and the
# device loop's top-p program all run.
CASE = next(
    c for c in load_json("generate_stories260K.json")["cases"]
    if c["prompt"] == "Lily and Tom went to the park" and c["seed"] == 42
)
ARGS = (
    f"--prompt={CASE['prompt']}", f"--temperature={CASE['temperature']}",
    f"--top_p={CASE['topp']}", f"--seed={CASE['seed']}", f"--steps={CASE['steps']}",
    "--output_format=json",
)


@pytest.fixture
def home(tmp_path):
    """A fresh $JLLAMA_HOME whose kernels folder is this machine's (built once, not per test)."""
    kernels = jllama_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels)
    return tmp_path


def jllama(home: Path, *args: str) -> tuple[dict, list[str]]:
    """Run jllama with ARGS in a new process; (its JSON output, its stderr lines)."""
    env = {**os.environ, "JLLAMA_HOME": str(home)}
    done = subprocess.run(jllama_command() + [*ARGS, *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["generated_ids"] == CASE["generated_ids"]
    return out, done.stderr.splitlines()


def entries(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("*-cache")}


def cache_lines(stderr: list[str]) -> list[str]:
    return [line for line in stderr if "compile cache" in line]


def test_a_second_process_compiles_nothing_and_a_damaged_cache_heals(home):
    folder = cache_folder(home)
    first, err = jllama(home)
    written = entries(folder)
    assert first["programs_compiled"] > 0 and first["programs_from_cache"] == 0
    # Every program compiled left one entry in the folder named by the kernel library.
    assert len(written) == first["programs_compiled"], sorted(written)
    assert cache_lines(err) == []

    second, err = jllama(home)
    assert second["programs_compiled"] == 0
    assert second["programs_from_cache"] == first["programs_compiled"]
    assert entries(folder) == written  # nothing new was stored
    assert cache_lines(err) == []

    # Damage every entry: half of them cut short (a process killed while writing), the
    # others overwritten with bytes that are no compressed program.
    for i, (name, data) in enumerate(sorted(written.items())):
        (folder / name).write_bytes(data[: len(data) // 2] if i % 2 else b"not a program" * 9)
    third, err = jllama(home)
    assert third["programs_compiled"] == len(written)
    lines = cache_lines(err)
    assert len(lines) == 1 and lines[0].startswith("jllama: warning: compile cache "), err
    assert "Traceback" not in "\n".join(err) and "UserWarning" not in "\n".join(err)

    fourth, err = jllama(home)  # the third run replaced the damaged entries
    assert fourth["programs_compiled"] == 0 and cache_lines(err) == []
    assert set(entries(folder)) == set(written)


def test_a_cache_that_cannot_be_written_is_skipped_with_one_line(home):
    (home / "xla-cache").write_text("a file where the cache folder would be\n")
    out, err = jllama(home)
    lines = cache_lines(err)
    assert len(lines) == 1 and lines[0].startswith("jllama: warning: compile cache off: "), err
    assert str(cache_folder(home)) in lines[0]
    assert out["programs_compiled"] > 0 and out["programs_from_cache"] == 0


def test_nocompile_cache_stores_nothing(home):
    out, err = jllama(home, "--nocompile_cache")
    assert not (home / "xla-cache").exists()
    assert out["programs_compiled"] > 0 and out["programs_from_cache"] == 0
    assert cache_lines(err) == []


def test_startup_times_are_parts_of_the_wait_for_the_first_token(home):
    out, err = jllama(home)
    parts = ("startup_seconds", "load_seconds", "jax_seconds", "compile_seconds",
             "prefill_seconds", "other_seconds")
    assert all(out[name] >= 0 for name in parts)
    # Consecutive, disjoint spans of one clock between the process's start and the first
    # sampled token, "other" the time no part names: they add up to it.
    assert sum(out[name] for name in parts) == pytest.approx(out["first_token_seconds"],
                                                             abs=1e-9)
    assert out["compile_seconds"] > 0 and out["load_seconds"] > 0 and out["startup_seconds"] > 0
    assert 0 < out["before_python_seconds"] < out["startup_seconds"]
    # The same on the text stats line (a text run of its own): the printed parts add up to
    # the printed total within their rounding (half a hundredth each, and the total's).
    env = {**os.environ, "JLLAMA_HOME": str(home)}
    text = subprocess.run(jllama_command() + [a for a in ARGS if "output_format" not in a],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    stats = next(line for line in text.stderr.splitlines() if line.startswith("achieved tok/s"))
    found = re.search(
        r"; first token ([0-9.]+) s after the process started: startup ([0-9.]+) s \(exec and "
        r"interpreter ([0-9.]+) s\), load ([0-9.]+) s, JAX start ([0-9.]+) s, compile ([0-9.]+) "
        r"s \(\d+ programs, \d+ from the cache\), prefill ([0-9.]+) s, other ([0-9.]+) s$",
        stats)
    assert found, stats
    total, startup, before_python, *rest = (float(v) for v in found.groups())
    assert abs(startup + sum(rest) - total) <= 0.005 * 7 + 1e-9, stats
    assert before_python <= startup


def test_what_ran_before_exec_is_named_as_such(tmp_path):
    """A shell that sleeps 0.3 s in the process before exec'ing jllama (a wrapper script's
    way): the process's start is its fork, so the wait counts those 0.3 s, in the part said to
    come before Python (the compile cache of the machine's $JLLAMA_HOME: a warm run)."""
    command = " ".join(f"'{a}'" for a in jllama_command() + list(ARGS))
    done = subprocess.run(["sh", "-c", f"sleep 0.3; exec {command}"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert 0.3 <= out["before_python_seconds"] < out["startup_seconds"]
    assert out["first_token_seconds"] > 0.3


def test_the_cache_folder_changes_with_the_kernel_library(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    plain = cache_folder(tmp_path)
    assert plain.parent == tmp_path / "xla-cache"
    if compiler() is None:
        pytest.skip("no C++ compiler: no kernel library to name the folder by")
    assert plain.name == library_path(compiler()).stem  # matvec-<hash of source, flags, CPU>
    monkeypatch.setenv("CXX", "c++ -DJLLAMA_OTHER_BUILD")  # another build of the library
    other = cache_folder(tmp_path)
    assert other != plain and other.name == library_path(compiler()).stem
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cache_folder(tmp_path).name.startswith("xla-")


def test_lazy_blocks_make_each_block_once_when_first_read():
    from jllama.backends.jax_graph import LazyBlocks

    made = []
    blocks = LazyBlocks(4, lambda: made.append(len(made)) or f"block{len(made) - 1}")
    assert len(blocks) == 4 and made == []
    assert blocks[1] == "block0" and blocks[1] == "block0" and made == [0]
    assert blocks[:3] == ["block1", "block0", "block2"]  # slot 0 then 2 made, in order
    blocks[3] = "written"
    assert list(blocks) == ["block1", "block0", "block2", "written"] and made == [0, 1, 2]


def test_a_short_run_allocates_only_the_cache_blocks_it_reaches():
    import numpy as np

    from jllama.backends.jax_graph import JaxGraphBackend
    from jllama.backends.numpy_ref import NumpyBackend
    from jllama.model.config import ModelConfig
    from jllama.model.weights import random_weights

    config = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                         vocab_size=96, seq_len=1024)
    weights = random_weights(config, seed=3, scale=0.08)
    backend, reference = JaxGraphBackend(matvec="xla"), NumpyBackend()
    backend.prepare(config, weights)
    reference.prepare(config, weights)

    def allocated():
        return [[list.__getitem__(blocks, i) is not None for i in range(len(blocks))]
                for blocks in backend.key_cache + backend.value_cache]

    # 4 blocks of 256 positions; the warm-up step of `prepare` ran one layer of each kind
    # (`warm_layers`: here layer 0), so only its first block is made yet.
    assert allocated() == [[True, False, False, False], [False] * 4] * 2
    for pos, token in enumerate([5, 7, 9]):
        np.testing.assert_allclose(backend.forward(token, pos), reference.forward(token, pos),
                                   rtol=2e-4, atol=2e-5)
    assert allocated() == [[True, False, False, False]] * 4
    # Position 300 lies in the second block: it is made (zeros, as the reference's cache
    # holds there) when the window first reaches it.
    np.testing.assert_allclose(backend.forward(1, 300), reference.forward(1, 300),
                               rtol=2e-4, atol=2e-5)
    assert allocated() == [[True, True, False, False]] * 4
