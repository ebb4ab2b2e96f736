"""Compile jllama's CPU kernels (`SOURCE`) into a shared library once per machine and compiler,
and reuse it.

The library is built on first use with the system's C++ compiler (`$CXX`, else `c++`) against
the XLA FFI headers of the installed jaxlib (`jax.ffi.include_dir()`), so its calling
convention always matches the jaxlib that loads it. On x86-64 it is built with
`-march=native` (AVX2 / AVX-512 when the CPU has them), as llama.cpp builds by default.

It is kept in `$JLLAMA_HOME/kernels/` (default `~/.cache/jllama/kernels/`) under a name that
hashes everything the binary depends on: the sources and headers (`FILES`), the flags, the
compiler, the jaxlib version and the CPU's feature flags; a change of any of them builds a new
file. A build writes a temporary file and renames it into place only once it loads with every
handler, so processes building at the same time never see a half-written library and a broken
build is never cached. The compiler runs in its own process group, killed whole on a timeout or
an interrupt. A build takes about 12 s (g++ 12).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from jllama.errors import BackendError
from jllama.platform.fetch import jllama_home

_HERE = Path(__file__).parent

SOURCE = _HERE / "library.cc"
"""The source the compiler is given: the kernels' parts (matvec.cc, ggml_products.cc, ...) as one
translation unit."""

FILES = tuple(sorted((*_HERE.glob("*.cc"), *_HERE.glob("*.h"))))
"""Every source and header of the kernels, `SOURCE` and all it may include: what the library's
name hashes, so that a change to any of them builds a new library."""

MARCH_ENV = "JLLAMA_MARCH"
"""Environment variable: build the kernels with `-march=$JLLAMA_MARCH` instead of native (e.g.
`x86-64-v3`, the AVX2 + FMA path an AVX2-only CPU runs, to measure it on an AVX-512 machine)."""

BUILD_TIMEOUT_S = 120


class KernelBuildError(BackendError):
    """The kernels cannot be built or loaded here (one line)."""


SYMBOLS = ("jllama_matvec_f32", "jllama_matvec_bf16", "jllama_matvec_int8",
           "jllama_matvec_int8_groups", "jllama_attention_f32", "jllama_sample_f32",
           "jllama_argmax_f32", "jllama_rope_write_f32", "jllama_attention_chunk_f32",
           "jllama_matvec_ggml", "jllama_dequantize_ggml", "jllama_rows_ggml",
           "jllama_matmul_ggml", "jllama_matvec_batch_f32", "jllama_matvec_batch_bf16",
           "jllama_matvec_batch_int8", "jllama_matvec_batch_int8_groups",
           "jllama_rope_attend_batch_f32", "jllama_matvec_batch_ggml", "jllama_sample_batch_f32")
"""The FFI handlers the library exports; a library lacking one is not used or cached."""

VECTOR_WIDTH = "jllama_vector_width"
"""A plain C function the library exports too (attention.cc): floats per vector register of the
build's loops (16 with AVX-512, 8 with AVX2 and FMA, else 1)."""


def compiler() -> list[str] | None:
    """The C++ compiler command (`$CXX` split as a shell would, e.g. "ccache g++"; `c++` when
    unset or empty) with its program resolved to a path, or None if there is no such program
    (or `$CXX` does not split, e.g. an unbalanced quote)."""
    try:
        words = shlex.split(os.environ.get("CXX") or "c++")
    except ValueError:
        return None
    path = shutil.which(words[0]) if words else None
    return [path, *words[1:]] if path else None


def flags(march: str | None = None) -> list[str]:
    """Compiler flags: `-march=native` on x86-64, or `-march=MARCH` when given (the tests
    build the AVX2-only and the generic paths with it), else `$JLLAMA_MARCH` when set. No
    -ffast-math: linking with it sets flush-to-zero for the whole process; the 64 partial sums
    per row vectorize without reassociation."""
    out = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-DJLLAMA_PREFETCH={prefetch()}"]
    if march is None:
        march = os.environ.get(MARCH_ENV) or None
    if march is not None:
        out.append(f"-march={march}")
    elif platform.machine().lower() in ("x86_64", "amd64"):
        out.append("-march=native")
    return out


PREFETCH_ENV = "JLLAMA_PREFETCH"
"""Environment variable: 1 makes the kernels stream their weights with non-temporal prefetches,
0 with plain loads (default: 1 on AMD CPUs, 0 elsewhere; simd.h's JLLAMA_PREFETCH)."""


def prefetch() -> int:
    """Whether the kernels prefetch their weights ahead (`PREFETCH_ENV`, else by the CPU's
    vendor: measured faster on AMD, 2.5x slower on an Intel Sapphire Rapids)."""
    value = os.environ.get(PREFETCH_ENV, "").strip()
    if value in ("0", "1"):
        return int(value)
    return int("AuthenticAMD" in _cpu_vendor())


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_features() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (its `flags` or `Features` line), else
    `platform.processor()`: what a library built for this CPU depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cxx: list[str], march: str | None = None) -> Path:
    """Where the library for these sources, compiler, flags, jaxlib and CPU lives (built or
    not)."""
    import jaxlib

    key = hashlib.sha256()
    sources = b"".join(f.name.encode() + b"\0" + f.read_bytes() + b"\0" for f in FILES)
    for part in (sources, " ".join(flags(march)).encode(), " ".join(cxx).encode(),
                 jaxlib.__version__.encode(), cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return jllama_home() / "kernels" / f"matvec-{key.hexdigest()[:16]}.so"


def failure_path(library: Path) -> Path:
    """Where a failed build of `library` is remembered: its error message, one line."""
    return library.with_suffix(".failed")


def is_built() -> bool:
    """Whether `build` would return at once: a library already built, or a failure already
    remembered for these sources, compiler and flags (and not compile)."""
    cxx = compiler()
    if cxx is None:
        return False
    target = library_path(cxx)
    return target.exists() or failure_path(target).exists()


def check_library(path: str | os.PathLike) -> ctypes.CDLL:
    """Load the library at `path` (into this process), look up every handler, and return it.

    Raises:
      KernelBuildError: it does not load, or lacks a handler.
    """
    try:
        lib = ctypes.CDLL(os.fspath(path))
        for name in (*SYMBOLS, VECTOR_WIDTH):
            getattr(lib, name)
        return lib
    except (OSError, AttributeError) as e:
        # ctypes' messages start with the path; keep the reason only.
        reason = str(e).replace(f"{os.fspath(path)}: ", "")
        raise KernelBuildError(f"{path} is not a usable kernel library: {reason}") from None


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary files of builds that were killed (their compiler went on writing)."""
    now = time.time()
    for stale in folder.glob("tmp*.so"):
        try:
            if now - stale.stat().st_mtime > 2 * BUILD_TIMEOUT_S:
                stale.unlink()
        except OSError:
            pass


def _compile(cmd: list[str], output: str) -> tuple[int, str]:
    """Run the compiler in its own process group; (exit status, stderr). On a timeout, an
    exception or SIGINT the whole group (driver, cc1plus, as, ld) is killed first, so nothing
    writes the output file after we give up on it. (jllama's own SIGINT handler exits at once,
    so the group is killed, and `output` removed, from a handler put in front of it while the
    compiler runs.)"""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def kill_group():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None

    def on_interrupt(signum, frame):
        kill_group()
        proc.wait()
        if os.path.exists(output):
            os.unlink(output)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt

    if main:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException:
        kill_group()
        proc.wait()
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    return proc.returncode, err


def build(march: str | None = None) -> Path:
    """The built library's path, compiling it first if this machine has none yet. A library is
    cached only once it loads and has every handler. A failed compile (or one that timed out,
    or built no usable library) is remembered next to where the library would be
    (`failure_path`), so later runs fail at once with the same message instead of compiling
    again (a hanging compiler would cost BUILD_TIMEOUT_S every run); deleting that file
    retries. march: see `flags`.

    Raises:
      KernelBuildError: no C++ compiler, the cache folder cannot be written, the compile
        failed or timed out (the compiler's first error line is quoted), or what it built
        is not a usable library, now or in a remembered earlier build.
    """
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(
            f"no C++ compiler (CXX={os.environ.get('CXX') or 'c++'} is not a program here) to "
            "build jllama's CPU kernels; install one (e.g. g++) or pass --matvec=xla"
        )
    target = library_path(cxx, march)
    if target.exists():
        return target
    failed = failure_path(target)
    try:
        remembered = failed.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        remembered = None
    if remembered:
        raise KernelBuildError(f"{remembered} (remembered from an earlier build; delete "
                               f"{failed} to try again)")
    import jax

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(target.parent)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(
            f"cannot write jllama's CPU kernels into {target.parent}: {e.strerror or e}"
        ) from None
    cmd = [*cxx, *flags(march), "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        return _build(cmd, cxx, tmp, target)
    except KernelBuildError as e:
        _remember(failed, str(e))
        raise


def _remember(failed: Path, message: str) -> None:
    """Write `message` to `failed` whole or not at all (a half-written file would be read as
    a failure); a folder that cannot be written just means the next run compiles again."""
    partial = None
    try:
        fd, partial = tempfile.mkstemp(suffix=".failed", dir=failed.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(message + "\n")
        os.replace(partial, failed)
    except OSError:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)


def _build(cmd: list[str], cxx: list[str], tmp: str, target: Path) -> Path:
    """Compile with `cmd` into `tmp`, check it and move it to `target`; see `build`."""
    named = " ".join(cxx)
    try:
        status, err = _compile(cmd, tmp)
        if status != 0:
            lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
            why = next((ln for ln in lines if "error" in ln), lines[0] if lines else None)
            raise KernelBuildError(
                f"building jllama's CPU kernels with {named} failed: "
                f"{why or f'exit status {status}, no message'}"
            )
        try:
            check_library(tmp)
        except KernelBuildError as e:
            raise KernelBuildError(f"building jllama's CPU kernels with {named} made no "
                                   f"usable library: {str(e).split(': ', 1)[-1]}") from None
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise KernelBuildError(
            f"building jllama's CPU kernels with {named} took over {BUILD_TIMEOUT_S} s"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
