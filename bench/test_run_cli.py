"""bench/run.py on bad input, failed --vs programs and Ctrl-C, run as a user would run it:
`.venv/bin/python -m pytest bench/test_run_cli.py` (about 30 s).

The house rule: one line naming the flag and what is wrong, a non-zero exit status, no
traceback, and an --out file left as it was. The expected messages and counts below are
written by hand from the inputs, not taken from a run.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
# The scripts' machine lines measure the read bandwidth over 16 MB, not 400 MB (~5 s a script
# run): these tests check the lines' form, not the figure (bench/run.py's READ_BYTES_ENV).
os.environ.setdefault("JLLAMA_BENCH_READ_BYTES", "16000000")

import vs
import worker

OLD = '{"metric": "meta", "old": true}\n'
"""What an --out file holds before a run: the tests check that it is kept, or appended to."""


def run_py(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HERE / "run.py"), *flags], cwd=REPO, capture_output=True,
        text=True, timeout=timeout, check=False,
    )


def base(tmp_path: Path) -> list[str]:
    """The smallest real run: stories260K, numpy, float32, one rep, four timed tokens."""
    return [f"--cache={tmp_path / 'cache'}", "--shapes=stories260K", "--backends=numpy",
            "--dtypes=float32", "--reps=1", "--decode_tokens=4", "--prefill_lengths=4"]


def script(tmp_path: Path, name: str, body: str) -> Path:
    """An executable Python script in tmp_path (a stand-in for run.c)."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def strict_json(line: str) -> dict:
    """json.loads that refuses NaN and Infinity (what allow_nan=False never writes)."""

    def refuse(name):
        raise ValueError(f"non-finite number {name} in {line!r}")

    return json.loads(line, parse_constant=refuse)


# (flags, what stderr's one line starts with after "run.py: ", a word of the reason)
BAD = [
    (["--dtypes=bogus"], "--dtypes", "'bogus'"),
    (["--dtypes=float32,bogus"], "--dtypes", "'bogus'"),
    (["--backends=bogus"], "--backends", "'bogus'"),
    (["--backends=jax:decode=bogus"], "--backends", "decode='bogus'"),
    (["--backends=jax:matvec=bogus"], "--backends", "matvec='bogus'"),
    (["--backends=jax:devices=0"], "--backends", "devices='0'"),
    (["--backends=jax:bogus=1"], "--backends", "'bogus'"),
    (["--backends=jax:decode"], "--backends", "KEY=VALUE"),
    (["--backends=numpy:decode=graph"], "--backends", "no options"),
    (["--threads=-1"], "--threads=-1", "must be"),
    (["--threads=100000"], "--threads=100000", "must be"),
    (["--seq_len=-1"], "--seq_len=-1", "must be"),
    (["--decode_tokens=0"], "--decode_tokens=0", "at least 1"),
    (["--decode_tokens=-5"], "--decode_tokens=-5", "at least 1"),
    (["--reps=0"], "--reps=0", "at least 1"),
    (["--reps=abc"], "argument --reps", "'abc'"),
    (["--prefill_lengths=abc"], "--prefill_lengths", "'abc' is not an integer"),
    (["--prefill_lengths=4,0"], "--prefill_lengths=0", "at least 1"),
    (["--prefill_lengths=-4"], "--prefill_lengths=-4", "at least 1"),
    (["--timeout_s=0"], "--timeout_s=0", "above 0"),
    (["--timeout_s=-3"], "--timeout_s=-3", "above 0"),
    (["--shapes="], "--shapes", "at least one"),
    (["--shapes=bogus"], "--shapes", "'bogus'"),
    (["--backends=,"], "--backends", "at least one"),
    (["--dtypes="], "--dtypes", "at least one"),
    (["--prefill_mode=batched"], "--prefill_mode=batched", "numpy"),
    (["--vs="], "--vs ''", "empty"),
    (["--vs={bogus} {checkpoint}"], "--vs '{bogus} {checkpoint}'", "unknown placeholder {bogus}"),
    (["--vs=run 'a {checkpoint}"], "--vs \"run 'a {checkpoint}\"", "No closing quotation"),
    (["--vs=no-such-program-xyz {checkpoint}"], "--vs", "'no-such-program-xyz' is not found"),
    (["--vs=env OMP_NUM_THREADS=1 no-such-program-xyz"], "--vs", "'no-such-program-xyz'"),
    (["--vs=/no/such/dir/run {checkpoint}"], "--vs", "/no/such/dir/run does not exist"),
    (["--bogus_flag=1"], "unrecognized arguments", "--bogus_flag"),
]


@pytest.mark.parametrize("flags,names,why", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_flag_is_one_line_before_any_work(tmp_path, flags, names, why):
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    done = run_py(*base(tmp_path), f"--out={out}", *flags)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"run.py: {names}"), lines[0]
    assert why in lines[0]
    assert done.stdout == ""  # not even the meta line
    assert out.read_text() == OLD
    assert not (tmp_path / "cache").exists()  # no checkpoint was written either


def test_cache_that_is_a_file(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    done = run_py(*base(tmp_path), f"--cache={cache}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"run.py: --cache={cache}: is a file, not a folder"]
    assert done.stdout == ""


def test_vs_program_that_is_not_executable(tmp_path):
    program = tmp_path / "run"
    program.write_text("#!/bin/sh\n")  # mode 0644
    done = run_py(*base(tmp_path), f"--vs={program} {{checkpoint}}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"run.py: --vs '{program} {{checkpoint}}': program {program} is not executable"]


@pytest.mark.parametrize("kind", ["missing folder", "a folder"])
def test_out_that_cannot_be_written(tmp_path, kind):
    out = tmp_path / "nope" / "out.jsonl" if kind == "missing folder" else tmp_path
    done = run_py(*base(tmp_path), f"--out={out}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"run.py: --out={out}: ")
    assert len(done.stderr.splitlines()) == 1
    assert done.stdout == "" and not (tmp_path / "nope").exists()


def test_failed_vs_runs_say_why_and_fail_the_exit_status(tmp_path):
    """One worker run, then five --vs programs: one exits 3, one prints a rate of 0, one a rate
    that overflows to inf, one prints no rate, one a good rate of 50. By hand: 6 runs, 4 failed;
    the ratio is the worker's rate / 50."""
    fail = script(tmp_path, "fail3", "print('loading'); print('boom: no such model')\n"
                                     "raise SystemExit(3)\n")
    zero = script(tmp_path, "zero", "print('achieved tok/s: 0')\n")
    huge = script(tmp_path, "huge", "print('achieved tok/s: 1e999')\n")
    quiet = script(tmp_path, "quiet", "print('once upon a time')\n")
    good = script(tmp_path, "good", "print('achieved tok/s: 50.0')\n")
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    programs = (fail, zero, huge, quiet, good)
    done = run_py(*base(tmp_path), f"--out={out}",
                  *(f"--vs={p} {{checkpoint}} -z {{tokenizer}}" for p in programs))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == "run.py: 4 of 6 runs failed (see the error lines)"
    # the progress lines say what happened, not "decode None tok/s"
    assert "None" not in done.stderr
    assert "[stories260K vs fail3 rep 1/1] exited with status 3: boom: no such model" in done.stderr
    records = [strict_json(line) for line in done.stdout.splitlines()]
    errors = {vs.label(r["command"]): r["error"] for r in records if r["metric"] == "error"}
    assert errors == {
        "fail3": "--vs fail3 exited with status 3: boom: no such model",
        "zero": "--vs zero printed no usable tok/s rate: 0.0 is not a finite number > 0",
        "huge": "--vs huge printed no usable tok/s rate: inf is not a finite number > 0",
        "quiet": "--vs quiet printed no tok/s rate: once upon a time",
    }
    rates = [r for r in records if r["metric"] == "vs_decode_tok_s"]
    assert [(vs.label(r["command"]), r["values"]) for r in rates] == [("good", [50.0])]
    ours = next(r["median"] for r in records if r["metric"] == "decode_tok_s")
    ratio = next(r for r in records if r["metric"] == "decode_ratio_vs")
    assert ratio["values"] == [pytest.approx(ours / 50.0)]
    # the run finished, so --out has the old lines and all of this run's, in order
    assert out.read_text() == OLD + done.stdout


def test_run_other_says_what_happened(tmp_path):
    missing = vs.run_other([str(tmp_path / "gone")], 5)
    assert missing["tok_s"] is None
    assert missing["error"].startswith("could not start: [Errno 2] No such file or directory")
    slow = script(tmp_path, "slow", "import time; print('starting', flush=True); time.sleep(30)\n")
    start = time.monotonic()
    late = vs.run_other([str(slow)], 0.5)
    assert time.monotonic() - start < 10
    assert late["tok_s"] is None and late["error"] == "timed out after 0.5 s"
    silent = script(tmp_path, "silent", "raise SystemExit(2)\n")
    assert vs.run_other([str(silent)], 5)["error"] == "exited with status 2: (no output)"
    ok = script(tmp_path, "ok", "print('achieved tok/s: 12.5')\n")
    assert vs.run_other([str(ok)], 5) | {"wall_s": 0} == {
        "tok_s": 12.5, "wall_s": 0, "returncode": 0, "tail": "achieved tok/s: 12.5\n",
        "text": "achieved tok/s: 12.5\n",
        "error": None}


def test_backend_options_are_checked_and_typed():
    assert worker.backend_options("jax", {"decode": "fused", "devices": "2"}) == {
        "decode": "fused", "devices": 2}
    assert worker.backend_options("numpy", {}) == {}
    with pytest.raises(ValueError, match="given twice"):
        worker.parse_backend("jax:decode=fused:decode=loop")
    with pytest.raises(ValueError, match="graph, fused, loop"):
        worker.backend_options("jax", {"decode": "auto"})


def test_worker_writes_no_nan_or_infinity():
    assert worker.finite({"a": float("inf"), "b": [1.5, float("nan")], "c": 2, "d": "x"}) == {
        "a": None, "b": [1.5, None], "c": 2, "d": "x"}


def _wait_for_line(stream, seconds: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    if not sel.select(timeout=seconds):
        raise AssertionError(f"no line within {seconds} s")
    return stream.readline()


@pytest.mark.parametrize("sig, status, word", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_or_sigterm_is_one_line_and_leaves_out_alone(tmp_path, sig, status, word):
    pid_file = tmp_path / "pid"
    sleeper = script(tmp_path, "sleeper", "import os, sys, time\n"
                     f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                     "time.sleep(60)\nprint('achieved tok/s: 1.0')\n")
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "run.py"), *base(tmp_path), f"--out={out}",
         f"--vs={sleeper} {{checkpoint}}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert strict_json(_wait_for_line(proc.stdout, 30))["metric"] == "meta"
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:  # the sleeper has started
            time.sleep(0.1)
        assert pid_file.exists()
        time.sleep(1)
        os.kill(proc.pid, sig)  # the main process only: it must stop its children itself
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == f"run.py: {word}"
    assert out.read_text() == OLD
    # the --vs program was killed: gone, or a zombie its new parent has yet to reap
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_out_that_is_not_a_regular_file_is_refused_before_any_work(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(fifo)
    for out in (fifo, link):
        done = run_py(*base(tmp_path), f"--out={out}")
        assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
        assert done.stderr.splitlines() == [
            f"run.py: --out={out}: is not a regular file (a device, pipe or socket)"]
    assert fifo.is_fifo() and link.is_symlink()


def test_out_through_a_symlink_appends_to_its_target(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text(OLD)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    done = run_py(*base(tmp_path), f"--out={link}")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and real.read_text() == OLD + done.stdout


def test_out_that_is_stdout_already_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    with open(out, "a") as stdout:
        done = subprocess.run([sys.executable, str(HERE / "run.py"), *base(tmp_path),
                               f"--out={out}"], cwd=REPO, stdout=stdout, stderr=subprocess.PIPE,
                              text=True, timeout=60, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"run.py: --out={out}: is where stdout goes already (every line would be there twice)"]
    assert out.read_text() == OLD


def test_runs_saving_to_one_out_at_once_keep_every_line(tmp_path):
    """Four processes append 10 lines each to one file at the same moment: all 40 arrive."""
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import run\n"
            "e = run.Emitter(); e.lines = [f'{{\"n\": {i}, \"p\": {sys.argv[3]}}}' "
            "for i in range(10)]\n"
            "time.sleep(float(sys.argv[4]) - time.time()); e.save(sys.argv[2])\n")
    start = time.time() + 2
    procs = [subprocess.Popen([sys.executable, "-c", code, str(HERE), str(out), str(p),
                               str(start)], cwd=REPO) for p in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    lines = out.read_text().splitlines()
    assert lines[0] == OLD.strip() and len(lines) == 41
    assert sorted(json.loads(l)["p"] for l in lines[1:]) == sorted(list(range(4)) * 10)


def test_the_same_vs_twice_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    done = run_py(*base(tmp_path), "--vs=true {checkpoint}", "--vs=true {checkpoint}",
                  f"--out={out}")
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == ["run.py: --vs given twice: 'true {checkpoint}'"]
    assert out.read_text() == OLD
