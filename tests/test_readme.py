"""The README's Python examples run as written (each block in a fresh interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_examples_the_issue_asks_for():
    text = "\n".join(BLOCKS)
    assert "numpy_ref" in text  # the research script
    assert "class CountingBackend" in text  # adding a backend


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_counting_backend_counts_one_call_per_position():
    block = next(b for b in BLOCKS if "CountingBackend" in b)
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120
    ).stdout
    assert out.strip() == "20 forward passes"
