"""jllama: Llama-family inference in Python/JAX.

The pieces, each usable on its own (see README.md):

  ModelConfig, TransformerWeights      jllama.config, jllama.weights
  read_checkpoint, write_checkpoint    jllama.formats.llama2c (llama2.c version 0 files)
  Tokenizer, read_tokenizer            jllama.tokenizers.llama2c (tokenizer.bin, run.c's BPE)
  Sampler                              jllama.sampling (argmax, multinomial, top-p; run.c's rng)
  Backend, make_backend                jllama.backends ("numpy" reference, "jax" compiled)
  Generation                           jllama.generate (the generation loop)
  load_model                           jllama.loading (checkpoint + tokenizer, embedded default)

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
    "load_model": "jllama.loading",
    "Sampler": "jllama.sampling",
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
