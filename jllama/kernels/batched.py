"""The batched decode step's kernels (batch.cc), for tracing inside the jitted programs of
`jllama.graphs.batch`: products of B vectors reading each weight row once, and each
sequence's RoPE, cache write and attention on its own cache, with the bits of the
single-sequence kernels (`jllama.kernels.matvec`, `rope_write`, `attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jllama.model.ggml_matrix import FloatRows, GGMLMatrix, RowStack
from jllama.kernels import SYMBOLS, ggml_operands, prologue_args
from jllama.model.quant import Int8Matrix

BATCH_TARGETS = dict(zip(("float32", "bfloat16", "int8"), SYMBOLS[13:16], strict=True))
"""The batched products' handlers per weight dtype (`matvec_batch`; batch.cc)."""
GROUPED_INT8_BATCH, ROPE_ATTEND_BATCH, GGML_BATCH, SAMPLE_BATCH = SYMBOLS[16:20]
"""The batched product for grouped int8, the batched decode's RoPE, cache write and attention
(`rope_attend_batch`), the batched product of GGML blocks, and every row's draw
(`sample_batch`)."""


def batch_supported(w) -> bool:
    """Whether `matvec_batch` takes w: f32 / bf16 [m, n], an `Int8Matrix`, or GGML blocks
    (`GGMLMatrix`, `RowStack`, `FloatRows`) as `matvec` takes them."""
    if isinstance(w, (Int8Matrix, GGMLMatrix, RowStack, FloatRows)):
        return True
    return getattr(w, "ndim", 0) == 2 and jnp.dtype(w.dtype).name in ("float32", "bfloat16")


def matvec_batch(
    w,
    x: jax.Array,
    count: jax.Array,
    *,
    norm: jax.Array | None = None,
    eps: float = 0.0,
    gate: jax.Array | None = None,
    add: jax.Array | None = None,
) -> jax.Array:
    """`matvec` for B vectors at once, each weight row read once for all of them (batch.cc):
    row b of the result has the bits `matvec(w, x[b], norm=norm, eps=eps, gate=gate[b],
    add=add[b])` gives, whatever B and the other rows are. For tracing inside a jitted program
    (call `load()` first).

    Args:
      w: f32[m, n], bf16[m, n], an `Int8Matrix` or GGML blocks (`batch_supported`): each
        GGML row against x[b] quantized as `matvec` quantizes x, the 8 rows of a repacked
        group decoded once for 4 rows of x.
      x: f32[B, n].
      count: int32 scalar, the rows of x that are real (0 <= count <= B): rows from count on
        (padding up to a compiled batch size) are not computed and come back as zeros.
      norm, eps: as `matvec` (one weight f32[n] for every row).
      gate: f32[B, n] or None, as `matvec`'s per row.
      add: f32[B, m] or None, as `matvec`'s per row.

    Returns:
      f32[B, m].
    """
    b, n = x.shape
    m = w.shape[0]
    if w.ndim != 2 or w.shape[1] != n:
        raise ValueError(f"matvec_batch needs w[m, n] and x[B, n], got {w.shape} and {x.shape}")
    if not batch_supported(w):
        raise ValueError("matvec_batch takes f32, bf16, int8 or GGML weights")
    extra, attrs = prologue_args("matvec_batch", (n,), x.shape, (b, m), norm, eps, gate, add)
    out = jax.ShapeDtypeStruct((b, m), jnp.float32)
    x = x.astype(jnp.float32)
    count = jnp.asarray(count, jnp.int32)
    if isinstance(w, (GGMLMatrix, RowStack, FloatRows)):
        parts, types = ggml_operands(w)
        return jax.ffi.ffi_call(GGML_BATCH, out)(x, count, *parts, *extra, types=types, **attrs)
    if isinstance(w, Int8Matrix):
        target = GROUPED_INT8_BATCH if w.grouped else BATCH_TARGETS["int8"]
        return jax.ffi.ffi_call(target, out)(w.q, w.scale, x, count, *extra, **attrs)
    return jax.ffi.ffi_call(BATCH_TARGETS[jnp.dtype(w.dtype).name], out)(w, x, count, *extra,
                                                                         **attrs)


def rope_attend_batch(
    qkv: jax.Array, pos: jax.Array, count: jax.Array, inv_freq: jax.Array,
    key_current: tuple, value_current: tuple, key_blocks: tuple, value_blocks: tuple,
) -> tuple[jax.Array, tuple, tuple]:
    """One layer's RoPE, cache write and attention for B sequences, each on its own cache, in
    one call (batch.cc): sequence b is `rope_write(qkv[b], pos[b], ...)` into its current
    blocks, then `attention` over its blocks, by the same code as those two kernels (the same
    bits). For tracing inside a jitted program (call `load()` first).

    Args:
      qkv: f32[B, (n_heads + 2 * n_kv_heads) * head_dim], the stacked QKV product's rows.
      pos: int32[B], each sequence's position.
      count: int32 scalar: sequences from count on are padding (not computed, not written).
      inv_freq: f32[head_dim // 2].
      key_current, value_current: B blocks each, block pos[b] // block_length of sequence b's
        layer cache, updated in place (aliased to the results: donate them; distinct buffers).
        Keys of one KV cache type and values of one, as `jllama.kernels.rope_write` takes
        them (f32/f16/bf16[n_kv_heads, block_length, head_dim], q8_0 uint8[n_kv_heads,
        block_length, head_dim // 32 * 34]).
      key_blocks, value_blocks: B * K blocks each, sequence b's blocks 0 .. K - 1 at b * K ..;
        the slot of its current block, and blocks past it, are not read (pass any block).

    Returns:
      (att f32[B, n_heads * head_dim], key_current, value_current written).
    """
    batch = qkv.shape[0]
    n_kv = key_current[0].shape[0]
    head_dim = 2 * inv_freq.shape[0]
    n_heads = qkv.shape[1] // head_dim - 2 * n_kv
    key = jax.ShapeDtypeStruct(key_current[0].shape, key_current[0].dtype)
    value = jax.ShapeDtypeStruct(value_current[0].shape, value_current[0].dtype)
    out = (jax.ShapeDtypeStruct((batch, n_heads * head_dim), jnp.float32),
           *([key] * batch), *([value] * batch))
    aliases = {4 + i: 1 + i for i in range(2 * batch)}
    att, *written = jax.ffi.ffi_call(ROPE_ATTEND_BATCH, out, input_output_aliases=aliases)(
        qkv.astype(jnp.float32), jnp.asarray(pos, jnp.int32), jnp.asarray(count, jnp.int32),
        inv_freq.astype(jnp.float32), *key_current, *value_current, *key_blocks, *value_blocks,
    )
    return att, tuple(written[:batch]), tuple(written[batch:])


@jax.jit
def sample_batch(logits, temperature, top_p, coin, count):
    """The next token of each row of a batched step, drawn by jllama's CPU kernel
    (sampling.cc `sample_rows`): row b < count as `jllama.kernels.sample` with its own
    temperature, top_p and coin (run.c's sampler, bit for bit the host `Sampler`'s token for
    the same logits and coin), or run.c's argmax where its temperature is 0. The rows are shared
    among XLA's threads. Call `jllama.kernels.load()` first.

    Args:
      logits: f32[B, vocab_size].
      temperature: f32[B] (0: greedy); top_p: f32[B] (<= 0 or >= 1: the whole distribution);
        coin: f32[B] in [0, 1), each row's `XorShiftRng.random_f32()` (unused where greedy).
      count: int32 scalar, the rows to draw (the rest get token 0).

    Returns:
      (token: int32[B], finite: bool[B]): where a row holds an inf or NaN, finite is False and
      its token means nothing.
    """
    b = logits.shape[0]
    token, finite = jax.ffi.ffi_call(
        SAMPLE_BATCH, (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    )(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
      jnp.asarray(top_p, jnp.float32), jnp.asarray(coin, jnp.float32),
      jnp.asarray(count, jnp.int32))
    return token, finite != 0
