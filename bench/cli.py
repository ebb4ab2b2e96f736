"""What the bench/ scripts share on the command line: one-line errors, a clean Ctrl-C or
SIGTERM, and output files written whole.

The house rule for bad input holds for the benchmark tools too: one line naming the flag,
file or field and what is wrong, a non-zero exit, no traceback, no half-written output.

    from cli import BenchError, Parser, guarded
    def main(argv=None) -> int: ...  # Parser for its flags, BenchError for bad input
    if __name__ == "__main__":
        sys.exit(guarded("table.py", main))
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class BenchError(Exception):
    """Bad input to a bench script: its message is the one line printed (after the script's
    name); the exit status is 1, argparse's own errors included (`Parser`)."""


class Parser(argparse.ArgumentParser):
    """argparse whose own errors (an unknown flag, --reps=abc) are one line and exit status
    1, like the checks after parsing, instead of its usage text and 2."""

    def error(self, message: str):
        raise BenchError(message)


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so `subprocess.run` kills its child on the way."""


def _terminate(signum, frame):
    raise Terminated


def guarded(name: str, main: Callable[[], int]) -> int:
    """Runs main(); a BenchError becomes "name: message" on stderr and exit status 1, Ctrl-C
    "name: interrupted" and 130, SIGTERM "name: terminated" and 143 (the shell's 128 + the
    signal). Both signals unwind through main, so the programs it started are killed
    (`subprocess.run` kills its child when interrupted) and no output is left half-written."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return main()
    except BenchError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143


def positive_int(flag: str, value: int) -> int:
    """value, if >= 1; else BenchError naming the flag."""
    if value < 1:
        raise BenchError(f"{flag}={value}: must be at least 1")
    return value


def positive_ints(flag: str, text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (at least one), or BenchError naming the flag."""
    words = [w.strip() for w in text.split(",")]
    if not any(words):
        raise BenchError(f"{flag}={text!r}: give at least one value")
    if not all(words):
        raise BenchError(f"{flag}={text!r}: an empty item between commas")
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
    """Where an output file named `path` will be written, checked before any work starts:
    symbolic links followed, the folder exists and can be written to, and the file is new
    or a regular file (not a folder, a device such as /dev/null, a pipe, or a socket, which
    `write_whole`'s rename would replace). Returns the resolved path; BenchError naming the
    flag otherwise."""
    p = Path(os.path.realpath(path))
    if p.is_dir():
        raise BenchError(f"{flag}={path}: is a directory, not a file")
    if p.exists() and not p.is_file():
        raise BenchError(f"{flag}={path}: is not a regular file (a device, pipe or socket)")
    if not p.parent.is_dir():
        raise BenchError(f"{flag}={path}: the folder {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise BenchError(f"{flag}={path}: the folder {p.parent} is not writable")
    return p


def writable_folder(flag: str, path: Path) -> Path:
    """`path` if it is a folder that exists, or can be made, and can be written to (the
    --cache of run.py and ceiling.py); BenchError naming the flag otherwise."""
    if path.exists():
        if not path.is_dir():
            raise BenchError(f"{flag}={path}: is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise BenchError(f"{flag}={path}: the folder is not writable")
        return path
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise BenchError(f"{flag}={path}: cannot be made, {above} is a file")
    if not os.access(above, os.W_OK | os.X_OK):
        raise BenchError(f"{flag}={path}: cannot be made, {above} is not writable")
    return path


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """Calls write(tmp) for a temporary file beside path, then renames it onto path, so path
    is either its old self or complete, never half-written. The file gets the replaced file's
    permissions, or those of a new file under the umask. Symbolic links are followed (the
    file they point to is replaced); a target that is not a regular file is refused.

    Raises:
      BenchError: path exists and is not a regular file.
    """
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        raise BenchError(f"{path}: is not a regular file (a device, pipe or socket)")
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
