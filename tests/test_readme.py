"""The README's and docs/'s Python examples run as written (each block in a fresh interpreter),
the README stays short and links every page of docs/, and their relative links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    """(test id, code) of every ```python block, README.md first, then docs/ in name order."""
    out = []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        found = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        out += [(f"{name}-block{i}", code) for i, code in enumerate(found)]
    return out


BLOCKS = _blocks()


def test_the_docs_have_the_examples_the_issue_asks_for():
    text = "\n".join(code for _, code in BLOCKS)
    assert "numpy_ref" in text  # the research script
    assert "class CountingBackend" in text  # adding a backend


@pytest.mark.parametrize("block", [code for _, code in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_python_block_runs(block, tmp_path):
    if block.startswith("# fragment"):  # a piece of an example above it: its syntax only
        compile(block, "<docs block>", "exec")
        return
    result = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_counting_backend_counts_one_call_per_position():
    block = next(code for _, code in BLOCKS if "CountingBackend" in code)
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120
    ).stdout
    assert out.strip() == "20 forward passes"


def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = set(re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text))
    files = sorted(p.relative_to(REPO).as_posix() for p in DOCS.rglob("*") if p.is_file())
    assert files, "docs/ is empty"
    assert [f for f in files if f not in links] == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())  # GitHub keeps underscores
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen, fence = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.*)", line)):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(target)
    assert not broken, broken
