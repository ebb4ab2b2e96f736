"""`jllama.model.packing`: the decode step's matrices end to end in one buffer, in reading order, and
the jax backend's device arrays over that same memory (the addresses worked out by hand from
the shapes: each matrix starts where the one before ends, rounded up to 64 bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_backends import GQA_UNSHARED

from jllama.backends import make_backend
from jllama.model.packing import ALIGN, DECODE_ORDER, HUGE_PAGE, host_buffer, pack_in_decode_order
from jllama.model.quant import Int8Matrix
from jllama.model.weights import cast_weights, random_weights, to_graph_weights


def _address(a) -> int:
    return np.asarray(a.q if isinstance(a, Int8Matrix) else a).ctypes.data


def _nbytes(a) -> int:
    return (a.q if isinstance(a, Int8Matrix) else np.asarray(a)).nbytes


def _in_order(layers, wcls):
    return [getattr(layer, name) for layer in layers for name in DECODE_ORDER] + [wcls]


def _assert_end_to_end(matrices):
    start = _address(matrices[0])
    assert start % ALIGN == 0
    for before, after in zip(matrices, matrices[1:], strict=False):
        padded = -(-_nbytes(before) // ALIGN) * ALIGN
        assert _address(after) == _address(before) + padded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_packed_matrices_are_the_same_values_end_to_end_in_reading_order(dtype):
    host = to_graph_weights(cast_weights(random_weights(GQA_UNSHARED, seed=3), dtype))
    layers, wcls = pack_in_decode_order(host.layers, host.wcls)
    before, after = _in_order(host.layers, host.wcls), _in_order(layers, wcls)
    for old, new in zip(before, after, strict=True):
        if isinstance(old, Int8Matrix):
            np.testing.assert_array_equal(new.q, old.q)
            assert new.scale is old.scale
        else:
            assert new.dtype == old.dtype and new.shape == old.shape
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    _assert_end_to_end(after)
    for old, new in zip(host.layers, layers, strict=True):  # norms are not copied
        assert new.rms_att_weight is old.rms_att_weight and new.rms_ffn_weight is old.rms_ffn_weight


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files, from /proc/self/maps."""
    out = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0":
            start, end = (int(v, 16) for v in fields[0].split("-"))
            out.append((start, end))
    return out


@pytest.mark.parametrize("matvec", ["kernel", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_cpu_backend_reads_its_weights_from_one_buffer(stories260k, dtype, matvec):
    config, weights = stories260k
    b = make_backend("jax", matvec=matvec)
    b.prepare(config, cast_weights(weights, dtype))
    # device_put aliased the packed buffer: the device arrays lie end to end as packed, but for
    # a matrix the kernels read as stored from the mapped checkpoint (`place_weights`)
    files = _file_mappings()
    matrices = _in_order(b.layers, b.wcls)
    mapped = [any(lo <= _address(m) < hi for lo, hi in files) for m in matrices]
    assert not any(mapped) or (matvec == "kernel" and dtype == "float32")
    _assert_end_to_end([m for m, in_file in zip(matrices, mapped, strict=True) if not in_file])


def _huge_page_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_host_buffer_is_zeroed_aligned_and_on_huge_pages_where_linux_offers_them(huge_pages):
    nbytes = 3 * HUGE_PAGE + 100
    buffer = host_buffer(nbytes, huge_pages=huge_pages)
    assert buffer.dtype == np.uint8 and buffer.shape == (nbytes,)
    assert buffer.ctypes.data % (HUGE_PAGE if huge_pages else ALIGN) == 0
    assert not buffer.any()
    buffer[:] = 7  # writable; the pages are faulted in here
    assert buffer[-1] == 7
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if huge_pages and thp.exists() and "[never]" not in thp.read_text():
        # three whole 2 MiB pages fit; without the madvise "madvise" mode would give none
        assert _huge_page_kib(buffer.ctypes.data) >= 3 * 2048
