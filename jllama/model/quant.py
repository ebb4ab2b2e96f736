"""int8 weight matrices with one float32 scale per row (symmetric, per output channel).

A float32 matrix `w: f32[..., out, in]` is held as `q: int8[..., out, in]` and
`scale: f32[..., out]` with `w ~= q * scale[..., None]`, where
`scale = max(|row|) / 127` and `q = round(w / scale)` (round half to even, in [-127, 127]).
This is the per-channel absmax scheme of LLM.int8()'s vector-wise quantization (Dettmers et
al. 2022, without its outlier split) and of gpt-fast's `int8` weight-only mode; llama.cpp's
Q8_0 uses the same rounding with one scale per 32 weights instead of per row.

Why one scale per row and not per group of 32: a matrix-vector product then needs a single
multiply by the row's scale after the integer row sum, `(q @ x) * scale`, so the compiled
program reads one int8 per weight and nothing else. With group scales XLA CPU ran the product
at 5.2 GB/s of int8 against 11-14 GB/s per row (JAX 0.10, 2-core Zen 5 EPYC, 12 matrices of
2048x768; bench/NOTES.md), slower than float32 itself.

GGUF's Q8_0 and Q4_0 tensors (llama.cpp) are int8 (Q4_0: 4-bit, minus 8) with one float16
scale per 32 weights of a row; read with `--dtype=int8` they are held exactly as an
`Int8Matrix` with group scales, `scale: f32[..., out, in // 32]` (`grouped`), rather than
dequantized and quantized again per row.

`Int8Matrix` is a frozen dataclass, registered as a JAX pytree by `jllama.model.pytrees` (imported by
the JAX code; this module imports no JAX), so it travels through `jax.device_put` and `jax.jit`
like the arrays it replaces; it has `shape`, `dtype` (int8), `nbytes` and `ndim`, indexes along
its leading (layer) axis, and `np.asarray` of it is the dequantized float32 matrix (what the
NumPy reference computes with).
"""

from __future__ import annotations

import dataclasses

import numpy as np

INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """A weight matrix (or a stack of them) as int8 values and per-row float32 scales.

    Attributes:
      q: int8[..., out, in], values in [-127, 127].
      scale: f32[..., out], the float32 step of each row: `w[..., i, j] ~= q[..., i, j] *
        scale[..., i]`; or f32[..., out, in // g] (`grouped`), one step per g consecutive
        weights of a row: `w[..., i, j] = q[..., i, j] * scale[..., i, j // g]`.
    """

    q: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the matrix it stands for (`q.shape`)."""
        return tuple(self.q.shape)

    @property
    def grouped(self) -> bool:
        """True when `scale` has one step per group of `group_size` weights of a row."""
        return len(self.scale.shape) == len(self.q.shape)

    @property
    def group_size(self) -> int:
        """Weights per scale along a row (the row length when not `grouped`)."""
        n = self.q.shape[-1]
        return n // self.scale.shape[-1] if self.grouped else n

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self) -> np.dtype:
        """int8: the storage type of the values (`weights_dtype` reports "int8")."""
        return np.dtype(np.int8)

    @property
    def nbytes(self) -> int:
        """Bytes held: one per value plus four per row."""
        return int(self.q.nbytes + self.scale.nbytes)

    def __getitem__(self, index) -> Int8Matrix:
        """Index the leading axes (layers, or rows of an embedding table): `m[l]` is layer
        l's `Int8Matrix`; `m[token]` is one row, still quantized (see `dequantize_rows`)."""
        return Int8Matrix(q=self.q[index], scale=self.scale[index])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The dequantized matrix, f32[..., out, in] (a new array)."""
        out = dequantize(self)
        return out if dtype is None else out.astype(dtype)


def quantize_int8(w: np.ndarray) -> Int8Matrix:
    """Quantize `w: f[..., out, in]` (float32 or narrower floats) row by row, on the host.

    Returns:
      Int8Matrix with `scale = max(|row|) / 127` (float32) and `q = round(w / scale)`; a row of
      zeros gets scale 1 and zeros. The error of each weight is at most scale / 2.

    Raises:
      ValueError: w has fewer than 2 dimensions or non-finite values (a scale would be inf/NaN).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize_int8 needs a matrix, got shape {w.shape}")
    absmax = np.max(np.abs(w), axis=-1)
    if not np.all(np.isfinite(absmax)):
        raise ValueError("quantize_int8: the matrix has non-finite values")
    # A row of subnormals tiny enough that absmax / 127 underflows to 0 gets the smallest
    # subnormal step instead (its values are then < 127 steps: q stays in range).
    step = np.maximum(absmax / np.float32(INT8_MAX), np.finfo(np.float32).smallest_subnormal)
    # A subnormal step is coarse (1.4e-45 apart): rounded down, absmax / step can pass 127 and
    # clip (a row holding one 4.4e-43: q would be 157). Take the next float up there, which is
    # above absmax / 127 exactly (compared in float64, where nothing underflows). A normal
    # step's rounding (6e-8 relative) keeps absmax / step within rint's reach of 127.
    low = (step < np.finfo(np.float32).tiny) & (
        step.astype(np.float64) * INT8_MAX < absmax.astype(np.float64))
    step = np.where(low, np.nextafter(step, np.float32(np.inf)), step)
    scale = np.where(absmax > 0, step, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return Int8Matrix(q=q, scale=scale)


def dequantize(m: Int8Matrix) -> np.ndarray:
    """`q * scale[..., None]` (per row) or `q * scale` repeated over each group, as
    f32[..., out, in] (each product exact in float32 up to one rounding)."""
    q = np.asarray(m.q, dtype=np.float32)
    scale = np.asarray(m.scale, dtype=np.float32)
    if not m.grouped:
        return q * scale[..., None]
    groups = q.reshape(*q.shape[:-1], scale.shape[-1], m.group_size)
    return (groups * scale[..., None]).reshape(q.shape)


def group_scales(m: Int8Matrix, group_size: int) -> Int8Matrix:
    """The same matrix with one scale per `group_size` weights (exact: a row's scale repeated
    over its groups); a grouped matrix with that group size is returned as it is.

    Raises:
      ValueError: the row length is not a multiple of group_size, or m has other groups.
    """
    if m.grouped:
        if m.group_size != group_size:
            raise ValueError(f"groups of {m.group_size}, not {group_size}")
        return m
    n = m.q.shape[-1]
    if n % group_size:
        raise ValueError(f"rows of {n} do not split into groups of {group_size}")
    scale = np.repeat(np.asarray(m.scale)[..., None], n // group_size, axis=-1)
    return Int8Matrix(q=m.q, scale=scale)


def concatenate_rows(matrices: list[Int8Matrix]) -> Int8Matrix:
    """Stack int8 matrices with the same `in` along their rows, scales with them (what
    stacking wq/wk/wv into wqkv does for float matrices). Per-row scales make this exact: the
    result holds the same values as quantizing the stacked float matrix. If any is grouped,
    the others' row scales are spread over the same groups first (`group_scales`, exact)."""
    sizes = {m.group_size for m in matrices if m.grouped}
    if len(sizes) > 1:
        raise ValueError(f"int8 matrices with different groups: {sorted(sizes)}")
    if sizes:
        size = sizes.pop()
        matrices = [group_scales(m, size) for m in matrices]
    axis = -2 if matrices[0].grouped else -1
    return Int8Matrix(
        q=np.concatenate([np.asarray(m.q) for m in matrices], axis=-2),
        scale=np.concatenate([np.asarray(m.scale) for m in matrices], axis=axis),
    )
