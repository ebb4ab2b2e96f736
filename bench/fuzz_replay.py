"""Failing fuzz cases kept and run again (bench/fuzz.py --out, --replay): a case's files copied
out with a case.json holding its argv and result, and one such folder (or any checkpoint) rerun.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from fuzz_mutations import Mutation  # bench/ is the script's folder
from fuzz_outcomes import Limits, classify, read_text
from fuzz_plan import Case, Running
from fuzz_runner import RUN_FLAGS, run_one, spawn
from fuzz_seeds import Seed


def keep(result: dict, r: Running, seeds: dict[str, Seed], out: Path) -> Path:
    """Copy a failing case's files into `out` with case.json (its argv with "{dir}" for the
    folder, and its result), for --replay."""
    dest = out / r.folder.name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(r.folder, dest,
                    ignore=shutil.ignore_patterns("stdout", "stderr", "rss0", "modules"))
    argv = list(seeds[r.case.seed].argv) + list(RUN_FLAGS)
    (dest / "case.json").write_text(json.dumps({"argv": argv, **result}, indent=1) + "\n")
    return dest


def replay(path: Path, mode: str, limits: Limits) -> dict:
    """Run one kept case folder again (its case.json's argv), or any checkpoint path (file or
    Hugging Face folder) with the usual flags; returns its JSON line."""
    path = path.resolve()
    meta = path / "case.json"
    if meta.is_file():
        saved = json.loads(meta.read_text())
        argv = [a.replace("{dir}", str(path)) for a in saved["argv"]]
        case = Case(saved["case"], saved["kind"], saved["seed"], None)
        mutation = Mutation(saved["mutation"], saved["target"] or "", b"", saved["expect"])
    else:
        argv = [f"--checkpoint={path}", *RUN_FLAGS]
        case = Case(0, "replay", "replay", None)
        mutation = Mutation(f"replay {path}", path.name, b"", "any")
    with tempfile.TemporaryDirectory(prefix="jllama-replay-") as tmp:
        if mode == "fork":
            import jllama.cli  # noqa: F401  (the rest is imported by the child)
        r, status, usage = run_one(spawn(case, mutation, Path(tmp), argv, mode), limits)
        result = classify(r, status, usage, time.monotonic() - r.started, limits)
        result["stdout"] = read_text(Path(tmp) / "stdout", 2000)
    return result | {"argv": argv}
