"""The kernel library's placing of weights at load (`repack.cc`), called through ctypes.

  place(pieces, threads)       copy or x8-repack each piece into its destination, on threads
  repack_x8(data, type_id)     one matrix into its x8 layout (`jllama.model.ggml_repack.repack`'s
                               result, byte for byte), for tests and small matrices

Only where the library builds (`jllama.kernels.library`); the caller falls back otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

PIECE = np.dtype([("src", np.uintp), ("file_offset", np.int64), ("dst", np.uintp),
                  ("rows", np.int64), ("row_bytes", np.int64), ("type", np.int32),
                  ("release", np.int32), ("fd", np.int32), ("unused", np.int32)])
"""repack.cc's `JllamaPiece`: the rows' address (src), their offset in the file `fd`, the
destination's address, rows, bytes a row, the ggml type to repack into its x8 layout (-1:
copy as is), whether src is a read-only shared file mapping whose pages are dropped once read
(1) or not (0), and an open file descriptor to pread the rows from instead of reading src
(-1: read src)."""

COPY = -1
"""A piece's type for a plain copy."""


class PlaceError(RuntimeError):
    """A piece that does not fit its type, or a file that could not be read (one line)."""


@functools.cache
def _library() -> ctypes.CDLL:
    # The library as built (its XLA handlers are registered by `jllama.kernels.load`, which
    # the backend has called: placing needs none of them).
    from jllama.kernels.library import build

    lib = ctypes.CDLL(str(build()))
    lib.jllama_place.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    lib.jllama_place.restype = ctypes.c_int
    return lib


def place(pieces: np.ndarray, threads: int) -> None:
    """Place every piece (an array of `PIECE`) on `threads` threads; the GIL is released
    meanwhile. The caller keeps the sources and destinations alive and of the sizes given.

    Raises:
      PlaceError: a piece to repack whose type has no x8 layout, whose rows are not a multiple
        of 8 or whose row is not whole blocks; or a read of a piece's file that failed.
    """
    pieces = np.ascontiguousarray(pieces, PIECE)
    status = _library().jllama_place(pieces.ctypes.data, len(pieces), max(1, threads))
    if status == -1:
        raise PlaceError("a piece to repack has no x8 layout, rows not a multiple of 8, or "
                         "rows that are not whole blocks")
    if status:
        raise PlaceError(f"reading the weights failed: {os.strerror(status)}")


def piece(src: np.ndarray, dst: np.ndarray, type_id: int = COPY, *, release: bool = False,
          fd: int = -1, file_offset: int = 0) -> np.ndarray:
    """One `PIECE` from C-contiguous arrays: src's bytes, as rows of its last axis (u8[...,
    row_bytes] for GGML blocks; any dtype for a copy), into dst of the same byte count; read
    from the open file `fd` at `file_offset` instead when fd >= 0."""
    rows = src.reshape(-1, src.shape[-1]) if src.ndim else src.reshape(1, 1)
    if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.nbytes != dst.nbytes:
        raise ValueError("piece: src and dst must be C-contiguous and of the same size")
    out = np.zeros((), PIECE)
    out["src"], out["file_offset"], out["dst"] = src.ctypes.data, file_offset, dst.ctypes.data
    out["rows"], out["row_bytes"] = rows.shape[0], rows.shape[1] * src.itemsize
    out["type"], out["release"], out["fd"] = type_id, int(release), fd
    return out


def repack_x8(data: np.ndarray, type_id: int, threads: int = 1) -> np.ndarray:
    """u8[..., rows, row_bytes] of ggml type `type_id` in its x8 layout (a new array), by the
    library: the same bytes as `jllama.model.ggml_repack.repack`.

    Raises:
      PlaceError: as `place`.
    """
    src = np.ascontiguousarray(data, np.uint8)
    out = np.empty_like(src)
    if src.size:
        place(piece(src, out, type_id), threads)
    return out
