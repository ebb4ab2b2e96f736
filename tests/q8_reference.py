"""llama.cpp's activation quantizers, written out in NumPy from ggml-cpu/arch/x86/quants.c and
ggml-quants.c: the reference the tests hold jllama's kernels (jllama/kernels/ggml_dot.h) to."""

from __future__ import annotations

import numpy as np

from jllama.formats import ggml_quants as gq

K_TYPES = (gq.Q2_K, gq.Q3_K, gq.Q4_K, gq.Q5_K, gq.Q6_K)


def activations(x: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int8[n], d float64[n]: each value's step) as llama.cpp's CPU backend quantizes x for a
    product with `type_id` weights: Q8_K for the K-quants (per 256: m the first value of largest
    magnitude, iscale = -127 / m in float32, q = min(127, rint(iscale * x)), d = 1 / iscale),
    Q8_0 / Q8_1 otherwise (per 32: q = rint(x * (127 / max|x|)), d = max|x| / 127 rounded to
    float16). rint rounds half to even, as llama.cpp's _mm256_round_ps and nearest_int."""
    f32 = np.float32
    x = x.astype(f32)
    if type_id in K_TYPES:
        blocks = x.reshape(-1, 256)
        first = np.argmax(np.abs(blocks), axis=1)
        m = blocks[np.arange(len(blocks)), first]
        with np.errstate(divide="ignore"):
            iscale = np.where(m != 0, f32(-127) / m, f32(0)).astype(f32)
        q = np.minimum(np.rint(blocks * iscale[:, None]), 127).astype(np.int8)
        with np.errstate(divide="ignore"):
            d = np.where(iscale != 0, f32(1) / iscale, f32(0)).astype(f32)
        return q.reshape(-1), np.repeat(d.astype(np.float64), 256)
    blocks = x.reshape(-1, 32)
    amax = np.max(np.abs(blocks), axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, f32(127) / amax, f32(0)).astype(f32)
    q = np.rint(blocks * inv[:, None]).astype(np.int8)
    d = (amax / f32(127)).astype(np.float16).astype(np.float64)
    return q.reshape(-1), np.repeat(d, 32)


def quantized_x(x: np.ndarray, type_id: int = gq.Q8_0) -> np.ndarray:
    """x as llama.cpp quantizes it for `type_id` weights, float64 values (q * d)."""
    q, d = activations(x, type_id)
    return q.astype(np.float64) * d


