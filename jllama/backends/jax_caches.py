"""The jax backend's KV caches: per layer, a list of separate blocks (`jllama.graphs.attention`).

Whole arrays, one per block of `block_length` positions, so no program ever copies a window
out of a larger cache; on one device each block is allocated the first time it is read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jllama import graphs
from jllama.config import ModelConfig


class LazyBlocks(list):
    """One layer's KV-cache blocks (a list of `count` arrays), each made by `make` the first
    time it is read: a short run of a long-context model allocates only the blocks it reaches
    (SmolLM2's 8192 positions are 377 MB of zeros, about 0.5-1 s to write at start-up)."""

    def __init__(self, count: int, make):
        super().__init__([None] * count)
        self._make = make

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        block = super().__getitem__(index)
        if block is None:
            block = self._make()
            super().__setitem__(index, block)
        return block

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def layer_caches(
    config: ModelConfig, n_layers: int, where, lazy: bool
) -> tuple[list, list, jax.Array]:
    """Zeroed caches for n_layers layers: (key_cache, value_cache, zero_block).

    key_cache, value_cache: per layer, `graphs.n_blocks(seq_len)` blocks of
    f32[n_kv_heads, block_length, head_dim] (`LazyBlocks` when `lazy`, else allocated now);
    zero_block: one more such block of zeros (the loop program's stand-in for the block it
    carries, `jllama.graphs.loop`). where: a `jax.Device`, or a sharding (by KV head over a
    mesh). The backend asks for lazy blocks on one device only (LazyBlocks came for a short run
    of a long-context model on one CPU; split caches are allocated whole, as before).
    """
    shape = (config.n_kv_heads, graphs.block_length(config.seq_len), config.head_dim)
    count = graphs.n_blocks(config.seq_len)

    def blocks():
        if lazy:
            return LazyBlocks(count, lambda: jnp.zeros(shape, jnp.float32, device=where))
        return [jnp.zeros(shape, jnp.float32, device=where) for _ in range(count)]

    key_cache = [blocks() for _ in range(n_layers)]
    value_cache = [blocks() for _ in range(n_layers)]
    return key_cache, value_cache, jnp.zeros(shape, jnp.float32, device=where)
