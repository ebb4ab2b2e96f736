"""Running fuzz cases (bench/fuzz.py): each case's files written to a folder of its own, the
`jllama` command run on them in a forked child (--mode=fork) or a fresh `python -m jllama`
(--mode=cli), watched for its time and RSS, and reaped with os.wait4 for its peak RSS.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from fuzz_mutations import Mutation  # bench/ is the script's folder
from fuzz_outcomes import Limits, classify
from fuzz_plan import Case, Running
from fuzz_seeds import Seed

PROMPT = "Hi there, fuzz!"
STEPS = 32  # more than the prompt's tokens in every seed, so each case generates
RUN_FLAGS = ("--backend=numpy", f"--steps={STEPS}", "--temperature=0", f"--prompt={PROMPT}")
"""What every case runs after its --checkpoint (and --tokenizer): a few greedy tokens."""


def write_case(seed: Seed, mutation: Mutation | None, folder: Path) -> list[str]:
    """Write the seed's files, one of them mutated, into `folder`; returns the flags."""
    for name, data in seed.files.items():
        if mutation is not None and name == mutation.target:
            data = mutation.data
        path = folder / name
        if data is None:  # a missing file; its folder is still there
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return [a.replace("{dir}", str(folder)) for a in seed.argv] + list(RUN_FLAGS)


def rss_kib(pid: int | str = "self") -> int:
    """A process's resident set now (VmRSS), KiB; 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _child(argv: list[str], folder: Path, report_modules: bool) -> None:
    """In the forked child: run the `jllama` command (`jllama.cli.run`, what the console
    script runs after its Ctrl-C handler) with `argv`, stdout and stderr into files, and leave
    with its exit status, never returning into the harness."""
    code = 1
    try:
        os.setpgid(0, 0)
        # Resident at the start: what the fork gave this child (its growth is measured from it).
        (folder / "rss0").write_text(str(rss_kib()))
        for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, folder / "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, folder / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(name, flags, 0o644), fd)
        sys.argv = ["jllama", *argv]
        from jllama.cli import run

        try:
            run()
            code = 0
        except SystemExit as e:
            # As the interpreter exits: an int is the status, None is 0, anything else is
            # printed and exits 1.
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        if report_modules:
            (folder / "modules").write_text("\n".join(sorted(sys.modules)))
    except BaseException:  # noqa: BLE001 - what an uncaught exception prints, then status 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def spawn(case: Case, mutation: Mutation | None, folder: Path, argv: list[str], mode: str,
          report_modules: bool = False, rss_offset_kib: int = 0) -> Running:
    """Start the process for `argv` (fork: a forked child; cli: `python -m jllama`, through
    posix_spawn) in its own process group, output into `folder`."""
    sys.stdout.flush()
    sys.stderr.flush()
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            _child(argv, folder, report_modules)
    else:
        write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, str(folder / "stdout"), write, 0o644),
                   (os.POSIX_SPAWN_OPEN, 2, str(folder / "stderr"), write, 0o644)]
        pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "jllama", *argv],
                             os.environ, file_actions=actions, setpgroup=0)
    if mode == "fork":
        try:
            os.setpgid(pid, pid)  # as the child does, whichever runs first
        except OSError:
            pass
    return Running(case, mutation, folder, argv, pid, time.monotonic(), rss_offset_kib)


def start(case: Case, seeds: dict[str, Seed], root: Path, mode: str,
          rss_offset_kib: int = 0) -> Running:
    """Build the case's mutation, write its files and start its process."""
    folder = root / f"{case.index:05d}-{case.kind}"
    folder.mkdir(parents=True)
    mutation = case.make() if case.make else None
    argv = write_case(seeds[case.seed], mutation, folder)
    if mutation is not None:
        # A random value can be the one already there (e.g. a 0 over a 0): say so.
        same = mutation.data == seeds[case.seed].files[mutation.target]
        mutation = dataclasses.replace(mutation, data=b"", unchanged=same)
    return spawn(case, mutation, folder, argv, mode, rss_offset_kib=rss_offset_kib)


def _kill(r: Running, why: str) -> None:
    """SIGKILL the case's process group (anything it started goes too)."""
    r.killed = why
    for kill, target in ((os.killpg, r.pid), (os.kill, r.pid)):
        try:
            kill(target, signal.SIGKILL)
            return
        except OSError:
            pass


def watch(running: dict[int, Running], limits: Limits) -> list[tuple[Running, int, object]]:
    """One look at the running cases: kill any over a limit, and return those that ended as
    (case, wait status, rusage), reaped with os.wait4 so their peak RSS comes with them."""
    ended = []
    for pid, r in list(running.items()):
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid == 0:
            if r.killed is None and time.monotonic() - r.started > limits.seconds:
                _kill(r, "timeout")
            elif r.killed is None and rss_kib(pid) + r.rss_offset_kib > limits.rss_mb * 1024:
                _kill(r, "rss")  # before it takes the machine's memory
            continue
        del running[pid]
        ended.append((r, status, usage))
    return ended


def run_all(cases: list[Case], seeds: dict[str, Seed], root: Path, mode: str, jobs: int,
            limits: Limits, on_done: Callable[[dict, Running], None],
            rss_offset_kib: int = 0) -> list[dict]:
    """Run the cases, `jobs` at a time, each watched for its time and RSS; `on_done` gets
    each result (and its case) as it ends; returns the results in case order."""
    pending, running, results = list(cases), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            r = start(pending.pop(0), seeds, root, mode, rss_offset_kib)
            running[r.pid] = r
        for r, status, usage in watch(running, limits):
            result = classify(r, status, usage, time.monotonic() - r.started, limits)
            results[r.case.index] = result
            on_done(result, r)
        if running:
            time.sleep(0.002)  # a 10 ms case is timed to within a few ms
    return [results[c.index] for c in cases]


def run_one(r: Running, limits: Limits) -> tuple[Running, int, object]:
    """Wait for one started case under the limits: (case, wait status, rusage)."""
    running = {r.pid: r}
    while True:
        ended = watch(running, limits)
        if ended:
            return ended[0]
        time.sleep(0.002)


def preload(seeds: list[Seed], root: Path, limits: Limits) -> None:
    """Import here what the command line imports to run each seed, so the forked children
    start warm: each seed is run once in a child that lists its modules, and this process
    imports them. Imports only: nothing here parses flags or touches a JAX device (forking
    after JAX starts its backend would not be safe)."""
    wanted: set[str] = set()
    for i, seed in enumerate(seeds):
        folder = root / f"preload-{i}"
        folder.mkdir(parents=True)
        argv = write_case(seed, None, folder)
        run_one(spawn(Case(-1, seed.kind, seed.name, None), None, folder, argv, "fork",
                      report_modules=True), limits)
        listing = folder / "modules"
        if listing.exists():
            wanted |= set(listing.read_text().split())
    for name in sorted(wanted - set(sys.modules)):
        if name.startswith(("__main__", "_pytest", "pytest")):
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that only imports in its package's order
            pass


def seed_peak_kib(seed: Seed, root: Path, mode: str, limits: Limits) -> int:
    """The peak RSS (ru_maxrss, KiB) of running `seed` as it is in `mode`.

    For the calibration in fuzz.py's `fuzz`: a forked child shares this process's libraries
    and counts only the pages it touches, while a fresh `jllama` process also holds what its
    imports touched, so the difference on a seed is what to add to a forked child's peak to
    make it a `jllama` process's. Measure "cli" before `preload`: posix_spawn's child starts
    counting from its parent's resident pages, which must be fewer than the command's own
    then."""
    folder = root / f"{seed.name}-{mode}"
    folder.mkdir(parents=True)
    argv = write_case(seed, None, folder)
    r = spawn(Case(-1, seed.kind, seed.name, None), None, folder, argv, mode)
    return run_one(r, limits)[2].ru_maxrss
