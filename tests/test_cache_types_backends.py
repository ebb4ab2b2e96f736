"""The backends on each KV cache type (issue 32; `jllama.model.cache_types`): the JAX backend in
each decode mode against the NumPy reference holding its cache in the same type, prefill chunks
against token-by-token decode, the device loop against the graph's greedy ids, the batched
step's rows against each sequence alone, writes in place and compiled once; and jllama's
kernels on blocks of each type against XLA's reads and writes of the same blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_prefill import _compiles  # the programs compiled inside a `with` block

from jllama.model import cache_types

from jllama import kernels
from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.graphs import cache_rows
from jllama.graphs.attention import attend, write_positions
from jllama.model.weights import random_weights

KV = ModelConfig(dim=128, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                 seq_len=300, shared_weights=False)
"""head_dim 32 (one q8_0 block a row), kv_mul 2, two cache blocks (256 + 44 positions)."""

PAIRS = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "f16")]
"""Each type for keys and values, and a mixed pair."""
RUN_PAIRS = [("f16", "f16"), ("q8_0", "bf16"), ("bf16", "q8_0")]
"""For the programs that cost a compile per pair (fused, prefill, the loop, the kernels): f16
(the GGUF default) and two mixed pairs that put every other type on both sides (f32 is the
rest of the suite's). f16 and bf16 share their code (a cast each way), q8_0 has its own."""
CASES = [(("q8_0", "q8_0"), "xla"), (("f16", "f16"), "kernel"), (("bf16", "q8_0"), "kernel")]
"""(pair, matvec) of the prefill and loop tests: q8_0 both sides through XLA's programs; the
kernel path (its attention in the kernels where they read the type) for f16 and a mix."""


def _case_id(case) -> str:
    return f"{_ids(case[0])}-{case[1]}"


TOLERANCE = {"f32": 1e-4, "f16": 3e-4, "bf16": 3e-4, "q8_0": 2e-3}
"""Logits of two computations that should agree (a JAX path and the NumPy reference, prefill
and decode). A cache of a rounding type amplifies the float32 differences of the products
(~1e-6 here): a value that lands within them of a rounding boundary rounds the other way, one
step of the type (f16 2^-11 of it, q8_0 1/127 of its block's largest). Measured: up to 1.8e-4
(f16, bf16) and 1e-3 (q8_0) on this model. Each stays well below what the type itself changes
(`test_the_type_changes_the_logits`)."""


def _tolerance(pair) -> float:
    return max(TOLERANCE[name] for name in pair)


def _ids(pair) -> str:
    return pair[0] if pair[0] == pair[1] else f"k{pair[0]}-v{pair[1]}"


def _kernels_pending(pair):
    """A pair of cache types as a test parameter (every type's blocks are read by the kernels,
    `cache_rows.KERNEL_CACHE_DTYPES`; a type they did not read would fail here)."""
    assert all(cache_types.cache_type(t).dtype in cache_rows.KERNEL_CACHE_DTYPES for t in pair)
    return pytest.param(pair, id=_ids(pair))


@pytest.fixture(scope="module")
def weights():
    return random_weights(KV, seed=1, scale=0.08)


TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, KV.vocab_size, 48)]


@pytest.fixture(scope="module")
def reference(weights):
    """The NumPy reference's logits along TOKENS with the cache types of a pair (each pair
    computed once)."""
    @functools.cache
    def logits(pair):
        ref = make_backend("numpy", cache_type_k=pair[0], cache_type_v=pair[1])
        ref.prepare(KV, weights)
        return np.stack([ref.forward(t, p) for p, t in enumerate(TOKENS)])

    return logits


def _jax(pair, weights, **options):
    b = make_backend("jax", cache_type_k=pair[0], cache_type_v=pair[1], **options)
    b.prepare(KV, weights)
    return b


def _decode(backend, tokens=TOKENS):
    return np.stack([backend.forward(t, p) for p, t in enumerate(tokens)])


@pytest.mark.parametrize("pair", PAIRS[1:] + RUN_PAIRS[1:], ids=_ids)
def test_the_type_changes_the_logits(pair, reference):
    """The reference of each type is not f32's: the comparisons below could tell them apart."""
    gap = np.abs(reference(pair) - reference(("f32", "f32"))).max()
    assert gap > 4 * _tolerance(pair), gap


@pytest.mark.parametrize("pair, decode", [(p, "graph") for p in PAIRS]
                         + [(p, "fused") for p in RUN_PAIRS[1:]],
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else v)
def test_xla_decode_matches_the_numpy_reference(pair, decode, weights, reference):
    b = _jax(pair, weights, matvec="xla", decode=decode)
    key, value = b.key_cache[0][0], b.value_cache[0][0]
    for block, name in ((key, pair[0]), (value, pair[1])):
        t = cache_types.cache_type(name)
        assert block.dtype == t.dtype and block.shape == (2, 256, t.row_length(32))
    with _compiles() as compiled:  # prepare's warm-up compiled every program these need
        got = _decode(b)
    assert compiled == []
    assert np.abs(got - reference(pair)).max() <= _tolerance(pair)


@pytest.mark.parametrize("pair", RUN_PAIRS, ids=_ids)
def test_kernel_products_match_the_numpy_reference(pair, weights, reference):
    """matvec="kernel": the products in jllama's kernels, attention in the kernels where they
    read the type (else in XLA, `test_the_kernels_read_the_cache`)."""
    got = _decode(_jax(pair, weights, matvec="kernel"))
    assert np.abs(got - reference(pair)).max() <= _tolerance(pair)


KERNEL_PAIRS = [_kernels_pending(p) for p in [("f32", "f32")] + RUN_PAIRS]


@pytest.mark.parametrize("pair", KERNEL_PAIRS)
def test_the_backend_runs_the_kernels_on_the_cache(pair, weights):
    """The kernel path takes every type itself: no note of attention moved to XLA, and the
    batched step runs its kernels."""
    b = _jax(pair, weights, matvec="kernel")
    assert b.cache_note == "" and b.batch_kernels()


@pytest.mark.parametrize("pair", KERNEL_PAIRS)
def test_the_kernels_read_the_cache(pair):
    """rope_write / attention / attention_chunk on blocks of the type give what XLA's writes
    and reads of the same blocks give (called directly, whatever the backend chooses)."""
    key_type, value_type = (cache_types.cache_type(t) for t in pair)
    rng = np.random.default_rng(5)
    c = KV
    from jllama.model.rope import rope_frequencies

    inv_freq = rope_frequencies(c)
    shape = (c.n_kv_heads, 256, c.head_dim)
    qkv = (rng.standard_normal(c.q_dim + 2 * c.kv_dim) * 0.5).astype(np.float32)
    pos = jnp.int32(40)
    kb0 = jnp.asarray(cache_types.encode(rng.standard_normal(shape).astype(np.float32),
                                         key_type))
    vb0 = jnp.asarray(cache_types.encode(rng.standard_normal(shape).astype(np.float32),
                                         value_type))
    q, kb, vb = jax.jit(kernels.rope_write)(qkv, pos, inv_freq, kb0.copy(), vb0.copy())
    q_x, kb_x, vb_x = jax.jit(functools.partial(_xla_qkv, c))(qkv, pos, inv_freq, kb0, vb0)
    np.testing.assert_allclose(np.asarray(q), np.asarray(q_x), atol=1e-5)
    # The key (after RoPE: sin / cos differ by an ulp between the two) and value rows stored
    # in the type, to one step of it where a rotated value lands by a boundary.
    for got, want in ((kb, kb_x), (vb, vb_x)):
        assert got.dtype == want.dtype
        assert np.abs(cache_types.decode(np.asarray(got)) - cache_types.decode(
            np.asarray(want))).max() <= 0.05
    qg = q_x.reshape(c.n_kv_heads, c.kv_mul, c.head_dim)
    got = jax.jit(kernels.attention)(qg, (kb_x,), (vb_x,), pos)
    want = jax.jit(functools.partial(attend, c, matvec="xla"))(q_x, (kb_x,), (vb_x,), pos)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), np.asarray(want), atol=1e-5)
    if kernels.attention_chunk_fits(c.head_dim, 256, fast_only=False):
        from jllama.graphs.prefill import attention_chunk

        qs = jnp.asarray(rng.standard_normal((8, c.n_heads, c.head_dim)).astype(np.float32))
        got = jax.jit(kernels.attention_chunk)(qs, (kb_x,), (vb_x,), pos)
        want = attention_chunk(c, qs, (kb_x,), (vb_x,), pos, matvec="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def _xla_qkv(config, qkv, pos, inv_freq, key_block, value_block):
    from jllama.graphs.ops import rope, split_qkv

    q, k, v = split_qkv(config, qkv)
    q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
    key_block, value_block = write_positions((key_block, value_block),
                                             (k[:, None, :], v[:, None, :]), pos)
    return q, key_block, value_block


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_chunks_equal_token_by_token_decode(case, weights):
    """Chunks of 8 tokens from position 240, across the end of the first cache block, then
    single tokens (the positions before 240 hold zeros for both)."""
    pair, matvec = case
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, KV.vocab_size, 36)]
    b = _jax(pair, weights, matvec=matvec)
    rows = b.prefill_logits(tokens, 240)
    one_by_one = np.stack([b.forward(t, 240 + i) for i, t in enumerate(tokens)])
    assert np.abs(rows - one_by_one).max() <= _tolerance(pair)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_device_loop_gives_the_graphs_greedy_ids(case, weights):
    """Greedy ids from the device loop from position 250, across the end of the first cache
    block, against forward's argmax from the same state (zeros before 250)."""
    pair, matvec = case
    b = _jax(pair, weights, matvec=matvec)
    token, pos, looped = 7, 250, []
    while len(looped) < 12:
        ids, finite = b.decode_loop(token, pos, 12 - len(looped))
        assert finite
        looped += ids
        token, pos = ids[-1], pos + len(ids)
    token, graph = 7, []
    for pos in range(250, 262):
        token = int(np.argmax(b.forward(token, pos)))
        graph.append(token)
    assert looped == graph


@pytest.mark.parametrize("pair", RUN_PAIRS, ids=_ids)
def test_batched_rows_are_each_sequence_alone(pair, weights):
    """decode_batch's row b has the bits of forward on sequence b alone (matvec="kernel"; the
    batched kernels where they read the type, else forward per sequence), from positions 3
    and 254 (across a block's end); the caches of both hold the same bytes."""
    b = _jax(pair, weights, matvec="kernel")
    rng = np.random.default_rng(9)
    starts = [3, 254]
    alone = [b.new_caches() for _ in starts]
    batched = [b.new_caches() for _ in starts]
    for step in range(4):
        tokens = [int(t) for t in rng.integers(0, KV.vocab_size, len(starts))]
        positions = [s + step for s in starts]
        rows = b.decode_batch(tokens, positions, batched)
        for i, (token, pos) in enumerate(zip(tokens, positions, strict=True)):
            b.use_caches(alone[i])
            assert np.array_equal(rows[i], b.forward(token, pos)), (step, i)
    for a, c in zip(alone, batched, strict=True):
        for blocks_a, blocks_c in zip(a[0] + a[1], c[0] + c[1], strict=True):
            assert all(np.array_equal(np.asarray(x), np.asarray(y))
                       for x, y in zip(blocks_a, blocks_c, strict=True))


@pytest.mark.parametrize("decode, matvec", [("graph", "kernel"), ("fused", "xla")])
def test_cache_writes_stay_in_place(decode, matvec, weights):
    """The donated blocks of a typed cache are written in place (the same buffer comes back)
    by the decode step, a prefill chunk and the device loop."""
    b = _jax(("bf16", "q8_0"), weights, matvec=matvec, decode=decode)

    def written_in_place(run):
        blocks = [c[l][0] for c in (b.key_cache, b.value_cache) for l in range(KV.n_layers)]
        pointers = [x.unsafe_buffer_pointer() for x in blocks]
        run()
        now = [c[l][0] for c in (b.key_cache, b.value_cache) for l in range(KV.n_layers)]
        return all(old.is_deleted() and new.unsafe_buffer_pointer() == p
                   for old, new, p in zip(blocks, now, pointers, strict=True))

    assert written_in_place(lambda: b.forward(5, 1))
    assert written_in_place(lambda: b.prefill(list(range(8)), 8))
    assert written_in_place(lambda: b.decode_loop(5, 16, 4))


def test_slots_and_pads_take_the_types(weights):
    b = _jax(("q8_0", "bf16"), weights, matvec="xla")
    keys, values = b.new_caches()
    assert keys[1][1].dtype == np.uint8 and keys[1][1].shape == (2, 256, 34)
    assert values[0][0].dtype == ml_dtypes.bfloat16
    assert [z.dtype for z in b._zero_blocks] == [np.uint8, ml_dtypes.bfloat16]
