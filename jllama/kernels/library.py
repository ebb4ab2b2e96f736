"""Compile `matvec.cc` into a shared library once per machine, and reuse it.

The library is built on first use with the system's C++ compiler (`$CXX`, else `c++`) against
the XLA FFI headers of the installed jaxlib (`jax.ffi.include_dir()`), so its calling
convention always matches the jaxlib that loads it. On x86-64 it is built with
`-march=native` (AVX2 / AVX-512 when the CPU has them), as llama.cpp builds by default.

It is kept in `$JLLAMA_HOME/kernels/` (default `~/.cache/jllama/kernels/`) under a name that
hashes everything the binary depends on: the source, the flags, the compiler, the jaxlib
version and the CPU's feature flags; a change of any of them builds a new file. A build writes
a temporary file and renames it into place, so processes building at the same time never see a
half-written library. A build takes about 2 s (g++ 12).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from jllama.errors import BackendError
from jllama.fetch import jllama_home

SOURCE = Path(__file__).with_name("matvec.cc")

BUILD_TIMEOUT_S = 120


class KernelBuildError(BackendError):
    """The kernels cannot be built here: no C++ compiler, or it failed (one line)."""


def compiler() -> str | None:
    """The C++ compiler to use (`$CXX`, else `c++`) as a path, or None if there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def flags() -> list[str]:
    """Compiler flags. No -ffast-math: linking with it sets flush-to-zero for the whole
    process; the 64 partial sums per row vectorize without reassociation."""
    out = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        out.append("-march=native")
    return out


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cxx: str) -> Path:
    """Where the library for this source, compiler, jaxlib and CPU lives (built or not)."""
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags()).encode(), cxx.encode(),
                 jaxlib.__version__.encode(), _cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return jllama_home() / "kernels" / f"matvec-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The built library's path, compiling it first if this machine has none yet.

    Raises:
      KernelBuildError: no C++ compiler, the cache folder cannot be written, or the compile
        failed or timed out (the compiler's first error line is quoted).
    """
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(
            f"no C++ compiler ({os.environ.get('CXX', 'c++')}) to build jllama's CPU kernels; "
            "install one (e.g. g++) or pass --matvec=xla"
        )
    target = library_path(cxx)
    if target.exists():
        return target
    import jax

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(
            f"cannot write jllama's CPU kernels into {target.parent}: {e.strerror or e}"
        ) from None
    cmd = [cxx, *flags(), "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or [""]
            raise KernelBuildError(
                f"building jllama's CPU kernels with {cxx} failed: {lines[0].strip()}"
            )
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise KernelBuildError(
            f"building jllama's CPU kernels with {cxx} took over {BUILD_TIMEOUT_S} s"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
