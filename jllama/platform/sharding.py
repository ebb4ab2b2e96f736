"""Tensor parallelism: the layout of a model's weights and KV caches over a 1-D device mesh.

Megatron-LM's split of a transformer layer (Shoeybi et al. 2019), as Distributed Llama splits
it across machines: every device holds a slice of every layer.

  wqkv (wq, wk, wv)  rows split by head: device d holds query heads d*n_heads/N ... and key
                     and value heads d*n_kv_heads/N ...; its rows are regrouped so that its
                     shard is contiguous (`qkv_row_order`)
  wo                 columns split the same way (its input is the attention output, by head)
  w1, w3             rows split by hidden unit
  w2                 columns split by hidden unit
  wcls               rows split by vocabulary entry (replicated if vocab_size % N != 0)
  RMSNorm gains      replicated (f32[dim], tiny)
  KV cache blocks    split by KV head (axis 0 of [n_kv_heads, block_length, row_length], any
                     KV cache type, `jllama.model.cache_types`)

The residual stream x: f32[dim] is replicated. Per layer XLA's SPMD partitioner then inserts
exactly two all-reduces of dim floats (after wo and after w2: each device's product over its
own columns is a partial sum) and the classifier's logits are gathered once per token; no
weight ever moves between devices. The compiled programs are `jllama.graphs`' own, run under
these shardings (`jllama.graphs.sharded`).

Several processes (several hosts) form one mesh through `jax.distributed`
(`jllama.platform.distributed`); arrays are then built from each process's own shards
(`jax.make_array_from_callback`), so a process reads and holds only its slices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jllama.model.pytrees  # noqa: F401 (registers the weight dataclasses as JAX pytrees)
from jllama.model.config import ModelConfig
from jllama.errors import JllamaError
from jllama.model.quant import Int8Matrix
from jllama.model.weights import LayerWeights, TransformerWeights

AXIS = "model"
"""The name of the mesh's one axis: the devices a layer is split over."""


class ShardingError(JllamaError, ValueError):
    """A device count the model cannot be split over, or more devices than there are."""


def check_divisible(config: ModelConfig, n_devices: int) -> list[str]:
    """Check that `config` splits over `n_devices` devices.

    Returns:
      notes, one line each, on what is replicated instead of split (the classifier when
      vocab_size is not a multiple of n_devices); [] when everything splits.

    Raises:
      ShardingError: n_devices < 1, or not dividing n_kv_heads (each device holds whole KV
        heads and the query heads that read them; the constraint Distributed Llama documents),
        n_heads, or hidden_dim. The message starts with `devices=N` (the CLI prefixes "--").
    """
    n = n_devices
    if n < 1:
        raise ShardingError(f"devices={n} must be at least 1")
    for name, value, why in (
        ("n_kv_heads", config.n_kv_heads, "each device holds whole key/value heads"),
        ("n_heads", config.n_heads, "each device holds whole query heads"),
        ("hidden_dim", config.hidden_dim, "each device holds an equal share of the FFN"),
    ):
        if value % n:
            fits = [d for d in range(1, config.n_kv_heads + 1)
                    if config.n_kv_heads % d == 0 and config.hidden_dim % d == 0]
            raise ShardingError(
                f"devices={n} must divide {name}={value} ({why}); this model splits over "
                f"{', '.join(map(str, fits))} devices"
            )
    if config.vocab_size % n:
        return [f"vocab_size={config.vocab_size} is not a multiple of {n}: the classifier "
                "is replicated on every device"]
    return []


def make_mesh(n_devices: int, devices=None) -> Mesh:
    """A 1-D mesh (axis `AXIS`) over the first `n_devices` of `devices` (default: every device
    of every process, `jax.devices()`).

    Raises:
      ShardingError: fewer devices than asked, or (several processes) a process left without
        a device in the mesh: it could not read the results every process needs.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= n_devices <= len(devices):
        raise ShardingError(
            f"devices={n_devices}: JAX sees {len(devices)} device(s) "
            f"({devices[0].platform if devices else 'none'}); on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N"
        )
    chosen = devices[:n_devices]
    missing = {d.process_index for d in devices} - {d.process_index for d in chosen}
    if missing:
        raise ShardingError(
            f"devices={n_devices} leaves process(es) {sorted(missing)} without a device: use "
            f"all {len(devices)} devices of the {jax.process_count()} processes"
        )
    return Mesh(np.array(chosen), (AXIS,))


def qkv_row_order(config: ModelConfig, n_devices: int) -> np.ndarray:
    """The permutation of `wqkv`'s rows (wq's, wk's, wv's stacked) that groups them by device:
    group d = device d's query rows, then its key rows, then its value rows
    (`jllama.graphs.ops.split_qkv` reads them back). int64[q_dim + 2 * kv_dim]; the identity
    for one device."""
    c, n = config, n_devices
    qs, ks = c.q_dim // n, c.kv_dim // n
    groups = []
    for d in range(n):
        groups.append(np.arange(d * qs, (d + 1) * qs))
        groups.append(c.q_dim + np.arange(d * ks, (d + 1) * ks))
        groups.append(c.q_dim + c.kv_dim + np.arange(d * ks, (d + 1) * ks))
    return np.concatenate(groups)


def _spec_of(array, spec: PartitionSpec):
    """The PartitionSpec pytree for `array` split as `spec` (an Int8Matrix's per-row scales
    follow its rows; group scales, one axis per axis of q, follow its rows and columns)."""
    if isinstance(array, Int8Matrix):
        if array.grouped:
            return Int8Matrix(q=spec, scale=spec)
        return Int8Matrix(q=spec, scale=PartitionSpec(spec[0]) if len(spec) else spec)
    return spec


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel layout over one mesh.

    Attributes:
      mesh: a 1-D `Mesh` with axis `AXIS` (`make_mesh`).
      split_classifier: whether wcls is split by vocabulary rows (False: replicated, for a
        vocab_size that is not a multiple of the device count).
    """

    mesh: Mesh
    split_classifier: bool = True

    @property
    def n_devices(self) -> int:
        return self.mesh.size

    def sharding(self, *spec) -> NamedSharding:
        """NamedSharding(mesh, PartitionSpec(*spec)); no arguments: replicated."""
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def by_head(self) -> NamedSharding:
        """Axis 0 split: cache blocks [n_kv_heads, block_length, row_length], q f32[n_heads,
        head_dim], the attention output f32[q_dim]."""
        return self.sharding(AXIS)

    def layer_specs(self, layer: LayerWeights) -> LayerWeights:
        """PartitionSpecs for one layer's arrays (`LayerWeights` of specs)."""
        rows, cols, rep = PartitionSpec(AXIS, None), PartitionSpec(None, AXIS), PartitionSpec()
        return LayerWeights(
            rms_att_weight=rep,
            wqkv=_spec_of(layer.wqkv, rows),
            wo=_spec_of(layer.wo, cols),
            rms_ffn_weight=rep,
            w1=_spec_of(layer.w1, rows),
            w2=_spec_of(layer.w2, cols),
            w3=_spec_of(layer.w3, rows),
            # The bias follows wqkv's rows (regrouped alike by `place_layer`); the per-head
            # norm gains are the same for every head, so every device holds them.
            bqkv=None if layer.bqkv is None else PartitionSpec(AXIS),
            q_norm=None if layer.q_norm is None else rep,
            k_norm=None if layer.k_norm is None else rep,
        )

    def classifier_spec(self, wcls) -> PartitionSpec | Int8Matrix:
        """wcls [vocab_size, dim] (or an embedding table used as one): rows split, or
        replicated when `split_classifier` is False."""
        spec = PartitionSpec(AXIS, None) if self.split_classifier else PartitionSpec()
        return _spec_of(wcls, spec)

    def put(self, host, specs=PartitionSpec()):
        """Host arrays (a pytree) as global arrays laid out as `specs` (a matching pytree of
        PartitionSpecs, or one spec for all; default replicated).

        In one process this is `jax.device_put`. With several processes each process builds
        its own devices' shards from its host copy (`jax.make_array_from_callback`): nothing
        is sent between processes, and every process must pass the same values.
        """
        if isinstance(specs, PartitionSpec):
            specs = jax.tree.map(lambda _: specs, host)
        shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs,
            is_leaf=lambda s: isinstance(s, PartitionSpec),
        )
        if jax.process_count() == 1:
            return jax.device_put(host, shardings)

        def one(array, sharding):
            array = np.asarray(array)
            return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])

        return jax.tree.map(one, host, shardings)

    def place_layer(self, config: ModelConfig, layer: LayerWeights) -> LayerWeights:
        """One layer (host, `to_graph_weights`' layout) on the mesh: wqkv's rows regrouped
        by device (`qkv_row_order`), every array split as `layer_specs`."""
        if self.n_devices > 1:
            order = qkv_row_order(config, self.n_devices)
            layer = dataclasses.replace(layer, wqkv=layer.wqkv[order])
            if layer.bqkv is not None:
                layer = dataclasses.replace(layer, bqkv=layer.bqkv[order])
        return self.put(layer, self.layer_specs(layer))


def tensor_parallel(config: ModelConfig, n_devices: int, devices=None) -> tuple[TensorParallel, list[str]]:
    """The layout of `config` over the first `n_devices` devices, and `check_divisible`'s
    notes.

    Raises:
      ShardingError: as `check_divisible` and `make_mesh`.
    """
    notes = check_divisible(config, n_devices)
    mesh = make_mesh(n_devices, devices)
    return TensorParallel(mesh, split_classifier=config.vocab_size % n_devices == 0), notes


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device holds under tensor parallelism over `n_devices`, bytes.

    Attributes:
      n_devices: the device count.
      weights: the layers' slices, the replicated gains, the classifier's slice (or all of it
        when it is replicated).
      kv_cache: the device's KV heads of every layer for seq_len positions, in the cache
        types.
      host_embedding: the token embedding table, kept on the host (0 when the classifier
        is the embedding table: it is then on the devices, counted in `weights`).
    """

    n_devices: int
    weights: int
    kv_cache: int
    host_embedding: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def device_memory(config: ModelConfig, weights: TransformerWeights, n_devices: int,
                  cache_types=("f32", "f32")) -> DeviceMemory:
    """Bytes per device of `weights` (file layout, any dtype) split as `TensorParallel` splits
    them over `n_devices` (n_devices must pass `check_divisible`), and of the KV cache for
    config.seq_len positions in its (key, value) `cache_types` (`jllama.model.cache_types`)."""
    from jllama.model.cache_types import kv_cache_nbytes

    n = n_devices
    split = sum(getattr(weights, f).nbytes // n for f in ("wq", "wk", "wv", "w1", "w3"))
    for f in ("wo", "w2"):  # split by columns: an int8 matrix's per-row scales stay whole
        m = getattr(weights, f)
        if isinstance(m, Int8Matrix) and not m.grouped:
            split += m.q.nbytes // n + m.scale.nbytes
        else:
            split += m.nbytes // n
    gains = sum(getattr(weights, f).nbytes
                for f in ("rms_att_weight", "rms_ffn_weight", "rms_final_weight"))
    wcls = weights.wcls.nbytes
    wcls_share = wcls // n if config.vocab_size % n == 0 else wcls
    shared = weights.wcls is weights.token_embedding_table
    return DeviceMemory(
        n_devices=n,
        weights=split + gains + wcls_share,
        kv_cache=kv_cache_nbytes(config.n_layers, config.n_kv_heads, config.head_dim,
                                 config.seq_len, *cache_types) // n,
        host_embedding=0 if shared else weights.token_embedding_table.nbytes,
    )
