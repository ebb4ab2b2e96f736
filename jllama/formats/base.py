"""What the readers of `jllama.formats` return for a model file or folder."""

from __future__ import annotations

import dataclasses
from typing import Any

from jllama.model.config import ModelConfig
from jllama.model.weights import TransformerWeights


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFile:
    """A model as its reader found it: the fields every format has (each reader's subclass,
    `gguf.GGUFModel` and `hf.HFModel`, adds its own and says what its weights hold).

    Attributes:
      config: the model's hyperparameters (seq_len possibly capped by the reader's caller).
      weights: `TransformerWeights` in llama2.c's layout (matrices out x in); wcls is
        token_embedding_table when the classifier is tied.
      tokenizer: the file's own tokenizer, or None when the reader reads none.
      chat_template: the jinja source of the model's chat template, or None.
      context_length: the context the model was trained for, tokens.
      source: the file's or folder's path.
    """

    config: ModelConfig
    weights: TransformerWeights
    tokenizer: Any
    chat_template: str | None
    context_length: int
    source: str
