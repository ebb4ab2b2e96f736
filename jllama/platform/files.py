"""Checks shared by the file readers."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

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


def parse_json(text: str | bytes) -> Any:
    """`json.loads(text)`, every way it can fail as one ValueError whose message is one line:
    bad syntax (line and column), nesting too deep for the parser (Python's recursion limit:
    a crafted file nests 10^5 deep), a number with more digits than Python converts (4300),
    bytes that are not UTF-8.

    Raises:
      ValueError: the reason, one line, without the file's name (the caller adds it).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start})") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(" ".join(str(e).split())) from None


def parse_json_object(text: str | bytes, what: str, error: type[Exception]) -> dict:
    """`parse_json(text)`, which must be a JSON object, else `error` with one line that starts
    with `what`: "WHAT: not valid JSON: REASON" or "WHAT: expected a JSON object, got TYPE"."""
    try:
        data = parse_json(text)
    except ValueError as e:
        raise error(f"{what}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data
