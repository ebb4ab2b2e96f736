"""The decode step's weight matrices side by side in one host buffer, in the order it reads them.

A decode step streams every matrix once: per layer wqkv, wo, w1, w3, w2, then the classifier.
On XLA CPU `jax.device_put` of a 64-byte aligned NumPy array makes a device array over the
same memory (no copy), so the device arrays of `pack_in_decode_order`'s result lie end to end
in one allocation. On this project's 2-core AMD machine that read 2-6% more bytes per second in
the machine's fast minutes than the same matrices as separate XLA allocations (stories110M
f32 decode, alternated in one process, the same tokens; bench/NOTES.md), and the same in its
slow ones.

Two ways in: `pack_in_decode_order` copies matrices already in the graph layout (NumPy; what
XLA's products and tensor parallelism take), and `place_weights` goes straight from the file
layout (`TransformerWeights`, views of the memory-mapped file) to the kernels' layout: each
matrix that needs another layout (GGML blocks repacked eight rows at a time, `ggml_repack`) or
that is made of several tensors (wq, wk, wv end to end as wqkv) is written once into its place
by the kernel library on every core (`jllama.kernels.repack`), and the file's pages it was read
from are dropped from the process; a matrix the kernels read as stored stays a view of the file.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jllama.model import weights_cache
from jllama.model.ggml_matrix import MAX_PARTS, GGMLMatrix, RowStack, from_float, is_ggml
from jllama.model.ggml_repack import X8, can_repack
from jllama.model.quant import Int8Matrix, concatenate_rows
from jllama.model.weights import LayerWeights, TransformerWeights, layer_vectors

ALIGN = 64
"""Bytes: each matrix starts on a cache line, and XLA CPU aliases only 64-byte aligned arrays."""

HUGE_PAGE = 2 << 20
"""Bytes: the buffer starts on a 2 MiB boundary and asks Linux for transparent huge pages."""

DECODE_ORDER = ("wqkv", "wo", "w1", "w3", "w2")
"""A layer's matrices in the order a decode step reads them (then the next layer's, then wcls)."""


def _streamed(matrix) -> list[np.ndarray]:
    """The arrays a product streams: the matrix itself, an `Int8Matrix`'s int8 values (its
    per-row or per-group scales are small and stay where they are), or the blocks of GGML
    matrices (`jllama.model.ggml_matrix`; a RowStack's parts in order)."""
    if isinstance(matrix, Int8Matrix):
        return [matrix.q]
    if isinstance(matrix, GGMLMatrix):
        return [matrix.data]
    if isinstance(matrix, RowStack):
        return [p.data for p in matrix.parts]
    return [matrix]


def _rebuilt(matrix, views: list[np.ndarray]):
    """`matrix` with its streamed arrays replaced by `views` (same shapes and dtypes)."""
    if isinstance(matrix, Int8Matrix):
        return Int8Matrix(q=views[0], scale=matrix.scale)
    if isinstance(matrix, GGMLMatrix):
        return GGMLMatrix(views[0], matrix.type_id, matrix.cols)
    if isinstance(matrix, RowStack):
        return RowStack(tuple(GGMLMatrix(v, p.type_id, p.cols)
                              for p, v in zip(matrix.parts, views, strict=True)))
    return views[0]


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_buffer(nbytes: int, *, huge_pages: bool = True) -> np.ndarray:
    """A new, zeroed uint8[nbytes] host buffer starting on a `HUGE_PAGE` boundary.

    With `huge_pages`, on Linux, the buffer is an anonymous mapping marked `MADV_HUGEPAGE`, so
    the kernel backs it with 2 MiB pages where it can (transparent huge pages in "madvise" or
    "always" mode; in "never" mode the call changes nothing). Why: two threads streaming 438 MB
    with the kernels' prefetches read 3.7-4.7% more bytes per second through 2 MiB pages than
    through 4 KiB ones here, in the machine's slow minutes (bench/NOTES.md). NumPy already asks
    for huge pages for its own allocations of 4 MiB or more, so a NumPy buffer got them for all
    but its unaligned ends; this makes it explicit and whole. Elsewhere, or without
    `huge_pages`, it is a NumPy allocation aligned to `ALIGN` only.
    """
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(region, np.uint8)  # keeps `region` alive as long as any view
        start = -whole.ctypes.data % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        return whole[start : start + nbytes]
    buffer = np.zeros(nbytes + ALIGN, np.uint8)
    start = -buffer.ctypes.data % ALIGN
    return buffer[start : start + nbytes]


def pack_in_decode_order(
    layers: tuple[LayerWeights, ...], wcls, *, huge_pages: bool = True
) -> tuple[tuple[LayerWeights, ...], object]:
    """Copies of `layers`' matrices and of `wcls`, placed end to end (each 64-byte aligned) in
    one new host buffer in the decode step's reading order.

    Args:
      layers: per-layer weights on the host (`jllama.model.weights.to_graph_weights`); matrices
        float32, bfloat16, `Int8Matrix` or GGML blocks (`jllama.model.ggml_matrix`).
      wcls: the classifier [vocab_size, dim], same kinds.
      huge_pages: place the buffer on transparent huge pages where Linux offers them
        (`host_buffer`).

    Returns:
      (layers, wcls) of the same shapes, dtypes and values; the norm weights and int8 scales
      are the given arrays. Memory: one buffer of the matrices' bytes (plus at most 63 bytes
      of padding each); the inputs are not changed.
    """
    order = [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]
    streamed = [[np.ascontiguousarray(a) for a in _streamed(m)] for m in order]
    total = sum(_padded(a.nbytes) for arrays in streamed for a in arrays)
    buffer = host_buffer(total, huge_pages=huge_pages)
    offset = 0
    placed = []
    for arrays in streamed:
        views = []
        for a in arrays:
            view = buffer[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            views.append(view)
            offset += _padded(a.nbytes)
        placed.append(views)

    it = iter(zip(order, placed, strict=True))
    packed = tuple(
        dataclasses.replace(layer, **{name: _rebuilt(*next(it)) for name in DECODE_ORDER})
        for layer in layers
    )
    return packed, _rebuilt(*next(it))


READS = ("map", "pread")
"""How `place_weights` reads what it copies out of a mapped file: through the mapping (its
pages dropped once read), or with pread into the destination (the mapping never touched)."""


def mapped_read_only(a: np.ndarray) -> bool:
    """Whether `a` is a view of a read-only mapping of a file (`np.memmap` mode "r", or an
    `mmap.mmap` opened with ACCESS_READ, as the checkpoint readers map files): dropping its
    pages from the process loses nothing, they are read again from the file when touched."""
    b = a
    while b is not None:
        if isinstance(b, np.memmap):
            return b.mode == "r"
        if isinstance(b, memoryview):
            return b.readonly and isinstance(b.obj, mmap.mmap)
        b = getattr(b, "base", None)
    return False


def _file_position(a: np.ndarray) -> tuple[str, int] | None:
    """(path, byte offset) of `a`'s first byte in the file an `np.memmap` maps, or None."""
    b = a
    while b is not None:
        if isinstance(b, np.memmap):
            if b.filename is None:
                return None
            return os.fspath(b.filename), a.ctypes.data - b.ctypes.data + b.offset
        b = getattr(b, "base", None)
    return None


@dataclasses.dataclass
class _Plan:
    """Where each array goes in the buffer: `put` gives an array its bytes' offset, the
    sources it is written from (end to end) and how (`repack.COPY` or a ggml type to repack
    into its x8 layout), or keeps a source as it is (a 64-byte aligned view of a mapped file
    that needs no other layout: device_put aliases it)."""

    total: int = 0
    pieces: list = dataclasses.field(default_factory=list)  # (source, offset, type)

    def put(self, sources: list[np.ndarray], type_id: int) -> Callable[[np.ndarray], np.ndarray]:
        """A function of the buffer giving the array's bytes (u8[nbytes]), or the kept source
        (any dtype and shape)."""
        from jllama.kernels.repack import COPY

        sources = [np.ascontiguousarray(a) for a in sources]
        one = sources[0]
        if (len(sources) == 1 and type_id == COPY and one.ctypes.data % ALIGN == 0
                and mapped_read_only(one)):
            return lambda buffer: one
        start, nbytes = self.total, sum(a.nbytes for a in sources)
        for a in sources:
            self.pieces.append((a, self.total, type_id))
            self.total += a.nbytes
        self.total = start + _padded(nbytes)
        return lambda buffer: buffer[start : start + nbytes]

    def cache_key(self) -> str | None:
        """The `weights_cache.key` of the buffer this plan builds, or None when a piece is not
        read from a mapped file (its bytes are not the file's) or a file cannot be examined."""
        pieces = []
        for a, offset, type_id in self.pieces:
            where = _file_position(a) if mapped_read_only(a) else None
            if where is None:
                return None
            pieces.append((*where, a.nbytes, type_id, a.shape[-1] * a.itemsize, offset))
        try:
            return weights_cache.key(pieces, self.total)
        except OSError:
            return None

    def run(self, buffer: np.ndarray, threads: int, read: str) -> None:
        from jllama.kernels.repack import PIECE, place

        table = np.zeros(len(self.pieces), PIECE)
        files: dict[str, int] = {}
        try:
            for row, (a, offset, type_id) in zip(table, self.pieces, strict=True):
                rows = a.reshape(-1, a.shape[-1])
                row["src"], row["dst"] = a.ctypes.data, buffer.ctypes.data + offset
                row["rows"], row["row_bytes"] = rows.shape[0], rows.shape[1] * a.itemsize
                row["type"], row["fd"] = type_id, -1
                row["release"] = mapped_read_only(a)
                where = _file_position(a) if read == "pread" and row["release"] else None
                if where is not None:
                    if where[0] not in files:
                        files[where[0]] = os.open(where[0], os.O_RDONLY)
                    row["fd"], row["file_offset"] = files[where[0]], where[1]
            place(table, threads)
        finally:
            for fd in files.values():
                os.close(fd)


def _planned(plan: _Plan, matrices: list, x8: bool) -> Callable[[np.ndarray], object]:
    """Plan one decode-step matrix made of `matrices` stacked along their rows (one, or wq,
    wk, wv), as `jllama.model.weights.to_graph_weights` stacks them and `jllama.model.ggml_matrix.repacked`
    lays them out; returns the function of the buffer that builds it."""
    from jllama.kernels.repack import COPY

    if any(is_ggml(m) for m in matrices):
        ggml = [m if is_ggml(m) else from_float(m) for m in matrices]
        if len({m.cols for m in ggml}) != 1:
            raise ValueError(f"rows of different lengths: {[m.cols for m in ggml]}")
        if len({m.type_id for m in ggml}) == 1:
            groups = [ggml]  # one matrix: the blocks end to end (`stack_rows`)
        elif len(ggml) > MAX_PARTS:
            raise ValueError(f"at most {MAX_PARTS} parts in a RowStack, got {len(ggml)}")
        else:
            groups = [[m] for m in ggml]
        repack = x8 and all(m.data.ndim == 2 and can_repack(m.type_id, m.shape[0]) for m in ggml)
        cols = ggml[0].cols
        parts = []
        for group in groups:
            type_id = group[0].type_id
            rows = sum(m.shape[0] for m in group)
            get = plan.put([m.data for m in group], type_id if repack else COPY)
            parts.append((get, type_id + X8 if repack else type_id, rows))

        def build(buffer):
            out = [GGMLMatrix(get(buffer).reshape(rows, -1), t, cols) for get, t, rows in parts]
            return out[0] if len(out) == 1 else RowStack(tuple(out))

        return build
    if all(isinstance(m, Int8Matrix) for m in matrices):
        m = concatenate_rows(matrices) if len(matrices) > 1 else matrices[0]
        get = plan.put([m.q], COPY)
        return lambda buffer: Int8Matrix(q=get(buffer).view(np.int8).reshape(m.q.shape),
                                         scale=m.scale)
    arrays = [np.asarray(m) for m in matrices]
    if len({a.dtype for a in arrays}) > 1:
        arrays = [np.concatenate(arrays)]  # as to_graph_weights would
    shape = (sum(a.shape[0] for a in arrays), *arrays[0].shape[1:])
    get = plan.put(arrays, COPY)
    return lambda buffer: get(buffer).view(arrays[0].dtype).reshape(shape)


def place_weights(
    weights: TransformerWeights, *, x8: bool, threads: int, huge_pages: bool = True,
    read: str = "map", cache: os.PathLike | None = None,
) -> tuple[tuple[LayerWeights, ...], object]:
    """`jllama.model.weights.to_graph_weights` and `pack_in_decode_order` in one pass, for the
    kernels: the decode step's matrices (per layer wqkv, wo, w1, w3, w2, then wcls) end to end
    in one new host buffer in reading order, each written once from `weights` (views of a mapped
    file, or any arrays) by the kernel library on `threads` threads.

    Args:
      weights: file-layout weights: float32 / bfloat16 arrays, `Int8Matrix`, or GGML blocks
        (`GGMLMatrix`, `LayerStack`).
      x8: lay GGML blocks out eight rows at a time where the type has such a layout
        (`jllama.model.ggml_repack`; a wqkv of several types only when all of them have), as the
        kernels' AVX2 / AVX-512 products read them.
      threads: threads to copy on.
      huge_pages: see `host_buffer`.
      read: one of `READS`, for what is read from a read-only mapped file.
      cache: a folder of `jllama.model.weights_cache` files: where the buffer was kept by an
        earlier load of the same file(s), it is mapped from there (nothing is built), else it
        is built and written there in the background. None: built, not kept.

    Returns:
      (layers, wcls): the graph layout's `LayerWeights` (the norm gains are `weights`' own
      views; a Mixture-of-Experts model's w1, w2 and w3 a tuple of one matrix per expert, each
      planned as a matrix of its own) and the classifier. A matrix that is one tensor, needs no other layout and is a
      64-byte aligned view of a read-only mapped file is kept as that view (not copied:
      `jax.device_put` aliases it); every other is a view of the buffer. The pages of a mapped
      file that were copied from are dropped from the process (they stay in the page cache).

    Raises:
      ValueError: matrices of a layer that do not stack (different row lengths, too many
        types), or an unknown `read`.
      repack.PlaceError: a read of the file failed.
    """
    if read not in READS:
        raise ValueError(f"read={read!r}; known: {', '.join(READS)}")
    n_layers = weights.rms_att_weight.shape[0]
    plan = _Plan()
    builders = []
    experts = 0 if weights.ffn_gate_inp is None else weights.ffn_gate_inp.shape[1]
    for l in range(n_layers):
        for name in DECODE_ORDER:
            if experts and name in ("w1", "w2", "w3"):  # MoE: one matrix per expert
                stack = getattr(weights, name)[l]
                builders.append(tuple(_planned(plan, [stack[e]], x8) for e in range(experts)))
                continue
            matrices = ([weights.wq[l], weights.wk[l], weights.wv[l]] if name == "wqkv"
                        else [getattr(weights, name)[l]])
            builders.append(_planned(plan, matrices, x8))
    builders.append(_planned(plan, [weights.wcls], x8))
    keep = cache is not None and plan.total >= weights_cache.MIN_BYTES
    name = plan.cache_key() if keep else None
    buffer = None if name is None else weights_cache.load(Path(cache), name, plan.total)
    if buffer is None:
        buffer = host_buffer(max(plan.total, ALIGN), huge_pages=huge_pages)
        plan.run(buffer, threads, read)
        if name is not None:
            weights_cache.store(Path(cache), name, buffer)
    built = iter([tuple(b(buffer) for b in build) if isinstance(build, tuple) else build(buffer)
                  for build in builders])
    layers = tuple(
        LayerWeights(rms_att_weight=weights.rms_att_weight[l], rms_ffn_weight=weights.rms_ffn_weight[l],
                     **{name: next(built) for name in DECODE_ORDER}, **layer_vectors(weights, l))
        for l in range(n_layers)
    )
    return layers, next(built)


def aliasable(matrix, threads: int = 1):
    """`matrix` (an array, `Int8Matrix` or GGML blocks) whose arrays `jax.device_put` can alias
    on XLA CPU: itself when every one starts on a 64-byte boundary, else a copy of it in a new
    `host_buffer` made by the kernel library on `threads` threads (a read-only mapped file's
    pages dropped once read). Why: device_put copies an unaligned array itself, on one thread,
    touching every page of the file (a Llama-3.1-8B GGUF's 295 MB embedding table, whose file
    aligns tensors to 32 bytes, for the device loop: 580 MB more RSS and a second's copy)."""
    arrays = [np.asarray(a) for a in _streamed(matrix)]
    if all(a.ctypes.data % ALIGN == 0 and a.flags.c_contiguous for a in arrays):
        return matrix
    from jllama.kernels.repack import COPY

    plan = _Plan()
    gets = [plan.put([a], COPY) for a in arrays]
    buffer = host_buffer(plan.total)
    plan.run(buffer, threads, "map")
    views = [get(buffer).view(a.dtype).reshape(a.shape) for get, a in zip(gets, arrays, strict=True)]
    return _rebuilt(matrix, views)
