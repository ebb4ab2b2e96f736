"""jllama's kernels for GGML blocks (jllama/kernels/ggml_dot.h, ggml_x8.h) against the `gguf`
package's dequantizer for the weights' values and llama.cpp's activation quantizers written out
here in NumPy (`activations`, from ggml-cpu/arch/x86/quants.c and ggml-quants.c).

A product's reference is float64: the weights as `gguf.quants.dequantize` gives them, times x
quantized the way llama.cpp quantizes it for that weight type (Q8_0, Q8_1 or Q8_K). The kernels
sum in float32, so each row may differ by float rounding: at most 1e-5 of sum_j |w_j x_j| (a
bound, not a fit).
"""

from __future__ import annotations

import ctypes

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jllama.model import ggml_repack

from jllama import kernels
from jllama.formats import ggml_quants as gq
from jllama.model.ggml_matrix import (GGMLMatrix, LayerStack, RowStack, from_float, q4_0_as_q8_0,
                                quantize, repacked, stack_rows)

INTEGER_TYPES = (gq.Q8_0, gq.Q4_0, gq.Q4_1, gq.Q5_0, gq.Q5_1, gq.Q2_K, gq.Q3_K, gq.Q4_K,
                 gq.Q5_K, gq.Q6_K)
# Byte offsets of each type's float16 scale fields within a block.
SCALES = {gq.Q8_0: [0], gq.Q4_0: [0], gq.Q4_1: [0, 2], gq.Q5_0: [0], gq.Q5_1: [0, 2],
          gq.Q2_K: [80, 82], gq.Q3_K: [108], gq.Q4_K: [0, 2], gq.Q5_K: [0, 2], gq.Q6_K: [208]}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    kernels.load()


def random_blocks(rng, type_id: int, rows: int, cols: int) -> np.ndarray:
    """u8[rows, row_bytes]: random bytes with finite float16 scales (a few hundredths)."""
    elements, nbytes = gq.BLOCK_SIZES[type_id]
    blocks = rng.integers(0, 256, size=(rows * cols // elements, nbytes), dtype=np.uint8)
    for offset in SCALES[type_id]:
        scale = (rng.uniform(-1, 1, blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


from q8_reference import K_TYPES, activations, quantized_x  # noqa: E402  (tests/ on sys.path)


def q8_1_minimum_term(x: np.ndarray) -> np.ndarray:
    """Q8_1's s per 32: max|x| / 127 * sum(q), rounded to float16 (llama.cpp's y.s)."""
    q, _ = activations(x, gq.Q8_0)
    amax = np.max(np.abs(x.reshape(-1, 32)), axis=1) / np.float32(127)
    return (amax * q.reshape(-1, 32).sum(axis=1).astype(np.float32)).astype(np.float16)


def reference(w_f32: np.ndarray, xq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w @ xq in float64, the per-row bound 1e-5 * |w| @ |xq|)."""
    w = w_f32.astype(np.float64)
    return w @ xq, 1e-5 * (np.abs(w) @ np.abs(xq)) + 1e-30


def dequantized(data, type_id, rows, cols) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(data), Q(type_id)).reshape(rows, cols)


def expected_product(data, type_id, rows, cols, x):
    """The float64 reference of a product of `type_id` blocks with x, and its bound. Q4_1 and
    Q5_1 rows are d * v + m: their minimum meets llama.cpp's float16 s = d * sum(q) of each
    block, so the reference takes the minimums' term with that rounded s."""
    w = dequantized(data, type_id, rows, cols)
    xq = quantized_x(x, type_id)
    if type_id not in (gq.Q4_1, gq.Q5_1):
        return reference(w, xq)
    blocks = np.asarray(data).reshape(rows, cols // 32, -1)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)[..., 0]
    scaled = (w - np.repeat(m, 32, axis=1)) / np.where(np.repeat(d, 32, axis=1) == 0, 1,
                                                     np.repeat(d, 32, axis=1))
    v = np.rint(scaled)  # the 4- or 5-bit value of each weight
    main = (np.repeat(d, 32, axis=1) * v) @ xq
    s = q8_1_minimum_term(x).astype(np.float64)
    want = main + m @ s
    bound = 1e-5 * (np.abs(np.repeat(d, 32, axis=1) * v) @ np.abs(xq) + np.abs(m) @ np.abs(s)) + 1e-30
    return want, bound


def shapes_for(type_id):
    return [(16, 256), (40, 768)] if gq.BLOCK_SIZES[type_id][0] == 256 else [(8, 32), (24, 576)]


matvec = jax.jit(kernels.matvec)


@pytest.mark.parametrize("type_id", INTEGER_TYPES, ids=gq.type_name)
def test_products_of_every_type_and_layout_match_gguf(type_id):
    rng = np.random.default_rng(type_id)
    for rows, cols in shapes_for(type_id):
        data = random_blocks(rng, type_id, rows, cols)
        plain = GGMLMatrix(data, type_id, cols)
        x = rng.standard_normal(cols).astype(np.float32)
        want, bound = expected_product(data, type_id, rows, cols, x)
        layouts = [plain, repacked(plain)] if kernels.vector_width() >= 8 else [plain]
        if type_id in ggml_repack.TYPES and len(layouts) == 2:
            assert layouts[1].repacked
        for w in layouts:
            got = np.asarray(matvec(w, jnp.asarray(x)), np.float64)
            assert np.all(np.abs(got - want) <= bound), (gq.type_name(type_id), w.type_id)


@pytest.mark.parametrize("type_id", INTEGER_TYPES, ids=gq.type_name)
def test_dequantize_and_embedding_rows_are_ggml_values_exactly(type_id):
    rng = np.random.default_rng(100 + type_id)
    rows, cols = shapes_for(type_id)[-1]
    data = random_blocks(rng, type_id, rows, cols)
    want = dequantized(data, type_id, rows, cols)
    for w in (GGMLMatrix(data, type_id, cols), repacked(GGMLMatrix(data, type_id, cols))):
        assert np.array_equal(np.asarray(w).view(np.uint32), want.view(np.uint32))
        got = np.asarray(jax.jit(kernels.dequantize)(w))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        tokens = jnp.asarray([0, rows - 1, 5, 5], jnp.int32)
        rows_got = np.asarray(jax.jit(kernels.embedding_rows)(w, tokens))
        assert np.array_equal(rows_got.view(np.uint32), want[np.asarray(tokens)].view(np.uint32))


def test_activations_are_quantized_as_llama_cpp_does():
    """A Q8_0 matrix whose rows pick one element each (q = 1 there, d = 1) returns the
    quantized activations themselves, q_j * d_j (one float32 rounding): llama.cpp's Q8_0 for
    Q8_0 weights; a Q6_K matrix of the same kind (scale 1, value 33: weight 1) its Q8_K."""
    rng = np.random.default_rng(3)
    n = 256
    x = (rng.standard_normal(n) * np.repeat([0.01, 3.0, 1e-30, 1, 1, 1, 1, 1], 32)).astype(np.float32)
    x[32:64] = np.clip(x[32:64], -60, 60)
    x[32], x[40], x[41] = 63.5, 0.25, -0.75  # id = 2: x * id = 0.5 and -1.5 are ties
    blocks = np.zeros((n, n // 32, 34), np.uint8)
    blocks[:, :, :2] = np.array([1], np.float16).view(np.uint8)
    for j in range(n):
        blocks[j, j // 32, 2 + j % 32] = 1
    w = GGMLMatrix(blocks.reshape(n, -1), gq.Q8_0, n)
    q, d = activations(x, gq.Q8_0)
    assert q[40] == 0 and q[41] == -2  # half to even
    want = q.astype(np.float32) * d.astype(np.float32)
    assert np.array_equal(np.asarray(matvec(w, jnp.asarray(x))), want)
    assert np.array_equal(np.asarray(matvec(repacked(w), jnp.asarray(x))), want)
    # Q6_K rows that pick one element: ql/qh give value 33 (weight (33 - 32) * scale 1 * d 1).
    six = np.zeros((n, 210), np.uint8)
    six[:, 192:208] = 1
    six[:, 208:210] = np.array([1], np.float16).view(np.uint8)
    for j in range(n):
        half, e = divmod(j, 128)
        group, lane = divmod(e, 32)  # value 33 = 0b100001: low nibble 1, high bits 2
        six[j, 64 * half + lane + 32 * (group % 2)] = 1 << (4 * (group // 2))
        six[j, 128 + 32 * half + lane] = 2 << (2 * group)
    # every other element of the row is 0 = weight -32: subtract those, as the reference does
    q, d = activations(x, gq.Q6_K)
    w6 = dequantized(six, gq.Q6_K, n, n)
    got = np.asarray(matvec(GGMLMatrix(six, gq.Q6_K, n), jnp.asarray(x)), np.float64)
    want6, bound = reference(w6, q.astype(np.float64) * d)
    assert np.all(np.abs(got - want6) <= bound)
    assert np.all(np.diag(w6) == 1)


def test_row_stacks_of_mixed_types_and_prologues():
    """One call over parts of other types (a Q4_K_M layer's wq/wk/wv), with RMSNorm before it
    and a residual after, as the decode programs call it."""
    rng = np.random.default_rng(5)
    cols = 512
    parts = [GGMLMatrix(random_blocks(rng, t, r, cols), t, cols)
             for t, r in ((gq.Q5_0, 64), (gq.Q8_0, 16), (gq.Q6_K, 24))]
    stack = stack_rows(parts)
    assert isinstance(stack, RowStack)
    x = rng.standard_normal(cols).astype(np.float32)
    norm = rng.standard_normal(cols).astype(np.float32)
    add = rng.standard_normal(104).astype(np.float32)
    xn = (norm.astype(np.float64) * x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5))
    w = np.concatenate([dequantized(p.data, p.type_id, p.shape[0], cols) for p in parts])
    xn32 = xn.astype(np.float32)
    want = np.concatenate([reference(dequantized(p.data, p.type_id, p.shape[0], cols),
                                     quantized_x(xn32, p.type_id))[0] for p in parts])
    bound = np.concatenate([reference(dequantized(p.data, p.type_id, p.shape[0], cols),
                                      quantized_x(xn32, p.type_id))[1] for p in parts])
    f = jax.jit(lambda w, x, n, a: kernels.matvec(w, x, norm=n, eps=1e-5, add=a))
    for layout in (stack, repacked(stack)):
        got = np.asarray(f(layout, jnp.asarray(x), jnp.asarray(norm), jnp.asarray(add)), np.float64)
        # x after the norm may differ from this float64 one by float32 rounding, which can move
        # an activation's rounding step: allow one step of each block on top of the bound.
        step = np.abs(w) @ np.repeat(np.max(np.abs(xn.reshape(-1, 32)), axis=1) / 127, 32)
        assert np.all(np.abs(got - add - want) <= bound + step * 1e-2 + 1e-4)
        assert np.max(np.abs(got - add - want)) < 0.05 * np.max(np.abs(want))


def test_same_type_parts_stack_into_one_matrix_and_float_parts_join():
    rng = np.random.default_rng(6)
    a = GGMLMatrix(random_blocks(rng, gq.Q4_K, 8, 256), gq.Q4_K, 256)
    b = GGMLMatrix(random_blocks(rng, gq.Q4_K, 16, 256), gq.Q4_K, 256)
    joined = stack_rows([a, b])
    assert isinstance(joined, GGMLMatrix) and joined.shape == (24, 256)
    assert np.array_equal(np.asarray(joined), np.concatenate([np.asarray(a), np.asarray(b)]))
    f = rng.standard_normal((8, 256)).astype(np.float32)
    mixed = stack_rows([a, from_float(f)])
    assert np.array_equal(np.asarray(mixed)[8:], f)
    x = rng.standard_normal(256).astype(np.float32)
    got = np.asarray(matvec(mixed, jnp.asarray(x)), np.float64)
    want_q, bound = reference(np.asarray(a), quantized_x(x, gq.Q4_K))
    assert np.all(np.abs(got[:8] - want_q) <= bound)
    np.testing.assert_allclose(got[8:], f.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_id", sorted(ggml_repack.TYPES), ids=gq.type_name)
def test_x8_layouts_are_permutations_that_round_trip(type_id):
    rng = np.random.default_rng(7)
    elements, nbytes = gq.BLOCK_SIZES[type_id]
    data = rng.integers(0, 256, (3, 16, 2 * nbytes), dtype=np.uint8)
    packed = ggml_repack.repack(data, type_id)
    assert packed.shape == data.shape and not np.array_equal(packed, data)
    if type_id in (gq.Q5_0, gq.Q5_1):  # their high bits are transposed within each row's 4
        ones = np.unpackbits(packed).sum(), np.unpackbits(data).sum()
        assert ones[0] == ones[1]
    else:  # the same bytes
        assert np.array_equal(np.sort(packed.reshape(-1)), np.sort(data.reshape(-1)))
    assert np.array_equal(ggml_repack.unpack(packed, type_id + ggml_repack.X8), data)
    # The kernels' own table (ggml_products.cc) is the same layout.
    lib = ctypes.CDLL(kernels.load())
    pos = np.zeros(8 * nbytes, np.int32)
    assert lib.jllama_x8_positions(type_id, pos.ctypes.data_as(ctypes.c_void_p)) == 0
    inverse = np.empty(8 * nbytes, np.int64)
    inverse[ggml_repack.tile_sources(type_id)] = np.arange(8 * nbytes)
    assert np.array_equal(pos, inverse)


def test_rows_not_a_multiple_of_8_keep_the_row_layout():
    rng = np.random.default_rng(8)
    m = GGMLMatrix(random_blocks(rng, gq.Q4_0, 12, 64), gq.Q4_0, 64)
    assert repacked(m) is m
    stack = RowStack((GGMLMatrix(random_blocks(rng, gq.Q8_0, 8, 64), gq.Q8_0, 64), m))
    assert repacked(stack) is stack


@pytest.mark.parametrize("type_id,qtype", [(gq.Q8_0, Q.Q8_0), (gq.Q4_0, Q.Q4_0),
                                           (gq.Q4_1, Q.Q4_1)])
def test_quantizers_make_gguf_quants_bytes(type_id, qtype):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((3, 10, 96)).astype(np.float32)
    w[0, 0, :32] = 0  # a zero block: d = 0
    w[0, 1, :32] = np.arange(32) - 15.5  # halves everywhere
    got = quantize(w, type_id)
    want = gguf.quants.quantize(w, qtype)
    assert np.array_equal(got.data, want) and got.shape == w.shape
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(w[..., :40], type_id)


def test_q4_0_becomes_q8_0_exactly():
    rng = np.random.default_rng(10)
    m = quantize(rng.standard_normal((16, 64)).astype(np.float32), gq.Q4_0)
    eight = q4_0_as_q8_0(m)
    assert eight.type_id == gq.Q8_0
    assert np.array_equal(np.asarray(eight), np.asarray(m))


def test_layer_stack_holds_a_type_per_layer():
    rng = np.random.default_rng(11)
    layers = (GGMLMatrix(random_blocks(rng, gq.Q4_K, 8, 256), gq.Q4_K, 256),
              GGMLMatrix(random_blocks(rng, gq.Q6_K, 8, 256), gq.Q6_K, 256))
    stack = LayerStack(layers)
    assert stack.shape == (2, 8, 256) and stack.type_names == {"Q4_K", "Q6_K"}
    assert stack[1] is layers[1]
    assert np.array_equal(np.asarray(stack)[1], np.asarray(layers[1]))
    assert stack.nbytes == layers[0].data.nbytes + layers[1].data.nbytes


def test_bad_parts_are_refused_by_the_kernel():
    rng = np.random.default_rng(12)
    m = GGMLMatrix(random_blocks(rng, gq.Q4_0, 8, 64), gq.Q4_0, 64)
    out = jax.ShapeDtypeStruct((8,), jnp.float32)
    attrs = {"prologue": np.int32(0), "eps": np.float32(0), "residual": np.int32(0)}
    call = jax.ffi.ffi_call(kernels.MATVEC_GGML, out)
    with pytest.raises(Exception, match="unknown or its blocks"):
        call(jnp.zeros(64), jnp.asarray(m.data), types=np.array([99], np.int32), **attrs)
    with pytest.raises(Exception, match="rows are not x's length"):
        call(jnp.zeros(96), jnp.asarray(m.data), types=np.array([gq.Q4_0], np.int32), **attrs)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_generic_builds_match_gguf(march):
    """What an AVX2-only CPU runs (x86-64-v3: the x8 layouts with maddubs instead of VNNI) and
    the plain C++ build, registered under their own names and checked as the native one (the
    builds test_kernels.py makes once per run: a handler's name can be registered once)."""
    from test_kernels import march_targets

    names, _ = march_targets(march)
    rng = np.random.default_rng(13)
    attrs = {"prologue": np.int32(0), "eps": np.float32(0), "residual": np.int32(0)}
    for type_id in INTEGER_TYPES:
        rows, cols = shapes_for(type_id)[-1]
        data = random_blocks(rng, type_id, rows, cols)
        wf = dequantized(data, type_id, rows, cols)
        x = rng.standard_normal(cols).astype(np.float32)
        want, bound = expected_product(data, type_id, rows, cols, x)
        layouts = [GGMLMatrix(data, type_id, cols)]
        if march == "x86-64-v3" and type_id in ggml_repack.TYPES:
            layouts.append(repacked(layouts[0]))
        for w in layouts:
            types = np.array([w.type_id], np.int32)
            got = jax.ffi.ffi_call(names[kernels.MATVEC_GGML],
                                   jax.ShapeDtypeStruct((rows,), jnp.float32))(
                jnp.asarray(x), jnp.asarray(w.data), types=types, **attrs)
            assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), (march, w.type_id)
            deq = jax.ffi.ffi_call(names[kernels.DEQUANTIZE_GGML],
                                   jax.ShapeDtypeStruct((rows, cols), jnp.float32))(
                jnp.asarray(w.data), types=types)
            assert np.array_equal(np.asarray(deq).view(np.uint32), wf.view(np.uint32))
