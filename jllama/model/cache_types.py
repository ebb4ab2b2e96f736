"""KV cache types: how a cache block stores the key or value rows of its positions.

llama.cpp's names and block formats (`--cache-type-k` / `--cache-type-v`, `-ctk` / `-ctv`):

  f32   float32 per value                            [n_kv_heads, block, head_dim] float32
  f16   IEEE half per value                          [n_kv_heads, block, head_dim] float16
  bf16  bfloat16 per value                           [n_kv_heads, block, head_dim] bfloat16
  q8_0  ggml's block_q8_0 per 32 values of a row:    [n_kv_heads, block, head_dim / 32 * 34] uint8
        a float16 step d, then 32 int8 q (value = d * q; ggml-common.h)

A cache block's dtype says its type (uint8 is q8_0), so the kernels and the XLA programs need no
other argument. Writes round to the type (f16/bf16: round to nearest even; q8_0: llama.cpp's
CPU quantizer, d = max|x| / 127 as float16, q = round-half-even(x * 127 / max|x|)); reads widen
to float32 and compute in float32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllama.errors import ConfigError

QK8_0 = 32
"""Values per q8_0 block (ggml's QK8_0)."""
Q8_0_BLOCK_BYTES = 34
"""Bytes of one q8_0 block: a float16 step and 32 int8 (ggml's sizeof(block_q8_0))."""


@dataclasses.dataclass(frozen=True)
class CacheType:
    """One KV cache type.

    Attributes:
      name: llama.cpp's name ("f32", "f16", "bf16", "q8_0").
      ggml_type: ggml's type id (F32 0, F16 1, Q8_0 8, BF16 30).
    """

    name: str
    ggml_type: int

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of a block of this type (uint8 for q8_0's bytes)."""
        import ml_dtypes

        return np.dtype({"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
                         "q8_0": np.uint8}[self.name])

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    def row_length(self, head_dim: int) -> int:
        """The last axis of a block: head_dim values, or q8_0's head_dim / 32 * 34 bytes."""
        if self.quantized:
            return head_dim // QK8_0 * Q8_0_BLOCK_BYTES
        return head_dim

    def row_nbytes(self, head_dim: int) -> int:
        """Bytes of one head's row (one position of one KV head)."""
        return self.row_length(head_dim) * self.dtype.itemsize

    def check(self, head_dim: int, flag: str = "cache_type") -> None:
        """Raises ConfigError (naming `flag`) when this type cannot hold rows of head_dim."""
        if self.quantized and head_dim % QK8_0:
            raise ConfigError(
                f"--{flag}={self.name} needs head_dim a multiple of {QK8_0}, this model's is "
                f"{head_dim}; use f16, bf16 or f32")


CACHE_TYPES: dict[str, CacheType] = {
    t.name: t for t in (CacheType("f32", 0), CacheType("f16", 1), CacheType("bf16", 30),
                        CacheType("q8_0", 8))
}
"""Every KV cache type by name."""


def cache_type(name: str | CacheType, flag: str = "cache_type") -> CacheType:
    """The CacheType called `name` (a CacheType is returned as it is).

    Raises:
      ConfigError: an unknown name, naming `flag` and the known ones.
    """
    if isinstance(name, CacheType):
        return name
    found = CACHE_TYPES.get(str(name).lower())
    if found is None:
        raise ConfigError(f"--{flag}={name!r} is not a KV cache type (known: "
                          f"{', '.join(CACHE_TYPES)})")
    return found


def of_dtype(dtype) -> CacheType:
    """The cache type of a block of this dtype (uint8: q8_0).

    Raises:
      ValueError: a dtype no cache type has.
    """
    for t in CACHE_TYPES.values():
        if np.dtype(dtype) == t.dtype:
            return t
    raise ValueError(f"no KV cache type is stored as {np.dtype(dtype)}")


DEFAULT_GGUF = "f16"
"""The cache type "auto" means for a GGUF file (llama.cpp's default, half f32's bytes). llama2.c
files and Hugging Face folders get f32 (run.c's arithmetic, bit for bit)."""

AUTO = "auto"


def resolve(key: str | CacheType = AUTO, value: str | CacheType = AUTO,
            file_format: str = "llama2c", head_dim: int | None = None,
            flags: tuple[str, str] = ("cache_type_k", "cache_type_v")
            ) -> tuple[CacheType, CacheType]:
    """The (key, value) cache types asked for, "auto" made f32, or `DEFAULT_GGUF` for
    file_format "gguf"; checked against head_dim when given.

    Raises:
      ConfigError: an unknown name, or q8_0 with a head_dim not a multiple of 32 (one line
        naming the flag of `flags` it came from).
    """
    auto = DEFAULT_GGUF if file_format == "gguf" else "f32"
    types = []
    for name, flag in zip((key, value), flags, strict=True):
        t = cache_type(auto if str(name).lower() == AUTO else name, flag)
        if head_dim is not None:
            t.check(head_dim, flag)
        types.append(t)
    return types[0], types[1]


def describe(key: str | CacheType, value: str | CacheType) -> str:
    """The types for a line to the user: "f16", or "keys q8_0, values f16" when they differ."""
    k, v = cache_type(key), cache_type(value)
    return k.name if k == v else f"keys {k.name}, values {v.name}"


def encode(rows: np.ndarray, t: str | CacheType) -> np.ndarray:
    """Rows f32[..., head_dim] stored as type t: [..., t.row_length(head_dim)] of t.dtype,
    rounded to nearest even (f16, bf16) or quantized as `quantize_q8_0`."""
    t = cache_type(t)
    rows = np.asarray(rows, np.float32)
    return quantize_q8_0(rows) if t.quantized else rows.astype(t.dtype)


def decode(stored: np.ndarray) -> np.ndarray:
    """Rows stored by `encode` widened to f32[..., head_dim] (the type from the dtype: uint8 is
    q8_0, dequantized as `dequantize_q8_0`)."""
    if of_dtype(stored.dtype).quantized:
        return dequantize_q8_0(stored)
    return np.asarray(stored, np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x: f32[..., n] (n a multiple of 32) -> uint8[..., n / 32 * 34]: ggml's block_q8_0 of each
    32 values, the rule of llama.cpp's CPU quantizer (ggml-cpu/arch/x86/quants.c,
    `quantize_row_q8_0`, which writes its KV cache): amax = max |x|, step d = amax / 127 stored
    as float16 (round to nearest even), q = round-half-even(x * (127 / amax)) (0 where amax is
    0), clipped to [-127, 127]; bytes: d little-endian, then the 32 int8.

    (gguf-py's `quants.quantize` follows ggml's reference `quantize_row_q8_0_ref` instead:
    x * (1 / d) rounded half away from zero; the two differ only where x * 127 / amax lands
    within an ulp of a half.)"""
    x = np.asarray(x, np.float32)
    groups = x.reshape(*x.shape[:-1], -1, QK8_0)
    amax = np.max(np.abs(groups), axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    q = np.clip(np.rint(groups * inv), -127, 127).astype(np.int8)
    out = np.concatenate([d.astype("<f2").view(np.uint8), q.view(np.uint8)], axis=-1)
    return out.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """uint8[..., m / 34 * 34] of ggml's block_q8_0 -> f32[..., m / 34 * 32]: d * q, the
    product in float32 (ggml's `dequantize_row_q8_0`)."""
    b = np.ascontiguousarray(blocks, np.uint8)
    b = b.reshape(*b.shape[:-1], -1, Q8_0_BLOCK_BYTES)
    d = b[..., :2].copy().view("<f2").astype(np.float32)
    q = b[..., 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(*b.shape[:-2], -1)


def kv_cache_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, positions: int,
                    key_type: str | CacheType = "f32", value_type: str | CacheType = "f32",
                    sequences: int = 1) -> int:
    """Bytes of the key and value caches of `sequences` sequences of `positions` positions:
    n_layers * n_kv_heads * positions * (key row bytes + value row bytes) * sequences."""
    k, v = cache_type(key_type), cache_type(value_type)
    per_position = n_layers * n_kv_heads * (k.row_nbytes(head_dim) + v.row_nbytes(head_dim))
    return per_position * positions * sequences
