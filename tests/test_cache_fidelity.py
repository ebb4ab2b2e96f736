"""jllama's default GGUF path (weights as stored, 8-bit activations, the f16 KV cache) against
llama.cpp's default one (f16 K and V caches, flash attention) on the tiny Llama 3.2 fixture's
Q4_K_M and Q4_1 files: tests/data/llama32_tiny/llamacpp_f16_cache.json (its `about` says how it
was made).

On SmolLM2 the same comparison parts after a few tokens on most prompts, where the top-2
margins are 0.03-0.26 (docs/formats.md, "KV cache types"): 8-bit activations make a model's
logits move by tenths at any float difference upstream, so two programs agree token for token
only with the same arithmetic bit for bit. llama.cpp itself parts from its own default at those
places when its cache is f32 (5 of 6 prompts, tokens 5-19). This fixture's model was trained on
its text, so its continuations hold margins that the cache's rounding does not reach.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jllama.model.loading import open_model
from jllama.sampling import Sampler
from jllama.generation.session import Session

TINY = Path(__file__).parent / "data" / "llama32_tiny"
ORACLE = json.loads((TINY / "llamacpp_f16_cache.json").read_text())

# The largest gap between jllama's best logit and llama.cpp's along llama.cpp's continuation,
# measured on these files (0.144, Q4_K_M "Colors: red, orange,"; the others 0.03-0.06), with
# room: llama.cpp's flash attention rounds the queries and the running value sums to f16 where
# jllama keeps them in f32, and its f16 cache moves these logits from its own f32 cache's by 0.045.
TOP_LOGIT_TOLERANCE = 0.25


@pytest.fixture(scope="module", params=sorted(ORACLE["greedy"]))
def session(request):
    model = open_model(TINY / f"llama32-tiny-{request.param}.gguf", seq_len=128)
    session = Session.prepare(model)  # the defaults: jax, blocks as stored, the f16 cache
    assert [t.name for t in session.backend.cache_types] == ["f16", "f16"]
    return request.param, session


def test_greedy_ids_are_llama_cpps_with_the_f16_cache(session):
    """32 greedy tokens from each of 6 prompts, generated freely: llama.cpp's ids, or where
    they part a top-2 margin under 1e-3 there."""
    name, s = session
    for case in ORACLE["greedy"][name]:
        ids = s.encode(case["prompt"])
        assert case["prompt_ids"] in (ids, [s.tokenizer.bos_id] + ids)  # llama.cpp adds BOS
        prompt = case["prompt_ids"]
        generation = s.generate(prompt, Sampler(temperature=0.0), max_tokens=32, ignore_eos=True)
        got = [t.id for t in generation if t.sampled]
        want = case["generated_ids"]
        parted = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if parted is not None:
            assert case["margins"][parted] < 1e-3, (name, case["prompt"], parted, got, want)
        assert len(got) == 32


def test_best_logits_follow_llama_cpps_with_the_f16_cache(session):
    """Along llama.cpp's continuation (its tokens fed), every argmax is its token and the best
    logit within TOP_LOGIT_TOLERANCE of its own."""
    name, s = session
    backend = s.backend
    for case in ORACLE["greedy"][name]:
        sequence = case["prompt_ids"] + case["generated_ids"]
        rows = backend.prefill_logits(sequence[:-1], 0, first=len(case["prompt_ids"]) - 1)
        assert list(rows.argmax(axis=1)) == case["generated_ids"], (name, case["prompt"])
        gap = np.abs(rows.max(axis=1) - np.asarray(case["top_logits"]))
        assert gap.max() <= TOP_LOGIT_TOLERANCE, (name, case["prompt"], float(gap.max()))
