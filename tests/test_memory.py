"""`jllama.platform.memory`: the memory plan counts every slot's KV cache (bytes worked out by hand from
the shapes), and a plan bigger than the host is refused in one line before anything big is
allocated (`jllama serve --parallel=256 --seq_len=8192` on SmolLM2, the issue's case)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import gguf
import pytest
from test_cli import REPO, jllama_command

from jllama.errors import ResourceError
from jllama.model.loading import open_model, required_memory
from jllama.platform.memory import JAX_START_BYTES, memory_plan, scratch_nbytes
from jllama.platform.runtime import available_memory_bytes


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return open_model(smollm2_gguf, seq_len=2048, need_tokenizer=False)


def test_the_kv_cache_of_every_slot_is_counted(smollm2):
    # SmolLM2: 30 layers, 3 KV heads of 64 values; k and v; float32.
    per_token = 2 * 30 * 3 * 64 * 4
    plan = memory_plan(smollm2, slots=4)
    assert plan.kv_cache == 4 * 2048 * per_token == 377_487_360
    assert memory_plan(smollm2, slots=4, cache_type="f16").kv_cache == plan.kv_cache // 2
    q8 = memory_plan(smollm2, slots=4, cache_type="q8_0").kv_cache  # 34 bytes per 32 values
    assert q8 == 4 * 2048 * 2 * 30 * 3 * (64 // 32 * 34)
    mixed = memory_plan(smollm2, slots=4, cache_type="f16", value_type="q8_0")
    assert mixed.kv_cache == 4 * 2048 * 30 * 3 * (64 * 2 + 68)
    assert "(4 slots x 2048 tokens, keys f16, values q8_0)" in mixed.line()
    # the file's tensors as stored (the tied classifier is the embedding table: once)
    assert plan.weights == sum(int(t.n_bytes) for t in gguf.GGUFReader(smollm2.source).tensors)
    assert plan.process >= plan.resident > 0
    assert plan.scratch == scratch_nbytes(smollm2.config, 4)
    assert plan.total == plan.weights + plan.kv_cache + plan.process + plan.scratch
    line = plan.line()
    assert line.startswith(f"required memory: {plan.total / 1e6:.1f} MB = weights 96.")
    assert "+ KV cache 377.5 MB (4 slots x 2048 tokens, f32) + the process" in line
    assert "KV cache 94.4 MB (2048 tokens, f32)" in required_memory(smollm2)


def test_a_slot_holds_whole_cache_blocks(smollm2):
    from jllama.graphs.attention import MIN_WINDOW
    from jllama.platform.memory import BLOCK

    assert BLOCK == MIN_WINDOW
    short = dataclasses.replace(smollm2, config=dataclasses.replace(smollm2.config, seq_len=1000))
    assert memory_plan(short, slots=2).kv_cache == 2 * 1024 * 2 * 30 * 3 * 64 * 4


def test_a_process_without_jax_counts_its_start():
    code = ("import sys; from jllama.model.loading import open_model; from jllama.platform.memory import "
            "memory_plan; p = memory_plan(open_model(need_tokenizer=False)); "
            "print(p.process - p.resident, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.split()
    assert out == [str(JAX_START_BYTES), "False"]


def test_a_plan_bigger_than_the_memory_is_refused_in_one_line(smollm2):
    plan = memory_plan(smollm2, slots=4)
    fixed = plan.total - plan.resident - plan.kv_cache
    per_slot = plan.kv_cache // 4
    plan.check(available=fixed + 4 * per_slot)  # just fits
    with pytest.raises(ResourceError) as info:
        plan.check(available=fixed + 3 * per_slot + 1)
    message = str(info.value)
    assert "\n" not in message and message.startswith("not enough memory: the run needs ")
    assert "at most 3 slots of 2048 tokens fit: lower --parallel or --seq_len" in message
    one = memory_plan(smollm2, slots=1)
    with pytest.raises(ResourceError, match="at most 1023 tokens of context fit in one slot"):
        one.check(available=one.total - one.resident - one.kv_cache // 2 - 1)
    with pytest.raises(ResourceError, match="the weights alone do not fit"):
        one.check(available=1)


def test_serve_with_more_slots_than_the_host_holds_is_refused_before_it_allocates():
    """The issue's `serve --checkpoint=smollm2 --seq_len=8192 --parallel=256` (a 97 GB plan)
    on a host with less than that."""
    per_slot = 8192 * 2 * 30 * 3 * 64 * 2  # 24 MB in the f16 cache a GGUF gets by default
    parallel = 256  # --parallel's most
    if (available_memory_bytes() or 0) > parallel * per_slot:
        pytest.skip("this host holds 256 slots of SmolLM2's 8192 tokens")
    result = subprocess.run(
        [*jllama_command(), "serve", "--checkpoint=smollm2", "--seq_len=8192",
         f"--parallel={parallel}", "--port=0"], capture_output=True, text=True, timeout=300,
        cwd=REPO)
    assert result.returncode == 1
    # The only line: refused before the required-memory line, which comes before the weights
    # are placed and any cache block is allocated (a peak RSS cannot show it here: Linux
    # carries the test process's own peak into a child's).
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jllama: error: not enough memory: "), lines
    assert f"for {parallel} x 8192 tokens, f16" in lines[0]  # the GGUF default cache
    assert "slots of 8192 tokens fit: lower --parallel or --seq_len" in lines[0]
