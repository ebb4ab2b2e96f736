"""The set of compiled programs a backend calls, as one typed object.

The programs of one device are the module-level `jax.jit` functions of `jllama.graphs`
(`ONE_DEVICE`); a tensor-parallel layout jits the same traced bodies again with its output
layouts (`jllama.graphs.sharded.sharded_programs`). Both are a `Programs`, so the backend
runs either one through the same fields, and a test can swap one program for a spy with
`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jllama.graphs.attention import attention
from jllama.graphs.batch_xla import decode_batch_step, write_rows
from jllama.graphs.block import block
from jllama.graphs.classifier import classifier
from jllama.graphs.fused import decode_step, write_caches
from jllama.graphs.loop import decode_loop
from jllama.graphs.prefill import (
    attention_chunk,
    block_chunk,
    classifier_last,
    classifier_rows,
    qkv_chunk,
)
from jllama.graphs.qkv import qkv

Program = Callable[..., object]
"""A compiled program: called with the arguments of its `jllama.graphs` function; has
`.lower` (a `jax.jit` function, or one that waits for its results, `jllama.graphs.sharded`)."""


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled programs behind the jax backend, one field each, with the arguments,
    static arguments and donations of the `jllama.graphs` function of the same name.

    Decode (`graph` mode), per layer and token: qkv, attention, block; then classifier.
    Prefill, per layer and chunk: qkv_chunk, attention_chunk, block_chunk; then
    classifier_last (the last token's logits) or classifier_rows (every token's).
    `fused` mode: decode_step + write_caches. `loop` mode: decode_loop.
    The batched decode step with XLA's products: decode_batch_step, then write_rows per
    group of sequences.
    """

    qkv: Program
    attention: Program
    block: Program
    classifier: Program
    qkv_chunk: Program
    attention_chunk: Program
    block_chunk: Program
    classifier_last: Program
    classifier_rows: Program
    decode_step: Program
    write_caches: Program
    decode_loop: Program
    decode_batch_step: Program
    write_rows: Program


ONE_DEVICE = Programs(
    qkv=qkv, attention=attention, block=block, classifier=classifier,
    qkv_chunk=qkv_chunk, attention_chunk=attention_chunk, block_chunk=block_chunk,
    classifier_last=classifier_last, classifier_rows=classifier_rows,
    decode_step=decode_step, write_caches=write_caches, decode_loop=decode_loop,
    decode_batch_step=decode_batch_step, write_rows=write_rows,
)
"""The programs on one device: `jllama.graphs`' own `jax.jit` functions (jax places their
outputs on the device of their inputs)."""
