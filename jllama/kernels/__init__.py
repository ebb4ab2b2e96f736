"""jllama's own CPU matrix-vector products, as XLA FFI custom calls inside the compiled
programs.

XLA CPU (JAX 0.10) widens int8 and bfloat16 weights at about 1.6 G elements/s per core inside
its products, so on this project's 2-core machine narrower weights decoded slower than
float32 (stories110M int8 44 tok/s, f32 78). The loops in `matvec.cc` read int8 and bfloat16 at
about float32's bytes per second (int8: 231 tok/s) and float32 at least as fast as XLA's dot
(bench/NOTES.md). A decode step is almost all matrix-vector products, so `matvec="kernel"`
(the default on CPU, see `jllama.backends.jax_graph`) calls these instead of `jnp.dot`.

  load()          build (once per machine, `jllama.kernels.library`) and register the handlers
  matvec(w, x)    one product inside a traced program: w f32/bf16[m, n] or `Int8Matrix`,
                  optionally with RMSNorm or SwiGLU before it and a residual add after
  attention(...)  one token's attention over a layer's cache blocks, positions 0 .. pos only
  sample(...)     one token drawn as run.c's sampler (and the host's `Sampler`), bit for bit
  argmax(logits)  greedy decoding's token (run.c's argmax) and whether every logit is finite
  rope_write(...) one token's RoPE on q and k and its key and value written into the cache
  attention_chunk(...)  a prefill chunk's causal attention (T tokens), the chunk's own block
                  only up to each token

Only for one CPU device: under tensor parallelism XLA's partitioner cannot split a custom
call, so split programs keep `jnp.dot`; other platforms never lower these targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jllama.kernels.library import (
    SYMBOLS,
    VECTOR_WIDTH,
    KernelBuildError,
    build,
    check_library,
)
import jllama.model.pytrees  # noqa: F401 (registers the weight dataclasses as JAX pytrees)
from jllama.model.ggml_matrix import FLOAT_TYPES, FloatRows, GGMLMatrix, RowStack
from jllama.model.quant import Int8Matrix

MATVEC_MODES = ("xla", "kernel")
"""How the decode programs compute a matrix-vector product: "xla": `jnp.dot` (or XLA's
widening multiply-and-sum for narrow weights); "kernel": jllama's CPU kernels."""

TARGETS = dict(zip(("float32", "bfloat16", "int8"), SYMBOLS[:3], strict=True))
"""The FFI handler for each weight dtype (int8: one scale per row)."""
GROUPED_INT8 = SYMBOLS[3]
"""The handler for int8 with one scale per group of a row (`Int8Matrix.grouped`)."""
ATTENTION = SYMBOLS[4]
"""The handler for one token's attention over cache blocks of any KV cache type (results
float32, as every `_f32` handler's)."""
SAMPLE = SYMBOLS[5]
"""The handler for drawing one token from logits as run.c's sampler."""
ARGMAX = SYMBOLS[6]
"""The handler for greedy decoding's pick and the check that every logit is finite."""
ROPE_WRITE = SYMBOLS[7]
"""The handler for RoPE on one token's queries and keys plus the write of its key and value
into the layer's cache block."""
ATTENTION_CHUNK = SYMBOLS[8]
"""The handler for a prefill chunk's causal attention over cache blocks of any KV cache type."""
MATVEC_GGML, DEQUANTIZE_GGML, ROWS_GGML, MATMUL_GGML = SYMBOLS[9:13]
"""The handlers for GGML blocks (`jllama.model.ggml_matrix`): a product with stacked parts of any
types, the parts dequantized to float32, rows of a table dequantized, and the product with the
T tokens of a prefill chunk."""

PROLOGUE_PLAIN, PROLOGUE_RMSNORM, PROLOGUE_SWIGLU = 0, 1, 2
"""The matvec handlers' `prologue` attribute (`matvec.cc`): x as given, RMSNorm(x) * norm,
silu(x) * gate."""

__all__ = ["MATVEC_MODES", "KernelBuildError", "argmax", "attention", "attention_chunk",
           "attention_chunk_fits", "dequantize", "embedding_rows", "ggml_operands", "load",
           "matvec", "prologue_args", "rope_write", "sample", "vector_width"]


def prologue_args(name: str, norm_shape, gate_shape, add_shape, norm, eps, gate, add
                  ) -> tuple[list, dict]:
    """The extra operands and the attributes of a product's prologue and residual (the matvec
    handlers' `prologue`, `eps`, `residual`), checked: norm of norm_shape, or gate of
    gate_shape (not both), add of add_shape.

    Raises:
      ValueError: both norm and gate, or an operand of another shape (naming `name`).
    """
    if norm is not None and gate is not None:
        raise ValueError(f"{name} takes norm or gate, not both")
    prologue, extra = PROLOGUE_PLAIN, []
    for kind, v, shape in ((PROLOGUE_RMSNORM, norm, norm_shape), (PROLOGUE_SWIGLU, gate, gate_shape)):
        if v is not None:
            if v.shape != tuple(shape):
                what = (f"x's shape {tuple(gate_shape)}" if tuple(shape) == tuple(gate_shape)
                        else f"f32{list(shape)}, a row of x")
                raise ValueError(f"{name}'s norm or gate must be {what}, got {v.shape}")
            prologue, extra = kind, [v.astype(jnp.float32)]
    if add is not None:
        if add.shape != tuple(add_shape):
            raise ValueError(f"{name}'s add must be f32{list(add_shape)}, got {add.shape}")
        extra.append(add.astype(jnp.float32))
    attrs = {"prologue": np.int32(prologue), "eps": np.float32(eps),
             "residual": np.int32(add is not None)}
    return extra, attrs


@functools.cache
def load() -> str:
    """Build the kernels if needed, load them and register their FFI targets with JAX (once
    per process). Returns the library's path.

    Raises:
      KernelBuildError: see `jllama.kernels.library.build`, or the cached library does not
        load.
    """
    path = build()
    try:
        lib = check_library(path)
    except KernelBuildError as e:  # a cached file damaged since it was built
        raise KernelBuildError(f"{e}; delete it to rebuild, or pass --matvec=xla") from None
    for target in SYMBOLS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform="cpu")
    return str(path)


def matvec(
    w,
    x: jax.Array,
    *,
    norm: jax.Array | None = None,
    eps: float = 0.0,
    gate: jax.Array | None = None,
    add: jax.Array | None = None,
) -> jax.Array:
    """`add + w @ f(x)` by jllama's CPU kernel, for tracing inside a jitted program (call
    `load()` first, outside the trace), with the small work around a llama layer's products done
    inside the same call (in XLA each was a few programs of ~1 us on a few hundred floats).

    Args:
      w: f32[m, n], bf16[m, n] (widened exactly), an `Int8Matrix` (q int8[m, n], scale
        f32[m]: `scale * (q @ x)`; or grouped, scale f32[m, n // g]: each group's sum times its
        scale), or GGML blocks (`jllama.model.ggml_matrix.GGMLMatrix` / `RowStack`: the integer types
        against x quantized to int8 per 32 as Q8_0, ggml_dot.h), rows as llama2.c's "out x in".
      x: f32[n].
      norm: f32[n] or None; given, f(x) = RMSNorm as llama2.c run.c, `norm * (x /
        sqrt(mean(x**2) + eps))` (`jllama.graphs.ops.rmsnorm`), the sum of squares in 16
        lanes then a fixed tree.
      eps: RMSNorm's epsilon (only with norm).
      gate: f32[n] or None; given, f(x) = `silu(x) * gate` (SwiGLU's input to w2, Shazeer
        2020, as run.c), silu(x) = x / (1 + exp(-x)) with an exp good to about 1 ulp. Not with
        norm.
      add: f32[m] or None; given, it is added to the product (the residual stream), `add[i] +
        (w @ f(x))[i]`, as XLA would add them.
      Without norm or gate f(x) = x.

    Returns:
      f32[m]. Each row's sum runs in a fixed order (64 interleaved partial sums), so it differs
      from `jnp.dot`'s by float rounding only, and the same arguments give the same bits.

    Raises:
      ValueError: another weight dtype, shapes that do not agree, or both norm and gate.
    """
    out = jax.ShapeDtypeStruct((w.shape[0],), jnp.float32)
    if w.ndim != 2 or x.shape != (w.shape[1],):
        raise ValueError(f"matvec needs w[m, n] and x[n], got {w.shape} and {x.shape}")
    extra, attrs = prologue_args("matvec", x.shape, x.shape, out.shape, norm, eps, gate, add)
    x = x.astype(jnp.float32)
    if isinstance(w, (GGMLMatrix, RowStack, FloatRows)):
        parts, types = ggml_operands(w)
        return jax.ffi.ffi_call(MATVEC_GGML, out)(x, *parts, *extra, types=types, **attrs)
    if isinstance(w, Int8Matrix) and w.grouped:
        return jax.ffi.ffi_call(GROUPED_INT8, out)(w.q, w.scale, x, *extra, **attrs)
    if isinstance(w, Int8Matrix):
        return jax.ffi.ffi_call(TARGETS["int8"], out)(w.q, w.scale, x, *extra, **attrs)
    name = jnp.dtype(w.dtype).name
    if name not in TARGETS or name == "int8":
        raise ValueError(f"matvec has no kernel for {name} weights")
    return jax.ffi.ffi_call(TARGETS[name], out)(w, x, *extra, **attrs)


def ggml_operands(w) -> tuple[list, np.ndarray]:
    """The GGML handlers' operands for w (a `GGMLMatrix`, `RowStack` or `FloatRows`): its parts'
    arrays (byte arrays, or the typed float arrays of `FloatRows`) and their ggml type ids
    (int32[k], the handlers' `types` attribute)."""
    if isinstance(w, FloatRows):  # the arrays themselves, typed
        types = [FLOAT_TYPES[jnp.dtype(p.dtype).name] for p in w.parts]
        return list(w.parts), np.array(types, np.int32)
    parts = w.parts if isinstance(w, RowStack) else (w,)
    return [p.data for p in parts], np.array([p.type_id for p in parts], np.int32)


def dequantize(w) -> jax.Array:
    """A GGMLMatrix or RowStack as f32[rows, cols], exactly ggml's values (`ggml::dequantize_row`,
    split over XLA's threads), for tracing inside a jitted program (call `load()` first): the
    prefill chunks multiply it with XLA's matrix product."""
    parts, types = ggml_operands(w)
    out = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    return jax.ffi.ffi_call(DEQUANTIZE_GGML, out)(*parts, types=types)


def matmul(w, x: jax.Array) -> jax.Array:
    """x: f32[T, n] times a GGMLMatrix or RowStack [m, n] (out x in): f32[T, m], each token's
    row as `matvec` computes it for that token alone (activations quantized per token, the same
    sums in the same order). For tracing inside a jitted program (call `load()` first)."""
    parts, types = ggml_operands(w)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(MATMUL_GGML, out)(x.astype(jnp.float32), *parts, types=types)


def embedding_rows(table: GGMLMatrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` (int32[k]) of a [vocab_size, dim] GGMLMatrix, dequantized: f32[k, dim].
    For tracing inside a jitted program (call `load()` first). A token out of range is an error
    from the kernel."""
    out = jax.ShapeDtypeStruct((tokens.shape[0], table.cols), jnp.float32)
    return jax.ffi.ffi_call(ROWS_GGML, out)(table.data, tokens.astype(jnp.int32),
                                            type=np.int32(table.type_id))


def attention(
    qg: jax.Array,
    key_blocks,
    value_blocks,
    pos: jax.Array,
    cur: jax.Array | None = None,
    key_cur: jax.Array | None = None,
    value_cur: jax.Array | None = None,
) -> jax.Array:
    """One token's attention over a layer's cache by jllama's CPU kernel, as llama2.c run.c:
    for each query head, scores `q . k_t / sqrt(head_dim)` against its key head for t = 0 ..
    pos only, softmax, and the weighted sum of the values. For tracing inside a jitted program
    (call `load()` first).

    Args:
      qg: f32[n_kv_heads, kv_mul, head_dim], the queries after RoPE, grouped by key head.
      key_blocks, value_blocks: the layer's first k cache blocks (`jllama.graphs.attention`),
        positions 0 .. pos written; keys of one KV cache type and values of one
        (`jllama.model.cache_types`, told by the dtype): f32/f16/bf16[n_kv_heads, block_length,
        head_dim] or q8_0's uint8[n_kv_heads, block_length, head_dim // 32 * 34]. Each stored
        value is widened to float32 (q8_0: d * q) and the arithmetic is float32.
      pos: int32 scalar, 0 <= pos < k * block_length (checked by the kernel: an error at
        run time, not a wrong read).
      cur, key_cur, value_cur: optionally block `cur` (int32 scalar) given apart, as the
        decode loop holds it; key_blocks[cur] and value_blocks[cur] are then not read.

    Returns:
      f32[n_kv_heads, kv_mul, head_dim]. Each key and value row is read once for the kv_mul
      query heads of its key head, in spans of 256 positions shared among the threads, whose
      partial softmaxes are merged in span order (attention_decode.cc): the bits do not depend
      on the thread count, and differ from XLA's masked softmax by float rounding only.
    """
    if cur is None:
        cur, key_cur, value_cur = jnp.int32(-1), key_blocks[0], value_blocks[0]
    out = jax.ShapeDtypeStruct(qg.shape, jnp.float32)
    return jax.ffi.ffi_call(ATTENTION, out)(
        qg.astype(jnp.float32), jnp.asarray(pos, jnp.int32), jnp.asarray(cur, jnp.int32),
        key_cur, value_cur, *key_blocks, *value_blocks,
    )


def sample(logits: jax.Array, temperature, top_p, coin) -> jax.Array:
    """One token drawn from `logits` as llama2.c run.c's `sample` with temperature > 0, by
    jllama's CPU kernel: the same arithmetic as `jllama.sampling.Sampler` in the same order
    (logits / temperature in float32, softmax with exp correctly rounded to float32, sequential
    float32 sums, `sample_mult`, or `sample_topp` when 0 < top_p < 1), so for the same logits
    and coin it returns the host sampler's token. For tracing inside a jitted program (call
    `load()` first).

    Args:
      logits: f32[vocab_size].
      temperature: f32 scalar > 0 (a vanishing one shares the mass among the maxima, as
        `Sampler`).
      top_p: f32 scalar; <= 0 or >= 1 samples from the whole distribution.
      coin: f32 scalar in [0, 1), e.g. `XorShiftRng.random_f32()`.

    Returns:
      int32 scalar, the token id.
    """
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return jax.ffi.ffi_call(SAMPLE, jax.ShapeDtypeStruct((), jnp.int32))(
        f32(logits), f32(temperature), f32(top_p), f32(coin)
    )


def argmax(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy decoding's token, as llama2.c run.c's `argmax` (the first index of the maximum),
    and whether every logit is finite, by jllama's CPU kernel in one call (XLA needed four or
    five programs over the logits). For tracing inside a jitted program (call `load()` first).

    Args:
      logits: f32[vocab_size].

    Returns:
      (token: int32 scalar, finite: bool scalar). When some logit is inf or NaN the token is 0
      and means nothing.
    """
    token, finite = jax.ffi.ffi_call(
        ARGMAX, (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    )(logits.astype(jnp.float32))
    return token, finite != 0


def rope_write(
    qkv: jax.Array, pos: jax.Array, inv_freq: jax.Array, key_block: jax.Array,
    value_block: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token's RoPE and cache write by jllama's CPU kernel, in one call: the queries and
    keys of the stacked QKV product rotated as llama2.c run.c (pair (2i, 2i + 1) of each head
    by the float32 angle `pos * inv_freq[i]`, with cosf / sinf), the key and value stored at
    `pos % block_length` of the cache blocks, which are updated in place (the call aliases each
    to its result; donate them, or hold them in a loop's carry). For tracing inside a jitted
    program (call `load()` first).

    Args:
      qkv: f32[(n_heads + 2 * n_kv_heads) * head_dim], wq's rows, then wk's, then wv's (one
        device's stacked product, `jllama.graphs.ops.split_qkv` with shards=1).
      pos: int32 scalar >= 0, the token's position.
      inv_freq: f32[head_dim // 2], `jllama.model.rope.rope_frequencies`.
      key_block, value_block: the blocks holding pos, each of a KV cache type
        (`jllama.model.cache_types`, told by its dtype; keys and values each their own):
        f32/f16/bf16[n_kv_heads, block_length, head_dim] or q8_0's uint8[n_kv_heads,
        block_length, head_dim // 32 * 34].

    Returns:
      (q: f32[n_heads, head_dim] after RoPE, key_block, value_block with this token's key (after
      RoPE) and value at pos % block_length, rounded to the block's type: f16 and bf16 to
      nearest even, q8_0 as llama.cpp's CPU backend writes a q8_0 cache row (per 32 values d =
      max|x| / 127 as float16, q = x * 127 / max|x| rounded half to even; cache_rows.h)).
      Shapes that do not agree, or pos < 0, are an error from the kernel.
    """
    n_kv = key_block.shape[0]
    head_dim = 2 * inv_freq.shape[0]
    n_heads = qkv.shape[0] // head_dim - 2 * n_kv
    out = (
        jax.ShapeDtypeStruct((n_heads, head_dim), jnp.float32),
        jax.ShapeDtypeStruct(key_block.shape, key_block.dtype),
        jax.ShapeDtypeStruct(value_block.shape, value_block.dtype),
    )
    return jax.ffi.ffi_call(ROPE_WRITE, out, input_output_aliases={3: 1, 4: 2})(
        qkv.astype(jnp.float32), jnp.asarray(pos, jnp.int32), inv_freq.astype(jnp.float32),
        key_block, value_block,
    )


def attention_chunk_fits(head_dim: int, block_length: int, *, fast_only: bool = True) -> bool:
    """Whether `attention_chunk` takes these shapes: head_dim a multiple of 16 up to 128 (one
    register of 16 floats per 16 dimensions), cache blocks a multiple of 16 positions (a tile
    of 16 keys never crosses a block). With fast_only (the prefill program's question), also
    whether the kernel is faster than XLA's attention here: only when the library was built
    with AVX-512 or AVX2 loops (`vector_width` 16 or 8); its plain loops ran 5-8x slower than
    XLA's."""
    fits = head_dim % 16 == 0 and 16 <= head_dim <= 128 and block_length % 16 == 0
    return fits and (not fast_only or vector_width() >= 8)


@functools.cache
def vector_width() -> int:
    """Floats per vector register of the loaded library's explicit loops: 16 with AVX-512, 8
    with AVX2 and FMA (the prefill attention only), else 1 (builds the library if needed, as
    `load`).

    Raises:
      KernelBuildError: as `load`.
    """
    return int(getattr(check_library(load()), VECTOR_WIDTH)())


def attention_chunk(q: jax.Array, key_blocks, value_blocks, pos: jax.Array) -> jax.Array:
    """Causal attention of a prefill chunk by jllama's CPU kernel: token t (at position pos +
    t) attends with query head h over key head h // kv_mul at cache positions 0 .. pos + t
    (`jllama.graphs.prefill.attention_chunk`, llama2.c run.c's attention per token). XLA's
    version multiplies every query by whole cache blocks and masks the scores; this one reads
    each token's visible keys only. For tracing inside a jitted program (call `load()` first).

    Args:
      q: f32[T, n_heads, head_dim], the chunk's queries after RoPE; head_dim as
        `attention_chunk_fits`.
      key_blocks, value_blocks: the layer's first k cache blocks, holding positions 0 .. pos
        + T - 1 (the chunk's own keys and values already written; later positions are not
        used); of any KV cache type as `attention` takes them (block_length as
        `attention_chunk_fits`).
      pos: int32 scalar, the chunk's first position; 0 <= pos and pos + T <= k * block_length
        (checked by the kernel: an error at run time, not a wrong read).

    Returns:
      f32[T, n_heads * head_dim]. Tiles of 16 tokens of one head are split over XLA's pool
      threads, each computed on one thread in a fixed order (score sums over head_dim, then
      over positions in order), so the bits do not depend on the thread count; they differ
      from XLA's masked softmax by float rounding only.

    Raises:
      ValueError: shapes `attention_chunk_fits` refuses.
    """
    t, n_heads, head_dim = q.shape
    block_length = key_blocks[0].shape[1]
    if not attention_chunk_fits(head_dim, block_length, fast_only=False):
        raise ValueError(
            f"attention_chunk has no kernel for head_dim {head_dim} and cache blocks of "
            f"{block_length} positions"
        )
    out = jax.ShapeDtypeStruct((t, n_heads * head_dim), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_CHUNK, out)(
        q.astype(jnp.float32), jnp.asarray(pos, jnp.int32), *key_blocks, *value_blocks
    )
