"""Model implementations behind one protocol (`jllama.backends.base.Backend`), each with the
capabilities of `jllama.backends.base` it has:

  numpy  the reference: run.c's forward pass spelled out step by step (PrefillLogits,
         Described)
  jax    the graph-compiled pipeline of `jllama.graphs` (Prefill, PrefillLogits, DeviceLoop,
         CompilePlanning, Described; `jllama.backends.jax_graph`)
"""

from __future__ import annotations

from jllama.backends.base import Backend


def backend_names() -> tuple[str, ...]:
    """Names accepted by `make_backend` (and the CLI's --backend)."""
    return ("jax", "numpy")


def make_backend(name: str, **options) -> Backend:
    """A new, unprepared backend by name; `options` go to its constructor (e.g. the jax
    backend's `decode="fused"`, or `devices=4` to split the model over four devices,
    `jllama.sharding`).

    Raises:
      ValueError: an unknown name (the message lists the known ones), or options the backend
        does not take.
    """
    if name == "numpy":
        from jllama.backends.numpy_ref import NumpyBackend

        if options:
            raise ValueError(f"the numpy backend takes no options, got {sorted(options)}")
        return NumpyBackend()
    if name == "jax":
        from jllama.backends.jax_graph import JaxGraphBackend

        return JaxGraphBackend(**options)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")


__all__ = ["Backend", "backend_names", "make_backend"]
