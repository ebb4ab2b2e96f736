"""Process-level settings: how many CPU cores XLA may use.

XLA's CPU client sizes its thread pools from the cores the process may run on when it starts,
and this version has no flag for it; pinning the process (Linux `sched_setaffinity`) before JAX
creates its CPU backend is the dependable way to give it N threads.
"""

from __future__ import annotations

import os


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
