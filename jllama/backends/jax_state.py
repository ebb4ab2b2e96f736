"""The state the parts of the jax backend share, and the moves of host values to the device.

`JaxGraphBackend` (`jllama.backends.jax_graph`) is assembled from parts, one module each: the
decode step and `prepare` (jax_graph), batched prefill (`jax_prefill.PrefillSteps`), the
on-device decode loop (`jax_loop.DeviceLoopSteps`) and compile planning
(`jax_compile.CompilePlan`). Each part derives from `JaxState`, which names (and types) every
attribute they read, so a reader of one part sees what it may use without reading the others;
`JaxGraphBackend.__init__` and `prepare` set them.
"""

from __future__ import annotations

import jax
import numpy as np

from jllama.model.config import ModelConfig
from jllama.graphs import Programs
from jllama.platform.sharding import TensorParallel


class JaxState:
    """What the jax backend's parts share. Set by `JaxGraphBackend.__init__`:

      config: the model after `prepare`, None before.
      device: the `jax.Device` it runs on (the mesh's first when split over devices).
      decode: one of `jax_graph.DECODE_MODES`; matvec: "xla" or "kernel" after `prepare`.
      tensor_parallel: the layout when split over devices, else None.
      compile_seconds: seconds spent compiling so far.

    and by `prepare` (device arrays; "on the device": replicated over the mesh when split):

      _programs: the compiled programs (`jllama.graphs.ONE_DEVICE`, or the mesh's from
        `jllama.graphs.sharded.sharded_programs`); _shards: wqkv's row groups (1, or the
        device count).
      token_embedding_table: the host's table (one row per token is read); _host_wcls: the
        host's classifier; _shared_embedding: the two are the same array.
      layers: per-layer `LayerWeights`; rms_final_weight: f32[dim]; wcls: [vocab_size, dim].
      inv_freq: f32[head_dim // 2] on the device; _inv_freq: the host's copy.
      block_length: positions per cache block (`jllama.graphs.block_length`).
      key_cache, value_cache: per layer, a list of blocks [n_kv_heads, block_length,
        row_length] of the key (value) cache type (`jax_caches.layer_caches`; f32[...,
        head_dim] for f32); _zero_blocks: one block of zeros of each (key, value).
      cache_types: the (key, value) `jllama.model.cache_types.CacheType`s (set by `__init__`).
      _compiled: the keys of what compile planning need not run again (`jax_compile`).
    """

    config: ModelConfig | None
    device: jax.Device
    decode: str
    matvec: str
    tensor_parallel: TensorParallel | None
    compile_seconds: float
    _programs: Programs
    _shards: int
    token_embedding_table: object
    _host_wcls: object
    _shared_embedding: bool
    layers: tuple
    rms_final_weight: jax.Array
    wcls: object
    inv_freq: jax.Array
    _inv_freq: np.ndarray
    block_length: int
    key_cache: list
    value_cache: list
    _zero_blocks: tuple[jax.Array, jax.Array]
    cache_types: tuple
    _cache_place: tuple
    _compiled: set

    def _prepared(self, method: str) -> ModelConfig:
        """The config, or RuntimeError when `method` is called before `prepare`."""
        if self.config is None:
            raise RuntimeError(f"JaxGraphBackend.{method} called before prepare")
        return self.config

    def _put(self, host):
        """A host array (or scalar) on the device, or replicated over the mesh."""
        if self.tensor_parallel is None:
            return jax.device_put(host, self.device)
        return self.tensor_parallel.put(np.asarray(host))

    def _arg(self, host):
        """A small host argument for a program: passed as is on one device (jit moves it),
        a replicated global array over a mesh (what every process of a multi-process run
        can pass)."""
        return host if self.tensor_parallel is None else self._put(host)
