"""Finding and loading a model: checkpoint, tokenizer, and the embedded default.

The embedded default is llama2.c's stories260K (a 260K-parameter Llama 2 trained on
TinyStories) with its 512-token tokenizer, shipped as package data in `jllama/data/`.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from jllama.config import ModelConfig
from jllama.formats.llama2c import read_checkpoint
from jllama.tokenizers.llama2c import Tokenizer, read_tokenizer
from jllama.weights import TransformerWeights


def _data_file(name: str) -> Path:
    return Path(str(resources.files("jllama") / "data" / name))


def embedded_checkpoint() -> Path:
    """Path of the embedded stories260K checkpoint (llama2.c version 0, 1 MB)."""
    return _data_file("stories260K.bin")


def embedded_tokenizer() -> Path:
    """Path of the embedded 512-token tokenizer of stories260K (llama2.c tokenizer.bin format)."""
    return _data_file("tok512.bin")


def default_tokenizer_path(checkpoint: str | os.PathLike, vocab_size: int) -> Path:
    """The tokenizer to use when none is given: in the checkpoint's folder `tokenizer.bin`, else
    `tok{vocab_size}.bin` (llama2.c's names for its Llama 2 and custom vocabularies), else the
    embedded tok512.bin. The caller still checks that its size fits the checkpoint."""
    folder = Path(checkpoint).parent
    for name in ("tokenizer.bin", f"tok{vocab_size}.bin"):
        if (folder / name).is_file():
            return folder / name
    return embedded_tokenizer()


def load_model(
    checkpoint: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None
) -> tuple[ModelConfig, TransformerWeights, Tokenizer]:
    """Read a llama2.c checkpoint and its tokenizer (defaults: the embedded stories260K and the
    tokenizer found by `default_tokenizer_path`).

    Raises:
      CheckpointError: a missing or malformed checkpoint.
      TokenizerError: a missing or malformed tokenizer, or one whose vocabulary size differs
        from the checkpoint's.
    """
    checkpoint = Path(checkpoint) if checkpoint else embedded_checkpoint()
    config, weights = read_checkpoint(checkpoint)
    if tokenizer is None:
        tokenizer = default_tokenizer_path(checkpoint, config.vocab_size)
    return config, weights, read_tokenizer(tokenizer, vocab_size=config.vocab_size)
