"""Sliding-window attention (issue 36: Mistral v0.1's `sliding_window`, Qwen2's
`use_sliding_window`, GGUF's `<arch>.attention.sliding_window`): a tiny random
MistralForCausalLM whose window (8) is shorter than the 24 tokens run, against transformers'
logits (its eager attention masks key positions <= query position - window), on the NumPy
reference and the jax backend's XLA attention (graph, loop and fused decode, prefill chunks),
which also runs in place of jllama's CPU attention kernels (they have no window) where the window
is shorter than the context.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_models import build, edit_config, hf_logits, save
from qwen_models import SPECS, TOKENS, tokenizer_files

from jllama.backends import make_backend
from jllama.errors import ConfigError
from jllama.formats.gguf_config import config_from_metadata
from jllama.formats.hf import read_hf

WINDOW = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    spec = SPECS["mistral"]
    spec = dataclasses.replace(spec, config={**spec.config, "sliding_window": WINDOW})
    model = build(spec)
    folder = save(model, spec, tmp_path_factory.mktemp("mistral-window"))
    tokenizer_files(folder, "mistral")
    full = hf_logits(model, TOKENS)
    model.config.sliding_window = None  # the same weights, full causal attention
    return folder, full, hf_logits(model, TOKENS)


def test_the_window_changes_transformers_logits(mistral):
    _, windowed, full = mistral
    assert np.abs(windowed[:WINDOW] - full[:WINDOW]).max() < 1e-5
    assert np.abs(windowed[WINDOW:] - full[WINDOW:]).max() > 1e-2


def test_logits_match_transformers_past_the_window(mistral):
    """The NumPy reference per token; on one jax backend (XLA's attention): prefill chunks
    (positions 0-11), the graph decode (12-23), then the device loop's greedy ids (24-31)
    against the reference's."""
    folder, want, _ = mistral
    model = read_hf(folder, seq_len=32)
    assert (model.config.seq_len, model.config.sliding_window) == (32, WINDOW)
    reference = make_backend("numpy")
    reference.prepare(model.config, model.weights)
    got = np.stack([reference.forward(t, pos) for pos, t in enumerate(TOKENS)])
    assert np.abs(got - want).max() < 1e-4
    backend = make_backend("jax", matvec="xla")
    backend.prepare(model.config, model.weights)
    got = np.concatenate([backend.prefill_logits(TOKENS[:5], 0, 0),
                          backend.prefill_logits(TOKENS[5:12], 5, 0)])
    got = np.concatenate([got, [backend.forward(t, pos) for pos, t in
                                enumerate(TOKENS[12:], 12)]])
    assert np.abs(got - want).max() < 1e-4
    token = int(np.argmax(got[-1]))
    ids, _ = backend.decode_loop(token, len(TOKENS), 8)
    want_ids = []
    for pos in range(len(TOKENS), len(TOKENS) + 8):
        token = int(np.argmax(reference.forward(token, pos)))
        want_ids.append(token)
    assert ids == want_ids


def test_the_kernel_path_and_fused_decode_mask_it_too(mistral):
    """With jllama's CPU kernels for the products, attention runs in XLA where the window is
    shorter than the context (the kernels have none): prefill, graph decode, the batched step
    (`forward` per sequence) and the fused decode program, against transformers."""
    folder, want, _ = mistral
    model = read_hf(folder, seq_len=32)
    kernel = make_backend("jax", matvec="kernel")
    kernel.prepare(model.config, model.weights)
    assert not kernel.batch_kernels() and not kernel.batch_xla()
    got = np.concatenate([kernel.prefill_logits(TOKENS[:12], 0, 0),
                          [kernel.forward(t, pos) for pos, t in enumerate(TOKENS[12:20], 12)]])
    held = kernel.use_caches(kernel.new_caches())  # positions 0-19, run on as a batch row
    row = kernel.decode_batch([TOKENS[20]], [20], [held])
    assert np.abs(np.concatenate([got, row]) - want[:21]).max() < 1e-4
    fused = make_backend("jax", matvec="xla", decode="fused")
    fused.prepare(model.config, model.weights)
    got = np.stack([fused.forward(t, pos) for pos, t in enumerate(TOKENS)])
    assert np.abs(got - want).max() < 1e-4


def test_the_default_context_is_capped_and_mixed_layers_refused(mistral):
    folder, _, _ = mistral
    assert read_hf(folder).config.seq_len == WINDOW  # without seq_len: exact everywhere
    # Qwen2: the layers from max_window_layers on slide; a mix is capped, not masked.
    edit_config(folder, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                use_sliding_window=True, max_window_layers=1)
    try:
        with pytest.raises(ConfigError, match="only some layers slide"):
            read_hf(folder, seq_len=32)
    finally:
        edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral",
                    use_sliding_window=None, max_window_layers=None)


def test_gguf_sliding_window_key():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.feed_forward_length": 96, "llama.block_count": 2,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.context_length": 128, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 416, "llama.attention.sliding_window": 16}
    capped = config_from_metadata(meta, "m.gguf")
    assert (capped.seq_len, capped.sliding_window) == (16, 16)
    asked = config_from_metadata(meta, "m.gguf", seq_len=64)
    assert (asked.seq_len, asked.sliding_window) == (64, 16)
