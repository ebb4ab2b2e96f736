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
    `jllama.platform.sharding`; both take `cache_type_k` and `cache_type_v`, `jllama.model.cache_types`).

    Raises:
      ValueError: an unknown name (the message lists the known ones), or options the backend
        does not take.
      ConfigError: an unknown cache type.
    """
    if name == "numpy":
        from jllama.backends.numpy_ref import NumpyBackend

        other = sorted(set(options) - {"cache_type_k", "cache_type_v"})
        if other:
            raise ValueError(f"the numpy backend takes only cache_type_k and cache_type_v, "
                             f"got {other}")
        return NumpyBackend(**options)
    if name == "jax":
        from jllama.backends.jax_graph import JaxGraphBackend

        return JaxGraphBackend(**options)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")


def prepared_backend(model, backend: str | Backend = "jax", *, decode: str = "graph",
                     matvec: str = "auto", devices: int = 1, cache_type_k="auto",
                     cache_type_v="auto", say=None, weights_cache: bool = True) -> Backend:
    """`backend` (a name, or an unprepared backend) prepared for `model` (a
    `jllama.model.loading.Model`): the KV cache checked against the host's memory first (CPU
    backends), the kernels' build announced through `say` when it is about to happen.

    Args:
      decode, matvec, devices: the jax backend's settings (ignored for another name): decode
        "fused" makes the one-program decode, any other the per-layer programs.
      cache_type_k, cache_type_v: the KV cache types of a backend made here by name
        (`jllama.model.cache_types.resolve`: "auto" is f32, or `DEFAULT_GGUF` for a GGUF file);
        a backend given as an object keeps its own (and other values are a ValueError).
      say: takes lines for the user; None: nothing is said.
      weights_cache: the jax backend's (`jllama.model.weights_cache`).

    Raises:
      ConfigError: an unknown cache type, or q8_0 for a head_dim not a multiple of 32.
      ResourceError: the KV cache does not fit in the memory available.
      BackendError, ShardingError, ValueError: from the backend (see `make_backend`).
    """
    from jllama.model import cache_types
    from jllama.platform import runtime
    from jllama.backends.base import Described

    if isinstance(backend, str):
        key, value = cache_types.resolve(cache_type_k, cache_type_v,
                                         getattr(model, "file_format", "llama2c"),
                                         model.config.head_dim)
        settings = {"cache_type_k": key, "cache_type_v": value}
        if backend == "jax":
            settings.update(decode="fused" if decode == "fused" else "graph", matvec=matvec,
                            weights_cache=weights_cache)
            if devices > 1:
                settings["devices"] = devices
        backend = make_backend(backend, **settings)
    elif (cache_type_k, cache_type_v) != (cache_types.AUTO, cache_types.AUTO):
        raise ValueError("cache_type_k and cache_type_v are a backend's own settings: pass them "
                         "to make_backend, not with a backend already made")
    on_cpu = not isinstance(backend, Described) or backend.platform == "cpu"
    if on_cpu:
        runtime.check_kv_cache_fits(model.config, *getattr(backend, "cache_types",
                                                           ("f32", "f32")))
    if say is not None and on_cpu and devices == 1 and matvec != "xla" and backend.name == "jax":
        from jllama.kernels.library import compiler, is_built

        if compiler() and not is_built():
            say("building jllama's CPU kernels (once for this machine and compiler, about 15 s)")
    backend.prepare(model.config, model.weights)
    return backend


__all__ = ["Backend", "backend_names", "make_backend", "prepared_backend"]
