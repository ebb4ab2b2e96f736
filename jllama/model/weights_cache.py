"""The kernels' weight buffer kept on disk, so that a later run maps it instead of building it.

`jllama.model.packing.place_weights` writes every matrix of a model into one new buffer in the
kernels' layout (GGML blocks eight rows at a time). That buffer is fresh anonymous memory the
size of the model, and on a virtual machine whose host takes freed memory back (virtio-balloon
free page reporting, as on this project's machines) faulting it in is most of a load: a
Llama-3.1-8B Q4_K_M file (4.9 GB) loaded in 8.5-8.9 s with 16 s of system time, of which
zeroing fresh pages (`clear_page_erms`) was over half the samples; right after another run had
freed its memory, 2.5 s. llama.cpp maps its file, whose pages are in the page cache already.

So the buffer is written once to `$JLLAMA_HOME/weights/<key>.x8` (in the background, after the
first load), and later loads map that file read-only: its pages are the page cache's, shared
by every process that maps it, and nothing is copied or zeroed (a 1B Q4_K_M model's load
0.95 s instead of 6.8 s on a busy machine). The key covers every input of the buffer's bytes:
each source file's identity (path, size, modification time, inode), where each matrix comes
from in it and how it is laid out, and the layout code's own text; any change makes a new key.

Only buffers built from mapped files entirely, of `MIN_BYTES` or more, are kept. At most
`MAX_ENTRIES` files and `MAX_TOTAL_BYTES` are kept (the least recently used go first); a file
is written only where the disk keeps `FREE_MARGIN` free after it. `--noweights_cache` (the
`weights_cache` argument) turns all of it off.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

MIN_BYTES = 64 << 20
"""Smaller buffers are built each time (a 135M model's takes well under a second)."""

MAX_ENTRIES = 8
"""Cache files kept (the least recently used beyond are deleted)."""

MAX_TOTAL_BYTES = 64 << 30
"""Bytes of cache files kept, the same way."""

FREE_MARGIN = 2 << 30
"""Bytes the disk must keep free after a cache file is written; else none is written."""

SUFFIX = ".x8"

_LAYOUT_SOURCES = ("repack.cc", "ggml_x8.h", "ggml_types.h")
"""The kernel sources that define the layout (their text is part of every key)."""


def folder(home: Path) -> Path:
    """Where the cache files live under `$JLLAMA_HOME` (not created here)."""
    return home / "weights"


def key(pieces: Iterable[tuple[str, int, int, int, int, int]], total: int) -> str:
    """The cache key of a buffer of `total` bytes made of `pieces`: (path, file offset, bytes,
    ggml type or -1 for a copy, bytes a row, offset in the buffer) each. Hex, 32 characters.

    Raises:
      OSError: a source file that cannot be examined.
    """
    digest = hashlib.sha256()
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    for name in _LAYOUT_SOURCES:
        digest.update(name.encode() + b"\0" + (kernels / name).read_bytes() + b"\0")
    seen: dict[str, bytes] = {}
    for path, offset, nbytes, type_id, row_bytes, at in pieces:
        if path not in seen:
            st = os.stat(path)
            seen[path] = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|"
                          f"{st.st_dev}").encode()
        digest.update(seen[path] + f"|{offset}|{nbytes}|{type_id}|{row_bytes}|{at}\n".encode())
    digest.update(f"total {total}".encode())
    return digest.hexdigest()[:32]


def load(where: Path, name: str, nbytes: int) -> np.ndarray | None:
    """The cache file `name` mapped read-only as uint8[nbytes] (its pages faulted in now, from
    the page cache where they are there), or None when there is none of that size (a file of
    another size is deleted). Marks it used (its modification time)."""
    path = where / (name + SUFFIX)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            _remove(path)
            return None
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    try:
        os.utime(path)
    except OSError:
        pass
    return np.frombuffer(region, np.uint8)  # keeps `region` mapped as long as any view


def store(where: Path, name: str, buffer: np.ndarray) -> threading.Thread | None:
    """Writes `buffer` to the cache file `name` on a new thread (not a daemon: a process that
    ends first waits for it) and returns the thread; None when the disk has too little room.
    The file appears whole or not at all (written beside it, then renamed); a failed write is
    dropped silently (the next load builds the buffer again)."""
    try:
        where.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(where).free < buffer.nbytes + FREE_MARGIN:
            return None
    except OSError:
        return None
    thread = threading.Thread(target=_write, args=(where, name, buffer),
                              name="jllama-weights-cache", daemon=False)
    thread.start()
    return thread


def _write(where: Path, name: str, buffer: np.ndarray) -> None:
    final = where / (name + SUFFIX)
    partial = where / f"{name}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        with open(partial, "wb") as f:
            view = memoryview(buffer).cast("B")
            for start in range(0, len(view), 64 << 20):  # each write lets the GIL go
                f.write(view[start : start + (64 << 20)])
        os.replace(partial, final)
    except OSError:
        _remove(partial)
        return
    _evict(where, keep=final)


def _evict(where: Path, keep: Path) -> None:
    """Deletes the least recently used cache files beyond `MAX_ENTRIES` / `MAX_TOTAL_BYTES`
    (never `keep`), and partial files whose writer is gone (older than a day)."""
    import time

    entries = []
    for path in where.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue
        if path.suffix == ".partial" and time.time() - st.st_mtime > 86400:
            _remove(path)
        elif path.suffix == SUFFIX:
            entries.append((st.st_mtime, st.st_size, path))
    entries.sort(reverse=True)  # newest first
    count = total = 0
    for _, size, path in entries:
        if path != keep and (count + 1 > MAX_ENTRIES or total + size > MAX_TOTAL_BYTES):
            _remove(path)
        else:
            count, total = count + 1, total + size


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
