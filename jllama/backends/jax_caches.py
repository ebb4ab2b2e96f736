"""The jax backend's KV caches: per layer, a list of separate blocks (`jllama.graphs.attention`).

Whole arrays, one per block of `block_length` positions, so no program ever copies a window
out of a larger cache; on one device each block is allocated the first time it is read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jllama import graphs
from jllama.model.cache_types import CacheType
from jllama.model.config import ModelConfig


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


def block_shape(config: ModelConfig, cache_type: CacheType) -> tuple[int, int, int]:
    """A cache block's shape: [n_kv_heads, block_length, cache_type.row_length(head_dim)]."""
    return (config.n_kv_heads, graphs.block_length(config.seq_len),
            cache_type.row_length(config.head_dim))


def zero_block(config: ModelConfig, cache_type: CacheType, where) -> jax.Array:
    """One block of zeros of `cache_type` (zero bytes read as 0.0 in every type, q8_0's too)."""
    return jnp.zeros(block_shape(config, cache_type), cache_type.dtype, device=where)


def layer_caches(
    config: ModelConfig, n_layers: int, where, lazy: bool, key_type: CacheType,
    value_type: CacheType,
) -> tuple[list, list, tuple[jax.Array, jax.Array]]:
    """Zeroed caches for n_layers layers: (key_cache, value_cache, (key_zero, value_zero)).

    key_cache, value_cache: per layer, `graphs.n_blocks(seq_len)` blocks of
    [n_kv_heads, block_length, row_length] of key_type's (value_type's) dtype (`block_shape`;
    f32[n_kv_heads, block_length, head_dim] for f32), `LazyBlocks` when `lazy`, else
    allocated now; key_zero, value_zero: one more such block of zeros each (the loop
    program's stand-in for the block it carries, `jllama.graphs.loop`). where: a
    `jax.Device`, or a sharding (by KV head over a mesh). The backend asks for lazy blocks on
    one device only (LazyBlocks came for a short run of a long-context model on one CPU;
    split caches are allocated whole, as before).
    """
    count = graphs.n_blocks(config.seq_len)

    def blocks(cache_type):
        if lazy:
            return LazyBlocks(count, lambda: zero_block(config, cache_type, where))
        return [zero_block(config, cache_type, where) for _ in range(count)]

    key_cache = [blocks(key_type) for _ in range(n_layers)]
    value_cache = [blocks(value_type) for _ in range(n_layers)]
    zeros = (zero_block(config, key_type, where), zero_block(config, value_type, where))
    return key_cache, value_cache, zeros
