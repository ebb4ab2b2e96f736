"""--dtype=q4 and --dtype=int8 over GGML blocks (`jllama.model.weights.cast_weights`), against the gguf
package's quantizers and dequantizer."""

from __future__ import annotations

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as Q

from jllama.model.config import ModelConfig
from jllama.formats import ggml_quants as gq
from jllama.model.ggml_matrix import GGMLMatrix, LayerStack, quantize
from jllama.model.weights import cast_weights, random_weights, weights_dtype, weights_nbytes

from test_cli import run

CONFIG = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                     seq_len=32)


def test_q4_is_llama_cpps_q4_0_with_an_8_bit_classifier():
    weights = random_weights(CONFIG, seed=1, scale=0.1)
    q4 = cast_weights(weights, "q4")
    assert weights_dtype(q4) == "Q4_0+Q8_0"
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        got = getattr(q4, name)
        assert isinstance(got, GGMLMatrix) and got.type_name == "Q4_0", name
        want = gguf.quants.quantize(np.asarray(getattr(weights, name)), Q.Q4_0)
        assert np.array_equal(got.data, want), name
    table = q4.token_embedding_table
    assert q4.wcls is table and table.type_name == "Q8_0"  # tied, and 8-bit
    assert np.array_equal(table.data, gguf.quants.quantize(weights.token_embedding_table, Q.Q8_0))
    assert np.array_equal(q4.rms_att_weight, weights.rms_att_weight)  # norms stay float32
    # 4.5 bits a weight in the layers: an eighth of float32's bytes, and the table at 8.5
    layer_bytes = sum(getattr(q4, n).nbytes for n in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    layer_f32 = sum(getattr(weights, n).nbytes for n in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    assert layer_bytes * 32 == layer_f32 * 18 // 4
    assert weights_nbytes(q4) < weights_nbytes(weights) / 4


def test_q4_keeps_rows_that_are_not_a_multiple_of_32_and_narrow_ggml_types():
    odd = ModelConfig(dim=64, hidden_dim=72, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=40,
                      seq_len=16)
    weights = random_weights(odd, seed=2)
    q4 = cast_weights(weights, "q4")
    assert q4.w2 is weights.w2  # rows of 72: llama.cpp's fallback keeps such a tensor as it is
    assert isinstance(q4.w1, GGMLMatrix)
    rng = np.random.default_rng(3)
    k4 = GGMLMatrix(rng.integers(0, 255, (2 * 8, 144), dtype=np.uint8), gq.Q4_K, 256)
    assert cast_weights_field(k4, "q4") is k4  # 4.5 bits already: as stored
    five = GGMLMatrix(rng.integers(0, 255, (8, 22), dtype=np.uint8), gq.Q5_0, 32)
    assert cast_weights_field(five, "q4") is five  # 5.5: re-quantizing would cost too much
    eight = quantize(rng.standard_normal((8, 64)).astype(np.float32), gq.Q8_0)
    assert cast_weights_field(eight, "q4").type_name == "Q4_0"


def cast_weights_field(matrix, dtype):
    from jllama.model.weights import _cast_matrix

    return _cast_matrix(matrix, dtype)


def test_int8_on_ggml_blocks_is_q8_0_of_their_exact_values():
    rng = np.random.default_rng(4)
    f = rng.standard_normal((16, 256)).astype(np.float32)
    k4 = GGMLMatrix(gguf.quants.quantize(f, Q.Q4_0), gq.Q4_0, 256)
    six = rng.integers(0, 255, (16, 210), dtype=np.uint8)
    six[:, 208:210] = np.array([0.01], np.float16).view(np.uint8)
    k6 = GGMLMatrix(six, gq.Q6_K, 256)
    stack = cast_weights_field(LayerStack((k4, k6)), "int8")
    assert [m.type_name for m in stack.layers] == ["Q8_0", "Q8_0"]
    assert np.array_equal(np.asarray(stack.layers[0]), np.asarray(k4))  # Q4_0 -> Q8_0 exactly
    want = gguf.quants.quantize(gguf.quants.dequantize(six, Q.Q6_K).reshape(16, 256), Q.Q8_0)
    assert np.array_equal(stack.layers[1].data, want)


def test_non_finite_weights_are_one_line_naming_the_field():
    import pytest

    from jllama.errors import CheckpointError

    weights = random_weights(CONFIG, seed=5)
    weights.w2[1, 3, 7] = np.nan
    for dtype in ("q4", "int8"):
        with pytest.raises(CheckpointError, match=r"weights\.w2 cannot be held as "):
            cast_weights(weights, dtype)


def test_cli_runs_q4():
    result = run("--dtype=q4", "--steps=24", "--temperature=0")
    assert result.returncode == 0, result.stderr
    assert "Q4_0" in result.stderr and result.stdout.startswith("Once upon a time")


def test_backends_that_dequantize_say_what_they_hold():
    """The numpy backend and XLA's products compute with dequantized weights: the note gives
    float32's bytes (counted by hand: every weight 4 bytes, the tied table once) or, for XLA,
    Q8_0 as int8 plus a float32 scale per 32 weights."""
    from jllama.backends.jax_graph import JaxGraphBackend
    from jllama.backends.numpy_ref import NumpyBackend

    c = ModelConfig(dim=256, hidden_dim=512, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=4096,
                    seq_len=16)  # the table is 1 MB of 2.2 at 8 bits: counted twice would show
    weights = random_weights(c, seed=4, scale=0.1)
    q8 = cast_weights(cast_weights(weights, "q4"), "int8")
    assert weights_dtype(q8) == "Q8_0"
    matrices = c.n_layers * (c.dim * c.dim * 2 + 2 * c.dim * (c.dim * c.n_kv_heads // c.n_heads)
                             + 3 * c.dim * c.hidden_dim) + c.vocab_size * c.dim
    norms = (2 * c.n_layers + 1) * c.dim
    numpy = NumpyBackend()
    numpy.prepare(c, q8)
    assert numpy.weights_note.endswith(f"float32: weights {(matrices + norms) * 4 / 1e6:.1f} MB")
    xla = JaxGraphBackend(matvec="xla")
    xla.prepare(c, q8)
    assert "grouped int8" in xla.weights_note
    want = matrices + matrices // 32 * 4 + norms * 4
    assert xla.weights_note.endswith(f"weights {want / 1e6:.1f} MB"), xla.weights_note
    plain = NumpyBackend()
    plain.prepare(c, weights)
    assert plain.weights_note == ""
