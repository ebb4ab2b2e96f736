"""jllama: Llama-family inference in Python/JAX.

The pieces, each usable on its own (see README.md):

  ModelConfig, TransformerWeights      jllama.config, jllama.weights
  read_checkpoint, write_checkpoint    jllama.formats.llama2c (llama2.c files, versions 0, 1, 2)
  Tokenizer, read_tokenizer            jllama.tokenizers.llama2c (tokenizer.bin, run.c's BPE)
  Sampler                              jllama.sampling (argmax, multinomial, top-p; run.c's rng)
  Backend, make_backend                jllama.backends ("numpy" reference, "jax" compiled)
  Session                              jllama.session (a prepared model + backend: generations,
                                       completions, chat; what the CLI and server drive)
  Generation                           jllama.generate (the generation loop)
  load_model, open_model               jllama.loading (any checkpoint + tokenizer, embedded default)
  Conversation                         jllama.conversation (multi-turn chat over one KV cache)
  ChatTemplate                         jllama.chat (chat templates, rendered as Hugging Face does)
  jllama.fetch.fetch                   known models into the local cache
  jllama.convert.convert               any checkpoint -> a llama2.c file

The names are imported on first use, so `import jllama` stays cheap (JAX is loaded only when a
piece that needs it is touched).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "jllama.backends",
    "make_backend": "jllama.backends",
    "ModelConfig": "jllama.config",
    "JllamaError": "jllama.errors",
    "read_checkpoint": "jllama.formats.llama2c",
    "write_checkpoint": "jllama.formats.llama2c",
    "Generation": "jllama.generate",
    "open_model": "jllama.loading",
    "Conversation": "jllama.conversation",
    "ChatTemplate": "jllama.chat",
    "load_model": "jllama.loading",
    "Sampler": "jllama.sampling",
    "Session": "jllama.session",
    "Tokenizer": "jllama.tokenizers.llama2c",
    "read_tokenizer": "jllama.tokenizers.llama2c",
    "TransformerWeights": "jllama.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jllama' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
