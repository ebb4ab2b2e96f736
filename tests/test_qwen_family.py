"""Qwen2.5 (q/k/v biases), Qwen3 dense (per-head q/k RMSNorm, head_dim of its own) and Mistral
(a sliding window) through both readers and both backends, issue 36 (dense families):

  - Hugging Face folders of tiny random models written by transformers' `Qwen2ForCausalLM`,
    `Qwen3ForCausalLM` and `MistralForCausalLM` (`tests/qwen_models.py`), with a cut of Qwen's
    real tokenizer and the models' chat templates: logits of every position against
    transformers (the oracle, run here) within 1e-4 on the numpy and jax backends, decoded one
    token at a time and prefilled in chunks;
  - the same models converted by llama.cpp's own convert_hf_to_gguf.py
    (tests/data/qwen_tiny/, made by tests/data/make_qwen_tiny.py: architectures qwen2, qwen3,
    and llama for Mistral): the GGUF's logits against transformers' (oracle.npz, checked here
    to be the live model's) on both backends, as stored and dequantized; the batched step,
    the speculative verification step and the fused / loop decode modes on the kernels;
  - Qwen's tokenizer.json read by jllama against the `tokenizers` library, and the GGUF's
    vocabulary against it; a chat turn through Qwen3's template;
  - one-line refusals: other architectures, Qwen3 with attention_bias; Mistral's sliding
    window caps the default context (past it: tests/test_sliding_window.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest
from hf_models import build, edit_config, hf_logits, save
from qwen_models import DATA, GGUF_ARCH, SPECS, TOKENS, gguf_path, tokenizer_files

from jllama.backends import make_backend
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.gguf import read_gguf
from jllama.formats.hf import read_hf
from jllama.model.config import ModelConfig
from jllama.model.loading import open_model

ORACLE = np.load(DATA / "oracle.npz")
SEQ_LEN = 64


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (folder, transformers' logits for TOKENS computed now)."""
    out = {}
    for name, spec in SPECS.items():
        model = build(spec)
        folder = save(model, spec, tmp_path_factory.mktemp(name))
        tokenizer_files(folder, name)
        out[name] = (folder, hf_logits(model, TOKENS))
    return out


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """name -> the converted F32 GGUF, unpacked."""
    out = {}
    for name in SPECS:
        path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
        path.write_bytes(gzip.decompress(gguf_path(name).read_bytes()))
        out[name] = path
    return out


def _decoded(backend, config, weights) -> np.ndarray:
    backend.prepare(config, weights)
    return np.stack([backend.forward(t, pos) for pos, t in enumerate(TOKENS)])


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("name", list(SPECS))
def test_oracle_is_the_live_transformers_model(hf_models, name):
    # The GGUF files were converted from the models built here (same seeds): their oracle
    # logits are transformers' on this machine too.
    assert _max_diff(hf_models[name][1], ORACLE[name]) < 1e-5
    assert list(ORACLE["tokens"]) == TOKENS


@pytest.mark.parametrize("backend_name", ["numpy", "jax"])
@pytest.mark.parametrize("name", list(SPECS))
def test_hf_folder_logits_match_transformers(hf_models, name, backend_name):
    folder, want = hf_models[name]
    model = open_model(folder, seq_len=SEQ_LEN)
    c = model.config
    assert (c.qkv_bias, c.qk_norm) == (name == "qwen2", name == "qwen3")
    assert c.head_dim == (32 if name == "qwen3" else 16)
    assert c.sliding_window == (4096 if name == "mistral" else 0)
    got = _decoded(make_backend(backend_name), c, model.weights)
    assert _max_diff(got, want) < 1e-4, name
    if backend_name == "jax":  # the prefill programs: chunks of the prompt at once
        backend = make_backend("jax")
        backend.prepare(c, model.weights)
        assert _max_diff(backend.prefill_logits(TOKENS, 0), want) < 1e-4


@pytest.mark.parametrize("backend_name", ["numpy", "jax"])
@pytest.mark.parametrize("name", list(SPECS))
def test_gguf_logits_match_transformers(gguf_files, name, backend_name):
    model = read_gguf(gguf_files[name], seq_len=SEQ_LEN)
    assert model.metadata["general.architecture"] == GGUF_ARCH[name]
    assert model.tokenizer.pre == "qwen2"
    c = model.config
    assert (c.qkv_bias, c.qk_norm, c.head_dim) == (
        name == "qwen2", name == "qwen3", 32 if name == "qwen3" else 16)
    got = _decoded(make_backend(backend_name), c, model.weights)
    assert _max_diff(got, ORACLE[name]) < 1e-4, name


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gguf_stored_weights_on_every_decode_path(gguf_files, name):
    """The weights as the file stores them (the kernels' path, rows permuted for RoPE as
    blocks), through the graph, fused and loop decode modes, the batched step and the
    speculative verification step."""
    model = read_gguf(gguf_files[name], seq_len=SEQ_LEN, stored=True)
    want = ORACLE[name]
    for decode in ("graph", "fused"):
        got = _decoded(make_backend("jax", decode=decode), model.config, model.weights)
        assert _max_diff(got, want) < 1e-4, decode
    backend = make_backend("jax", decode="loop")
    backend.prepare(model.config, model.weights)
    greedy_want = [int(np.argmax(row)) for row in want]
    prompt = TOKENS[:8]
    backend.prefill(prompt[:-1], 0)
    ids, finite = backend.decode_loop(prompt[-1], len(prompt) - 1, 1)
    assert finite and ids == [greedy_want[len(prompt) - 1]]

    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    assert backend.batch_kernels()
    caches = [backend.new_caches() for _ in range(3)]
    starts = [0, 5, 9]  # three sequences, each TOKENS from its own offset
    for step in range(6):
        rows = backend.decode_batch([TOKENS[s + step] for s in starts], [step] * 3, caches)
        for b, s in enumerate(starts):
            ref = _decoded_from(model, TOKENS[s:s + step + 1])
            assert _max_diff(rows[b], ref) < 1e-4
    backend.use_caches(backend.new_caches())
    got = backend.verify(TOKENS[:8], 0)
    assert _max_diff(got, want[:8]) < 1e-4


_REFERENCE: dict = {}


def _decoded_from(model, tokens) -> np.ndarray:
    """The numpy backend's logits after `tokens` (fed from position 0)."""
    key = (id(model), tuple(tokens))
    if key not in _REFERENCE:
        backend = make_backend("numpy")
        backend.prepare(model.config, model.weights)
        for pos, t in enumerate(tokens):
            logits = backend.forward(t, pos)
        _REFERENCE[key] = logits
    return _REFERENCE[key]


def test_tokenizer_json_and_gguf_vocabulary_tokenize_as_qwen(hf_models, gguf_files):
    from tokenizers import Tokenizer

    folder = hf_models["qwen3"][0]
    ours = open_model(folder, seq_len=SEQ_LEN).tokenizer
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    from_gguf = read_gguf(gguf_files["qwen3"], seq_len=SEQ_LEN).tokenizer
    assert ours.pre == from_gguf.pre == "qwen2" and not ours.add_bos
    texts = ["Hello world, it's 2026!", "  spaces\n\nand lines\r\n", "naïve café 12345",
             "<|im_start|>user\nhi<|im_end|>", "don't WON'T 'll"]
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, bos=False, parse_special=True) == want, text
        assert from_gguf.encode(text, bos=False, parse_special=True) == want, text
        assert ours.decode(want, special=True) == text
    # NFC: a decomposed "é" is composed first, as Qwen's normalizer does.
    assert ours.encode("cafe\u0301", bos=False) == theirs.encode("cafe\u0301").ids
    im_end = ours.encode("<|im_end|>", bos=False, parse_special=True)
    assert len(im_end) == 1 and im_end[0] in ours.stop_ids


def test_qwen3_chat_turn_through_its_template(hf_models):
    from jllama.chat import ChatTemplate
    from jllama.generation.conversation import Conversation
    from jllama.generation.session import Session
    from jllama.sampling import Sampler

    model = open_model(hf_models["qwen3"][0], seq_len=SEQ_LEN)
    assert "<think>" in model.chat_template
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    session = Session(model, backend, prefill="token", compile_ahead=False)
    chat = Conversation(session, ChatTemplate.for_tokenizer(model.chat_template, model.tokenizer))
    replies = list(chat.say("Hi", Sampler(temperature=0.0), max_tokens=3))
    assert len(replies) <= 3
    prompt = model.tokenizer.decode(chat.last.prompt_ids, special=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- refusals


def test_other_architectures_are_refused_in_one_line(hf_models, gguf_files, tmp_path):
    folder = hf_models["qwen2"][0]
    edit_config(folder, architectures=["Gemma3ForCausalLM"], model_type=None)
    try:
        with pytest.raises(CheckpointError, match="architecture Gemma3ForCausalLM is not "
                                                  "supported") as e:
            read_hf(folder)
        assert "\n" not in str(e.value)
    finally:
        edit_config(folder, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    from jllama.formats.gguf_config import config_from_metadata

    for arch in ("gemma3", "phi3", "qwen2moe"):
        with pytest.raises(CheckpointError, match=f"architecture '{arch}' is not supported"):
            config_from_metadata({"general.architecture": arch}, "m.gguf")


def test_qwen3_attention_bias_and_foreign_tensors_refused(hf_models):
    folder = hf_models["qwen3"][0]
    edit_config(folder, attention_bias=True)
    try:
        with pytest.raises(CheckpointError, match="attention_bias=true is not supported"):
            read_hf(folder)
    finally:
        edit_config(folder, attention_bias=False)
    # A Qwen2 folder's biases are not part of a Llama model: named, not dropped.
    qwen2 = hf_models["qwen2"][0]
    edit_config(qwen2, architectures=["LlamaForCausalLM"], model_type="llama")
    try:
        with pytest.raises(CheckpointError, match="unexpected tensor .*bias"):
            read_hf(qwen2)
    finally:
        edit_config(qwen2, architectures=["Qwen2ForCausalLM"], model_type="qwen2")


def test_sliding_window_caps_the_default_context(hf_models):
    folder = hf_models["mistral"][0]
    cfg = json.loads((folder / "config.json").read_text())
    edit_config(folder, sliding_window=32)
    try:
        model = read_hf(folder)
        assert (model.config.seq_len, model.config.sliding_window) == (32, 32)
        assert model.context_length == cfg["max_position_embeddings"]
    finally:
        edit_config(folder, sliding_window=cfg["sliding_window"])
    # Qwen's sliding window counts only where use_sliding_window (or layer_types) says so.
    qwen = hf_models["qwen2"][0]
    edit_config(qwen, sliding_window=16, use_sliding_window=False, layer_types=None)
    try:
        assert read_hf(qwen).config.sliding_window == 0
    finally:
        edit_config(qwen, sliding_window=None)
    config = read_hf(folder, seq_len=SEQ_LEN).config
    # A longer context asked for is masked where a backend can (tests/test_sliding_window.py).
    assert dataclasses.replace(config, seq_len=4097).sliding_window == 4096
    with pytest.raises(ConfigError, match="qk_norm must be True or False"):
        ModelConfig(64, 96, 1, 4, 2, 32, 16, qk_norm=1)


_SPLIT = """
import json
import numpy as np
from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.model.weights import random_weights
# Both additions in one model (no family has both): q/k/v biases and q/k norms, head_dim 32.
config = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                     seq_len=32, head_dim=32, qkv_bias=True, qk_norm=True)
weights = random_weights(config, seed=5, scale=0.3)
tokens = [int(t) for t in np.random.default_rng(5).integers(0, 64, size=20)]
ref = make_backend("numpy")
ref.prepare(config, weights)
want = np.stack([ref.forward(t, p) for p, t in enumerate(tokens)])
split = make_backend("jax", devices=2)
split.prepare(config, weights)
# 20 tokens: two prefill chunks of 8 (qkv_chunk), then 4 through forward (qkv).
print(json.dumps(float(np.abs(split.prefill_logits(tokens, 0) - want).max())))
"""


def test_tensor_parallel_over_two_devices():
    """wqkv's rows regrouped by device carry the bias with them; the q/k norms run on each
    device's heads (two forced host devices, in a process of their own), against the numpy
    reference."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _SPLIT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) < 1e-4


LLAMA_CPP = json.loads((DATA / "llamacpp.json").read_text(encoding="utf-8"))


GREEDY_FILES = [f"{name}-tiny-{kind}" for name in ("qwen2", "qwen3")
                for kind in ("F32", "Q8_0", "Q4_K_M")] + ["qwen3-256-Q4_K_M"]


@pytest.mark.parametrize("stem", GREEDY_FILES)
def test_greedy_text_equals_llama_cpps(gguf_files, stem):
    """llama.cpp's llama-simple (greedy) on the F32 files and on llama-quantize's Q8_0 and
    Q4_K_M files (tests/data/qwen_tiny/llamacpp.json; the tiny models' rows are too short for
    K-quants, so their Q4_K_M holds Q5_0 and Q8_0 blocks; qwen3-256's rows of 256 take Q4_K
    and Q6_K), against jllama's argmax decoding of the weights as stored: the same 32 tokens'
    text."""
    name, kind = stem.split("-")[0], stem.rsplit("-", 1)[-1]
    path = gguf_files[name] if kind == "F32" else DATA / f"{stem}.gguf"
    model = open_model(path, seq_len=SEQ_LEN)
    types = set(model.tensor_types.values())
    if stem == "qwen3-256-Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= types
    elif kind != "F32":
        assert {"Q8_0"} <= types <= {"F32", "Q8_0", "Q5_0"}
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    tok = model.tokenizer
    ids = tok.encode(LLAMA_CPP["prompt"])  # no BOS: Qwen adds none
    for pos, t in enumerate(ids):
        logits = backend.forward(t, pos)
    out = []
    for i in range(LLAMA_CPP["n_predict"]):
        out.append(int(np.argmax(logits)))
        if out[-1] in tok.stop_ids:
            break
        logits = backend.forward(out[-1], len(ids) + i)
    want = bytes.fromhex(LLAMA_CPP["stdout_hex"][stem])
    text = LLAMA_CPP["prompt"].encode() + tok.decode(out).encode("utf-8", "surrogateescape")
    assert text + b"\n" == want


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_templates_render_as_transformers_with_tools(hf_models, name):
    """Qwen2.5's and Qwen3's templates (tools, a tool call and its result, Qwen3's
    enable_thinking) rendered by jllama's sandbox as transformers' apply_chat_template, and
    tokenized to transformers' ids."""
    from transformers import AutoTokenizer

    from jllama.chat import ChatTemplate

    folder = hf_models[name][0]
    model = open_model(folder, seq_len=SEQ_LEN)
    ours = ChatTemplate.for_tokenizer(model.chat_template, model.tokenizer)
    theirs = AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    variants = [{}, {"enable_thinking": False}] if name == "qwen3" else [{}]
    for extra in variants:
        want = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True, **extra)
        got = ours.render(messages, tools=TOOLS, add_generation_prompt=True, **extra)
        assert got == want, extra
        ids = model.tokenizer.encode(got, bos=False, parse_special=True)
        assert ids == theirs(want, add_special_tokens=False)["input_ids"]
    assert got.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if name == "qwen3"
                                                     else ""))


def test_llama2c_files_cannot_hold_the_qwen_additions(tmp_path):
    from jllama.formats.llama2c_writer import write_checkpoint
    from jllama.model.weights import random_weights

    for extra in ({"qkv_bias": True}, {"qk_norm": True}):
        config = ModelConfig(64, 96, 1, 4, 2, 32, 16, **extra)
        name = next(iter(extra))
        with pytest.raises(ConfigError, match=f"{name}=True: a llama2.c version-1 file has no "
                                              "place"):
            write_checkpoint(tmp_path / "m.bin", config, random_weights(config), version=1,
                             force=True)
