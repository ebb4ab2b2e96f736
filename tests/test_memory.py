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


# ------------------------------------------------------------------------------------------
# A draft model (speculative decoding's --draft) counted apart: its weights and its drafters'
# caches.

# SmolLM2-135M: dim 576, hidden 1536, 30 layers, 3 KV heads of 64, vocabulary 49152 (tied).
SMOLLM2_MATRIX_WEIGHTS = 49152 * 576 + 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
SMOLLM2_NORM_BYTES = (2 * 30 * 576 + 576) * 4  # RMSNorm gains stay float32


@pytest.mark.parametrize("draft, weights", [
    ("self:int8", SMOLLM2_MATRIX_WEIGHTS // 32 * 34 + SMOLLM2_NORM_BYTES),  # Q8_0 blocks
    ("self:bfloat16", SMOLLM2_MATRIX_WEIGHTS * 2 + SMOLLM2_NORM_BYTES),
])
def test_a_self_draft_counts_the_targets_weights_at_its_type(smollm2, draft, weights):
    assert SMOLLM2_MATRIX_WEIGHTS == 134_479_872
    plan = memory_plan(smollm2, slots=4, draft=draft)
    assert plan.draft_weights == weights
    # one drafter per slot, each a whole f16 cache (the GGUF default) of the context
    assert plan.drafters == 4
    assert plan.draft_kv_cache == 4 * 2048 * 2 * 30 * 3 * 64 * 2 == 188_743_680
    plain = memory_plan(smollm2, slots=4)
    assert plan.total - plain.total == weights + 188_743_680 + plan.resident - plain.resident
    line = plan.line()
    assert (f"+ draft {draft} {(weights + 188_743_680) / 1e6:.1f} MB (weights "
            f"{weights / 1e6:.1f} MB, {draft[5:]}; KV cache 188.7 MB, 4 drafters x 2048 tokens, "
            "f16) + the process") in line
    one = required_memory(smollm2, draft=draft)
    assert "KV cache 47.2 MB, 2048 tokens, f16)" in one  # one drafter


def test_a_self_q4_draft_keeps_q4_1_blocks_and_the_sizes_are_the_casts(smollm2):
    from jllama.model.cast_nbytes import cast_nbytes
    from jllama.model.weights import cast_weights, weights_nbytes

    # Q4_1 is of the types q4 keeps, the tied Q8_0-or-narrower classifier too: the file's bytes.
    assert memory_plan(smollm2, draft="self:q4").draft_weights == memory_plan(smollm2).weights
    stories = open_model(None)
    for dtype in ("float32", "bfloat16", "int8", "q4"):
        assert cast_nbytes(stories.weights, dtype) == weights_nbytes(
            cast_weights(stories.weights, dtype)), dtype


def test_a_draft_checkpoint_counts_its_weights_as_held():
    from jllama.generation.draft_model import load_draft

    target = open_model(None)
    draft = load_draft(str(target.source), target)  # stories260K drafting for itself
    plan = memory_plan(target, slots=2, draft=draft)
    # 64-wide, 5 layers of (2 x 64x64 + 2 x 32x64 + 3 x 172x64), a tied 512 x 64 table, and
    # 11 RMSNorm gains of 64, all float32
    assert plan.draft_weights == 4 * (512 * 64 + 5 * (2 * 4096 + 2 * 2048 + 3 * 11008)
                                      + 11 * 64) == 1_040_128
    assert plan.draft_kv_cache == 2 * 512 * 2 * 5 * 4 * 8 * 4  # 2 drafters, f32, 512 tokens
    assert "+ draft stories260K.bin 2.4 MB (weights 1.0 MB, float32; KV cache 1.3 MB, " \
           "2 drafters x 512 tokens, f32)" in plan.line()
    assert "draft" not in memory_plan(target, draft="ngram").line()  # n-grams: no cache


def test_the_command_says_the_drafts_memory():
    from test_cli import run

    result = run("--draft=self:int8", "--steps=8", "--temperature=0", "--prompt=Once")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if "required memory" in x)
    # stories260K at int8: 64-wide rows, one byte a weight and a float32 scale a row
    assert "+ draft self:int8 0.9 MB (weights 0.3 MB, int8; KV cache 0.7 MB, 512 tokens, " \
           "f32)" in line, line
