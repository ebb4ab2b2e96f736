"""What the bench/ scripts share on the command line: one-line errors and a clean Ctrl-C.

The house rule for bad input holds for the benchmark tools too: one line naming the flag,
file or field and what is wrong, a non-zero exit, no traceback, no half-written output.

    from cli import BenchError, guarded
    def main(argv=None) -> int: ...
    if __name__ == "__main__":
        sys.exit(guarded("table.py", main))
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class BenchError(Exception):
    """Bad input to a bench script: its message is the one line printed (after the script's
    name); the exit status is 1 (argparse's own usage errors exit 2)."""


def guarded(name: str, main: Callable[[], int]) -> int:
    """Runs main(); a BenchError becomes "name: message" on stderr and exit status 1, Ctrl-C
    becomes "name: interrupted" and 130 (the shell's 128 + SIGINT)."""
    try:
        return main()
    except BenchError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


def positive_int(flag: str, value: int) -> int:
    """value, if >= 1; else BenchError naming the flag."""
    if value < 1:
        raise BenchError(f"{flag}={value}: must be at least 1")
    return value


def positive_ints(flag: str, text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (at least one), or BenchError naming the flag."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise BenchError(f"{flag}={text!r}: give at least one value")
    out = []
    for w in words:
        try:
            v = int(w)
        except ValueError:
            raise BenchError(f"{flag}: {w!r} is not an integer") from None
        out.append(positive_int(flag, v))
    return out


def positive_seconds(flag: str, value: float) -> float:
    """value, if a finite number > 0; else BenchError naming the flag."""
    if not (math.isfinite(value) and value > 0):
        raise BenchError(f"{flag}={value:g}: must be a number of seconds above 0")
    return value


def last_line(text: str, limit: int = 200) -> str:
    """The last non-empty line of `text`, stripped and cut to `limit` characters, for an
    error message; "(no output)" when there is none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    line = lines[-1]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def rate(value) -> float | None:
    """value as a tok/s rate if it is a finite number > 0, else None."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


def writable_file(flag: str, path: str) -> Path:
    """A path an output file can be written to: its folder exists and it is not a folder;
    BenchError naming the flag otherwise. Checked before any work starts."""
    p = Path(path)
    if p.is_dir():
        raise BenchError(f"{flag}={path}: is a directory, not a file")
    if not p.parent.is_dir():
        raise BenchError(f"{flag}={path}: the folder {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise BenchError(f"{flag}={path}: the folder {p.parent} is not writable")
    return p


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """Calls write(tmp) for a temporary file beside path, then renames it onto path, so path
    is either its old self or complete, never half-written. The file gets the replaced file's
    permissions, or those of a new file under the umask."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    # mkstemp makes the file private (0600): give it the mode a plain open() would have, or
    # the replaced file's own
    umask = os.umask(0)
    os.umask(umask)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask
    try:
        os.chmod(tmp, mode)
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
