"""Rotary position embedding (RoPE) frequencies, shared by every backend.

RoPE as llama2.c run.c applies it: within each head, the pairs of adjacent entries
(2i, 2i + 1) are rotated by the angle `pos * inv_freq[i]`, with
`inv_freq[i] = rope_theta ** (-2i / head_dim)` (Su et al. 2021, "RoFormer"). Files that
store Q/K for another pairing (GGUF, Hugging Face) are permuted at load time so that this
one convention serves all of them.
"""

from __future__ import annotations

import numpy as np

from jllama.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies of the rotated pairs: f32[head_dim // 2] (radians per token).

    Computed in float32 as run.c does (`1.0f / powf(theta, 2i / (float)head_dim)`), so angles
    match run.c's to the last bit or two.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    return (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)).astype(np.float32)
