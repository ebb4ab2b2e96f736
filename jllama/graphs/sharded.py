"""The compiled programs of `jllama.graphs` for a tensor-parallel layout (`jllama.platform.sharding`).

The same traced bodies as the one-device programs, jitted again with `out_shardings` on the
mesh; their inputs arrive already laid out (weights split by `TensorParallel`, caches by KV
head, the residual stream replicated), and XLA's SPMD partitioner (GSPMD) propagates those
shardings through each body and inserts the collectives: an all-reduce after wo and after w2
(each device's product over its own columns is a partial sum) and a gather of the logits.

Why fixed output shardings: a donated cache block must come back laid out as it went in, or
the next call would see a new input layout and compile again; and every process of a
multi-process run reads the logits (and the loop's tokens) on the host, which needs them
replicated on its own devices, not split across processes.

`sharded_programs(mesh)` returns a `jllama.graphs.Programs`, as `jllama.graphs.ONE_DEVICE` is
for one device, so the backend runs either one.

On XLA CPU each call waits for its results (`wait=True`). XLA CPU runs each device's part of
a program as a task of one thread pool, and a collective holds its thread until every device
arrives. With calls queued behind each other (JAX's asynchronous dispatch), a device's part
of the block program waited for a thread that the other device's waiting all-reduce held:
XLA aborted after its 40 s rendezvous timeout (TinyLlama-1.1B's shape, 22 layers, 2 forced
host devices on 2 cores, `--decode=graph`; JAX 0.10.2). Waiting for each program before
queueing the next never deadlocked.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jllama import graphs
from jllama.graphs.programs import Programs
from jllama.platform.sharding import AXIS


def _waiting(program):
    """`program` that returns only once its results are computed (`.lower` kept)."""

    def call(*args, **kwargs):
        return jax.block_until_ready(program(*args, **kwargs))

    call.lower = program.lower
    return call


def sharded_programs(mesh: Mesh, wait: bool | None = None) -> Programs:
    """The decode, prefill, fused, loop and batched decode programs jitted for `mesh` (1-D, axis `AXIS`).

    Each keeps its `jllama.graphs` counterpart's arguments, static arguments and donations;
    pass `shards=mesh.size` to the ones that take it (wqkv's row groups,
    `jllama.platform.sharding.qkv_row_order`). Output layouts: q, the attention output and cache
    blocks split along the head axis; the residual stream, logits and sampled tokens
    replicated.

    wait: each call returns once its results are computed (see the module's note); None:
    when the mesh's devices are CPUs.
    """
    rep = NamedSharding(mesh, PartitionSpec())
    heads = NamedSharding(mesh, PartitionSpec(AXIS))  # axis 0: heads
    token_heads = NamedSharding(mesh, PartitionSpec(None, AXIS))  # [T, heads ...]
    donate_block = ("key_block", "value_block")

    if wait is None:
        wait = mesh.devices.flat[0].platform == "cpu"

    def jit(program, out, static_argnames=(), donate=()):
        compiled = jax.jit(
            program.__wrapped__, static_argnums=0, static_argnames=static_argnames,
            donate_argnames=donate, out_shardings=out,
        )
        return _waiting(compiled) if wait else compiled

    return Programs(
        qkv=jit(graphs.qkv, (heads, heads, heads), ("shards", "matvec"), donate_block),
        attention=jit(graphs.attention, heads, ("matvec",)),
        block=jit(graphs.block, rep, ("matvec",)),
        classifier=jit(graphs.classifier, rep, ("matvec",)),
        qkv_chunk=jit(graphs.qkv_chunk, (token_heads, heads, heads), ("shards",), donate_block),
        attention_chunk=jit(graphs.attention_chunk, token_heads, ("matvec",)),
        block_chunk=jit(graphs.block_chunk, rep),
        classifier_last=jit(graphs.classifier_last, rep),
        classifier_rows=jit(graphs.classifier_rows, rep),
        decode_step=jit(graphs.decode_step, (rep, heads, heads), ("shards", "matvec")),
        write_caches=jit(graphs.write_caches, (heads, heads), (),
                         ("key_blocks", "value_blocks")),
        decode_loop=jit(graphs.decode_loop, (rep, rep, rep, heads, heads),
                        ("n_steps", "kind", "shards", "matvec"), ("key_cur", "value_cur")),
        decode_batch_step=jit(graphs.decode_batch_step, (rep, heads, heads),
                              ("shards", "attention")),
        write_rows=jit(graphs.write_rows, (heads, heads), (), ("key_blocks", "value_blocks")),
    )
