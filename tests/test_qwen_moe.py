"""Qwen3-MoE (issue 36, the Mixture-of-Experts part): a tiny random `Qwen3MoeForCausalLM`
made by transformers (`qwen_models.MOE_SPEC`: 8 experts, 2 routed per token, 2 layers),

  - its Hugging Face folder read by jllama: logits of every position within 1e-4 of
    transformers' (the oracle, run here) on the numpy and jax backends (jax: decoded one token
    at a time, and through prefill_logits);
  - the same model converted by llama.cpp's convert_hf_to_gguf.py (architecture qwen3moe,
    experts as 3-D tensors; tests/data/make_qwen_moe_tiny.py made the files): the F32 file's
    logits against transformers' on both backends, dequantized and as stored (the kernels'
    products and XLA's; decoded, and prefilled in chunks grouped by expert); and the F32 and llama-quantize Q8_0 files' greedy text (and a
    Q4_K_M file's, `qwen_models.MOE_KQUANT_SPEC`: experts in K-quant blocks), the weights as
    stored on the kernels, equal to llama.cpp's llama-simple's (moe_llamacpp.json);
  - a step reads only the routed experts: experts no token routes to set to NaN change
    nothing;
  - the batched step and the verification step (a forward per sequence for MoE) equal
    `forward`; one-line refusals: the fused / loop decode modes and tensor parallelism, dense
    layers among the MoE ones, a shared expert.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest
from hf_models import build, edit_config, hf_logits, save
from qwen_models import DATA, MOE_SPEC, TOKENS, tokenizer_files

from jllama.backends import make_backend
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.gguf import read_gguf
from jllama.formats.hf import read_hf
from jllama.model.loading import open_model

ORACLE = np.load(DATA / "moe_oracle.npz")
LLAMA_CPP = json.loads((DATA / "moe_llamacpp.json").read_text(encoding="utf-8"))
SEQ_LEN = 64


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(folder, transformers' logits for TOKENS computed now)."""
    model = build(MOE_SPEC)
    folder = save(model, MOE_SPEC, tmp_path_factory.mktemp("qwen3moe"))
    tokenizer_files(folder, "qwen3")
    return folder, hf_logits(model, TOKENS)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "qwen3moe-tiny-F32.gguf"
    path.write_bytes(gzip.decompress((DATA / "qwen3moe-tiny-F32.gguf.gz").read_bytes()))
    return path


def _decoded(backend, model, tokens=TOKENS) -> np.ndarray:
    backend.prepare(model.config, model.weights)
    return np.stack([backend.forward(t, pos) for pos, t in enumerate(tokens)])


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def test_oracle_is_the_live_transformers_model(hf_model):
    assert _max_diff(hf_model[1], ORACLE["qwen3moe"]) < 1e-5
    assert list(ORACLE["tokens"]) == TOKENS


@pytest.mark.parametrize("backend_name", ["numpy", "jax"])
def test_hf_folder_logits_match_transformers(hf_model, backend_name):
    folder, want = hf_model
    model = open_model(folder, seq_len=SEQ_LEN)
    c = model.config
    assert (c.n_experts, c.n_experts_per_tok, c.norm_topk_prob, c.hidden_dim) == (8, 2, True, 32)
    assert c.qk_norm and not c.qkv_bias and model.weights.w1.shape == (2, 8, 32, 64)
    backend = make_backend(backend_name)
    assert _max_diff(_decoded(backend, model), want) < 1e-4
    if backend_name == "jax":
        backend.use_caches(backend.new_caches())
        assert _max_diff(backend.prefill_logits(TOKENS, 0), want) < 1e-4


def test_gguf_logits_match_transformers(f32_gguf):
    want = ORACLE["qwen3moe"]
    model = read_gguf(f32_gguf, seq_len=SEQ_LEN)
    assert model.metadata["general.architecture"] == "qwen3moe"
    assert model.config == dataclasses.replace(read_gguf(f32_gguf, seq_len=SEQ_LEN).config)
    assert _max_diff(_decoded(make_backend("numpy"), model), want) < 1e-4
    stored = read_gguf(f32_gguf, seq_len=SEQ_LEN, stored=True)
    for matvec in ("kernel", "xla"):
        backend = make_backend("jax", matvec=matvec)
        assert _max_diff(_decoded(backend, stored), want) < 1e-4, matvec
        assert backend.matvec == matvec
        backend.use_caches(backend.new_caches())  # prefill: chunks grouped by expert
        assert _max_diff(backend.prefill_logits(TOKENS, 0), want) < 1e-4, matvec


@pytest.mark.parametrize("stem", ["qwen3moe-tiny-F32", "qwen3moe-tiny-Q8_0",
                                  "qwen3moe-256-Q4_K_M"])
def test_greedy_text_equals_llama_cpps(f32_gguf, stem):
    """llama.cpp's llama-simple (greedy, 32 tokens) on the F32 file, llama-quantize's Q8_0
    file and the Q4_K_M file of a MoE with rows of 256 (experts in Q4_K, layer 1's
    ffn_down_exps in Q6_K), against jllama's argmax decoding of the weights as stored, on
    the kernels (the experts' blocks as the file stores them): the same bytes."""
    path = f32_gguf if stem.endswith("F32") else DATA / f"{stem}.gguf"
    model = open_model(path, seq_len=SEQ_LEN)
    types = model.tensor_types
    if stem.endswith("Q8_0"):
        assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    if stem.endswith("Q4_K_M"):
        assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
        assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    assert backend.matvec == "kernel"
    tok = model.tokenizer
    ids = tok.encode(LLAMA_CPP["prompt"])
    logits = backend.prefill(ids, 0)
    out = []
    for i in range(LLAMA_CPP["n_predict"]):
        out.append(int(np.argmax(logits)))
        if out[-1] in tok.stop_ids:
            break
        logits = backend.forward(out[-1], len(ids) + i)
    want = bytes.fromhex(LLAMA_CPP["stdout_hex"][stem])
    # llama-simple prints each token's bytes as they come (a byte-level BPE token can be part
    # of a UTF-8 character), so the bytes are compared, not decoded text.
    text = LLAMA_CPP["prompt"].encode() + b"".join(tok.token_bytes(t) for t in out)
    assert text + b"\n" == want


def test_only_the_routed_experts_are_read(f32_gguf, monkeypatch):
    """Every expert that no token routes to, in every layer, set to NaN: the kernels' step
    gives the same logits, so it never read them."""
    from jllama.backends import jax_step, numpy_ref

    model = read_gguf(f32_gguf, seq_len=SEQ_LEN)
    routed: list[set[int]] = [set() for _ in range(model.config.n_layers)]
    calls = []

    def recording(logits, k, normalize):
        experts, weights = numpy_ref.route(logits, k, normalize)
        calls.append(experts)
        return experts, weights

    monkeypatch.setattr(jax_step, "route", recording)
    backend = make_backend("jax", matvec="kernel")
    backend.prepare(model.config, model.weights)
    calls.clear()  # the warm-up step's routing
    tokens = TOKENS[:8]
    want = np.stack([backend.forward(t, pos) for pos, t in enumerate(tokens)])
    for i, experts in enumerate(calls):
        routed[i % model.config.n_layers].update(experts.tolist())
    unused = [sorted(set(range(8)) - r) for r in routed]
    assert any(unused), "every expert routed: the test proves nothing"
    w = model.weights
    poisoned = {name: np.array(getattr(w, name)) for name in ("w1", "w2", "w3")}
    for layer, experts in enumerate(unused):
        for name in poisoned:
            poisoned[name][layer, experts] = np.nan
    weights = dataclasses.replace(w, **poisoned)
    monkeypatch.setattr(jax_step, "route", numpy_ref.route)
    backend = make_backend("jax", matvec="kernel")
    backend.prepare(model.config, weights)
    got = np.stack([backend.forward(t, pos) for pos, t in enumerate(tokens)])
    assert np.isfinite(got).all() and _max_diff(got, want) == 0.0


def test_batched_and_verification_steps_equal_forward(f32_gguf):
    model = read_gguf(f32_gguf, seq_len=SEQ_LEN, stored=True)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    assert not backend.batch_kernels() and not backend.batch_xla()
    caches = [backend.new_caches() for _ in range(2)]
    starts = [0, 5]
    for step in range(3):
        rows = backend.decode_batch([TOKENS[s + step] for s in starts], [step] * 2, caches)
        for b, s in enumerate(starts):
            ref = make_backend("numpy")
            want = _decoded(ref, model, TOKENS[s:s + step + 1])[-1]
            assert _max_diff(rows[b], want) < 1e-4
    backend.use_caches(backend.new_caches())
    assert _max_diff(backend.verify(TOKENS[:4], 0), ORACLE["qwen3moe"][:4]) < 1e-4
    # A generation's decode mode: auto never picks the device loop for a MoE model.
    from jllama.generation.device_loop import decode_mode
    from jllama.sampling import SamplerConfig

    assert decode_mode("auto", backend, SamplerConfig(temperature=0.0), padded=False) == "graph"


def test_refusals_in_one_line(hf_model, f32_gguf):
    model = read_gguf(f32_gguf, seq_len=SEQ_LEN)
    for kwargs in ({"decode": "fused"}, {"decode": "loop"}):
        with pytest.raises(ConfigError, match="does not run Mixture-of-Experts") as e:
            make_backend("jax", **kwargs).prepare(model.config, model.weights)
        assert "\n" not in str(e.value)
    folder = hf_model[0]
    for change in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        edit_config(folder, **change)
        try:
            with pytest.raises(CheckpointError, match="no dense layers") as e:
                read_hf(folder)
            assert "\n" not in str(e.value)
        finally:
            edit_config(folder, mlp_only_layers=[], decoder_sparse_step=1)
    from jllama.formats.gguf_config import config_from_metadata

    meta = {k: v for k, v in model.metadata.items()}
    meta["qwen3moe.expert_shared_count"] = 1
    with pytest.raises(CheckpointError, match="expert_shared_count=1 is not supported"):
        config_from_metadata(meta, "m.gguf")
    with pytest.raises(ConfigError, match="n_experts_per_tok=9 must be in 1..n_experts=8"):
        dataclasses.replace(model.config, n_experts_per_tok=9)


def test_fused_expert_tensors_of_transformers_5(hf_model, tmp_path):
    """A folder holding transformers 5's fused expert tensors (mlp.experts.gate_up_proj
    [E, 2 * hidden, dim], gate rows first, and mlp.experts.down_proj [E, dim, hidden]) reads
    to the same weights and logits as the per-expert tensors save_pretrained writes."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, want = hf_model
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    tensors = load_file(fused / "model.safetensors")
    for layer in range(MOE_SPEC.config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        parts = {name: np.stack([tensors.pop(f"{p}{e}.{name}.weight") for e in range(8)])
                 for name in ("gate_proj", "up_proj", "down_proj")}
        tensors[p + "gate_up_proj"] = np.concatenate([parts["gate_proj"], parts["up_proj"]], 1)
        tensors[p + "down_proj"] = parts["down_proj"]
    save_file(tensors, fused / "model.safetensors")
    model = read_hf(fused, seq_len=SEQ_LEN)
    per_expert = read_hf(folder, seq_len=SEQ_LEN)
    for name in ("w1", "w2", "w3"):
        assert np.array_equal(getattr(model.weights, name), getattr(per_expert.weights, name))
    backend = make_backend("numpy")
    backend.prepare(model.config, model.weights)
    got = np.stack([backend.forward(t, pos) for pos, t in enumerate(TOKENS[:6])])
    assert _max_diff(got, want[:6]) < 1e-4
    del tensors["model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, fused / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.experts.0."
                                              "down_proj.weight"):
        read_hf(fused, seq_len=SEQ_LEN)
