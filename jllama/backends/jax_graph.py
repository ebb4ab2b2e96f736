"""The JAX backend: the compiled programs of `jllama.graphs` assembled into a decode step.

Per token: the embedding row goes to the device, then for each layer the `qkv`, `attention` and
`block` programs run with that layer's arrays, then `classifier`. The four programs are traced
and compiled once (in `prepare`, by a warm-up step) and replayed for every layer and token;
`attention` is compiled once more for each longer window the context grows into
(`graphs.attention_window`: 256, 512, 1024, ... positions). Each layer's KV cache is a list of
blocks of 256 positions (`graphs.attention`), passed whole to the programs.

With `devices=N` (or a `mesh`) the same programs run split over N devices, tensor-parallel
(`jllama.platform.sharding`: every device holds its heads' and hidden units' slice of every layer and
its KV heads' caches; `jllama.graphs.sharded`: the programs with their output layouts).

The backend is assembled from one module per job, each a class over the shared state that
`jax_state.JaxState` names: this module (construction, `prepare`, notes), `jax_step` (the
decode step, `forward`), `jax_prefill` (batched prefill), `jax_loop` (the device loop),
`jax_compile` (compile planning) and `jax_caches` (the KV-cache blocks).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
from jax.sharding import Mesh

from jllama import graphs
from jllama import kernels
from jllama.model.cache_types import cache_type as _cache_type
from jllama.backends.jax_verify import VerifySteps
from jllama.backends.jax_caches import LazyBlocks, layer_caches
from jllama.backends.jax_compile import CompilePlan
from jllama.backends.jax_loop import LOOP_CHUNK, LOOP_STOP_IDS
from jllama.backends.jax_prefill import PREFILL_CHUNKS
from jllama.model.config import ModelConfig
from jllama.graphs.cache_rows import KERNEL_CACHE_DTYPES
from jllama.errors import BackendError, ConfigError
from jllama.model.ggml_matrix import for_xla, is_ggml
from jllama.model import weights_cache
from jllama.model.packing import pack_in_decode_order, place_weights
from jllama.platform.fetch import jllama_home
from jllama.model.rope import rope_frequencies
from jllama.platform.runtime import available_cpus
from jllama.platform.sharding import TensorParallel
from jllama.model.weights import (
    TransformerWeights,
    check_shapes,
    to_graph_weights,
)

DECODE_MODES = ("graph", "fused", "loop")
"""graph: three compiled programs per layer plus the classifier (the design's per-block
programs); fused: one program for all layers and the classifier, plus one that writes the
caches (`jllama.graphs.fused`); loop: `LOOP_CHUNK` tokens per call of one program that also
samples (`jllama.graphs.loop`, through `decode_loop`; `forward` runs the graph programs). All
give the same greedy tokens."""

MATVEC = ("auto", "xla", "kernel")
"""How the decode programs compute their matrix-vector products (`jllama.graphs.ops.matmul`):
"kernel": jllama's CPU kernels (`jllama.kernels`); "xla": `jnp.dot`; "auto": the kernels on one
CPU device when they build here, else XLA."""

__all__ = [
    "DECODE_MODES",
    "LOOP_CHUNK",
    "LOOP_STOP_IDS",
    "MATVEC",
    "PREFILL_CHUNKS",
    "JaxGraphBackend",
    "LazyBlocks",
]


class JaxGraphBackend(CompilePlan, VerifySteps):
    """Graph-compiled backend over per-layer device arrays and per-layer head-major caches.

    Args:
      device: the `jax.Device` to run on (default: JAX's default device); one device only.
      decode: one of `DECODE_MODES`.
      devices: split the model over this many devices (the first N of `jax.devices()`,
        across every process of a `jax.distributed` run), tensor-parallel as
        `jllama.platform.sharding` lays it out; 1 (the default) runs on `device`.
      mesh: a 1-D `jax.sharding.Mesh` with axis `jllama.platform.sharding.AXIS` to split the model
        over instead (then `devices` is ignored).
      matvec: one of `MATVEC`; resolved to "xla" or "kernel" by `prepare`.
      cache_type_k, cache_type_v: the KV cache types of the keys and of the values
        (`jllama.model.cache_types`: "f32", "f16", "bf16", "q8_0", or a `CacheType`): each block is
        stored in its type, rows rounded as they are written and widened to float32 as they
        are read.
      weights_cache: with matvec="kernel", keep the kernels' weight buffer in
        `$JLLAMA_HOME/weights` and map it from there in later runs (`jllama.model.weights_cache`).

    Raises:
      ConfigError: an unknown cache type; (at `prepare`) q8_0 for a head_dim that is not a
        multiple of 32.
      BackendError: JAX cannot start its default device (e.g. JAX_PLATFORMS names a missing
        platform).
      ShardingError (at `prepare`): the model does not split over the devices
        (`jllama.platform.sharding.check_divisible`), or there are fewer devices than asked.
      KernelBuildError (at `prepare`, a `BackendError`): matvec="kernel" and the kernels do
        not build here, or the model is not on one CPU device.

    Attributes:
      name: "jax".
      compile_seconds: wall time of the warm-up step in `prepare` (tracing + compiling the four
        programs), seconds.
      tensor_parallel: the `jllama.platform.sharding.TensorParallel` layout after `prepare` when split
        over several devices, else None.
      sharding_notes: what `prepare` replicated instead of splitting (one line each).
      matvec: "xla" or "kernel" after `prepare` (the requested mode before).
      matvec_note: why matvec="auto" chose "xla" on a CPU (the kernels' build error, one
        line), or "" when it did not.
      weights_note: how `prepare` converted GGML blocks for XLA's products, or "".
      cache_types: (key, value) `jllama.model.cache_types.CacheType`s.
      cache_note: why attention runs in XLA beside the kernels' products (a cache type the
        kernels do not read), or "".
      loop_chunk: `LOOP_CHUNK`, the most tokens one `decode_loop` call samples.
      platform: the device's platform ("cpu", "gpu", "tpu").

    It satisfies every protocol of `jllama.backends.base`: `Backend`, `Prefill`,
    `PrefillLogits`, `DeviceLoop`, `CompilePlanning`, `Described`, `SlotCaches` and
    `BatchDecode` (`jax_batch.BatchSteps.decode_batch`) (`notes` gathers
    matvec_note, weights_note and sharding_notes as lines for the user).
    """

    name = "jax"

    def __init__(
        self,
        device: jax.Device | None = None,
        decode: str = "graph",
        devices: int = 1,
        mesh: Mesh | None = None,
        matvec: str = "auto",
        cache_type_k="f32",
        cache_type_v="f32",
        weights_cache: bool = True,
    ):
        self.weights_cache = weights_cache
        self.cache_types = (_cache_type(cache_type_k, "cache_type_k"),
                            _cache_type(cache_type_v, "cache_type_v"))
        self.cache_note = ""
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}; known modes: {', '.join(DECODE_MODES)}")
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be an integer >= 1")
        if matvec not in MATVEC:
            raise ValueError(f"matvec={matvec!r}; known: {', '.join(MATVEC)}")
        self.decode = decode
        self.matvec = matvec
        self.matvec_note = ""
        self.weights_note = ""
        self.devices = mesh.size if mesh is not None else devices
        self._mesh = mesh
        self.tensor_parallel: TensorParallel | None = None
        self.sharding_notes: list[str] = []
        self._programs = graphs.ONE_DEVICE
        self._shards = 1
        if mesh is not None:
            device = mesh.devices.flat[0]
        if device is None:
            try:
                device = jax.devices()[0]
            except Exception as e:  # JAX reports a missing platform in several ways
                why = str(e) or type(e).__name__
                platforms = os.environ.get("JAX_PLATFORMS")
                hint = f" (JAX_PLATFORMS={platforms}: is that platform installed?)" if platforms else ""
                raise BackendError(f"JAX could not start a device: {why}{hint}") from e
        self.device = device
        self.config: ModelConfig | None = None
        self.compile_seconds = 0.0

    def prepare(self, config: ModelConfig, weights: TransformerWeights) -> None:
        """Convert the weights to the per-layer layout on the device, allocate the caches
        (per layer, blocks of seq_len positions in all of the key and of the value cache
        types, `jax_caches.layer_caches`) and compile the programs.

        Weight matrices keep their dtype on the device (float32; bfloat16: half the bytes;
        int8 `jllama.model.quant.Int8Matrix`: a quarter; both widened to float32 inside each
        product); the caches hold their cache types; activations and logits are float32.

        Raises:
          ConfigError: a q8_0 cache type and a head_dim that is not a multiple of 32."""
        check_shapes(config, weights)
        for t, flag in zip(self.cache_types, ("cache_type_k", "cache_type_v"), strict=True):
            t.check(config.head_dim, flag)
        if config.moe:
            self._check_moe()
        if self.devices > 1:
            self._split_over_devices(config)
        self.config = config
        self.matvec = self._resolve_matvec(self.matvec)
        self._shared_embedding = weights.token_embedding_table is weights.wcls
        # The embedding table stays on the host: one row per token is all a step needs.
        self.token_embedding_table = weights.token_embedding_table
        self._loop_embedding = None
        tp = self.tensor_parallel
        if config.moe:
            self._place_moe(weights)
        elif self.matvec == "kernel":  # one CPU device
            # Straight from the file into one buffer in reading order, which device_put aliases
            # rather than copies (`jllama.model.packing.place_weights`); GGML blocks eight rows at a
            # time where the kernels have that path (AVX2 or AVX-512): the same bytes, 2-3x
            # faster products (`jllama.model.ggml_repack`).
            cache = weights_cache.folder(jllama_home()) if self.weights_cache else None
            layers, wcls = place_weights(weights, x8=kernels.vector_width() >= 8,
                                         threads=available_cpus(), cache=cache)
            self.layers, self.rms_final_weight, self.wcls = jax.device_put(
                (layers, weights.rms_final_weight, wcls), self.device
            )
            self._host_wcls = wcls
        else:
            self._place_converted(weights)
        self._inv_freq = rope_frequencies(config)  # the host's copy, for prefill's angles
        self.inv_freq = self._put(self._inv_freq)
        # Per layer, a list of cache blocks (`jllama.graphs.attention`): whole arrays, so no
        # program ever copies a window out of a larger cache.
        self.block_length = graphs.block_length(config.seq_len)
        where = self.device if tp is None else tp.by_head  # split by KV head
        self._cache_place = (where, tp is None)  # for new_caches: device, lazily allocated
        self.key_cache, self.value_cache, self._zero_blocks = layer_caches(
            config, len(self.layers), where, tp is None, *self.cache_types
        )
        off_kernels = [t.name for t in self.cache_types if t.dtype not in KERNEL_CACHE_DTYPES]
        if self.matvec == "kernel" and off_kernels:
            self.cache_note = (
                f"attention and the cache writes run in XLA for the {off_kernels[0]} KV cache "
                "(jllama's kernels do not read it); the products keep the kernels"
            )
        start = time.perf_counter()
        # Warm-up: traces and compiles all four programs. Harmless to the sequence that follows:
        # position 0 is rewritten by the first real step and later positions are masked.
        self._warm_layers = None
        self.warm_forward(0)
        self.compile_seconds = time.perf_counter() - start
        # What compile_for need not run again: ("forward", k), ("loop", kind, k) and
        # ("prefill", size, k) for k cache blocks read.
        self._compiled = {("forward", graphs.attention_blocks(config.seq_len, 0))}

    def _check_moe(self) -> None:
        """Refuse, in one line, what a Mixture-of-Experts model does not run on yet: the
        fused and loop decode modes and tensor parallelism (the graph mode's step routes each
        layer's token on the host, `jllama.graphs.moe`).

        Raises:
          ConfigError: decode is not "graph", or the model is split over devices.
        """
        if self.decode != "graph":
            raise ConfigError(f"decode={self.decode!r} does not run Mixture-of-Experts models "
                              "yet (n_experts > 0): use decode='graph'")
        if self.devices > 1:
            raise ConfigError("tensor parallelism does not run Mixture-of-Experts models yet "
                              f"(n_experts > 0): use one device, not devices={self.devices}")

    def _place_moe(self, weights: TransformerWeights) -> None:
        """A Mixture-of-Experts model's weights on the device: the graph layout (wqkv
        stacked) with each layer's w1, w2 and w3 a tuple of one matrix per expert (views of the
        stacked tensor, or for the kernels laid out by `place_weights` as a dense model's
        matrices are: x8 layouts where the kernels have them, copied on every core, file
        pages dropped; for XLA's products converted as `_place_converted` converts, expert by
        expert), so a step reads only the routed experts' arrays (`jllama.graphs.moe`)."""
        n = self.config.n_experts
        if self.matvec == "kernel":  # as a dense model's, experts planned one by one
            cache = weights_cache.folder(jllama_home()) if self.weights_cache else None
            layers, wcls = place_weights(weights, x8=kernels.vector_width() >= 8,
                                         threads=available_cpus(), cache=cache)
        else:
            host = to_graph_weights(weights)

            def held(m):
                return for_xla(m) if is_ggml(m) else m

            layers = tuple(
                dataclasses.replace(
                    layer, wqkv=held(layer.wqkv), wo=held(layer.wo),
                    **{name: tuple(held(getattr(layer, name)[e]) for e in range(n))
                       for name in ("w1", "w2", "w3")},
                )
                for layer in host.layers
            )
            wcls = held(host.wcls)
        self._host_wcls = wcls
        self.layers, self.rms_final_weight, self.wcls = jax.device_put(
            (layers, weights.rms_final_weight, wcls), self.device
        )

    def _place_converted(self, weights: TransformerWeights) -> None:
        """The weights for XLA's products (on any platform, or split over devices): the graph
        layout on the host, GGML blocks converted, then placed (on a CPU, one buffer in reading
        order)."""
        host = to_graph_weights(weights)
        # XLA's products cannot read GGML blocks: Q8_0 / Q4_0 become grouped int8 (exact),
        # other types float32 (`jllama.model.ggml_matrix.for_xla`).
        leaves = jax.tree_util.tree_leaves(host, is_leaf=is_ggml)
        converted = {id(m): for_xla(m) for m in leaves if is_ggml(m)}  # a tied table once
        host = jax.tree_util.tree_map(lambda m: converted.get(id(m), m), host, is_leaf=is_ggml)
        if converted:
            leaves = {id(a): a for a in jax.tree_util.tree_leaves(host)}
            nbytes = sum(a.nbytes for a in leaves.values())
            self.weights_note = (
                "XLA's products take GGML blocks as grouped int8 (Q8_0, Q4_0) or dequantized "
                f"float32 (other types), with float32 activations: weights {nbytes / 1e6:.1f} MB"
            )
        self.token_embedding_table = host.token_embedding_table
        self._host_wcls = host.wcls
        tp = self.tensor_parallel
        if tp is None:
            layers, wcls = host.layers, host.wcls
            if self.device.platform == "cpu":
                # One buffer in reading order, which device_put aliases rather than copies
                # (`jllama.model.packing`): the matrices end to end stream faster.
                layers, wcls = pack_in_decode_order(layers, wcls)
            self.layers, self.rms_final_weight, self.wcls = jax.device_put(
                (layers, host.rms_final_weight, wcls), self.device
            )
        else:
            # Layer by layer: the regrouped wqkv is a host copy, freed once placed.
            self.layers = tuple(tp.place_layer(self.config, layer) for layer in host.layers)
            self.rms_final_weight = tp.put(host.rms_final_weight)
            self.wcls = tp.put(host.wcls, tp.classifier_spec(host.wcls))

    def _resolve_matvec(self, requested: str) -> str:
        """"xla" or "kernel" for `requested`, building the kernels when they may be used."""
        if requested == "xla":
            return "xla"
        if self.tensor_parallel is not None or self.device.platform != "cpu":
            if requested == "kernel":
                where = ("split over devices" if self.tensor_parallel is not None
                         else f"on {self.device.platform}")
                raise kernels.KernelBuildError(
                    f"matvec=kernel runs on one CPU device only, not {where}"
                )
            return "xla"
        try:
            kernels.load()
        except kernels.KernelBuildError as e:
            if requested == "kernel":
                raise kernels.KernelBuildError(f"matvec=kernel: {e}") from None
            self.matvec_note = str(e)
            return "xla"
        return "kernel"

    def _split_over_devices(self, config: ModelConfig) -> None:
        """Choose the mesh and the layout, and the programs that run under it."""
        from jllama.graphs.sharded import sharded_programs
        from jllama.platform.sharding import check_divisible, tensor_parallel

        if self._mesh is not None:
            self.sharding_notes = check_divisible(config, self._mesh.size)
            self.tensor_parallel = TensorParallel(
                self._mesh, split_classifier=config.vocab_size % self._mesh.size == 0
            )
        else:
            self.tensor_parallel, self.sharding_notes = tensor_parallel(config, self.devices)
            self.device = self.tensor_parallel.mesh.devices.flat[0]
        self._programs = sharded_programs(self.tensor_parallel.mesh)
        self._shards = self.devices

    def new_caches(self) -> tuple[list, list]:
        """(key_cache, value_cache) for one more sequence (`SlotCaches`), laid out as
        `prepare`'s: per layer, blocks allocated the first time they are read (on one device).

        Raises:
          RuntimeError: before `prepare`.
        """
        config = self._prepared("new_caches")
        where, lazy = self._cache_place
        keys, values, _ = layer_caches(config, len(self.layers), where, lazy, *self.cache_types)
        return keys, values

    def use_caches(self, caches: tuple[list, list]) -> tuple[list, list]:
        """Run on `caches` (`SlotCaches`); returns the (key_cache, value_cache) in use before.
        The programs update the lists in place, so a sequence's caches stay its own."""
        previous = self.key_cache, self.value_cache
        self.key_cache, self.value_cache = caches
        return previous

    @property
    def platform(self) -> str:
        """The platform of the device it runs on (of the mesh's devices when split)."""
        return self.device.platform

    def notes(self) -> list[str]:
        """What `prepare` chose that the user should hear of, one line each (empty before
        `prepare`): the fall-back to XLA's products and why, GGML blocks converted for them,
        and what was replicated instead of split over the devices. The CLI prints each after
        "jllama: note: ", spelling `matvec=` as its flag `--matvec=`."""
        lines = []
        if self.matvec_note:
            lines.append(f"using XLA's products (matvec=xla): {self.matvec_note}")
        if self.weights_note:
            lines.append(self.weights_note)
        if self.cache_note:
            lines.append(self.cache_note)
        return lines + list(self.sharding_notes)
