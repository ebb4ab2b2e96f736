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
from jllama.errors import TokenizerError
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


def find_tokenizer(checkpoint: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """The tokenizer for a checkpoint given none: the first of `tok{vocab_size}.bin` and
    `tokenizer.bin` in the checkpoint's folder (llama2.c's names for its custom and Llama 2
    vocabularies) that holds `vocab_size` tokens, else the embedded tok512.bin when
    vocab_size is 512.

    Raises:
      TokenizerError: none fits; the message names the files looked at and why each was not
        taken, and suggests --tokenizer.
    """
    folder = Path(checkpoint).parent
    candidates = [folder / f"tok{vocab_size}.bin", folder / "tokenizer.bin"]
    if vocab_size == 512:
        candidates.append(embedded_tokenizer())
    refused = []
    for path in candidates:
        if not path.exists():
            continue
        try:
            return read_tokenizer(path, vocab_size=vocab_size)
        except TokenizerError as e:
            refused.append(str(e))
    looked = ", ".join(str(p) for p in candidates)
    detail = f" ({'; '.join(refused)})" if refused else ""
    raise TokenizerError(
        f"no tokenizer with vocab_size={vocab_size} for checkpoint {checkpoint}: looked for "
        f"{looked}{detail}; pass --tokenizer"
    )


def load_model(
    checkpoint: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None
) -> tuple[ModelConfig, TransformerWeights, Tokenizer]:
    """Read a llama2.c checkpoint and its tokenizer (defaults: the embedded stories260K and the
    tokenizer `find_tokenizer` picks).

    Raises:
      CheckpointError: a missing or malformed checkpoint.
      TokenizerError: a missing or malformed tokenizer, or one whose vocabulary size differs
        from the checkpoint's.
    """
    checkpoint = Path(checkpoint) if checkpoint else embedded_checkpoint()
    config, weights = read_checkpoint(checkpoint)
    return config, weights, load_tokenizer(checkpoint, config.vocab_size, tokenizer)


def load_tokenizer(
    checkpoint: str | os.PathLike, vocab_size: int, tokenizer: str | os.PathLike | None = None
) -> Tokenizer:
    """`tokenizer` read and checked against `vocab_size`, or `find_tokenizer`'s pick when None.

    Raises:
      TokenizerError: as `read_tokenizer` and `find_tokenizer`.
    """
    if tokenizer is None:
        return find_tokenizer(checkpoint, vocab_size)
    return read_tokenizer(tokenizer, vocab_size=vocab_size)
