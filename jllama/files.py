"""Checks shared by the file readers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from jllama.errors import JllamaError


def require_regular_file(path: Path, what: str, error: type[JllamaError]) -> int:
    """Return the size in bytes of `path`, a regular file, or raise `error` with one line that
    starts with `what` (e.g. "checkpoint /x/model.bin").

    Pipes and devices are refused before opening: reading a FIFO would block forever and a
    process substitution (`<(...)`) cannot be memory-mapped.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as e:
        raise error(f"{what}: cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: not a regular file (a pipe or a device?)")
    return st.st_size
