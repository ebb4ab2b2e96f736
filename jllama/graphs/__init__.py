"""The graph-compiled decode step: one module per compiled program.

Each program is a pure, module-level `jax.jit` function taking the `ModelConfig` as a static
argument and one layer's arrays as ordinary arguments, so every layer (same shapes) replays the
same compiled executable and `pos` (a traced int32 scalar) never causes a retrace. Programs never
slice layer-stacked weights: XLA CPU would copy the slice before the dot.

  qkv        attention RMSNorm + stacked QKV product + RoPE + KV-cache write (caches donated)
  attention  masked causal attention over a window of the cache (one compiled program per
             window length bucket)
  block      wo + residual + FFN RMSNorm + SwiGLU + residual
  classifier final RMSNorm + wcls
"""

from jllama.graphs.attention import attention, attention_window
from jllama.graphs.block import block
from jllama.graphs.classifier import classifier
from jllama.graphs.qkv import qkv

PROGRAMS = ("qkv", "attention", "block", "classifier")

__all__ = ["PROGRAMS", "attention", "attention_window", "block", "classifier", "qkv"]
