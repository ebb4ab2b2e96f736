"""The graph-compiled decode step: one module per compiled program.

Each program is a pure, module-level `jax.jit` function taking the `ModelConfig` as a static
argument and one layer's arrays as ordinary arguments, so every layer (same shapes) replays the
same compiled executable and `pos` (a traced int32 scalar) never causes a retrace. Programs never
slice layer-stacked weights: XLA CPU would copy the slice before the dot.

  qkv        attention RMSNorm + stacked QKV product + RoPE + KV-cache write (caches donated)
  attention  masked causal attention over the first blocks of the cache (one compiled
             program per block-count bucket; the cache is a tuple of blocks per layer)
  block      wo + residual + FFN RMSNorm + SwiGLU + residual
  classifier final RMSNorm + wcls

and for batched prefill (`prefill.py`), the same three layer programs over a chunk of tokens:
`qkv_chunk`, `attention_chunk`, `block_chunk`, and `classifier_last` (the last token's logits)
or `classifier_rows` (every token's logits, for a perplexity).

The other decode modes reuse those bodies: `fused.py` (`decode_step` + `write_caches`: one
program for all layers per token) and `loop.py` (`decode_loop`: a chunk of tokens in one
on-device loop, sampled on the device by `sample_on_device`), and `batch_xla.py`
(`decode_batch_step`: one token for each of B sequences, XLA's products, one program).

`ONE_DEVICE` holds all of them as one typed `Programs` object, the one a backend calls on one
device (`sharded.sharded_programs` builds the tensor-parallel one).
"""

from jllama.graphs.attention import (
    attention,
    attention_blocks,
    attention_window,
    block_length,
    n_blocks,
)
from jllama.graphs.batch_xla import decode_batch_step, write_rows
from jllama.graphs.block import block
from jllama.graphs.classifier import classifier
from jllama.graphs.fused import decode_step, write_caches
from jllama.graphs.loop import SAMPLING_KINDS, decode_loop, sample_on_device
from jllama.graphs.prefill import (
    attention_chunk,
    block_chunk,
    classifier_last,
    classifier_rows,
    qkv_chunk,
)
from jllama.graphs.programs import ONE_DEVICE, Programs
from jllama.graphs.qkv import qkv

PROGRAMS = ("qkv", "attention", "block", "classifier")

PREFILL_PROGRAMS = ("qkv_chunk", "attention_chunk", "block_chunk", "classifier_last")

__all__ = [
    "ONE_DEVICE",
    "PREFILL_PROGRAMS",
    "PROGRAMS",
    "Programs",
    "SAMPLING_KINDS",
    "attention",
    "attention_chunk",
    "attention_blocks",
    "attention_window",
    "block_length",
    "n_blocks",
    "block",
    "block_chunk",
    "classifier",
    "classifier_last",
    "classifier_rows",
    "decode_batch_step",
    "decode_loop",
    "decode_step",
    "qkv",
    "qkv_chunk",
    "sample_on_device",
    "write_caches",
    "write_rows",
]
