"""Several processes (on one host or several) running one model together, with JAX's own
multi-process runtime.

Every process runs the same program: `start` joins it to the others through
`jax.distributed.initialize` (process 0 runs the coordinator service at the address all are
given), after which `jax.devices()` lists the devices of every process and one mesh can span
them (`jllama.platform.sharding.make_mesh`). On CPU the cross-process collectives are gloo's over TCP
(`jax_cpu_collectives_implementation`); GPUs use NCCL. jllama opens no socket of its own.

Process 0 is the one that talks to the user; `agree` hands its choices (prompt ids, seed) to
the others so that every process feeds and samples the same tokens.
"""

from __future__ import annotations

import atexit
import re

from jllama.errors import JllamaError

CPU_COLLECTIVES = "gloo"
"""The cross-process collectives XLA CPU uses (JAX's flag also takes "mpi")."""


class DistributedError(JllamaError, ValueError):
    """Bad multi-process settings, or a process group that cannot form."""


def check_settings(coordinator: str | None, num_processes: int, process_id: int) -> None:
    """Validate the three settings of a multi-process run before anything starts.

    Raises:
      DistributedError: naming the setting (`coordinator`, `num_processes`, `process_id`; the
        CLI prefixes "--") and what is wrong.
    """
    if num_processes < 1:
        raise DistributedError(f"num_processes={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
        raise DistributedError(
            f"process_id={process_id} must be in 0..{num_processes - 1} "
            f"(num_processes={num_processes})"
        )
    if num_processes > 1 and not coordinator:
        raise DistributedError(
            f"num_processes={num_processes} needs a coordinator: HOST:PORT of process 0 "
            "(--coordinator on the command line)"
        )
    if coordinator and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", coordinator):
        raise DistributedError(f"coordinator={coordinator!r} must be HOST:PORT")


def start(coordinator: str, num_processes: int, process_id: int, timeout_s: int = 120) -> None:
    """Join this process to the others (`jax.distributed.initialize`). Must run before
    anything touches a JAX device. Waits up to `timeout_s` for all `num_processes` to
    arrive.

    Raises:
      DistributedError: invalid settings (`check_settings`), or the group did not form
        (e.g. a process never started, or the coordinator's port is taken).
    """
    check_settings(coordinator, num_processes, process_id)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes,
            process_id=process_id, initialization_timeout=timeout_s,
            shutdown_timeout_seconds=timeout_s,
        )
    except Exception as e:  # the runtime reports failures as several exception types
        why = " ".join(str(e).split()) or type(e).__name__
        raise DistributedError(
            f"process {process_id} of {num_processes} could not join the coordinator at "
            f"{coordinator}: {why[:300]}"
        ) from e
    # Leave together: each process waits at exit (up to timeout_s) for the others to finish
    # their last collectives before the coordinator goes away.
    atexit.register(jax.distributed.shutdown)


def is_main_process() -> bool:
    """Whether this is process 0 (or the only process): the one that prints."""
    import jax

    return jax.process_index() == 0


def agree(values: list[int]) -> list[int]:
    """Process 0's list of non-negative ints (< 2**32), on every process
    (`jax.experimental.multihost_utils.broadcast_one_to_all`); `values` itself with one
    process. Every process must call it at the same point of the program."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(values)
    length = multihost_utils.broadcast_one_to_all(np.array([len(values)], np.uint32))
    n = int(length[0])
    if n == 0:
        return []
    mine = np.zeros(n, np.uint32)
    if jax.process_index() == 0:
        mine[:] = np.asarray(values, np.uint64).astype(np.uint32)
    return [int(v) for v in multihost_utils.broadcast_one_to_all(mine)]
