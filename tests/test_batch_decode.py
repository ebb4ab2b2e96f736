"""The jax backend's batched decode step (`decode_batch`, issue 20): row b's logits bit-identical
to `forward` of that sequence alone on its own caches, whatever the batch size and the other
rows; the caches updated as forward updates them; no compilation as batches come and go
within the compiled sizes and windows."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from test_prefill import _compiles  # the programs compiled inside a `with` block

from jllama.backends import make_backend
from jllama.backends.base import BatchDecode
from jllama.backends.jax_batch import batch_size
from jllama.model.config import ModelConfig
from jllama.model.weights import cast_weights, random_weights

GQA = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300,
                  seq_len=600, shared_weights=False)
"""kv_mul 4, three cache blocks of 256 positions (windows of 1, 2 and 3 blocks)."""


@pytest.fixture(scope="module")
def gqa_backend():
    b = make_backend("jax", matvec="kernel")
    b.prepare(GQA, random_weights(GQA, seed=4, scale=0.1))
    return b


@pytest.fixture(scope="module")
def stories_backend(stories260k):
    config, weights = stories260k
    b = make_backend("jax", matvec="kernel")
    b.prepare(config, weights)
    return b

def _pairs(backend, starts, seed):
    """Per start position, two caches holding the same prompt of `start` tokens (one for the
    batch, one for forward alone)."""
    rng = np.random.default_rng(seed)
    vocab = backend.config.vocab_size
    before = backend.use_caches(backend.new_caches())
    alone, batched = [], []
    for start in starts:
        prompt = [int(t) for t in rng.integers(0, vocab, start)]
        for group in (alone, batched):
            c = backend.new_caches()
            if start:
                backend.use_caches(c)
                backend.prefill(prompt, 0)
            group.append(c)
    backend.use_caches(before)
    return alone, batched


def _check(backend, starts, steps=3, seed=0):
    """decode_batch over sequences starting at `starts` against forward on copies, `steps`
    steps; returns the batched caches."""
    rng = np.random.default_rng(seed + 1)
    vocab = backend.config.vocab_size
    alone, batched = _pairs(backend, starts, seed)
    in_use = backend.use_caches(backend.new_caches())
    backend.use_caches(in_use)
    for step in range(steps):
        tokens = [int(t) for t in rng.integers(0, vocab, len(starts))]
        positions = [s + step for s in starts]
        out = backend.decode_batch(tokens, positions, batched)
        assert out.shape == (len(starts), vocab) and out.dtype == np.float32
        for b, (token, pos) in enumerate(zip(tokens, positions, strict=True)):
            backend.use_caches(alone[b])
            ref = backend.forward(token, pos)
            assert np.array_equal(out[b], ref), (step, b, pos, float(np.abs(out[b] - ref).max()))
        backend.use_caches(in_use)
    # The caches hold the same bits as forward's.
    for a, c in zip(alone, batched, strict=True):
        for la, lc in zip(a[0] + a[1], c[0] + c[1], strict=True):
            for blk in range(len(la)):
                if list.__getitem__(la, blk) is not None or list.__getitem__(lc, blk) is not None:
                    assert np.array_equal(np.asarray(la[blk]), np.asarray(lc[blk]))
    return batched


def _starts(n, seq_len, seed):
    rng = np.random.default_rng(seed)
    return [int(s) for s in rng.integers(0, seq_len - 4, n)]


def test_protocol(gqa_backend):
    assert isinstance(gqa_backend, BatchDecode)
    assert gqa_backend.batch_kernels()


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_gqa_bit_identical(gqa_backend, n):
    # Positions in every window: block 0, 1 and 2, and across a block's end (254 -> 256).
    starts = ([254, 0, 300, 520, 10, 511, 255, 100] + _starts(n, GQA.seq_len, n))[:n]
    _check(gqa_backend, starts)


def test_gqa_batch_32(gqa_backend):
    _check(gqa_backend, _starts(32, GQA.seq_len, 32), steps=2)


def test_gqa_more_than_32(gqa_backend):
    _check(gqa_backend, _starts(35, GQA.seq_len, 35), steps=1)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_stories260k_bit_identical(stories_backend, n):
    starts = ([0, 300, 255, 17, 400, 1, 256, 500] + _starts(n, 512, n))[:n]
    _check(stories_backend, starts)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_narrow_weights(stories260k, dtype):
    config, weights = stories260k
    b = make_backend("jax", matvec="kernel")
    b.prepare(config, cast_weights(weights, dtype))
    assert b.batch_kernels()
    _check(b, [0, 300, 5, 256, 100], steps=2)


def test_row_does_not_depend_on_neighbours(gqa_backend):
    """The same sequence alone and beside 1, 7 and 31 others: the same bits."""
    rows = []
    for n in (1, 2, 8, 32):
        starts = [300] + _starts(n - 1, GQA.seq_len, n)
        _, batched = _pairs(gqa_backend, starts, seed=7)  # sequence 0: the same prompt each time
        others = [int(t) for t in np.random.default_rng(n).integers(0, 300, n - 1)]
        rows.append(gqa_backend.decode_batch([5] + others, starts, batched)[0])
    for r in rows[1:]:
        assert np.array_equal(r, rows[0])


def test_no_recompilation(gqa_backend):
    """Batch sizes within a compiled size, and positions within a compiled window, compile
    nothing more."""
    _, batched = _pairs(gqa_backend, [0] * 8, seed=3)
    gqa_backend.decode_batch([1] * 8, [0] * 8, batched)  # size 8, one block: compiled now
    gqa_backend.decode_batch([1] * 2, [1] * 2, batched[:2])
    with _compiles() as compiled:
        for n, pos in ((5, 2), (8, 3), (7, 4), (6, 5)):
            assert batch_size(n) == 8
            gqa_backend.decode_batch([2] * n, [pos] * n, batched[:n])
        gqa_backend.decode_batch([3, 4], [6, 6], batched[:2])
    assert compiled == []


def test_kernel_products_without_a_batched_kernel_fall_back_to_forward(stories260k):
    """matvec="kernel" with weights `matvec_batch` does not take: forward per sequence, the
    same bits. (XLA's products have a batched step of their own: tests/test_batch_xla.py.)"""
    config, weights = stories260k
    b = make_backend("jax", matvec="kernel")
    b.prepare(config, weights)
    b.batch_kernels = lambda: False
    assert not b.batch_xla()
    _check(b, [0, 260, 3], steps=2)


def test_errors(gqa_backend):
    c = gqa_backend.new_caches()
    with pytest.raises(ValueError):
        gqa_backend.decode_batch([1, 2], [0], [c, gqa_backend.new_caches()])
    with pytest.raises(ValueError):
        gqa_backend.decode_batch([1, 2], [0, 0], [c, c])
    with pytest.raises(ValueError):
        gqa_backend.decode_batch([], [], [])
    with pytest.raises(ValueError):
        gqa_backend.decode_batch([GQA.vocab_size], [0], [c])
    with pytest.raises(ValueError):
        gqa_backend.decode_batch([0], [GQA.seq_len], [c])


def _weights(kind, m, n, rng):
    import ml_dtypes

    from jllama.model.quant import Int8Matrix, quantize_int8

    w = rng.standard_normal((m, n)).astype(np.float32)
    if kind == "bfloat16":
        return jax.numpy.asarray(w.astype(ml_dtypes.bfloat16))
    if kind == "int8":
        q = quantize_int8(w)
        return Int8Matrix(jax.numpy.asarray(q.q), jax.numpy.asarray(q.scale))
    if kind == "int8_groups":
        q = rng.integers(-127, 128, (m, n)).astype(np.int8)
        scale = rng.random((m, n // 32)).astype(np.float32) / 100
        return Int8Matrix(jax.numpy.asarray(q), jax.numpy.asarray(scale))
    return jax.numpy.asarray(w)


@pytest.mark.parametrize("kind, shape", [
    (kind, shape) for kind in ("float32", "bfloat16", "int8", "int8_groups")
    for shape in ((300, 96), (70, 172), (1000, 576))
    if kind != "int8_groups" or shape[1] % 32 == 0  # grouped int8 needs groups of 32
])
def test_matvec_batch_rows_equal_matvec(kind, shape):
    """Each row of the batched product, with each prologue and the residual, is the single
    product's bits; rows from count on are zeros."""
    from jllama import kernels
    from jllama.kernels import batched as batch_kernels

    kernels.load()
    rng = np.random.default_rng(sum(shape))
    m, n = shape
    w = _weights(kind, m, n, rng)
    batch, live = 8, 6
    x = rng.standard_normal((batch, n)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    gate = rng.standard_normal((batch, n)).astype(np.float32)
    add = rng.standard_normal((batch, m)).astype(np.float32)
    for options in ({}, {"norm": norm, "eps": 1e-5}, {"gate": gate}, {"add": add},
                    {"gate": gate, "add": add}, {"norm": norm, "eps": 1e-5, "add": add}):
        batched = functools.partial(batch_kernels.matvec_batch, **options)
        out = np.asarray(jax.jit(batched)(w, x, np.int32(live)))
        assert not out[live:].any()
        # One program for every row (its arrays arguments, eps static), not one per row.
        alone = jax.jit(functools.partial(kernels.matvec, **{
            k: v for k, v in options.items() if k == "eps"}))
        for b in range(live):
            row = {k: (v[b] if k in ("gate", "add") else v) for k, v in options.items()
                   if k != "eps"}
            ref = np.asarray(alone(w, x[b], **row))
            assert np.array_equal(out[b], ref), (kind, shape, sorted(options), b)


def _ggml(kind, m, n, rng, repack):
    """A GGMLMatrix of kind (a ggml type's name: quantized by the gguf package, or random
    blocks for the K types it cannot quantize), repacked into the x8 layout when asked;
    "mixed": a RowStack of Q4_1, Q8_0 and F16 parts."""
    import gguf
    from test_ggml_kernels import random_blocks

    from jllama.model.ggml_matrix import GGMLMatrix, RowStack, repacked

    if kind == "mixed":
        parts = [_ggml(k, rows, n, rng, repack) for k, rows in (("Q4_1", m - 16), ("Q8_0", 8),
                                                                ("F16", 8))]
        return RowStack(tuple(parts))
    qtype = gguf.GGMLQuantizationType[kind]
    if kind.endswith("_K"):
        data = random_blocks(rng, int(qtype), m, n)
    else:
        data = gguf.quants.quantize(rng.standard_normal((m, n)).astype(np.float32), qtype)
        data = np.ascontiguousarray(data).view(np.uint8)  # F16's come as float16
    matrix = GGMLMatrix(data, int(qtype), n)
    return repacked(matrix) if repack else matrix


@pytest.mark.parametrize("kind, repack", [
    ("Q4_1", False), ("Q4_1", True), ("Q8_0", True), ("Q4_0", True), ("Q4_K", True),
    ("Q6_K", True), ("Q6_K", False), ("Q5_K", True), ("F16", False), ("mixed", True),
])
def test_matvec_batch_ggml_rows_equal_matvec(kind, repack):
    """The batched product of GGML blocks: each row, with each prologue and the residual, is
    `matvec`'s bits for that row alone (its activations quantized alone), rows from count on
    are zeros; batches of 1 to 33 rows (the 4- and 8-row passes, 16-row tiles and the rest)."""
    from jllama import kernels
    from jllama.kernels import batched as batch_kernels

    kernels.load()
    rng = np.random.default_rng(len(kind) + repack)
    m, n = 48, 512
    w = _ggml(kind, m, n, rng, repack)
    assert batch_kernels.batch_supported(w)
    norm = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    # 33 rows: two 16-token tile blocks (AMX where the CPU has it) and one token after them.
    for batch, live in ((1, 1), (8, 6), (9, 9), (16, 0), (33, 33)):
        x = rng.standard_normal((batch, n)).astype(np.float32)
        gate = rng.standard_normal((batch, n)).astype(np.float32)
        add = rng.standard_normal((batch, m)).astype(np.float32)
        for options in ({}, {"norm": norm, "eps": 1e-5}, {"gate": gate, "add": add},
                        {"norm": norm, "eps": 1e-5, "add": add}):
            batched = functools.partial(batch_kernels.matvec_batch, **options)
            out = np.asarray(jax.jit(batched)(w, x, np.int32(live)))
            assert out.shape == (batch, m) and not out[live:].any()
            # One program for every row (its arrays arguments, eps static), not one per row.
            alone = jax.jit(functools.partial(kernels.matvec, **{
                k: v for k, v in options.items() if k == "eps"}))
            for b in range(live):
                row = {k: (v[b] if k in ("gate", "add") else v) for k, v in options.items()
                       if k != "eps"}
                ref = np.asarray(alone(w, x[b], **row))
                assert np.array_equal(out[b], ref), (kind, repack, batch, sorted(options), b)


GGUF_GQA = ModelConfig(dim=256, hidden_dim=512, n_layers=2, n_heads=8, n_kv_heads=2,
                       vocab_size=259, seq_len=600, shared_weights=False)
"""dim 256 for the K types' super-blocks; three cache blocks as GQA's."""


@pytest.fixture(scope="module")
def gguf_backend(tmp_path_factory):
    """A GGUF of mixed types, as a Q4_K_M file mixes them (K-type tensors as random blocks:
    the gguf package cannot quantize them), read as a user's file is."""
    import gguf
    from gguf_files import write_gguf
    from test_ggml_kernels import random_blocks

    from jllama.model.loading import open_model

    t = gguf.GGMLQuantizationType
    c = GGUF_GQA
    types = {"*": t.Q4_1, "output.weight": t.Q8_0, "token_embd.weight": t.Q5_1}
    rng = np.random.default_rng(5)
    raw = {}
    for layer in range(c.n_layers):
        types |= {f"blk.{layer}.attn_k.weight": t.Q8_0, f"blk.{layer}.ffn_down.weight": t.Q5_0,
                  f"blk.{layer}.ffn_up.weight": t.F16}
        raw[f"blk.{layer}.attn_v.weight"] = (
            random_blocks(rng, int(t.Q6_K), c.n_kv_heads * c.head_dim, c.dim), t.Q6_K)
        raw[f"blk.{layer}.attn_output.weight"] = (random_blocks(rng, int(t.Q4_K), c.dim, c.dim),
                                                  t.Q4_K)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", c,
                      random_weights(c, seed=5, scale=0.1), types=types,
                      drop_tensors=tuple(raw), raw_tensors=raw)
    model = open_model(path, need_tokenizer=False)
    b = make_backend("jax", matvec="kernel")
    b.prepare(model.config, model.weights)
    return b


def test_gguf_blocks_take_the_batched_step(gguf_backend):
    assert gguf_backend.batch_kernels()
    _check(gguf_backend, [254, 0, 300, 7, 520], steps=2)


def test_gguf_row_does_not_depend_on_neighbours(gguf_backend):
    rows = []
    for n in (1, 2, 8):
        starts = [300] + _starts(n - 1, GGUF_GQA.seq_len, n)
        _, batched = _pairs(gguf_backend, starts, seed=7)
        others = [int(t) for t in np.random.default_rng(n).integers(0, 259, n - 1)]
        rows.append(gguf_backend.decode_batch([5] + others, starts, batched)[0])
    for r in rows[1:]:
        assert np.array_equal(r, rows[0])


def test_sample_batch_rows_are_the_host_samplers_draws():
    """Each row of `sample_batch` is the token the host `Sampler` (run.c's sampler, checked
    against llama2.c in test_sampling) draws from that row with the same seed: greedy, whole
    distribution, nucleus, a vanishing temperature; rows from count on are 0, a row with a NaN
    is reported not finite."""
    from jllama import kernels
    from jllama.kernels.batched import sample_batch
    from jllama.sampling import Sampler

    kernels.load()
    rng = np.random.default_rng(7)
    settings = [(0.0, 0.9), (1.0, 1.0), (0.8, 0.9), (0.5, 0.0), (1e-30, 0.9), (1.3, 0.5),
                (0.9, 0.99), (0.7, 0.9), (0.6, 0.9)]
    batch, vocab = len(settings), 3000
    logits = (rng.standard_normal((batch, vocab)) * np.linspace(1, 8, batch)[:, None]
              ).astype(np.float32)
    logits[7, 5] = np.nan
    count = batch - 1
    for seed in range(5):
        host = [Sampler(temperature=t, top_p=p, seed=100 + seed + b)
                for b, (t, p) in enumerate(settings)]
        coins = [Sampler(temperature=t, top_p=p, seed=100 + seed + b).rng.random_f32()
                 if t else 0.0 for b, (t, p) in enumerate(settings)]
        temperature = np.array([t for t, _ in settings], np.float32)
        top_p = np.array([p for _, p in settings], np.float32)
        token, finite = sample_batch(logits, temperature, top_p, np.array(coins, np.float32),
                                     np.int32(count))
        token, finite = np.asarray(token), np.asarray(finite)
        assert finite.tolist() == [True] * 7 + [False, True]
        assert token[count] == 0
        for b in range(count):
            if b != 7:
                assert token[b] == host[b](logits[b]), (seed, b, settings[b])
