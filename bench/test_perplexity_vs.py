"""`perplexity_vs.py`: reading llama-perplexity's output (lines of a real run on this machine,
and its too-short message as tools/perplexity/perplexity.cpp formats it), and bad input as one
line with exit status 1 before any work (`.venv/bin/python -m pytest
bench/test_perplexity_vs.py`, a few seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import perplexity_vs
from cli import BenchError

# llama-perplexity -m smollm2-f32.gguf -f alice_wonderland_ch1-4.txt -c 101 --chunks 3 -t 2
# -fa off -ctk f32 -ctv f32 (llama.cpp 0c1e570): lines 5-11 of its output
OUTPUT = """0.05.392.907 I perplexity: tokenizing the input ..
0.05.414.978 I perplexity: tokenization took 22.056 ms
0.05.415.047 I perplexity: calculating perplexity over 3 chunks, n_ctx=101, batch_size=2020, n_seq=20
0.10.375.689 I perplexity: 4.96 seconds per pass - ETA 0.00 minutes
[1]26.9103,[2]29.3994,[3]29.5068,
0.10.443.047 I Final estimate: PPL = 29.5068 +/- 6.19378

"""


def test_parse_llama_perplexity():
    got = perplexity_vs.parse_llama_perplexity(OUTPUT)
    assert got == {"ppl": 29.5068, "ppl_error": 6.19378, "chunks": 3,
                   "chunk_ppl": [26.9103, 29.3994, 29.5068]}


def test_parse_a_text_too_short_and_a_crash():
    short = ("perplexity: you need at least 1024 tokens to evaluate perplexity with a context "
             "of 512\nperplexity: the data file you provided tokenizes to only 6 tokens\n")
    with pytest.raises(BenchError, match="too short, it needs at least 1024 tokens"):
        perplexity_vs.parse_llama_perplexity(short)
    with pytest.raises(BenchError, match="printed no final estimate: .*n_seq=1"):
        perplexity_vs.parse_llama_perplexity("calculating perplexity over 2 chunks, n_seq=1\n")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "perplexity_vs.py"), *args],
                          cwd=HERE.parent, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, words", [
    (["--file=/nonexistent.txt"], ["--file=/nonexistent.txt: no such file"]),
    (["--ctx=2"], ["--ctx=2: must be at least 3"]),
    (["--chunks=0"], ["--chunks=0: must be at least 1"]),
    (["--llama_perplexity=/nonexistent"], ["--llama_perplexity=/nonexistent: no such program"]),
    (["--llama_perplexity=/bin/true", "--models=/nonexistent.gguf"],
     ["--models: /nonexistent.gguf: no such file"]),
    (["--llama_perplexity=/bin/true", "--models=jllama/data/stories260K.bin"],
     ["not a GGUF file"]),
    (["--llama_perplexity=/bin/true", "--llamacpp_args='-nr"], ["--llamacpp_args="]),
    (["--ctx=abc"], ["--ctx", "invalid int value"]),
])
def test_bad_input_is_one_line(args, words):
    done = _run(*args)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("perplexity_vs.py: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]
