"""Model implementations behind one protocol (`jllama.backends.base.Backend`).

  numpy  the reference: run.c's forward pass spelled out step by step
  jax    the graph-compiled pipeline of `jllama.graphs`
"""

from __future__ import annotations

from jllama.backends.base import Backend


def backend_names() -> tuple[str, ...]:
    """Names accepted by `make_backend` (and the CLI's --backend)."""
    return ("jax", "numpy")


def make_backend(name: str) -> Backend:
    """A new, unprepared backend by name.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name == "numpy":
        from jllama.backends.numpy_ref import NumpyBackend

        return NumpyBackend()
    if name == "jax":
        from jllama.backends.jax_graph import JaxGraphBackend

        return JaxGraphBackend()
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")


__all__ = ["Backend", "backend_names", "make_backend"]
