"""XLA's compiled programs kept across processes: JAX's persistent compilation cache, set up
under `$JLLAMA_HOME/xla-cache/` so that a second `jllama` run loads its programs instead of
compiling them.

The folder holds one subfolder per kernel library (`jllama.kernels.library.library_path`,
whose name hashes the kernels' source, flags, compiler, jaxlib and the CPU's features): the
compiled programs call into that library (XLA FFI custom calls) and are built for this CPU, so
a change of either starts a new folder. JAX keys each program inside it by its StableHLO,
jaxlib version, XLA flags and compile options.

A cache that cannot be used never stops a run: a folder that cannot be written turns it off
with one warning line; an entry JAX cannot read (a file cut short by a killed process,
damaged bytes) is reported once in one line, and every entry of that program is removed so
that this run's fresh compile replaces it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from jllama.platform.fetch import jllama_home

FOLDER = "xla-cache"

MAX_BYTES = 512 * 2**20
"""A bound on one cache folder's size, bytes (JAX evicts the least recently used entries past
it). SmolLM2's programs for one prompt take about 100 kB. Setting a bound also makes JAX lock
the folder around each read and write (`filelock`), so a process never reads an entry
another is writing."""

_JAX_CACHE_ERROR = re.compile(
    r"Error (reading|writing) persistent compilation cache entry for '([^']*)'"
)
"""JAX's warning when it cannot read or write an entry (`jax._src.compiler`); it then
compiles the program as if the cache had no entry."""


def cache_folder(home: Path | None = None) -> Path:
    """`$JLLAMA_HOME/xla-cache/<key>` (not created here): the key is the file name of the
    kernel library this machine's compiler builds (`matvec-<hash>`), or, without a C++
    compiler, `xla-<hash>` of the CPU's features and jaxlib's version."""
    from jllama.kernels.library import compiler, cpu_features, library_path

    cxx = compiler()
    if cxx is not None:
        key = library_path(cxx).stem
    else:
        import jaxlib

        digest = hashlib.sha256(
            f"{cpu_features()}\0{jaxlib.__version__}\0{platform.machine()}".encode()
        ).hexdigest()
        key = f"xla-{digest[:16]}"
    return (home or jllama_home()) / FOLDER / key


@dataclasses.dataclass
class CompileCounts:
    """Programs JAX was asked to compile in this process, counted from its monitoring events.

    Attributes:
      requested: programs compiled or loaded (each `jit` shape once), count.
      from_cache: of those, loaded from the persistent cache, count.
    """

    requested: int = 0
    from_cache: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (not found in the cache), count."""
        return self.requested - self.from_cache


class CompileCache:
    """The persistent cache for this process, and the counts of what it served.

    `setup()` makes one. Attributes:
      folder: the cache folder in use, or None when the cache is off.
      counts: `CompileCounts` since `setup`.
    """

    def __init__(self, folder: Path | None, warn: Callable[[str], None]):
        self.folder = folder
        self.counts = CompileCounts()
        self._warn = warn
        self._reported = False

    def _on_event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.counts.from_cache += 1

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        # Recorded around every compile-or-load of a program, cache or not.
        if event == "/jax/core/compile/backend_compile_duration":
            self.counts.requested += 1

    def _on_warning(self, message: str) -> bool:
        """Handle one of JAX's cache warnings; False for any other warning."""
        found = _JAX_CACHE_ERROR.search(message)
        if found is None or self.folder is None:
            return False
        if found.group(1) == "reading":
            remove_program(self.folder, found.group(2))
        if not self._reported:
            self._reported = True
            reason = " ".join(message.split(": ", 1)[-1].split())
            if found.group(1) == "reading":
                what = (f"the entry of {found.group(2)} is unreadable ({reason}); unreadable "
                        "entries are compiled again and replaced")
            else:
                what = (f"cannot store {found.group(2)} ({reason}); programs that cannot be "
                        "stored are compiled in every run")
            self._warn(f"jllama: warning: compile cache {self.folder}: {what}")
        return True


def setup(
    enabled: bool = True,
    folder: Path | None = None,
    warn: Callable[[str], None] | None = None,
) -> CompileCache:
    """Turn JAX's persistent compilation cache on for this process in `folder` (default
    `cache_folder()`), storing every program however fast it compiled, and count the programs
    compiled and loaded (`CompileCache.counts`). Call once, before the first program compiles
    (JAX reads these settings once); enabled=False only counts.

    A folder that cannot be created or written leaves the cache off, with one line through
    `warn` (default: print to stderr). JAX's later warnings about entries it cannot read or
    write are shown as one such line (the first only); see the module's docstring.

    Returns:
      the `CompileCache`, its `folder` None when off.
    """
    import jax

    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    cache = CompileCache(None, warn)
    if enabled:
        folder = Path(folder) if folder is not None else cache_folder()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            warn(f"jllama: warning: compile cache off: cannot write {folder}: "
                 f"{e.strerror or e} (--nocompile_cache silences this)")
        else:
            cache.folder = folder
            jax.config.update("jax_compilation_cache_dir", str(folder))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            try:
                import filelock  # noqa: F401  (JAX's bounded cache needs it)
            except ImportError:
                pass
            else:
                jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
            _show_cache_warnings_with(cache._on_warning)
    jax.monitoring.register_event_listener(cache._on_event)
    jax.monitoring.register_event_duration_secs_listener(cache._on_duration)
    return cache


def remove_program(folder: Path, module_name: str) -> int:
    """Delete every entry of the program `module_name` (e.g. "jit_qkv") from the cache folder,
    whatever its key; returns how many files went. Files that cannot be removed stay."""
    removed = 0
    prefix = module_name + "-"
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix) and name.endswith(("-cache", "-atime")):
            try:
                os.unlink(folder / name)
            except OSError:
                continue
            removed += name.endswith("-cache")
    return removed


def _show_cache_warnings_with(handler: Callable[[str], bool]) -> None:
    """Route warnings through `handler` first; the ones it takes (True) are not shown."""
    previous = warnings.showwarning
    # Shown every time (not once per text), so that each damaged program is removed.
    warnings.filterwarnings("always", message=_JAX_CACHE_ERROR.pattern.split("'")[0])

    def show(message, category, filename, lineno, file=None, line=None):
        if not handler(str(message)):
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
