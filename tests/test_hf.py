"""Hugging Face Llama folders: tiny random models written by transformers, read by
`jllama.formats.hf`, run on both backends and checked against transformers'
`LlamaForCausalLM` (the oracle): logits, greedy continuations, RoPE frequencies; plus the
reader's dtypes against the safetensors package and one-line errors for bad folders."""

from __future__ import annotations

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from hf_models import Spec, build, edit_config, hf_greedy, hf_logits, save

from jllama import Generation, Sampler
from jllama.backends import make_backend
from jllama.model.config import RopeScaling
from jllama.errors import CheckpointError, ConfigError, JllamaError
from jllama.formats import hf
from jllama.formats.hf import config_from_hf, is_hf_folder, read_chat_template, read_hf
from jllama.model.rope import rope_frequencies

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SPECS = {
    # Llama 2 style: multi-head attention, untied classifier, plain RoPE, one f32 file.
    "llama2": Spec("llama2", {
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 300,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
    }, seed=1),
    # Llama 3.1 style: GQA 4:1, head_dim 16 != 64 / 8, llama3 RoPE scaling from position 16,
    # sharded into several files with an index.
    "llama3.1-sharded": Spec("llama3.1-sharded", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
        "max_position_embeddings": 64, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    }, seed=2, max_shard_size="200KB"),
    # Llama 3.2 style: tied embeddings, GQA 3:1, llama3 scaling (factor 32), saved as bf16.
    "llama3.2-bf16": Spec("llama3.2-bf16", {
        "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 64, "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    }, seed=3, save_dtype="bfloat16"),
}
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, 300, size=48)]
PROMPT, N_GREEDY = TOKENS[:8], 32
SEQ_LEN = 64


@dataclasses.dataclass(frozen=True)
class Case:
    spec: Spec
    folder: object
    model: object  # the transformers model, float32 (bf16-rounded weights for a bf16 file)
    logits: np.ndarray  # f32[48, vocab] for TOKENS
    greedy: list[int]
    greedy_gap: float  # smallest top-1 minus top-2 logit over the greedy steps


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (spec, folder, model): every model built and saved once."""
    out = {}
    for name, spec in SPECS.items():
        model = build(spec)
        out[name] = (spec, save(model, spec, tmp_path_factory.mktemp(name)), model)
    return out


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, folders):
    spec, folder, model = folders[request.param]
    greedy, gap = hf_greedy(model, PROMPT, N_GREEDY)
    return Case(spec, folder, model, hf_logits(model, TOKENS), greedy, gap)


@pytest.fixture(scope="module", params=["numpy", "jax"])
def backend_name(request):
    return request.param


@pytest.fixture(scope="module")
def jllama_run(case, backend_name):
    """(logits f32[48, vocab], greedy ids) from jllama on one backend."""
    model = read_hf(case.folder, seq_len=SEQ_LEN, dtype="float32")
    backend = make_backend(backend_name)
    backend.prepare(model.config, model.weights)
    logits = np.stack([backend.forward(t, pos) for pos, t in enumerate(TOKENS)])
    gen = Generation(
        backend.forward, PROMPT, Sampler(temperature=0.0), steps=len(PROMPT) - 1 + N_GREEDY,
        stop_ids=(),
    )
    list(gen)
    return logits, gen.generated_ids


def test_logits_match_transformers(case, jllama_run, backend_name):
    logits, _ = jllama_run
    diff = float(np.abs(logits - case.logits).max())
    assert diff < 1e-4, f"{case.spec.name} on {backend_name}: max |logit diff| {diff:.3g}"


def test_greedy_continuation_matches_transformers(case, jllama_run):
    _, greedy = jllama_run
    assert case.greedy_gap > 1e-3  # the oracle's choices are not near-ties
    assert greedy == case.greedy


def test_config_read_from_folder(folders):
    _, folder, _ = folders["llama3.1-sharded"]
    model = read_hf(folder, dtype="float32")
    c = model.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        64, 128, 3, 8, 2, 16
    )
    assert (c.vocab_size, c.seq_len, c.shared_weights) == (300, 64, False)
    assert (c.rope_theta, c.norm_eps) == (500000.0, 1e-5)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert model.context_length == 64 and model.tokenizer is None and model.source == str(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # the index really was used
    assert read_hf(folder, seq_len=16).config.seq_len == 16
    assert read_hf(folder, seq_len=16).context_length == 64
    assert read_hf(folder, seq_len=1000).config.seq_len == 64
    with pytest.raises(ConfigError, match="seq_len"):
        read_hf(folder, seq_len=0)
    assert is_hf_folder(folder) and not is_hf_folder(folder / "config.json")
    assert not is_hf_folder(folder.parent / "nowhere")


def test_plain_and_tied_models(folders):
    _, folder, _ = folders["llama2"]
    c = read_hf(folder).config
    assert c.rope_scaling is None and c.rope_theta == 10000.0 and c.head_dim == 16
    assert not c.shared_weights
    _, folder, _ = folders["llama3.2-bf16"]
    model = read_hf(folder)
    assert "lm_head.weight" not in model.dtypes  # transformers does not store a tied head
    assert model.config.shared_weights
    assert model.weights.wcls is model.weights.token_embedding_table


def _torch_tensors(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(path))
    return out


@pytest.mark.parametrize("name", ["llama2", "llama3.1-sharded"])
def test_reader_equals_safetensors_package(folders, name):
    """Every tensor as the safetensors package reads it, q/k rows permuted per head."""
    _, folder, _ = folders[name]
    model = read_hf(folder)
    c, w = model.config, model.weights
    tensors = {k: v.numpy() for k, v in _torch_tensors(folder).items()}
    assert set(model.dtypes) == set(tensors) and set(model.dtypes.values()) == {"F32"}
    half = c.head_dim // 2
    for layer in range(c.n_layers):
        p = f"model.layers.{layer}."
        for field, hf_name, heads in [("wq", "q_proj", c.n_heads), ("wk", "k_proj", c.n_kv_heads)]:
            stored = tensors[p + f"self_attn.{hf_name}.weight"].reshape(heads, c.head_dim, c.dim)
            got = getattr(w, field)[layer].reshape(heads, c.head_dim, c.dim)
            assert np.array_equal(got[:, 0::2], stored[:, :half]), (field, layer)
            assert np.array_equal(got[:, 1::2], stored[:, half:]), (field, layer)
        for field, hf_name in [
            ("wv", "self_attn.v_proj"), ("wo", "self_attn.o_proj"), ("w1", "mlp.gate_proj"),
            ("w2", "mlp.down_proj"), ("w3", "mlp.up_proj"), ("rms_att_weight", "input_layernorm"),
            ("rms_ffn_weight", "post_attention_layernorm"),
        ]:
            assert np.array_equal(getattr(w, field)[layer], tensors[p + hf_name + ".weight"])
    assert np.array_equal(w.token_embedding_table, tensors["model.embed_tokens.weight"])
    assert np.array_equal(w.wcls, tensors["lm_head.weight"])
    assert np.array_equal(w.rms_final_weight, tensors["model.norm.weight"])
    assert all(getattr(w, f.name).dtype == np.float32 for f in dataclasses.fields(w)
               if getattr(w, f.name) is not None)  # a Llama has no biases, no q/k norms


def test_dtypes(folders):
    bf16 = np.dtype(ml_dtypes.bfloat16)
    _, folder, _ = folders["llama3.2-bf16"]
    stored = _torch_tensors(folder)
    kept = read_hf(folder)  # dtype None: an all-BF16 file stays bf16
    assert set(kept.dtypes.values()) == {"BF16"}
    w = kept.weights
    assert w.w2.dtype == bf16 and w.token_embedding_table.dtype == bf16
    assert w.rms_att_weight.dtype == np.float32 and w.rms_final_weight.dtype == np.float32
    down = stored["model.layers.1.mlp.down_proj.weight"].view(torch.int16).numpy()
    assert np.array_equal(w.w2[1].view(np.int16), down)  # bit for bit
    wide = read_hf(folder, dtype="float32").weights
    assert wide.w2.dtype == np.float32 and np.array_equal(wide.w2, w.w2.astype(np.float32))

    _, folder, _ = folders["llama2"]
    assert read_hf(folder).weights.wq.dtype == np.float32  # dtype None: an F32 file stays f32
    narrow = read_hf(folder, dtype="bfloat16").weights
    assert narrow.wv.dtype == bf16 and narrow.rms_ffn_weight.dtype == np.float32
    v = _torch_tensors(folder)["model.layers.0.self_attn.v_proj.weight"]
    rounded = v.to(torch.bfloat16).view(torch.int16).numpy()  # torch rounds to nearest even
    assert np.array_equal(narrow.wv[0].view(np.int16), rounded)
    assert read_hf(folder, dtype=ml_dtypes.bfloat16).weights.wv.dtype == bf16
    with pytest.raises(ConfigError, match="float16"):
        read_hf(folder, dtype="float16")


def test_f16_and_mixed_files_widen_to_f32(folders, tmp_path):
    _, folder, _ = folders["llama2"]
    shutil.copytree(folder, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    up = "model.layers.0.mlp.up_proj.weight"
    tensors[up] = tensors[up].half()
    tensors["lm_head.weight"] = tensors["lm_head.weight"].bfloat16()
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    model = read_hf(tmp_path / "m")
    assert model.dtypes[up] == "F16"
    assert model.weights.w3.dtype == np.float32 and model.weights.wcls.dtype == np.float32
    want = tensors[up].float().numpy()
    assert np.array_equal(model.weights.w3[0], want)


def test_without_the_permutation_logits_differ(folders, monkeypatch):
    """The control for the logit tests: HF rows taken as stored give clearly other logits."""
    _, folder, model = folders["llama2"]
    monkeypatch.setattr(hf, "rope_row_permutation", lambda n, d: np.arange(n * d))
    m = read_hf(folder, seq_len=SEQ_LEN, dtype="float32")
    backend = make_backend("numpy")
    backend.prepare(m.config, m.weights)
    logits = np.stack([backend.forward(t, pos) for pos, t in enumerate(TOKENS)])
    assert np.abs(logits - hf_logits(model, TOKENS)).max() > 1e-2


def _transformers_inv_freq(config_kwargs):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(**config_kwargs)
    return hf_config, LlamaRotaryEmbedding(config=hf_config).inv_freq.numpy()


ROPE_CASES = {
    # Llama 3.1 8B's own settings: all three llama3 bands (kept, blended, divided).
    "llama3.1-8b": {
        "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    },
    "llama3-tiny": dict(SPECS["llama3.1-sharded"].config),
    "linear": {
        "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "default": {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_frequencies_match_transformers(name):
    hf_config, want = _transformers_inv_freq(ROPE_CASES[name])
    config = config_from_hf(hf_config.to_dict(), name)
    got = rope_frequencies(config)
    assert got.dtype == np.float32 and got.shape == want.shape
    # Bit for bit: an ulp of inv_freq[i] is pos ulps of the angle (at 32K, 2e-3 rad for the
    # fast pairs). NumPy's float32 power missed 13 of the 8B's 64 pairs by an ulp.
    np.testing.assert_array_equal(got, want)


def test_transformers_4_and_5_config_layouts_agree():
    base = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 300, "max_position_embeddings": 4096,
    }
    v4 = {**base, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    v5 = {**base, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4096, "rope_theta": 500000.0}}
    a, b = config_from_hf(v4, "v4"), config_from_hf(v5, "v5")
    assert a == b and a.rope_theta == 500000.0
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers
    assert a.rope_scaling.original_max_position_embeddings == 4096
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 1e6}}, "v5")
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    assert config_from_hf(base, "bare").rope_theta == 10000.0
    assert config_from_hf(base, "bare").norm_eps == 1e-6


_BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
}


@pytest.mark.parametrize("changes, error, match", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, CheckpointError,
     "config.json rope_scaling has no 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, ConfigError,
     "factor=-2.0 must be positive"),
    ({"rope_scaling": {"rope_type": "longrope"}}, CheckpointError, "type 'longrope'"),
    ({"partial_rotary_factor": 0.5}, CheckpointError, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, CheckpointError,
     "per-layer-type rope_parameters"),
    ({"mlp_bias": True}, CheckpointError, "mlp_bias=true is not supported"),
    ({"hidden_size": None}, CheckpointError, "config.json has no 'hidden_size'"),
    ({"num_hidden_layers": "2"}, CheckpointError, "'num_hidden_layers' is '2', not an int"),
    ({"num_attention_heads": 5}, ConfigError, "not a multiple of n_heads=5"),
    ({"architectures": None, "model_type": None}, CheckpointError, "names no architecture"),
])
def test_config_errors_are_one_line(changes, error, match):
    cfg = {k: v for k, v in {**_BASE, **changes}.items() if v is not None}
    with pytest.raises(error, match=match) as info:
        config_from_hf(cfg, "m")
    assert str(info.value).startswith("m: ") and "\n" not in str(info.value)


def test_chat_template(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert read_chat_template(tmp_path) == "{{ x }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default",
                                                                  "template": "d"}]}))
    assert read_chat_template(tmp_path) == "d"
    (tmp_path / "chat_template.jinja").write_text("{{ y }}")
    assert read_chat_template(tmp_path) == "{{ y }}"


# ---- errors: one line each, naming what is wrong ----

def _resave(folder, change):
    """Load model.safetensors with the safetensors package, `change(tensors)`, save it back."""
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def _truncate(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _drop_second_shard(folder):
    sorted(folder.glob("model-0*.safetensors"))[1].unlink()


_UP1 = "model.layers.1.mlp.up_proj.weight"
# name: (model copied, damage(folder), regex the one-line CheckpointError must match)
ERRORS = {
    "missing shard": (
        "llama3.1-sharded", _drop_second_shard,
        r"shard model-00002-of-0\d+\.safetensors \(named by .*index\.json\) is missing",
    ),
    "yarn": (
        "llama2",
        lambda f: edit_config(f, rope_parameters=None, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        "rope_scaling type 'yarn' is not supported",
    ),
    "dynamic": (
        "llama2",
        lambda f: edit_config(f, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "rope_scaling type 'dynamic' is not supported",
    ),
    "wrong shape": (
        "llama2", lambda f: _resave(f, lambda t: t.update({_UP1: t[_UP1][:100]})),
        r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \[100, 64\], expected \[160, 64\]",
    ),
    "bias tensor": (
        "llama2",
        lambda f: _resave(f, lambda t: t.update({
            "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
        "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'",
    ),
    "attention_bias": (
        "llama2", lambda f: edit_config(f, attention_bias=True),
        "attention_bias=true is not supported",
    ),
    "missing tensor": (
        "llama2",
        lambda f: _resave(f, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight")),
        "missing tensor model.layers.1.post_attention_layernorm.weight",
    ),
    "f64 tensor": (
        "llama2",
        lambda f: _resave(f, lambda t: t.update({
            "model.norm.weight": t["model.norm.weight"].double()})),
        "tensor 'model.norm.weight' has dtype F64, not supported",
    ),
    "not llama": (
        "llama2", lambda f: edit_config(f, architectures=["Gemma3ForCausalLM"]),
        "architecture Gemma3ForCausalLM is not supported",
    ),
    "model_type": (
        "llama2", lambda f: edit_config(f, model_type="gemma"),
        "model_type 'gemma' is not supported",
    ),
    "gelu": (
        "llama2", lambda f: edit_config(f, hidden_act="gelu"),
        "hidden_act 'gelu' is not supported",
    ),
    "truncated": ("llama2", _truncate, "run outside the .* data bytes"),
    "no weights": (
        "llama2", lambda f: (f / "model.safetensors").unlink(),
        "no model.safetensors or model.safetensors.index.json",
    ),
    "no config": (
        "llama2", lambda f: (f / "config.json").unlink(), "not a model folder: no config.json",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_are_one_line(folders, tmp_path, name):
    model_name, damage, match = ERRORS[name]
    folder = tmp_path / "m"
    shutil.copytree(folders[model_name][1], folder)
    damage(folder)
    with pytest.raises(JllamaError, match=match) as info:
        read_hf(folder)
    assert isinstance(info.value, CheckpointError)
    assert "\n" not in str(info.value)
