"""jllama: Llama-family inference in Python/JAX.

The pieces, each usable on its own (see README.md):

  ModelConfig, TransformerWeights      jllama.config, jllama.weights
  read_checkpoint, write_checkpoint    jllama.formats.llama2c (llama2.c version 0 files)
  Tokenizer, read_tokenizer            jllama.tokenizers.llama2c (tokenizer.bin, run.c's BPE)
  Sampler                              jllama.sampling (argmax, multinomial, top-p; run.c's rng)
  make_backend                         jllama.backends ("numpy" reference, "jax" compiled)
  Generation                           jllama.generate (the generation loop)
  load_model                           jllama.loading (checkpoint + tokenizer, embedded default)
"""

from jllama.backends import Backend, make_backend
from jllama.config import ModelConfig
from jllama.errors import JllamaError
from jllama.formats.llama2c import read_checkpoint, write_checkpoint
from jllama.generate import Generation
from jllama.loading import load_model
from jllama.sampling import Sampler
from jllama.tokenizers.llama2c import Tokenizer, read_tokenizer
from jllama.weights import TransformerWeights

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Generation",
    "JllamaError",
    "ModelConfig",
    "Sampler",
    "Tokenizer",
    "TransformerWeights",
    "load_model",
    "make_backend",
    "read_checkpoint",
    "read_tokenizer",
    "write_checkpoint",
]
