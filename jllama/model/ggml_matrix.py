"""Weight matrices held as GGML blocks, as a GGUF file stores them (Q4_K, Q5_0, Q8_0, ...).

A quantized GGUF tensor is rows of blocks (`jllama.formats.ggml_quants`): `GGMLMatrix` keeps
those bytes as they are, u8[..., rows, row_bytes], usually a view of the memory-mapped file, so
a model takes its stored size in memory and loading converts nothing. jllama's CPU kernels
read the blocks directly (`jllama.kernels.matvec`, ggml_dot.h): the integer types against
activations quantized to int8 per 32, the float types (F32, F16, BF16) against float32.

`RowStack` is several matrices with the same input length stacked along their rows, each in
its own type: a layer's wq, wk and wv become one product (`wqkv`) even where the file stores
them in different types (a Q4_K_M file's attn_v is often Q6_K or Q8_0 beside Q4_K or Q5_0).

Both are frozen dataclasses, registered by `jllama.model.pytrees` (imported by the JAX code; this
module imports no JAX) as JAX pytrees whose only leaves are the byte arrays (the type ids and
lengths are static), so they travel through `jax.device_put` and `jax.jit` like arrays;
`np.asarray` of either is the dequantized float32 matrix, exactly ggml's values (what the NumPy
reference and XLA's products compute with).

`quantize(w, type)` makes Q8_0, Q4_0 or Q4_1 blocks from float weights as ggml's reference
quantizers do (`quantize_row_q8_0_ref`, `_q4_0_ref`, `_q4_1_ref`), for `--dtype=q4` and
`--dtype=int8`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.formats import ggml_quants as gq
from jllama.model.ggml_repack import X8, base_type, can_repack, repack, unpack
from jllama.model.quant import Int8Matrix, dequantize


@dataclasses.dataclass(frozen=True)
class GGMLMatrix:
    """A matrix (or a stack of them along leading axes) as GGML blocks.

    Attributes:
      data: u8[..., rows, row_bytes], each row `cols` elements of `type_id` in blocks
        (`ggml_quants.BLOCK_SIZES`): row_bytes = cols / block elements * block bytes.
      type_id: the ggml type id (`ggml_quants.Q4_K` etc.), static under jit.
      cols: elements per row (the matrix's input length, "in" of out x in), static.
    """

    data: np.ndarray
    type_id: int
    cols: int

    def __post_init__(self):
        expected = gq.row_nbytes(base_type(self.type_id), self.cols)
        if self.data.shape[-1:] != (expected,):
            raise ValueError(
                f"{gq.type_name(self.type_id)} rows of {self.cols} elements take {expected} "
                f"bytes, got data of shape {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the matrix it stands for: (..., rows, cols)."""
        return (*self.data.shape[:-1], self.cols)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def type_name(self) -> str:
        """ggml's name of the type, e.g. "Q4_K" (also for its x8 layout)."""
        return gq.type_name(base_type(self.type_id))

    @property
    def repacked(self) -> bool:
        """Whether the blocks are in an x8 layout (`jllama.model.ggml_repack`)."""
        return self.type_id >= X8

    def stored_data(self) -> np.ndarray:
        """The blocks in ggml's own layout (unpacked from x8 if need be)."""
        return unpack(np.asarray(self.data), self.type_id) if self.repacked else np.asarray(self.data)

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks as stored."""
        return int(self.data.nbytes)

    def __getitem__(self, index) -> GGMLMatrix:
        """Index the leading axes (layers): `m[l]` is layer l's matrix. Rows of a matrix
        (`m[token]` of an embedding table) are `rows`."""
        if self.data.ndim < 3:
            raise IndexError("index a GGMLMatrix's rows with rows(), its layers with []")
        return GGMLMatrix(self.data[index], self.type_id, self.cols)

    def rows(self, index) -> np.ndarray:
        """Rows of the (2-D) matrix dequantized: f32[cols] for an int index, f32[k, cols] for k
        indices."""
        data = self.stored_data()[index]
        return gq.dequantize(data, base_type(self.type_id), (*data.shape[:-1], self.cols))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The dequantized matrix, f32[..., rows, cols] (a new array, ggml's exact values)."""
        out = gq.dequantize(self.stored_data(), base_type(self.type_id), self.shape)
        return out if dtype is None else out.astype(dtype)


class _Matrices:
    """What `RowStack` and `LayerStack` share: several `GGMLMatrix` held apart (`matrices`),
    read as one array by joining them with `_join` (along their rows, or along a new leading
    layer axis)."""

    _join = staticmethod(np.concatenate)

    @property
    def matrices(self) -> tuple[GGMLMatrix, ...]:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: every matrix's blocks as stored."""
        return sum(m.nbytes for m in self.matrices)

    @property
    def type_names(self) -> set[str]:
        """The ggml type names of the matrices, e.g. {"Q4_K", "Q6_K"}."""
        return {m.type_name for m in self.matrices}

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The dequantized matrices joined, f32 (a new array, ggml's exact values)."""
        out = self._join([np.asarray(m) for m in self.matrices])
        return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class RowStack(_Matrices):
    """Matrices with the same `cols` stacked along their rows, each in its own GGML type: the
    product with x is the parts' products end to end. Its shape is [sum of rows_k, cols].

    Attributes:
      parts: 2 to 4 `GGMLMatrix` of shape [rows_k, cols].
    """

    parts: tuple[GGMLMatrix, ...]

    @property
    def matrices(self) -> tuple[GGMLMatrix, ...]:
        return self.parts

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].cols)


@dataclasses.dataclass(frozen=True)
class LayerStack(_Matrices):
    """One weight of every layer, each layer's matrix in its own type (a Q4_K_M file stores
    ffn_down as Q4_K in some layers and Q6_K in others): `TransformerWeights`' layer-stacked
    field for GGML weights, of shape [n_layers, rows, cols]. `stack[l]` is layer l's matrix.

    Attributes:
      layers: a `GGMLMatrix` [rows, cols] per layer, all of one shape.
    """

    layers: tuple[GGMLMatrix, ...]
    _join = staticmethod(np.stack)

    def __getitem__(self, layer: int) -> GGMLMatrix:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.layers), *self.layers[0].shape)

    @property
    def matrices(self) -> tuple[GGMLMatrix, ...]:
        return self.layers


def type_names(m) -> set[str]:
    """The ggml type names a GGMLMatrix, RowStack or LayerStack holds."""
    return {m.type_name} if isinstance(m, GGMLMatrix) else m.type_names


def is_ggml(m) -> bool:
    """Whether m is GGML blocks (a GGMLMatrix, RowStack or LayerStack)."""
    return isinstance(m, (GGMLMatrix, RowStack, LayerStack))


MAX_PARTS = 4
"""The most parts one kernel call takes (ggml_products.cc's kMaxParts)."""


def stack_rows(matrices) -> GGMLMatrix | RowStack:
    """`matrices` (GGMLMatrix of the same `cols`) stacked along their rows: one GGMLMatrix when
    they share a type (the blocks concatenated: exact), else a `RowStack`.

    Raises:
      ValueError: different row lengths, or more than MAX_PARTS types that differ.
    """
    matrices = list(matrices)
    if len({m.cols for m in matrices}) != 1:
        raise ValueError(f"rows of different lengths: {[m.cols for m in matrices]}")
    if len({m.type_id for m in matrices}) == 1:
        data = np.concatenate([np.asarray(m.data) for m in matrices], axis=-2)
        return GGMLMatrix(data, matrices[0].type_id, matrices[0].cols)
    if len(matrices) > MAX_PARTS:
        raise ValueError(f"at most {MAX_PARTS} parts in a RowStack, got {len(matrices)}")
    return RowStack(tuple(matrices))


def from_float(w: np.ndarray) -> GGMLMatrix:
    """A float32, float16 or bfloat16 matrix as a GGMLMatrix of its own type (the same bytes;
    for a `RowStack` part beside quantized ones)."""
    import ml_dtypes

    w = np.ascontiguousarray(w)
    kinds = {np.dtype(np.float32): gq.F32, np.dtype(np.float16): gq.F16,
             np.dtype(ml_dtypes.bfloat16): gq.BF16}
    if w.dtype not in kinds:
        raise ValueError(f"from_float takes float32, float16 or bfloat16, not {w.dtype}")
    return GGMLMatrix(w.view(np.uint8).reshape(*w.shape[:-1], -1), kinds[w.dtype], w.shape[-1])


QUANTIZE_TYPES = (gq.Q8_0, gq.Q4_0, gq.Q4_1)
"""Types `quantize` makes."""


def quantize(w: np.ndarray, type_id: int) -> GGMLMatrix:
    """Quantize float weights f[..., rows, cols] (cols a multiple of 32) into GGML blocks as
    ggml's reference quantizers (ggml-quants.c), block by block of 32:

      Q8_0  d = max|x| / 127, q = roundf(x / d)                        (x = d * q)
      Q4_0  m = the value of largest magnitude (with its sign), d = m / -8,
            q = min(15, trunc(x / d + 8.5))                            (x = d * (q - 8))
      Q4_1  lo, hi = min, max; d = (hi - lo) / 15,
            q = min(15, trunc((x - lo) / d + 0.5))                     (x = d * q + lo)

    with 1 / d taken in float32 (0 when d is 0) and d, lo stored as float16, so the result is
    the same bytes as `gguf.quants.quantize` (tested).

    Raises:
      ValueError: a type other than QUANTIZE_TYPES, a row length not a multiple of 32, or
        non-finite weights.
    """
    if type_id not in QUANTIZE_TYPES:
        raise ValueError(f"quantize makes {[gq.type_name(t) for t in QUANTIZE_TYPES]}, "
                         f"not {gq.type_name(type_id)}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 2 or w.shape[-1] % 32:
        raise ValueError(f"quantize needs rows of a multiple of 32 elements, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("quantize: the weights have non-finite values")
    lead, cols = w.shape[:-1], w.shape[-1]
    x = w.reshape(-1, 32)
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        if type_id == gq.Q8_0:
            d = np.max(np.abs(x), axis=-1, keepdims=True) / f32(127)
            inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
            q = _roundf(x * inv).astype(np.int8)
            blocks = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], -1)
        elif type_id == gq.Q4_0:
            pick = np.argmax(np.abs(x), axis=-1)[:, None]
            m = np.take_along_axis(x, pick, axis=-1)
            d = m / f32(-8)
            inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
            q = np.minimum(f32(15), np.trunc(x * inv + f32(8.5))).astype(np.uint8)
            packed = q[:, :16] | (q[:, 16:] << 4)
            blocks = np.concatenate([d.astype(np.float16).view(np.uint8), packed], -1)
        else:
            lo = np.min(x, axis=-1, keepdims=True)
            hi = np.max(x, axis=-1, keepdims=True)
            d = (hi - lo) / f32(15)
            inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
            q = np.minimum(f32(15), np.trunc((x - lo) * inv + f32(0.5))).astype(np.uint8)
            packed = q[:, :16] | (q[:, 16:] << 4)
            blocks = np.concatenate([d.astype(np.float16).view(np.uint8),
                                     lo.astype(np.float16).view(np.uint8), packed], -1)
    data = np.ascontiguousarray(blocks).reshape(*lead, -1)
    return GGMLMatrix(data, type_id, cols)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf on float32: the nearest integer, halves away from zero."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0).astype(v.dtype)


def q4_0_as_q8_0(m: GGMLMatrix) -> GGMLMatrix:
    """A Q4_0 matrix as Q8_0 with the same values (each block's float16 d kept, q - 8 as its
    int8): exact, for `--dtype=int8`.

    Raises:
      ValueError: m is not Q4_0.
    """
    if m.type_id != gq.Q4_0:
        raise ValueError(f"q4_0_as_q8_0 takes Q4_0, not {m.type_name}")
    blocks = np.asarray(m.data).reshape(-1, 18)
    q = np.empty((blocks.shape[0], 32), np.int16)
    q[:, :16] = blocks[:, 2:] & 0x0F
    q[:, 16:] = blocks[:, 2:] >> 4
    q -= 8
    out = np.concatenate([blocks[:, :2], q.astype(np.int8).view(np.uint8)], axis=-1)
    return GGMLMatrix(out.reshape(*m.data.shape[:-1], -1), gq.Q8_0, m.cols)


def for_xla(m):
    """What XLA's products (`--matvec=xla`, tensor parallelism, GPUs) take in place of a
    GGMLMatrix or RowStack: Q8_0 and Q4_0 as a grouped `jllama.model.quant.Int8Matrix` (exact, about
    a quarter of f32's bytes), every other type (and a RowStack) dequantized to float32.
    Anything else is returned as it is."""
    if isinstance(m, (RowStack, LayerStack)):
        return np.asarray(m)
    if not isinstance(m, GGMLMatrix):
        return m
    if base_type(m.type_id) in (gq.Q8_0, gq.Q4_0):
        q, scale = gq.int8_groups(m.stored_data(), base_type(m.type_id), m.shape)
        return Int8Matrix(q=q, scale=scale)
    return np.asarray(m)


def repacked(m):
    """A GGMLMatrix (or the parts of a RowStack) in its x8 layout (`jllama.model.ggml_repack`) where
    it has one: every part's type among `ggml_repack.TYPES` and rows a multiple of 8; a
    RowStack only when all of its parts do (one kernel call runs them in groups of 8 rows).
    Anything else is returned as it is."""
    if isinstance(m, GGMLMatrix):
        if not m.repacked and can_repack(m.type_id, m.shape[-2]) and m.data.ndim == 2:
            return GGMLMatrix(repack(np.asarray(m.data), m.type_id), m.type_id + X8, m.cols)
        return m
    if isinstance(m, RowStack):
        if all(not p.repacked and can_repack(p.type_id, p.shape[0]) for p in m.parts):
            return RowStack(tuple(repacked(p) for p in m.parts))
        return m
    return m


@dataclasses.dataclass(frozen=True)
class FloatRows:
    """Float matrices with the same `cols` stacked along their rows without a copy, for one
    kernel call over all of them (`jllama.kernels.matvec`): each part's rows are summed exactly
    as `kernels.matvec` sums a float matrix's.

    Attributes:
      parts: 2 to 4 arrays f32[rows_k, cols] or bf16[rows_k, cols].
    """

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def ndim(self) -> int:
        return 2


FLOAT_TYPES = {"float32": gq.F32, "bfloat16": gq.BF16}


def float_gate_up(w1, w3):
    """w1 and w3 of float32 or bfloat16 ([hidden_dim, dim] each, the same dtype) as FloatRows,
    so the kernel runs both products in one call from one RMSNorm; None for other weights.
    For matvec="kernel" only: XLA's products cannot take it."""
    dtype = getattr(w1, "dtype", None)
    if getattr(dtype, "name", None) not in FLOAT_TYPES or getattr(w3, "dtype", None) != dtype:
        return None
    if w1.ndim != 2 or w1.shape != w3.shape:
        return None
    return FloatRows((w1, w3))


def gate_up(w1, w3):
    """w1 and w3 (SwiGLU's gate and up projections, [hidden_dim, dim] each) as one RowStack, so
    one kernel call computes both from one RMSNorm and one quantization of x; None unless both
    are GGMLMatrix (of any types, both in x8 layouts or both not)."""
    if not (isinstance(w1, GGMLMatrix) and isinstance(w3, GGMLMatrix)):
        return None
    if w1.repacked != w3.repacked or w1.data.ndim != 2 or w3.data.ndim != 2:
        return None
    return RowStack((w1, w3))


def embedding_rows(table, tokens) -> np.ndarray:
    """Rows of an embedding table as float32: `table[tokens]` for a float table, dequantized
    for an `Int8Matrix`. tokens: an int or int array; returns f32[dim] or f32[n, dim]."""
    if isinstance(table, Int8Matrix):
        return dequantize(table[tokens])
    if isinstance(table, GGMLMatrix):
        return table.rows(tokens)
    return np.asarray(table[tokens], dtype=np.float32)
