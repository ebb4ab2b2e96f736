"""Bad input to `ceiling.py` and `prefill_vs.py`: one line naming the flag, a non-zero exit, no
traceback (`.venv/bin/python -m pytest bench/test_ceiling_cli.py`, about 30 s).

The scripts run as subprocesses from the repository root. Most cases fail in validation,
before any work; the others run the tiniest real work there is (stories15M's read ceiling,
stories260K's prefill) against fake `--vs` programs written into tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# The scripts' machine lines measure the read bandwidth over 16 MB, not 400 MB (~5 s a script
# run): these tests check the lines' form, not the figure (bench/run.py's READ_BYTES_ENV).
os.environ.setdefault("JLLAMA_BENCH_READ_BYTES", "16000000")

import ceiling

from jllama.model.loading import embedded_checkpoint

STORIES260K = str(embedded_checkpoint())  # context 512


def run_script(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          check=False)


def assert_one_line(done: subprocess.CompletedProcess, script: str, *words: str) -> str:
    """A non-zero exit with exactly one stderr line, `script: ...` containing `words`."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{script}: ")
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def fake_program(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache folder with stream_read built in it (once for the module)."""
    folder = tmp_path_factory.mktemp("cache")
    ceiling.build(folder)
    return folder


def fake_run(tmp_path: Path, rate: str = "100", status: int = 0) -> Path:
    """A stand-in for llama2.c's run: prints a rate line, exits with `status`."""
    return fake_program(tmp_path / "run",
                        f'echo "once upon a time"\necho "achieved tok/s: {rate}"\nexit {status}\n')


def fake_llama_bench(tmp_path: Path, n: int = 64, status: int = 0) -> Path:
    """A stand-in for llama-bench: prints a table with a ppN row, exits with `status`."""
    return fake_program(tmp_path / "llama-bench", (
        'echo "| model | size | params | backend | threads | test | t/s |"\n'
        f'echo "| llama 256M all F32 | 513.13 MiB | 134.52 M | CPU | 2 | pp{n} | 1000.00 ± 5.55 |"\n'
        f"exit {status}\n"))


# ---- ceiling.py ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--shapes=bogus"], ["--shapes", "bogus"]),
    (["--shapes=stories15M,stories260K"], ["--shapes", "stories260K"]),
    (["--shapes=,"], ["--shapes"]),
    (["--reps=0"], ["--reps=0"]),
    (["--reps=-2"], ["--reps=-2"]),
    (["--timeout_s=0"], ["--timeout_s"]),
    (["--vs="], ["--vs", "empty"]),
    (["--vs=run {bogus}"], ["--vs", "{bogus}"]),
    (["--vs=run 'unbalanced"], ["--vs", "quotation"]),
    (["--vs=/nonexistent/run {checkpoint}"], ["--vs", "/nonexistent/run"]),
    (["--vs=no-such-program-xyz {checkpoint}"], ["--vs", "no-such-program-xyz"]),
    (["--vs=env OMP_NUM_THREADS=1 no-such-program-xyz"], ["--vs", "no-such-program-xyz"]),
    (["--vs=env OMP_NUM_THREADS=1"], ["--vs", "no program"]),
    (["--vs=OMP_NUM_THREADS=1 run"], ["--vs", "env"]),
])
def test_ceiling_refuses_bad_flags_before_any_work(tmp_path, args, words):
    cache = tmp_path / "cache"
    done = run_script("ceiling.py", "--vs=true {checkpoint}", f"--cache={cache}", *args)
    assert_one_line(done, "ceiling.py", *words)
    assert not cache.exists()  # nothing was built or written


def test_ceiling_refuses_a_vs_program_that_is_not_executable(tmp_path):
    script = tmp_path / "run"
    script.write_text("echo achieved tok/s: 100\n")  # no x bit
    done = run_script("ceiling.py", f"--vs={script}", f"--cache={tmp_path}")
    assert_one_line(done, "ceiling.py", "--vs", str(script), "executable")


def test_ceiling_refuses_a_cache_that_is_a_file(tmp_path):
    cache = tmp_path / "file"
    cache.write_text("")
    done = run_script("ceiling.py", "--vs=true", f"--cache={cache}")
    assert_one_line(done, "ceiling.py", "--cache", "not a folder")


def test_build_names_the_binary_by_a_hash_and_builds_it_once(tmp_path):
    first = ceiling.build(tmp_path)
    assert re.fullmatch(r"stream_read-[0-9a-f]{12}", first.name)
    assert first.parent == tmp_path and os.access(first, os.X_OK)
    mtime = first.stat().st_mtime_ns
    # fresh mtimes (a git clone) do not matter: the name says what the binary is
    source = ceiling.SOURCE.stat()
    try:
        os.utime(ceiling.SOURCE)
        second = ceiling.build(tmp_path)
    finally:
        os.utime(ceiling.SOURCE, ns=(source.st_atime_ns, source.st_mtime_ns))
    assert second == first and second.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temporary left


def test_build_says_on_stderr_when_it_builds(tmp_path, capfd):
    ceiling.build(tmp_path)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"building {ceiling.binary_name()}" in err
    ceiling.build(tmp_path)
    assert capfd.readouterr().err == ""


def test_ceiling_measures_against_a_fake_run(tmp_path, cache):
    run = fake_run(tmp_path)
    done = run_script("ceiling.py", "--shapes=stories15M", "--reps=1", f"--cache={cache}",
                      f"--vs={run} {{checkpoint}} -z {{tokenizer}}")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # stream_read was built already
    last = done.stdout.strip().splitlines()[-1]
    assert '"metric": "ceiling_ratio_vs"' in last and '"other_tok_s": 100.0' in last


@pytest.mark.parametrize("rate, status, words", [
    ("100", 3, ["--vs exited with status 3", "achieved tok/s: 100"]),
    ("0", 0, ["--vs", "no positive", "achieved tok/s: 0"]),
    ("nan", 0, ["--vs", "no positive"]),
    ("inf", 0, ["--vs", "no positive"]),
])
def test_ceiling_refuses_a_failed_run_or_no_rate(tmp_path, cache, rate, status, words):
    run = fake_run(tmp_path, rate=rate, status=status)
    done = run_script("ceiling.py", "--shapes=stories15M", "--reps=1", f"--cache={cache}",
                      f"--vs={run} {{checkpoint}}")
    assert_one_line(done, "ceiling.py", *words)


def test_ceiling_stops_a_vs_run_past_its_timeout(tmp_path, cache):
    run = fake_program(tmp_path / "run", "sleep 30\n")
    done = run_script("ceiling.py", "--shapes=stories15M", "--reps=1", f"--cache={cache}",
                      f"--vs={run}", "--timeout_s=0.5")
    assert_one_line(done, "ceiling.py", "--vs", "--timeout_s=0.5")


@pytest.mark.parametrize("script", ["ceiling.py", "prefill_vs.py"])
def test_ctrl_c_is_one_line(tmp_path, cache, script):
    """SIGINT while the --vs program runs: "SCRIPT: interrupted", status 130."""
    started = tmp_path / "started"
    other = fake_program(tmp_path / "other", f"touch {started}\nsleep 30\n")
    args = {"ceiling.py": ["--shapes=stories15M", f"--cache={cache}"],
            "prefill_vs.py": [f"--checkpoint={STORIES260K}", "--tokens=64", "--runs=1"]}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script), *args[script], "--reps=1", f"--vs={other}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), proc.stderr.read() if proc.poll() is not None else "no start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.strip() == f"{script}: interrupted"


# ---- prefill_vs.py ------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--checkpoint=/nonexistent/model.bin"], ["--checkpoint=/nonexistent/model.bin"]),
    (["--tokens=600"], ["--tokens=600", "512"]),
    (["--tokens=500", "--seq_len=400"], ["--tokens=500", "--seq_len=400"]),
    (["--dtype=bogus"], ["--dtype=bogus", "float32"]),
    (["--vs=/nonexistent/llama-bench -p 64"], ["--vs", "/nonexistent/llama-bench"]),
    (["--vs="], ["--vs", "empty"]),
    (["--vs=llama-bench -p {bogus}"], ["--vs", "{bogus}"]),
    (["--reps=0"], ["--reps=0"]),
    (["--runs=0"], ["--runs=0"]),
    (["--tokens=0"], ["--tokens=0"]),
    (["--seq_len=0"], ["--seq_len=0"]),
    (["--timeout_s=-1"], ["--timeout_s"]),
])
def test_prefill_vs_refuses_bad_flags_before_any_work(args, words):
    done = run_script("prefill_vs.py", f"--checkpoint={STORIES260K}", "--vs=true",
                      "--tokens=64", *args)
    assert_one_line(done, "prefill_vs.py", *words)


def test_prefill_vs_refuses_a_malformed_checkpoint_header(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 10)
    done = run_script("prefill_vs.py", f"--checkpoint={bad}", "--vs=true")
    assert_one_line(done, "prefill_vs.py", "--checkpoint", str(bad))


def test_prefill_vs_gives_the_last_line_of_a_failed_jllama_run(tmp_path):
    """A header that passes the parent's check on a truncated file: the child's reader fails,
    and its one-line error is all that is printed."""
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(Path(STORIES260K).read_bytes()[:200])
    llama_bench = fake_llama_bench(tmp_path)
    done = run_script("prefill_vs.py", f"--checkpoint={truncated}", f"--vs={llama_bench}",
                      "--tokens=64", "--reps=1", "--runs=1")
    assert_one_line(done, "prefill_vs.py", "jllama's prefill failed", str(truncated),
                    "truncated")


def test_prefill_vs_stops_a_jllama_run_past_its_timeout(tmp_path):
    llama_bench = fake_llama_bench(tmp_path)
    done = run_script("prefill_vs.py", f"--checkpoint={STORIES260K}", f"--vs={llama_bench}",
                      "--tokens=64", "--reps=1", "--runs=1", "--timeout_s=0.1")
    assert_one_line(done, "prefill_vs.py", "--timeout_s=0.1")


def test_prefill_vs_measures_against_a_fake_llama_bench(tmp_path):
    llama_bench = fake_llama_bench(tmp_path, n=64)
    done = run_script("prefill_vs.py", f"--checkpoint={STORIES260K}",
                      f"--vs={llama_bench} -p {{tokens}}", "--tokens=64", "--reps=1",
                      "--runs=1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    # The machine first (CPU flags, the kernels' build, the read bandwidth), then the pair.
    machine = json.loads(lines[0])
    assert machine["metric"] == "machine" and machine["cpus"] >= 1 and "cpu_flags" in machine
    assert len(lines) == 3 and '"vs": 1000.0' in lines[1]
    assert '"metric": "prefill_64_ratio_vs"' in lines[2]


@pytest.mark.parametrize("n, status, words", [
    (64, 3, ["--vs exited with status 3", "pp64"]),
    (512, 0, ["--vs", "pp512", "pp64", "--tokens=64"]),
])
def test_prefill_vs_refuses_a_failed_or_mismatched_llama_bench(tmp_path, n, status, words):
    llama_bench = fake_llama_bench(tmp_path, n=n, status=status)
    done = run_script("prefill_vs.py", f"--checkpoint={STORIES260K}", f"--vs={llama_bench}",
                      "--tokens=64", "--reps=1", "--runs=1")
    assert_one_line(done, "prefill_vs.py", *words)
