"""Shared test fixtures: data paths and the embedded stories260K model.

Tests read only files inside the repository (package data in jllama/data, test data in
tests/data), so they run from a clean clone with no ../shared beside it.
"""

from __future__ import annotations

import json
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
