"""Process-level settings and resources: CPU cores for XLA, memory, the process's age.

XLA's CPU client sizes its thread pools from the cores the process may run on when it starts,
and this version has no flag for it; pinning the process (Linux `sched_setaffinity`) before JAX
creates its CPU backend is the dependable way to give it N threads.
"""

from __future__ import annotations

import os
import time

from jllama.model.config import ModelConfig
from jllama.errors import ResourceError


def available_cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def limit_cpu_threads(n: int) -> None:
    """Pin the process to `n` of its cores so XLA CPU (and BLAS) use `n` threads.

    Must run before JAX creates its CPU backend (the first array operation); later calls still
    pin the process but XLA keeps the thread pools it already made.

    Raises:
      ValueError: n < 1 or more than `available_cpus()`.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not 1 <= n <= max(len(cpus), 1):
        raise ValueError(f"threads={n} is out of range (1..{len(cpus)})")
    if cpus:
        os.sched_setaffinity(0, cpus[:n])


_IMPORTED_AT = time.perf_counter()


def process_start() -> float:
    """When this process started, as a `time.perf_counter()` reading (seconds): the kernel's
    start time of the process (Linux `/proc/self/stat`, in clock ticks of 10 ms), so the
    interpreter's start and every import count; where that cannot be read, when this module
    was first imported."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime); the command name before it, in parentheses, may hold spaces.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT
    return time.perf_counter() - age if age >= 0 else _IMPORTED_AT


def python_start() -> float:
    """When Python began importing jllama, as a `time.perf_counter()` reading: from
    `process_start()` to it is what ran before jllama's code (the exec of the interpreter, and
    whatever a shell or a wrapper did in the process before that exec; the process's start is
    its fork), then the interpreter's own start."""
    import jllama

    return jllama._IMPORTED_AT


def available_memory_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (Linux `MemAvailable`), bytes;
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int:
    """This process's resident memory now (Linux `VmRSS`: anonymous and file-backed pages),
    bytes; 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_kv_cache_fits(config: ModelConfig, key_type="f32", value_type="f32") -> None:
    """Refuse, before allocating, a KV cache larger than the host memory available.

    key_type, value_type: the KV cache types (`jllama.model.cache_types`, names or `CacheType`s).

    Raises:
      ResourceError: one line with the bytes needed and available.
    """
    from jllama.model import cache_types

    need = cache_types.kv_cache_nbytes(config.n_layers, config.n_kv_heads, config.head_dim,
                                       config.seq_len, key_type, value_type)
    have = available_memory_bytes()
    if have is not None and need > have:
        raise ResourceError(
            f"the KV cache needs {need / 2**30:.1f} GiB (n_layers={config.n_layers}, "
            f"n_kv_heads={config.n_kv_heads}, seq_len={config.seq_len}, "
            f"head_dim={config.head_dim}, {cache_types.describe(key_type, value_type)}) but "
            f"only {have / 2**30:.1f} GiB of memory is available"
        )
