"""Placing the weights at load: the kernel library's x8 repack (`jllama.kernels.repack`) against
NumPy's reference (`jllama.model.ggml_repack`, itself checked against the kernels' own table in
test_ggml_kernels.py), and `jllama.model.packing.place_weights` against the NumPy path it replaces
(`to_graph_weights`, `repacked`, `pack_in_decode_order`): the same matrices, byte for byte."""

from __future__ import annotations

import os
import threading

import gguf
import jax
import numpy as np
import pytest
from gguf_files import byte_tokens, write_gguf
from test_ggml_kernels import random_blocks

from jllama.model import ggml_repack

from jllama import kernels
from jllama.model.config import ModelConfig
from jllama.formats import ggml_quants as gq
from jllama.model.ggml_matrix import GGMLMatrix, RowStack, is_ggml, repacked
from jllama.kernels.repack import COPY, PlaceError, piece, place, repack_x8
from jllama.model.loading import open_model
from jllama.model.packing import ALIGN, DECODE_ORDER, pack_in_decode_order, place_weights
from jllama.model.weights import random_weights, to_graph_weights

pytestmark = pytest.mark.skipif(kernels.vector_width() < 1, reason="unreachable")  # builds it


@pytest.mark.parametrize("type_id", sorted(ggml_repack.TYPES), ids=gq.type_name)
def test_the_library_repacks_as_numpy_does_byte_for_byte(type_id):
    rng = np.random.default_rng(type_id)
    _, nb = gq.BLOCK_SIZES[type_id]
    # Stacked matrices, and one over 1 MB: several items, on two threads.
    for shape in ((3, 16, 2 * nb), (8 * (2 + (3 << 20) // (8 * 5 * nb)), 5 * nb)):
        data = rng.integers(0, 256, shape, dtype=np.uint8)
        got = repack_x8(data, type_id, threads=2)
        assert np.array_equal(got, ggml_repack.repack(data, type_id))
        assert np.array_equal(ggml_repack.unpack(got, type_id + ggml_repack.X8), data)


def test_pieces_that_do_not_fit_their_type_are_refused_before_anything_is_written():
    src = np.random.default_rng(0).integers(1, 256, (12, 144), dtype=np.uint8)
    dst = np.zeros_like(src)
    short = np.zeros((8, 100), np.uint8)
    ok = piece(src[:8], dst[:8], gq.Q4_K)
    for bad in (piece(src, dst, gq.Q4_K),  # 12 rows
                piece(src[:8, :100].copy(), short, gq.Q4_K),  # not whole blocks
                piece(src[:8], dst[:8], gq.Q3_K)):  # no x8 layout
        with pytest.raises(PlaceError, match="multiple of 8"):
            place(np.stack([ok, bad]), threads=2)
        assert not dst.any() and not short.any()


def _mapped(tmp_path, data: np.ndarray) -> np.memmap:
    path = tmp_path / "blob"
    data.tofile(path)
    return np.memmap(path, mode="r")


def _mapping_rss_kib(address: int) -> int:
    """Rss (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pages_read_through_a_read_only_mapping_leave_the_process(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, (2048, 8 * 144), dtype=np.uint8)
    mapped = _mapped(tmp_path, data)
    view = np.frombuffer(mapped, np.uint8, data.size).reshape(data.shape)
    assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page read in
    assert _mapping_rss_kib(view.ctypes.data) >= data.nbytes // 1024 - 4
    dst = np.empty_like(data)
    place(piece(view, dst, gq.Q4_K, release=True)[None], threads=2)
    assert _mapping_rss_kib(view.ctypes.data) == 0
    assert np.array_equal(dst, ggml_repack.repack(data, gq.Q4_K))
    assert np.array_equal(view, data)  # read again from the file


def test_pread_reads_what_the_mapping_holds(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, (4096, 2 * 210), dtype=np.uint8)
    mapped = _mapped(tmp_path, np.concatenate([np.zeros(64, np.uint8), data.reshape(-1)]))
    view = np.frombuffer(mapped, np.uint8, data.size, 64).reshape(data.shape)
    fd = os.open(mapped.filename, os.O_RDONLY)
    try:
        out = np.empty((2, *data.shape), np.uint8)
        place(np.stack([piece(view, out[0], gq.Q6_K, fd=fd, file_offset=64),
                        piece(view, out[1], COPY, fd=fd, file_offset=64)]), threads=2)
        assert _mapping_rss_kib(view.ctypes.data) == 0  # the mapping was never touched
        bad = piece(view, out[1], COPY, fd=fd, file_offset=mapped.size)  # past the end
        with pytest.raises(PlaceError, match="reading the weights failed"):
            place(bad[None], threads=1)
    finally:
        os.close(fd)
    assert np.array_equal(out[0], ggml_repack.repack(data, gq.Q6_K))
    assert np.array_equal(out[1], data)


MIXED = ModelConfig(dim=256, hidden_dim=512, n_layers=2, n_heads=8, n_kv_heads=2,
                    vocab_size=264, seq_len=64, shared_weights=False)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A GGUF of every kind of decode matrix: wqkv of three types (a RowStack) in layer 0 and
    of one type (joined) in layer 1, x8 types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), types
    without an x8 layout (Q3_K, F16, F32) and a classifier of its own; tensors 64-byte aligned
    in the file."""
    t = gguf.GGMLQuantizationType
    c = MIXED
    rng = np.random.default_rng(5)
    types = {"*": t.Q4_1, "token_embd.weight": t.Q5_1, "output.weight": t.Q8_0,
             "blk.0.attn_k.weight": t.Q8_0, "blk.0.ffn_down.weight": t.Q5_0,
             "blk.0.ffn_up.weight": t.F16, "blk.1.ffn_up.weight": t.Q4_0,
             "blk.1.attn_q.weight": t.F32, "blk.1.attn_k.weight": t.F32,
             "blk.1.attn_v.weight": t.F32}
    raw = {"blk.0.attn_v.weight": (random_blocks(rng, gq.Q6_K, c.n_kv_heads * c.head_dim, c.dim),
                                   t.Q6_K),
           "blk.0.attn_output.weight": (random_blocks(rng, gq.Q4_K, c.dim, c.dim), t.Q4_K),
           "blk.1.attn_output.weight": (random_blocks(rng, gq.Q3_K, c.dim, c.dim), t.Q3_K),
           "blk.1.ffn_gate.weight": (random_blocks(rng, gq.Q6_K, c.hidden_dim, c.dim), t.Q6_K)}
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", c,
                      random_weights(c, seed=5, scale=0.1), types=types,
                      drop_tensors=tuple(raw), raw_tensors=raw,
                      vocab=byte_tokens() + [f"<|x{i}|>" for i in range(c.vocab_size - 256)],
                      alignment=ALIGN)
    return open_model(path, need_tokenizer=False).weights


def _arrays(m) -> list[np.ndarray]:
    if isinstance(m, GGMLMatrix):
        return [m.data]
    if isinstance(m, RowStack):
        return [p.data for p in m.parts]
    return [m]


def _described(m) -> tuple:
    """What a placed matrix is: its kind, types and shapes."""
    if isinstance(m, RowStack):
        return ("rows", tuple(_described(p) for p in m.parts))
    if isinstance(m, GGMLMatrix):
        return ("ggml", m.type_id, m.cols, m.data.shape)
    return ("array", m.dtype, m.shape)


def _in_order(layers, wcls) -> list:
    return [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]


@pytest.mark.parametrize("x8", [True, False])
@pytest.mark.parametrize("read", ["map", "pread"])
def test_placed_weights_are_the_numpy_paths_byte_for_byte(mixed_gguf, x8, read):
    weights = mixed_gguf
    host = to_graph_weights(weights)
    if x8:
        host = jax.tree_util.tree_map(repacked, host, is_leaf=is_ggml)
    want = _in_order(*pack_in_decode_order(host.layers, host.wcls))
    layers, wcls = place_weights(weights, x8=x8, threads=2, read=read)
    got = _in_order(layers, wcls)
    assert [_described(m) for m in got] == [_described(m) for m in want]
    for new, old in zip(got, want, strict=True):
        for a, b in zip(_arrays(new), _arrays(old), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(layers[0].wqkv, RowStack) and isinstance(layers[1].wqkv, GGMLMatrix)
    for old, new in zip(host.layers, layers, strict=True):
        assert np.array_equal(new.rms_att_weight, old.rms_att_weight)
        assert np.array_equal(new.rms_ffn_weight, old.rms_ffn_weight)
    # A matrix of one tensor in a type read as stored (64-byte aligned in the file) is that
    # view of the file; every other lies in one buffer, end to end in reading order.
    # (Layer 0's wq, wk and wv are three parts of a RowStack, each one tensor; layer 1's one
    # joined matrix.)
    singles = [m for l in range(MIXED.n_layers) for name in ("wq", "wk", "wv", *DECODE_ORDER[1:])
               for m in [getattr(weights, name)[l]] if l == 0 or name not in ("wq", "wk", "wv")]
    expect_kept = [m.data.ctypes.data for m in singles + [weights.wcls]
                   if m.data.ctypes.data % ALIGN == 0 and not (x8 and m.type_id in ggml_repack.TYPES)]
    assert len(expect_kept) >= 2
    arrays = [np.asarray(a) for m in got for a in _arrays(m)]
    assert [a.ctypes.data for a in arrays if not a.flags.writeable] == expect_kept
    _assert_end_to_end([a for a in arrays if a.flags.writeable])


def _assert_end_to_end(arrays):
    assert arrays[0].ctypes.data % ALIGN == 0
    for before, after in zip(arrays, arrays[1:], strict=False):
        # the parts of a joined wqkv follow each other unpadded
        ends = before.ctypes.data + before.nbytes, before.ctypes.data + -(-before.nbytes // ALIGN) * ALIGN
        assert after.ctypes.data in ends


def test_the_kernel_backend_reads_the_placed_arrays_themselves(mixed_gguf):
    from jllama.backends import make_backend

    b = make_backend("jax", matvec="kernel")
    b.prepare(MIXED, mixed_gguf)
    host = _in_order(*place_weights(mixed_gguf, x8=kernels.vector_width() >= 8, threads=1))
    kept = {np.asarray(a).ctypes.data for m in host for a in _arrays(m)
            if not np.asarray(a).flags.writeable}
    device = [a for m in _in_order(b.layers, b.wcls) for a in _arrays(m)]
    # device_put aliased the views of the file and the buffer's: no copies
    assert {a.unsafe_buffer_pointer() for a in device} & kept == kept
    _assert_end_to_end([np.asarray(a) for a in device if a.unsafe_buffer_pointer() not in kept])


def _placed_bytes(weights, cache) -> list[bytes]:
    layers, wcls = place_weights(weights, x8=True, threads=2, cache=cache)
    for thread in threading.enumerate():  # the cache file's writer, if one started
        if thread.name == "jllama-weights-cache":
            thread.join()
    return [np.asarray(a).tobytes() for m in _in_order(layers, wcls) for a in _arrays(m)]


def test_a_kept_buffer_is_mapped_by_the_next_load_and_built_again_when_the_file_changes(
        mixed_gguf, tmp_path, monkeypatch):
    """`jllama.model.weights_cache`: the first load builds the buffer and writes it; the next
    maps that file (a byte changed in it shows through: nothing was built); a truncated file is
    deleted and built again; a model file touched since gets a new key; the least recently
    used file goes past MAX_ENTRIES."""
    from jllama.model import weights_cache

    monkeypatch.setattr(weights_cache, "MIN_BYTES", 0)
    monkeypatch.setattr(weights_cache, "FREE_MARGIN", 0)
    want = _placed_bytes(mixed_gguf, None)
    assert _placed_bytes(mixed_gguf, tmp_path) == want
    (first,) = tmp_path.glob("*.x8")
    data = bytearray(first.read_bytes())
    data[0] ^= 0xFF
    first.write_bytes(bytes(data))
    got = _placed_bytes(mixed_gguf, tmp_path)
    assert got != want and b"".join(got)[:1] != b"".join(want)[:1]  # read from the cache file
    first.write_bytes(bytes(data[:-1]))  # truncated: not used, built and written again
    assert _placed_bytes(mixed_gguf, tmp_path) == want
    assert first.read_bytes()[0] == (data[0] ^ 0xFF)
    from jllama.model.packing import _file_position

    path, _ = _file_position(mixed_gguf.wcls.data)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    monkeypatch.setattr(weights_cache, "MAX_ENTRIES", 1)
    assert _placed_bytes(mixed_gguf, tmp_path) == want
    (second,) = tmp_path.glob("*.x8")  # a new key; the older file evicted
    assert second != first
