"""KV cache types (issue 32): f32, f16, bf16, q8_0 blocks (`jllama.model.cache_types`, the XLA
programs' `jllama.graphs.cache_rows`) against independent references: gguf-py's Q8_0 quantizer
and dequantizer (llama.cpp's own Python package), values worked out by hand with llama.cpp's
rule, NumPy's and ml_dtypes' float16 / bfloat16 casts. And the plumbing: "auto" by file format,
errors naming their flags (library and command line), the memory line and check.
(tests/test_cache_types_backends.py runs the backends on each type.)
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jllama.model import cache_types
from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.errors import ConfigError
from jllama.graphs import cache_rows
from jllama.graphs.attention import write_positions
from jllama.model.weights import random_weights


# -- block formats --------------------------------------------------------------------------

def _rows(seed, shape=(3, 5, 64), scale=3.0):
    rows = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    # gguf-py follows ggml's reference quantizer (x * (1 / d), halves away from zero), the KV
    # cache llama.cpp's CPU quantizer (x * (127 / amax), halves to even): equal away from
    # halves, which these random values keep clear of.
    groups = rows.reshape(-1, 32)
    scaled = groups * (127 / np.abs(groups).max(-1, keepdims=True))
    assert np.abs(np.abs(scaled - np.floor(scaled)) - 0.5).min() > 1e-4
    return rows


def _q8_0_by_hand():
    """One block worked with llama.cpp's rule: amax 127, so d = 1.0 (float16 0x3C00) and
    q = round-half-even(x): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2, -3.5 -> -4, 3.2 -> 3."""
    x = np.zeros(32, np.float32)
    x[:7] = [127, 0.5, 1.5, 2.5, -2.5, -3.5, 3.2]
    q = np.zeros(32, np.int8)
    q[:7] = [127, 0, 2, 2, -2, -4, 3]
    return x, bytes([0x00, 0x3C]) + q.tobytes()


def test_q8_0_by_hand():
    x, want = _q8_0_by_hand()
    assert cache_types.quantize_q8_0(x).tobytes() == want
    assert np.asarray(jax.jit(cache_rows.quantize_q8_0)(x)).tobytes() == want
    # gguf-py rounds the halves away from zero instead: 0.5 -> 1, 2.5 -> 3, -2.5 -> -3.
    assert list(gguf.quants.quantize(x[None], gguf.GGMLQuantizationType.Q8_0)[0, 2:6].view(
        np.int8)) == [127, 1, 2, 3]
    zeros = np.zeros(32, np.float32)  # amax 0: d = 0, q = 0
    assert cache_types.quantize_q8_0(zeros).tobytes() == bytes(34)


def test_q8_0_write_of_the_xla_path_is_gguf_quantize():
    """The bytes `write_positions` stores in a q8_0 block (traced, as every program writes)
    are gguf-py's Q8_0 blocks of the rows, at the positions written, and only there."""
    rows = _rows(0, (2, 5, 64))  # [n_kv_heads, T, head_dim]
    block = jnp.zeros((2, 16, 2 * 34), jnp.uint8)
    write = jax.jit(lambda b, r, p: write_positions((b,), (r,), p)[0])
    got = np.asarray(write(block, rows, jnp.int32(16 + 7)))  # positions 7 .. 11 of the block
    want = gguf.quants.quantize(rows.reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got[:, 7:12].reshape(-1, 68), want)
    assert not got[:, :7].any() and not got[:, 12:].any()
    assert np.array_equal(cache_types.quantize_q8_0(rows).reshape(-1, 68), want)


def test_q8_0_read_is_gguf_dequantize():
    raw = gguf.quants.quantize(_rows(1).reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(jax.jit(cache_rows.decode)(raw)), want)
    assert np.array_equal(cache_types.decode(raw), want)


@pytest.mark.parametrize("name, dtype", [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_f16_and_bf16_writes_round_to_nearest_even(name, dtype):
    t = cache_types.cache_type(name)
    rows = _rows(2)
    block = jnp.zeros((3, 8, 64), t.dtype)
    got = np.asarray(jax.jit(lambda b, r: write_positions((b,), (r,), jnp.int32(2))[0])(
        block, rows))
    assert got.dtype == dtype and np.array_equal(got[:, 2:7], rows.astype(dtype))
    # Halfway cases by hand: 1 + 2^-11 lies between float16's 1 and 1 + 2^-10 (to 1, even),
    # 1 + 3 * 2^-11 between 1 + 2^-10 and 1 + 2^-9 (to 1 + 2^-9, even); bfloat16 the same at
    # 2^-8 steps.
    step = 2.0 ** (-10 if name == "f16" else -7)
    halves = np.array([1 + step / 2, 1 + 3 * step / 2], np.float32)
    stored = np.asarray(cache_rows.encode(jnp.asarray(halves), t.dtype)).astype(np.float64)
    assert list(stored) == [1.0, 1 + 2 * step]
    assert np.array_equal(cache_types.encode(halves, name).astype(np.float64), stored)


def test_reads_widen_every_type_to_float32():
    rows = _rows(3, (2, 4, 64))
    for name in cache_types.CACHE_TYPES:
        stored = cache_types.encode(rows, name)
        assert stored.dtype == cache_types.cache_type(name).dtype
        assert stored.shape == (2, 4, cache_types.cache_type(name).row_length(64))
        widened = np.asarray(cache_rows.decode(jnp.asarray(stored)))
        assert widened.dtype == np.float32 and np.array_equal(widened,
                                                              cache_types.decode(stored))
        # Within half a step of the type: 2^-11 (f16) or 2^-8 (bf16) of the value; q8_0:
        # half its step amax / 127, plus the step's float16 rounding (2^-11 of it) times
        # |q| <= 127.
        err = np.abs(widened - rows)
        if name == "q8_0":
            amax = np.abs(rows.reshape(-1, 32)).max(-1, keepdims=True)
            assert (err.reshape(-1, 32) <= amax / 254 + amax * 2.0**-11).all()
        else:
            half = {"f32": 0, "f16": 2.0**-11, "bf16": 2.0**-8}[name]
            assert (err <= np.abs(rows) * half).all()


# -- plumbing -------------------------------------------------------------------------------

def test_auto_is_f32_for_llama2c_and_hf_and_f16_for_gguf():
    assert cache_types.resolve(file_format="llama2c") == (cache_types.CACHE_TYPES["f32"],) * 2
    assert cache_types.resolve(file_format="hf") == (cache_types.CACHE_TYPES["f32"],) * 2
    assert cache_types.DEFAULT_GGUF == "f16"
    assert [t.name for t in cache_types.resolve(file_format="gguf")] == ["f16", "f16"]
    assert [t.name for t in cache_types.resolve("auto", "q8_0", "gguf", 64)] == ["f16", "q8_0"]


def test_bad_types_name_their_flag():
    with pytest.raises(ConfigError, match=r"--cache_type='q4_0' is not a KV cache type \("
                                          r"known: f32, f16, bf16, q8_0\)"):
        cache_types.cache_type("q4_0")
    with pytest.raises(ConfigError, match="--cache_type_v=q8_0 needs head_dim a multiple of "
                                          "32, this model's is 48"):
        cache_types.resolve("f16", "q8_0", "gguf", 48)
    config = ModelConfig(dim=96, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=40, seq_len=16)
    for name in ("numpy", "jax"):
        b = make_backend(name, cache_type_k="q8_0")
        with pytest.raises(ConfigError, match="--cache_type_k=q8_0 needs head_dim"):
            b.prepare(config, random_weights(config, seed=0))
    with pytest.raises(ConfigError, match="cache_type_k='f8'"):
        make_backend("jax", cache_type_k="f8")


def test_memory_line_and_check_count_the_types(stories260k):
    from jllama.errors import ResourceError
    from jllama.model.loading import Model, required_memory
    from jllama.platform.runtime import check_kv_cache_fits

    config, w = stories260k
    model = Model(config=config, weights=w, tokenizer=None, chat_template=None, source="",
                  file_format="llama2c", context_length=config.seq_len)
    # 5 layers * 4 KV heads * 512 positions * 8 (head_dim) values: 81,920 per cache; f16
    # keys and values at 2 bytes: 327,680 bytes; f32 keys and bf16 values: 491,520.
    assert config.seq_len == 512
    line = required_memory(model, 1, cache_types.resolve("f16", "f16"))
    assert "KV cache 0.3 MB (512 tokens, f16) + the process" in line, line
    line = required_memory(model, 1, cache_types.resolve("f32", "bf16"))
    assert "KV cache 0.5 MB (512 tokens, keys f32, values bf16) + the process" in line, line
    # q8_0 of 64 values a row: 68 bytes against f32's 256.
    assert cache_types.kv_cache_nbytes(2, 4, 64, 100, "q8_0", "f32") == 2 * 4 * 100 * (68 + 256)
    huge = ModelConfig(dim=4096, hidden_dim=64, n_layers=64, n_heads=32, n_kv_heads=32,
                       vocab_size=40, seq_len=1 << 20)
    with pytest.raises(ResourceError, match=r"head_dim=128, keys q8_0, values f16\) but"):
        check_kv_cache_fits(huge, "q8_0", "f16")


def test_sessions_default_to_f16_for_gguf_and_f32_for_llama2c(tmp_path, stories260k):
    from gguf_files import write_gguf

    from jllama.model.loading import open_model
    from jllama.generation.session import Session

    config = ModelConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=259, seq_len=32)
    path = write_gguf(tmp_path / "tiny.gguf", config, random_weights(config, seed=2))
    model = open_model(path)
    for backend in ("jax", "numpy"):
        session = Session.prepare(model, backend, matvec="xla")
        assert [t.name for t in session.backend.cache_types] == ["f16", "f16"]
        if backend == "jax":
            assert session.backend.key_cache[0][0].dtype == np.float16
        session = Session.prepare(model, backend, matvec="xla", cache_type_v="q8_0")
        assert [t.name for t in session.backend.cache_types] == ["f16", "q8_0"]
    session = Session.open(seq_len=64, matvec="xla")  # the embedded stories260K
    assert [t.name for t in session.backend.cache_types] == ["f32", "f32"]
    with pytest.raises(ValueError, match="pass them to make_backend"):
        Session.prepare(model, make_backend("numpy"), cache_type_k="f16")


def test_command_line_flags(tmp_path):
    from test_cli import _assert_one_line_error, run

    from jllama.formats.llama2c import write_checkpoint

    _assert_one_line_error(run("--cache_type=q4_0"), "--cache_type='q4_0' is not a KV cache "
                           "type (known: f32, f16, bf16, q8_0)")
    _assert_one_line_error(run("serve", "--cache_type_k=F8"), "--cache_type_k='F8'")
    config = ModelConfig(dim=96, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=512, seq_len=32)
    path = tmp_path / "hd48.bin"
    write_checkpoint(path, config, random_weights(config, seed=3))
    _assert_one_line_error(run(f"--checkpoint={path}", "--cache_type=q8_0"),
                           "--cache_type=q8_0 needs head_dim a multiple of 32, this model's "
                           "is 48")
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time, there was a little cat. " * 8)
    _assert_one_line_error(run("perplexity", f"--checkpoint={path}", "--cache_type_v=q8_0",
                               f"--file={text}", "--ctx=16"),
                           "--cache_type_v=q8_0 needs head_dim")
    # stories260K: 81,920 values a cache (`test_memory_line_and_check_count_the_types`), f16
    # keys and bf16 values at 2 bytes each.
    result = run("--cache_type=f16", "--cache_type_v=bf16", "--temperature=0", "--steps=40",
                 "--backend=numpy")
    assert result.returncode == 0, result.stderr
    assert "KV cache 0.3 MB (512 tokens, keys f16, values bf16)" in result.stderr
    assert result.stdout.startswith("Once upon a time")
