"""GGUF files: metadata to ModelConfig, tensors (dequantized) to weights, SmolLM2 against
llama.cpp, and one-line errors for bad files."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf_files import write_gguf
from test_cli import run

from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError, JllamaError
from jllama.formats import ggml_quants
from jllama.formats.gguf import read_gguf
from jllama.model.loading import open_model
from jllama.model.weights import random_weights

Q = gguf.GGMLQuantizationType
TINY = ModelConfig(
    dim=64, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, seq_len=64,
    shared_weights=False, norm_eps=1e-6, rope_theta=50000.0,
)


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(TINY, seed=3, scale=0.1)


def _fields(weights):
    return {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)
            if getattr(weights, f.name) is not None}  # a Llama has no biases, no q/k norms


@pytest.mark.parametrize("shared", [False, True])
def test_f32_file_reads_back_exactly(tmp_path, tiny_weights, shared):
    config = dataclasses.replace(TINY, shared_weights=shared)
    weights = tiny_weights
    if shared:
        weights = dataclasses.replace(weights, wcls=weights.token_embedding_table)
    path = write_gguf(tmp_path / "m.gguf", config, weights)
    model = read_gguf(path)
    # Every hyperparameter, seq_len = context_length; GGUF stores norm_eps as a float32.
    assert model.config == dataclasses.replace(config, norm_eps=float(np.float32(config.norm_eps)))
    for name, want in _fields(weights).items():
        got = getattr(model.weights, name)
        assert got.dtype == np.float32 and np.array_equal(got, want), name
    if shared:
        assert model.weights.wcls is model.weights.token_embedding_table
    assert set(model.tensor_types.values()) == {"F32"}


def test_seq_len_caps_the_context(tmp_path, tiny_weights):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_weights)
    assert read_gguf(path, seq_len=16).config.seq_len == 16
    assert read_gguf(path, seq_len=1000).config.seq_len == TINY.seq_len
    assert read_gguf(path, seq_len=16).context_length == TINY.seq_len
    with pytest.raises(ConfigError, match="seq_len"):
        read_gguf(path, seq_len=0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_equal_the_gguf_packages_dequantize(tmp_path, tiny_weights, qtype):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_weights, types={"*": qtype})
    model = read_gguf(path)
    assert model.tensor_types["blk.1.ffn_down.weight"] == qtype.name
    for name, original in _fields(tiny_weights).items():
        got = getattr(model.weights, name)
        if original.ndim == 1 or name in ("rms_att_weight", "rms_ffn_weight"):
            assert np.array_equal(got, original), name  # norms are stored as F32
            continue
        stored = gguf.quants.quantize(np.ascontiguousarray(original, np.float32), qtype)
        want = gguf.quants.dequantize(stored, qtype).reshape(original.shape)
        assert np.array_equal(got, want), name


def q8_activations_reference(monkeypatch):
    """The NumPy reference with every product's x quantized as llama.cpp quantizes it for Q8_0
    weights (tests/q8_reference.py), float64 sums: what jllama's kernels compute, from an
    independent implementation."""
    import jllama.backends.numpy_ref as numpy_ref

    from q8_reference import quantized_x

    monkeypatch.setattr(numpy_ref, "matmul", lambda w, x: (
        np.asarray(w, np.float64) @ quantized_x(np.asarray(x, np.float32), ggml_quants.Q8_0)
    ).astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_dtype_int8_keeps_q8_0_and_q4_0_exactly_as_q8_0_blocks(tmp_path, tiny_weights, qtype,
                                                                 monkeypatch):
    """--dtype=int8 holds a Q8_0/Q4_0 matrix as Q8_0 blocks: the values are the gguf package's
    dequantized ones exactly. XLA's products (grouped int8, float32 activations) give the NumPy
    reference's logits on the dequantized model; jllama's kernels (activations quantized per 32,
    as llama.cpp's Q8_0 products) give the reference's with quantized activations, and the
    prefill and the decode loop agree with them."""
    from jllama.model.ggml_matrix import GGMLMatrix, LayerStack

    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_weights, types={"*": qtype})
    wide = open_model(path, need_tokenizer=False)
    narrow = open_model(path, need_tokenizer=False, dtype="int8")
    for name, original in _fields(tiny_weights).items():
        got = getattr(narrow.weights, name)
        if name.startswith("rms_"):
            continue
        layers = got.layers if isinstance(got, LayerStack) else [got]
        assert all(isinstance(m, GGMLMatrix) and m.type_name == "Q8_0" for m in layers), name
        stored = gguf.quants.quantize(np.ascontiguousarray(original, np.float32), qtype)
        want = gguf.quants.dequantize(stored, qtype).reshape(original.shape)
        assert np.array_equal(np.asarray(got), want), name
    tokens = [5, 17, 200, 3, 9, 250]

    def reference_logits():
        reference = make_backend("numpy")
        reference.prepare(wide.config, wide.weights)
        logits = np.stack([reference.forward(t, p) for p, t in enumerate(tokens)])
        greedy, pos, token = [], len(tokens), tokens[-1]
        for _ in range(4):
            token = int(np.argmax(reference.forward(token, pos)))
            greedy.append(token)
            pos += 1
        return logits, greedy

    exact = reference_logits()
    q8_activations_reference(monkeypatch)
    quantized = reference_logits()
    for matvec, (expected, greedy) in (("xla", exact), ("kernel", quantized)):
        b = make_backend("jax", matvec=matvec)
        b.prepare(narrow.config, narrow.weights)
        got = np.stack([b.forward(t, p) for p, t in enumerate(tokens)])
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        if matvec == "xla":
            chunk = b.prefill(tokens, 0)  # the prefill programs dequantize the groups
            np.testing.assert_allclose(chunk, expected[-1], atol=1e-4, rtol=0)
        ids, _ = b.decode_loop(tokens[-1], len(tokens), 4)  # the loop's embedding rows
        assert ids == greedy
    # The activations' rounding is what the kernels' logits differ from the exact ones by.
    assert 1e-3 < np.max(np.abs(quantized[0] - exact[0])) < 0.2


def test_gguf_logits_equal_llama2c_route_on_both_backends(tmp_path, tiny_weights):
    """The same weights through a GGUF file and directly: identical logits, so the reader
    keeps the row order of attn_q/attn_k (no permutation)."""
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_weights)
    model = read_gguf(path)
    for name in ("numpy", "jax"):
        direct, via_file = make_backend(name), make_backend(name)
        direct.prepare(TINY, tiny_weights)
        via_file.prepare(model.config, model.weights)
        for pos, token in enumerate([5, 17, 200, 3]):
            assert np.array_equal(direct.forward(token, pos), via_file.forward(token, pos))


# ------------------------------------------------------------------ SmolLM2 vs llama.cpp


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return open_model(smollm2_gguf, seq_len=256)


def test_smollm2_metadata(smollm2):
    # The values the issue states for SmolLM2-135M-Instruct (from its model card / GGUF).
    c = smollm2.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads) == (576, 1536, 30, 9, 3)
    assert (c.head_dim, c.vocab_size, c.rope_theta) == (64, 49152, 100000.0)
    assert c.shared_weights and smollm2.weights.wcls is smollm2.weights.token_embedding_table
    assert abs(c.norm_eps - 1e-5) < 1e-12
    assert smollm2.context_length == 8192 and c.seq_len == 256
    assert smollm2.file_format == "gguf" and "<|im_start|>" in smollm2.chat_template
    assert smollm2.tensor_types["blk.0.attn_q.weight"] == "Q4_1"
    assert smollm2.tensor_types["token_embd.weight"] == "Q8_0"


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_smollm2_greedy_completion_matches_llama_cpp(smollm2, smollm2_oracle, backend):
    """llama.cpp on the same weights widened to F32 (f32 arithmetic), greedy raw completion.

    Free-running: the first 32 generated tokens must be llama.cpp's. Then teacher-forced over
    the rest of llama.cpp's continuation (the same backend and cache: the free run's argmaxes
    were llama.cpp's tokens): every argmax must be llama.cpp's token, or a near tie (logit
    margin under 1e-3) where f32 rounding may legitimately pick the other one.
    """
    from jllama.generation.generate import Generation
    from jllama.sampling import Sampler

    model = open_model(smollm2.source, seq_len=256, dtype="float32")  # the widened weights
    tokenizer = model.tokenizer
    for case in smollm2_oracle["greedy"]:
        prompt = tokenizer.encode(case["prompt"])
        assert prompt == case["prompt_ids"], case["prompt"]
        want = case["generated_ids"]

        b = make_backend(backend)
        b.prepare(model.config, model.weights)
        generation = Generation(
            b.forward, prompt, Sampler(temperature=0.0), len(prompt) + 31,  # 32 samples
            stop_ids=tuple(tokenizer.stop_ids),
        )
        got = [t.id for t in generation if t.sampled]
        assert got == want[:32], (case["prompt"], got, want[:32])

        # The cache holds positions 0 .. len(prompt) + 30 (the prompt and want[:31]).
        sequence = prompt + want
        for pos in range(len(prompt) + 31, len(sequence) - 1):
            logits = b.forward(sequence[pos], pos)
            expected = sequence[pos + 1]
            best = int(np.argmax(logits))
            margin = float(logits[best] - logits[expected])
            assert best == expected or margin < 1e-3, (case["prompt"], pos, best, expected, margin)
        if len(want) < 48:  # llama.cpp stopped: its next token ends the generation
            logits = b.forward(sequence[-1], len(sequence) - 1)
            assert int(np.argmax(logits)) in tokenizer.stop_ids


# ------------------------------------------------------------------ bad files


def _bad_files(tmp_path, weights):
    hidden = TINY.hidden_dim
    files = {
        "missing_key": (
            write_gguf(tmp_path / "a.gguf", TINY, weights, drop_keys=("llama.embedding_length",)),
            "llama.embedding_length",
        ),
        "wrong_shape": (
            write_gguf(
                tmp_path / "b.gguf", TINY, weights, drop_tensors=("blk.1.attn_k.weight",),
                extra_tensors={"blk.1.attn_k.weight": np.zeros((16, 64), np.float32)},
            ),
            "blk.1.attn_k.weight",
        ),
        "unsupported_type": (
            write_gguf(
                tmp_path / "c.gguf", TINY, weights, drop_tensors=("blk.0.ffn_down.weight",),
                # IQ2_XXS: 256 elements in 66 bytes per block; rows of hidden_dim=256.
                raw_tensors={
                    "blk.0.ffn_down.weight": (np.zeros((TINY.dim, 66 * hidden // 256), np.uint8), Q.IQ2_XXS)
                },
            ),
            "IQ2_XXS (type 16) is not supported",
        ),
        "missing_tensor": (
            write_gguf(tmp_path / "d.gguf", TINY, weights, drop_tensors=("blk.1.ffn_up.weight",)),
            "blk.1.ffn_up.weight",
        ),
        "unexpected_tensor": (
            write_gguf(
                tmp_path / "e.gguf", TINY, weights,
                extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)},
            ),
            "blk.0.attn_q.bias",
        ),
        "rope_scaling": (  # head_dim 16 rotates 8 pairs: 5 factors is the wrong length
            write_gguf(
                tmp_path / "f.gguf", TINY, weights,
                extra_tensors={"rope_freqs.weight": np.ones(5, np.float32)},
            ),
            "rope_freqs.weight",
        ),
        "no_tokens": (
            write_gguf(tmp_path / "g.gguf", TINY, weights, drop_keys=("tokenizer.ggml.tokens",)),
            "tokenizer.ggml.tokens",
        ),
    }
    good = write_gguf(tmp_path / "good.gguf", TINY, weights)
    data = good.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) - 1000])
    files["truncated"] = (tmp_path / "truncated.gguf", "truncated")
    (tmp_path / "header_only.gguf").write_bytes(data[:100])
    files["header_only"] = (tmp_path / "header_only.gguf", "header_only.gguf")
    (tmp_path / "not.gguf").write_bytes(b"GGML" + data[4:200])
    files["not_gguf"] = (tmp_path / "not.gguf", "not.gguf")
    return files


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_weights):
    return _bad_files(tmp_path_factory.mktemp("bad"), tiny_weights)


CASES = [
    "missing_key", "wrong_shape", "unsupported_type", "missing_tensor", "unexpected_tensor",
    "rope_scaling", "no_tokens", "truncated", "header_only", "not_gguf",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_file_raises_one_line_error(bad_files, case):
    path, needle = bad_files[case]
    with pytest.raises(JllamaError) as info:
        open_model(path)
    message = str(info.value)
    assert "\n" not in message and needle in message, message


@pytest.mark.parametrize("case", ["missing_key", "wrong_shape", "unsupported_type", "truncated"])
def test_bad_file_at_the_cli_exits_1_with_one_line(bad_files, case):
    path, needle = bad_files[case]
    result = run(f"--checkpoint={path}", "--prompt=hi", "--steps=4")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jllama: error: ") and needle in lines[0], lines
    assert "Traceback" not in result.stderr


def test_unsupported_type_names_tensor_and_type(bad_files):
    with pytest.raises(CheckpointError) as info:
        read_gguf(bad_files["unsupported_type"][0])
    assert str(info.value).startswith(
        f"{bad_files['unsupported_type'][0]}: tensor 'blk.0.ffn_down.weight': IQ2_XXS (type 16) "
        "is not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, ")


def test_linear_rope_scaling_is_read(tmp_path, tiny_weights):
    from jllama.model.config import RopeScaling
    from jllama.model.rope import rope_frequencies

    path = tmp_path / "linear.gguf"
    write_gguf(path, TINY, tiny_weights)
    # Add the two keys with the gguf writer's own API on a fresh file.
    writer_path = tmp_path / "linear2.gguf"
    import gguf as gguf_package

    reader = gguf_package.GGUFReader(str(path))
    w = gguf_package.GGUFWriter(str(writer_path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf_package.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    w.add_string("llama.rope.scaling.type", "linear")
    w.add_float32("llama.rope.scaling.factor", 4.0)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = read_gguf(writer_path).config
    assert config.rope_scaling == RopeScaling("linear", 4.0)
    plain = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
    np.testing.assert_array_equal(rope_frequencies(config), plain / np.float32(4.0))
