"""A 32K context: a tiny Llama 3.1-style model (llama3 RoPE scaling, factor 8, rope_theta 500000,
131072 positions) run by jllama at seq_len 32768 and checked against transformers.

References: transformers' `LlamaForCausalLM` (sdpa attention, float32) on the same weights:
one forward of a 32763-token prompt, then greedy decoding with its cache up to position 32767,
the context's last; its logits at every position are the oracle. The GGUF file is written as
llama.cpp's convert_hf_to_gguf.py writes it (`gguf_files.write_converted_llama`: q/k rows
permuted back to Meta's pairs, llama3 scaling as `rope_freqs.weight`; checked against the
converter's own output in test_rope_long.py, which also checks the RoPE angles alone).

The model is small (1 layer, dim 64, 2 query heads over 1 KV head of 32: q8_0's blocks of 32
fit) so that transformers' 32K forward takes a second or two on two cores: the costs are the
attention's, which grow with the square of the context and with layers x heads x head_dim (two
layers took this file from 25 s to 40 s on a busy 2-core machine). What a second layer adds
(its own blocks) does not depend on the depth, and the short-context tests have it.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from gguf_files import write_converted_llama
from hf_models import Spec, build, save

from jllama import graphs
from jllama.backends import make_backend
from jllama.formats.hf import read_hf
from jllama.model.loading import open_model
from jllama.sampling import Sampler
from jllama.generation.session import Session

LLAMA31_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SPEC = Spec("llama3.1-long", {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 259,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": LLAMA31_ROPE,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}, seed=31)
SEQ_LEN = 32768
N_PROMPT = 32763
"""The prompt ends inside a 256-position block: its last chunks are smaller (64, then 8) and
3 tokens go through the decode programs; decoding then fills the context to its last
position, 32767."""
N_DECODE = SEQ_LEN - N_PROMPT
TOLERANCE = 1e-4
"""Largest |logit difference| allowed with the float32 cache (logits here span about +-5;
measured: 2e-6 in the first block, 7.8e-6 at 32K)."""

@pytest.fixture(scope="module")
def hf_model():
    model = build(SPEC)
    model.config._attn_implementation = "sdpa"  # eager would hold 32K x 32K scores per head
    return model


@pytest.fixture(scope="module")
def files(hf_model, tmp_path_factory):
    """(Hugging Face folder, GGUF path) of the model."""
    folder = save(hf_model, SPEC, tmp_path_factory.mktemp("hf"))
    path = write_converted_llama(tmp_path_factory.mktemp("gguf") / "long.gguf", hf_model)
    return folder, path


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers on a random prompt of N_PROMPT tokens, then greedy up to position 32767:
    (ids: the 32768 tokens fed, position by position; logits: f32[32768, vocab_size], row p
    after the token at p; greedy: the N_DECODE + 1 tokens it chose, the last never fed;
    margin: the smallest best-minus-second logit of those choices)."""
    ids = [int(t) for t in np.random.default_rng(32).integers(0, 256, size=N_PROMPT)]
    rows, greedy, margin = [], [], math.inf
    # transformers 5 calls the cache `cache` (`past_key_values` is deprecated there), 4 not
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else (
        "past_key_values")
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        cache = getattr(out, name)
        rows.append(out.logits[0].float().numpy())
        for step in range(N_DECODE + 1):
            last = rows[-1][-1]
            top2 = np.sort(last)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            greedy.append(int(np.argmax(last)))
            if step == N_DECODE:
                break
            out = hf_model(torch.tensor([[greedy[-1]]]), use_cache=True, **{name: cache})
            cache = getattr(out, name)
            rows.append(out.logits[0].float().numpy())
    logits = np.concatenate(rows)
    assert logits.shape == (SEQ_LEN, SPEC.config["vocab_size"])
    return ids + greedy[:N_DECODE], logits, greedy, margin


# --- 32K positions through the whole model ----------------------------------------------


def _open(files, source: str):
    """jllama's model at seq_len 32768 from the Hugging Face folder or the GGUF."""
    folder, path = files
    if source == "hf":
        return read_hf(folder, seq_len=SEQ_LEN, dtype="float32")
    return open_model(path, seq_len=SEQ_LEN)


LOGIT_WINDOWS = ((0, 256), (7936, 8448), (16384, 16640), (32512, N_PROMPT))
"""Prompt positions [start, end) whose logits are compared: the first block, both sides of
8192 (original_max_position_embeddings), the middle, and the prompt's last 251. Each window
and gap starts on a 256-position block, so the chunks are those of one whole-prompt prefill."""


def _prefill_windows(backend, ids: list[int]) -> np.ndarray:
    """The prompt through `backend` in pieces: `prefill_logits` over LOGIT_WINDOWS, `prefill`
    between them (no classifier). Returns the windows' logits, f32[positions, vocab_size], in
    order."""
    rows, pos = [], 0
    for start, end in LOGIT_WINDOWS:
        if start > pos:
            backend.prefill(ids[pos:start], pos)
        rows.append(backend.prefill_logits(ids[start:end], start))
        pos = end
    assert pos == N_PROMPT
    return np.concatenate(rows)


def _check(got: np.ndarray, want: np.ndarray, tolerance: tuple[float, float]) -> float:
    """Assert the |logit differences| below `tolerance` (first block, positions from 256 on),
    naming the worst position; returns the largest from 256 on. got: the windows' rows, then
    positions N_PROMPT .. SEQ_LEN - 1; want: f32[SEQ_LEN, vocab_size]."""
    positions = np.concatenate([np.arange(a, b) for a, b in LOGIT_WINDOWS]
                               + [np.arange(N_PROMPT, SEQ_LEN)])
    err = np.abs(got - want[positions]).max(axis=1)
    limit = np.where(positions < 256, *tolerance)
    worst = int(np.argmax(err / limit))
    assert err[worst] < limit[worst], (
        f"|logit diff| {err[worst]:.3g} at position {positions[worst]} "
        f"(tolerance {limit[worst]})")
    return float(err[positions >= 256].max())


def _run(backend, ids: list[int]) -> np.ndarray:
    """The windows' logits, then the teacher-forced decode steps' (each `forward`)."""
    windows = _prefill_windows(backend, ids)
    decoded = np.stack([backend.forward(ids[p], p) for p in range(N_PROMPT, SEQ_LEN)])
    return np.concatenate([windows, decoded])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_32k_context_matches_transformers(files, reference, source):
    """jllama at seq_len 32768 (jax backend, float32 cache): the 32763-token prompt prefilled in
    chunks, with the logits of LOGIT_WINDOWS (1275 positions), then transformers' greedy tokens
    decoded one at a time to position 32767 (teacher forcing): every logit within 1e-4 of
    transformers'. From the GGUF, the device loop's own greedy ids are then transformers', and
    so are the batched step's logits (a deep sequence beside a short one)."""
    ids, want, greedy, margin = reference
    model = _open(files, source)
    assert model.config.seq_len == SEQ_LEN
    attention = (graphs.ONE_DEVICE.attention, graphs.ONE_DEVICE.attention_chunk)
    before = [program._cache_size() for program in attention]
    backend = make_backend("jax", cache_type_k="f32", cache_type_v="f32")
    backend.prepare(model.config, model.weights)
    _check(_run(backend, ids), want, (TOLERANCE, TOLERANCE))
    if source == "hf":  # the first to run this config: every program compiled here
        # One attention program per power-of-two window of 256-position blocks (and chunk
        # size): 1 + log2(128) = 8 windows for 32768 positions. The 256-token chunks reach
        # all 8; the prompt's last 64- and 8-token chunks one more each; decode needs 2.
        assert graphs.n_blocks(SEQ_LEN) == 128
        compiled = [p._cache_size() - b for p, b in zip(attention, before, strict=True)]
        assert compiled[1] == 8 + 2 and 1 <= compiled[0] <= 8, compiled
        return
    # The device loop in the cache the prefill wrote: the prompt's last token again at
    # N_PROMPT - 1, then greedy on the device up to the context's end.
    assert margin > 1e-3  # transformers' choices are not near-ties
    session = Session(model, backend, decode="loop")
    generation = session.generate([ids[N_PROMPT - 1]], Sampler(temperature=0.0),
                                  start_pos=N_PROMPT - 1, context_ids=ids[:N_PROMPT - 1],
                                  ignore_eos=True)
    list(generation)
    assert session.decode_mode(Sampler(temperature=0.0)) == "loop"
    assert generation.generated_ids == greedy
    # The server's batched step (`decode_batch`), the deep sequence beside one at its start
    # (the prompt's first tokens in a new cache): each row transformers' at its position.
    deep = backend.use_caches(backend.new_caches())
    start = backend.new_caches()
    assert backend.batch_kernels()
    rows = [backend.decode_batch([ids[N_PROMPT + i], ids[i]], [N_PROMPT + i, i], [deep, start])
            for i in range(N_DECODE)]
    np.testing.assert_allclose(np.stack([r[0] for r in rows]), want[N_PROMPT:], atol=TOLERANCE,
                               rtol=0)
    np.testing.assert_allclose(np.stack([r[1] for r in rows]), want[:N_DECODE], atol=TOLERANCE,
                               rtol=0)


CACHE_TOLERANCE = {"f16": (4e-3, 1e-3), "bf16": (3e-2, 8e-3), "q8_0": (8e-2, 2.5e-2)}
"""(first block, from position 256 on): about three times the largest |logit difference|
measured against transformers' float32 with each cache type for keys and values. Largest in the
first block, where a few positions share the attention (f16 1.2e-3, bf16 9.5e-3, q8_0 2.8e-2);
from 256 to 32767 flat with depth (f16 3.3e-4, bf16 2.6e-3, q8_0 8.5e-3; float32: 7.8e-6)."""


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", list(CACHE_TOLERANCE))
def test_32k_context_with_each_cache_type(files, reference, cache_type):
    """The GGUF at seq_len 32768 with keys and values cached as f16 (a GGUF's default), bf16
    or q8_0: the windows' and the decode steps' logits (as the float32 test) within the cache
    type's tolerance of transformers' (float32 throughout)."""
    ids, want, _, _ = reference
    model = _open(files, "gguf")
    backend = make_backend("jax", cache_type_k=cache_type, cache_type_v=cache_type)
    backend.prepare(model.config, model.weights)
    err = _check(_run(backend, ids), want, CACHE_TOLERANCE[cache_type])
    assert err > 1e-4  # the type was in use: float32's error is 7.8e-6
