"""The backend protocol: what the generation loop needs from a model implementation.

A backend turns one token at one position into next-token logits, keeping its own KV cache.
Positions are given in order from 0 for each sequence; a call at position 0 starts a new
sequence (nothing from earlier sequences is visible to it).
"""

from __future__ import annotations

import operator
from typing import Protocol, runtime_checkable

import numpy as np

from jllama.config import ModelConfig
from jllama.weights import TransformerWeights


@runtime_checkable
class Backend(Protocol):
    """A model implementation the generation loop can drive.

    Attributes:
      name: a short name shown to users (e.g. "numpy", "jax").
    """

    name: str

    def prepare(self, config: ModelConfig, weights: TransformerWeights) -> None:
        """Take the model: convert the weights to the backend's layout, allocate the KV cache
        (f32, `seq_len` positions) and compile what needs compiling. Called once, before any
        `forward`."""
        ...

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Run the transformer on `token` (0 <= token < vocab_size) at position `pos`
        (0 <= pos < seq_len, given in order from 0) and return the logits for the next token,
        f32[vocab_size] as a NumPy array. Raises ValueError for a token or position out of
        range."""
        ...


def check_token_pos(config: ModelConfig, token: int, pos: int) -> tuple[int, int]:
    """`(token, pos)` as Python ints.

    Raises:
      TypeError: a token or position that is not an integer (a float, a bool).
      ValueError: a token or position outside the model's vocabulary / context.
    """
    if isinstance(token, bool) or isinstance(pos, bool):
        raise TypeError(f"token and position must be integers, got {token!r}, {pos!r}")
    token, pos = operator.index(token), operator.index(pos)
    if not 0 <= token < config.vocab_size:
        raise ValueError(f"token {token} is out of range for vocab_size={config.vocab_size}")
    if not 0 <= pos < config.seq_len:
        raise ValueError(f"position {pos} is out of range for seq_len={config.seq_len}")
    return token, pos
