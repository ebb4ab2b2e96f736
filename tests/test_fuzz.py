"""The fuzz harness of the readers (bench/fuzz.py, issue 21): a short deterministic run in CI.

One run of `bench/fuzz.py` with a fixed seed: each seed as it is, every crafted header lie once
(GGUF counts, lengths, offsets, types and dims; llama2.c headers; tokenizer.bin lengths;
tokenizer.json ids; deep and huge JSON; non-finite hyperparameters), then random damage up to
CASES inputs, each through the `jllama` command line in a forked child under 10 s and 1 GB
of peak RSS. None may fail. The harness runs in a process of its own: it forks, which is
safe only in a process where JAX has not started a backend (other tests here start them).
A long run by hand: `.venv/bin/python bench/fuzz.py --cases=2000 --out=fuzz-failures`.

And one run of its chat-template class (issue 33): TEMPLATE_CASES GGUFs in chat mode whose
template is every bomb of bench/fuzz_templates.py (each must be refused in one line) and real
models' templates randomly edited; about 15 s with two jobs.

And one run of its HTTP class (issue 33): HTTP_CASES raw-byte cases against one `jllama serve`
on the GGUF seed, every crafted one (framing, sizes, content types, slashes, deep JSON,
pipelining, slow senders) and random damage after them; about 8 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
FUZZ = BENCH / "fuzz.py"
SEED = 21
CASES = 300
FILE_KINDS = "gguf,llama2c,tokenizer_bin,hf"
HTTP_CASES = 150
TEMPLATE_CASES = 60


def run_fuzz(*flags: str, timeout: float = 240) -> tuple[list[dict], dict]:
    """bench/fuzz.py's JSON lines: (the cases' lines, the summary line)."""
    proc = subprocess.run([sys.executable, str(FUZZ), *flags], capture_output=True, text=True,
                          timeout=timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1].get("summary"), proc.stdout[-2000:] + proc.stderr[-2000:]
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def ci_run():
    return run_fuzz(f"--cases={CASES}", f"--seed={SEED}", "--jobs=2", f"--kinds={FILE_KINDS}")


@pytest.fixture(scope="module")
def template_run():
    return run_fuzz(f"--cases={TEMPLATE_CASES}", f"--seed={SEED}", "--jobs=2",
                    "--kinds=template", timeout=240)


def test_no_template_case_fails(template_run):
    results, summary = template_run
    failures = [r for r in results if r["outcome"] == "failure"]
    assert not failures, f"{len(failures)} of {summary['cases']} template cases failed:\n" + \
        "\n".join(f"  {r['mutation']}: {r['reason']} ({r['seconds']} s, {r['peak_rss_mb']} MB; "
                  f"{r['stderr'][:200]})" for r in failures)


def test_every_template_bomb_is_refused_in_one_line(template_run):
    sys.path.insert(0, str(BENCH))
    from fuzz_templates import BOMBS

    results, summary = template_run
    by_name = {r["mutation"]: r for r in results}
    for name in BOMBS:
        r = by_name[f"template.{name}"]
        assert r["outcome"] == "clean_error" and r["exit"] == 1, r
        assert r["seconds"] < 5 and r["peak_rss_mb"] < 1024, r
    assert by_name["seed"]["outcome"] == "ran"
    assert any(r["mutation"].startswith("template.random[") for r in results)


@pytest.fixture(scope="module")
def http_run():
    return run_fuzz(f"--cases={HTTP_CASES}", f"--seed={SEED}", "--kinds=http", timeout=180)


def test_no_input_fails(ci_run):
    results, summary = ci_run
    failures = [r for r in results if r["outcome"] == "failure"]
    assert not failures, f"{len(failures)} of {summary['cases']} inputs failed:\n" + "\n".join(
        f"  {r['kind']} {r['mutation']}: {r['reason']} (exit {r['exit']}, {r['seconds']} s, "
        f"{r['peak_rss_mb']} MB; {r['stderr'][:200]})" for r in failures)


def test_the_run_covers_every_reader_and_lie(ci_run):
    results, summary = ci_run
    assert summary["cases"] == CASES and summary["limits"] == {"seconds": 10.0, "rss_mb": 1024}
    assert set(summary["counts"]) == {"gguf", "llama2c", "tokenizer_bin", "hf", "all"}
    seeds = [r for r in results if r["mutation"] == "seed"]
    assert len(seeds) == 4 and all(r["outcome"] == "ran" for r in seeds), seeds
    names = {r["mutation"] for r in results}
    for lie in ("gguf.array_count[tokenizer.ggml.tokens]=2^40", "gguf.tensor_offset[",
                "gguf.tensor_overlap[all tensors at offset 0]", "gguf.tensor_misaligned[",
                "gguf.tensor_type[", "gguf.float[llama.rope.freq_base]=inf",
                "llama2c.header[dim]=-1", "tokenizer_json.vocab_id=10^12",
                "tokenizer_json.added_token_id=10^9", "json.deep[config.json",
                "json.huge_int[tokenizer.json", "json.deep[safetensors header",
                "json.value[config.json rms_norm_eps]=1e999", "tokenizer_json.no_byte_tokens",
                # issue 33: float32 overflows and K-quant scales
                "gguf.float64[llama.attention.layer_norm_rms_epsilon]=1e+300",
                "gguf.float64[llama.rope.scaling.factor]=1e-300", "gguf.rope_freqs=1e-45",
                "gguf.kquant[", "llama2c.group_scale[token_embedding_table 0]=3e+38",
                "json.float32[config.json"):
        assert any(name.startswith(lie) for name in names), lie
    random = [r for r in results if r["expect"] == "any"]
    assert len(random) > 50
    assert all(r["reason"] for r in results if r["outcome"] == "ran")


def test_the_plan_is_deterministic(tmp_path):
    sys.path.insert(0, str(BENCH))
    import fuzz

    def built(folder):
        """Each case's kind, seed, mutation name, target and bytes (hashed)."""
        seeds = fuzz.make_seeds(folder)
        out = []
        for case in fuzz.plan(seeds, 120, SEED, fuzz.KINDS):
            m = case.make() if case.make else None
            out.append((case.kind, case.seed) + ((m.name, m.target, hash(m.data)) if m else ()))
        return out

    assert built(tmp_path / "a") == built(tmp_path / "b")


@pytest.mark.parametrize("flags, reason", [
    (["--time_limit=0.001"], "timeout"),
    (["--rss_limit=20"], "peak RSS"),
    (["--rss_limit=20", "--kinds=http"], "peak RSS"),  # the server's, after the case
])
def test_the_limits_are_enforced(flags, reason):
    # The seed itself, under limits it cannot meet: the harness must call it a failure.
    results, summary = run_fuzz("--cases=1", "--kinds=gguf", "--seed=0", *flags, timeout=120)
    assert [r["outcome"] for r in results] == ["failure"]
    assert results[0]["reason"].startswith(reason), results[0]


def test_no_http_case_fails(http_run):
    results, summary = http_run
    failures = [r for r in results if r["outcome"] == "failure"]
    assert not failures, f"{len(failures)} of {summary['cases']} HTTP cases failed:\n" + "\n".join(
        f"  {r['mutation']}: {r['reason']} ({r['seconds']} s; {r['stderr'][:200]})"
        for r in failures)


def test_the_http_run_covers_the_edges(http_run):
    results, summary = http_run
    assert summary["cases"] == HTTP_CASES and set(summary["counts"]) == {"http", "all"}
    by_name = {r["mutation"]: r for r in results}
    for name, status in (("http.trailing_slash[POST /v1/completions/]", 200),
                         ("http.trailing_slash[GET /health/]", 200),
                         ("http.content_length[2^64, no body]", 413),
                         ("http.content_length[10485760, no body]", 413),
                         ("http.content_length['-1']", 400),
                         ("http.chunked[over the limit, open]", 413),
                         ("http.header[a line of 1 MB]", 400),
                         ("http.header[10,000 lines]", 400),
                         ("http.content_type['text/plain']", 415),
                         ("http.content_type['application/x-www-form-urlencoded']", 200),
                         ("http.encoding[utf-16]", 400),
                         ("http.json[prompt nested 10^5 deep]", 400),
                         ("http.json[max_tokens of 5000 characters]", 400)):
        assert by_name[name]["statuses"][:1] == [status], by_name[name]
    for name in ("http.content_length[2^64, no body]", "http.content_type['text/plain']"):
        assert by_name[name]["seconds"] < 1, by_name[name]
    assert len(by_name["http.pipelined[50 health checks]"]["statuses"]) == 50
    assert any(r["expect"] == "any" for r in results)  # random damage after the crafted
