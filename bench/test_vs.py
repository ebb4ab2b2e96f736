"""bench/vs.py, the --vs "another program" runner: bounded output, the useful error line, env's
options, bare placeholders only, one llama-bench tg row, no command twice.
`.venv/bin/python -m pytest bench/test_vs.py` (about 15 s).

The programs are small Python scripts in tmp_path standing in for run.c and llama-bench; the
expected values are written by hand from what they print.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs


def script(tmp_path: Path, name: str, body: str) -> Path:
    """An executable Python script in tmp_path."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def gone(pid: int, seconds: float = 5.0) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


def wait_for_file(path: Path, seconds: float = 5.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


TABLE = (
    "| model | size | params | backend | threads | test | t/s |\n"
    "| --- | ---: | ---: | --- | ---: | ---: | ---: |\n"
)
ROW1 = "| llama 256M all F32 | 513.13 MiB | 134.52 M | CPU | 1 | tg8 | 88.80 ± 0.70 |\n"
ROW2 = "| llama 256M all F32 | 513.13 MiB | 134.52 M | CPU | 2 | tg8 | 0.00 ± 0.00 |\n"


# ---- 1. output goes to files: bounded memory, a prompt timeout, a cap on size --------------

def test_endless_output_times_out_promptly_in_bounded_memory(tmp_path):
    # about 18 bytes x 100 lines per ms: some MB in 2 s, under the 64 MiB cap
    endless = script(tmp_path, "endless",
                     "import time\n"
                     "while True:\n"
                     "    for _ in range(100):\n"
                     "        print('achieved tok/s: 5')\n"
                     "    time.sleep(0.001)\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.monotonic()
    done = vs.run_other([str(endless)], 2)
    elapsed = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert 2 <= elapsed < 5
    assert done["tok_s"] is None
    assert done["error"] == "timed out after 2 s"
    assert done["returncode"] is None
    assert 2 <= done["wall_s"] < 5
    assert len(done["tail"]) == 400 and "achieved tok/s: 5" in done["tail"]
    assert after - before < 50 * 1024  # this process grew by less than 50 MiB


def test_a_flood_is_stopped_at_the_output_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(vs, "OUTPUT_LIMIT", 1024 * 1024)
    flood = script(tmp_path, "flood",
                   "import sys\n"
                   "while True:\n"
                   "    sys.stderr.write('x' * 65536)\n")
    start = time.monotonic()
    done = vs.run_other([str(flood)], 60)
    assert time.monotonic() - start < 5
    assert done["tok_s"] is None and done["returncode"] is None
    assert done["error"] == "printed more than 1 MiB on stderr; stopped it"
    assert done["tail"] == "x" * 400  # one long line: the last 64 KiB kept whole


def test_a_timeout_kills_what_the_program_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = script(tmp_path, "parent",
                    "import subprocess, sys, time\n"
                    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                    f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                    "time.sleep(60)\n")
    start = time.monotonic()
    done = vs.run_other([str(parent)], 2)
    assert time.monotonic() - start < 5
    assert done["error"] == "timed out after 2 s"
    assert gone(int(wait_for_file(pid_file)))


def test_ctrl_c_kills_the_program(tmp_path):
    pid_file = tmp_path / "pid"
    sleeper = script(tmp_path, "sleeper",
                     "import os, time\n"
                     f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                     "time.sleep(60)\n")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            vs.run_other([str(sleeper)], 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert gone(int(wait_for_file(pid_file)))


def test_long_output_is_read_from_its_end(tmp_path):
    # 2 MB of story on stdout (more than the 64 KiB read back), the rate on stderr as run.c does
    long = script(tmp_path, "long",
                  "import sys\n"
                  "for i in range(100000):\n"
                  "    print('once upon a time', i)\n"
                  "print('achieved tok/s: 7.5', file=sys.stderr)\n")
    done = vs.run_other([str(long)], 30)
    assert done["tok_s"] == 7.5 and done["error"] is None and done["returncode"] == 0
    assert done["tail"].endswith("once upon a time 99999\nachieved tok/s: 7.5\n")
    assert len(done["tail"]) == 400


# ---- 2. the error line: stderr's last line first -----------------------------------------

def test_a_failing_program_is_named_by_its_stderr(tmp_path):
    bench = script(tmp_path, "llama-bench",
                   "import sys\n"
                   f"sys.stdout.write({TABLE!r})\n"
                   "sys.stdout.flush()\n"
                   "print(\"llama_bench: error: failed to load model 'x.gguf'\", file=sys.stderr)\n"
                   "raise SystemExit(1)\n")
    done = vs.run_other([str(bench)], 30)
    assert done == {
        "tok_s": None, "wall_s": done["wall_s"], "returncode": 1,
        "tail": TABLE + "llama_bench: error: failed to load model 'x.gguf'\n",
        "text": TABLE + "llama_bench: error: failed to load model 'x.gguf'\n",
        "error": "exited with status 1: llama_bench: error: failed to load model 'x.gguf'"}


def test_no_rate_names_stderr_then_stdout(tmp_path):
    both = script(tmp_path, "both",
                  "import sys\n"
                  "print('once upon a time')\n"
                  "print('warning: no GPU', file=sys.stderr)\n")
    assert vs.run_other([str(both)], 30)["error"] == "printed no tok/s rate: warning: no GPU"
    blank = script(tmp_path, "blank",
                   "import sys\n"
                   "print('once upon a time')\n"
                   "print('\\n  \\n', file=sys.stderr)\n")
    assert vs.run_other([str(blank)], 30)["error"] == "printed no tok/s rate: once upon a time"
    killed = script(tmp_path, "killed",
                    "import os, signal, sys\n"
                    "print('loading')\n"
                    "print('out of memory', file=sys.stderr, flush=True)\n"
                    "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert vs.run_other([str(killed)], 30)["error"] == "was killed by signal 9: out of memory"


def test_the_rate_is_read_from_either_stream(tmp_path):
    runc = script(tmp_path, "runc",
                  "import sys\n"
                  "print('once upon a time')\n"
                  "print('achieved tok/s: 229.5', file=sys.stderr)\n")
    assert vs.run_other([str(runc)], 30)["tok_s"] == 229.5
    bench = script(tmp_path, "bench",
                   "import sys\n"
                   "print('load_backend: loaded CPU backend', file=sys.stderr)\n"
                   f"sys.stdout.write({TABLE + ROW1!r})\n")
    assert vs.run_other([str(bench)], 30)["tok_s"] == 88.8
    # stdout without a final newline still ends its line before stderr's
    unended = script(tmp_path, "unended",
                     "import sys\n"
                     "sys.stdout.write('achieved tok/s: 3')\n"
                     "sys.stdout.flush()\n"
                     "print('done', file=sys.stderr)\n")
    done = vs.run_other([str(unended)], 30)
    assert done["tok_s"] == 3.0 and done["tail"] == "achieved tok/s: 3\ndone\n"


# ---- 3. env's options --------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["env", "-i", "echo", "hi"], "echo"),
    (["env", "-u", "X", "echo"], "echo"),
    (["env", "-uX", "echo"], "echo"),
    (["env", "-iu", "X", "A=1", "echo"], "echo"),
    (["env", "--unset", "X", "echo"], "echo"),
    (["env", "--unset=X", "echo"], "echo"),
    (["env", "--uns", "X", "echo"], "echo"),
    (["env", "-C", "/tmp", "echo"], "echo"),
    (["env", "--chdir=/tmp", "-i", "echo"], "echo"),
    (["env", "--ignore-environment", "-0", "-v", "echo"], "echo"),
    (["env", "-", "A=1", "echo"], "echo"),
    (["env", "--", "A=1", "echo"], "echo"),
    (["/usr/bin/env", "A=1", "B=2", "echo"], "echo"),
    (["env", "A=1", "-i"], "-i"),  # settings end the options: "-i" is the program here
    (["env", "-u", "X"], None),
    (["echo", "-i"], "echo"),
])
def test_program_skips_env_options(argv, expected):
    assert vs.program(argv) == expected


def test_check_accepts_env_options_and_refuses_split_string(tmp_path):
    vs.check("env -i echo achieved tok/s: 12")
    vs.check("env -u X echo {checkpoint}")
    vs.check("env --unset=X -C /tmp OMP_NUM_THREADS=1 echo {tokenizer}")
    with pytest.raises(ValueError) as e:
        vs.check("env -i no-such-program-here {checkpoint}")
    assert str(e.value) == ("--vs 'env -i no-such-program-here {checkpoint}': "
                            "program 'no-such-program-here' is not found on PATH")
    with pytest.raises(ValueError) as e:
        vs.check("env -u X")
    assert str(e.value) == "--vs 'env -u X': names no program after its settings"
    for template in ("env -S 'echo hi'", "env -iS 'echo hi'", "env --split-string='echo hi'"):
        with pytest.raises(ValueError) as e:
            vs.check(template)
        assert str(e.value).startswith(f"--vs {template!r}: env -S (--split-string) is not "
                                       "supported")
    # and it runs: env -i empties the environment, echo prints the rate
    done = vs.run_other(vs.expand("env -i echo achieved tok/s: 12"), 30)
    assert done["tok_s"] == 12.0 and done["error"] is None


def test_label_leaves_env_options_out():
    assert vs.label("env -i -u X OMP_NUM_THREADS=1 bench/.cache/run {checkpoint}") == (
        "run OMP_NUM_THREADS=1")
    assert vs.label("env --chdir=/tmp /x/llama-bench -m /tmp/a-F32.gguf -t 2") == (
        "llama-bench a-F32.gguf")
    assert vs.label("env -S 'run x'") == "env"  # refused by check; still a name


# ---- 4. bare placeholders only -----------------------------------------------------------

@pytest.mark.parametrize("template, written", [
    ("run {checkpoint!r}", "{checkpoint!r}"),
    ("run {checkpoint:>9}", "{checkpoint:>9}"),
    ("run {checkpoint} -z x{tokenizer!s:>5}", "{tokenizer!s:>5}"),
    ("run {checkpoint!a}", "{checkpoint!a}"),
])
def test_placeholders_with_a_conversion_or_spec_are_refused(template, written):
    with pytest.raises(ValueError) as e:
        vs.expand(template, checkpoint="/c.bin", tokenizer="/t.bin")
    assert str(e.value).startswith(f"--vs {template!r}: ")
    assert written in str(e.value)
    with pytest.raises(ValueError) as e:
        vs.check(template)
    assert str(e.value).startswith(f"--vs {template!r}: ") and written in str(e.value)


def test_bare_placeholders_and_doubled_braces():
    assert vs.expand("run {{checkpoint}} {checkpoint} -z {tokenizer}",
                     checkpoint="/c.bin", tokenizer="/t.bin") == [
        "run", "{checkpoint}", "/c.bin", "-z", "/t.bin"]
    # prefill_vs.py's placeholders
    assert vs.expand("bench -m {checkpoint} -p {tokens}", checkpoint="/c", tokens="64") == [
        "bench", "-m", "/c", "-p", "64"]
    vs.check("echo -p {tokens}", placeholders=("tokens",))
    with pytest.raises(ValueError, match=r"^--vs 'echo -p \{tokens:3\}': .*\{tokens:3\}"):
        vs.check("echo -p {tokens:3}", placeholders=("tokens",))


# ---- 5. one llama-bench tg row -----------------------------------------------------------

def test_several_tg_rows_are_refused(tmp_path):
    two = ROW1 + ROW2
    assert vs.parse_tok_s(two) == 0.0  # documented: the last row
    assert vs.tg_rows(two) == 2
    assert vs.tg_rows(ROW1 + ROW1.replace("tg8", "pp512")) == 1
    assert vs.tg_rows("achieved tok/s: 5") == 0
    bench = script(tmp_path, "bench", f"print({TABLE + two!r}, end='')\n")
    done = vs.run_other([str(bench)], 30)
    assert done["tok_s"] is None and done["returncode"] == 0
    assert done["error"] == "printed 2 tg rows (one -n and one -t, please)"
    three = script(tmp_path, "three", f"print({TABLE + two + ROW1!r}, end='')\n")
    assert vs.run_other([str(three)], 30)["error"] == (
        "printed 3 tg rows (one -n and one -t, please)")
    one = script(tmp_path, "one", f"print({TABLE + ROW1.replace('tg8', 'pp512') + ROW1!r})\n")
    assert vs.run_other([str(one)], 30)["tok_s"] == 88.8


# ---- 6. no command twice -----------------------------------------------------------------

def test_check_unique():
    vs.check_unique([])
    vs.check_unique(["run {checkpoint} -t 1", "run {checkpoint} -t 2"])
    with pytest.raises(ValueError) as e:
        vs.check_unique(["run x", "run y", "run x"])
    assert str(e.value) == "--vs given twice: 'run x'"
    # the same words, spaced or quoted differently, are the same command
    with pytest.raises(ValueError) as e:
        vs.check_unique(["run  x", "'run' x"])
    assert str(e.value) == "--vs given twice: \"'run' x\""
