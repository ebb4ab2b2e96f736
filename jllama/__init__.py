"""jllama: Llama-family inference in Python/JAX.

The path of a token (docs/internals.md draws it in full): the command line (`cli`) or the HTTP
server (`server`, over the scheduler in `engine`) asks a `generation.session.Session` for a
generation; the Session was prepared from a file read by `formats` (llama2.c, GGUF,
safetensors) into `model` (ModelConfig, TransformerWeights, quantized matrices) with a
tokenizer from `tokenizers`, a chat template from `chat` and a backend from `backends`; each
position runs the programs `graphs` traces (QKV, attention over the KV cache, the attention
output + FFN block, the classifier), whose matrix products are `kernels` (C++ for the GGML
block types) or XLA's; the logits go to `sampling` (masked by `constrain` for structured
output) and the token back to the tokenizer's stream decoder. `platform` holds what belongs
to the process: threads, memory planning, XLA's compile cache, devices and hosts.

The packages, each with one job:

  cli          the `jllama` command (absl flags): generate, chat, serve, batch, perplexity, ...
  server       the OpenAI-compatible HTTP API (FastAPI + uvicorn), /metrics
  engine       continuous batching: requests into slots, one batched step per round
  generation   Session, the generation loop, streaming text, stop strings, chat turns,
               perplexity
  model        ModelConfig, TransformerWeights, loading and converting checkpoints, quantized
               matrices and the kernels' layouts, RoPE, KV cache types
  formats      llama2.c (v0, v1, v2), GGUF and safetensors files
  tokenizers   run.c's BPE (tokenizer.bin), GGUF vocabularies, tokenizer.json, tiktoken
  chat         chat templates (sandboxed Jinja, bounded in time and memory)
  constrain    JSON schemas, regular expressions and grammars as token masks (llguidance)
  sampling     argmax, multinomial, top-p (run.c's rng) and llama.cpp's sampler chain
  backends     "numpy" (the reference: run.c's forward) and "jax" (the compiled pipeline)
  graphs       the jitted JAX programs the "jax" backend replays per layer and token
  kernels      the C++ matrix-vector and attention kernels (AVX-512 / AVX2) and their calls
  platform     the process: threads, devices, memory plan, compile cache, fetch, file checks

The public names below are imported on first use, so `import jllama` stays cheap (JAX is
loaded only when a piece that needs it is touched):

  ModelConfig, TransformerWeights      jllama.model.config, jllama.model.weights
  read_checkpoint, write_checkpoint    jllama.formats.llama2c (llama2.c files, versions 0, 1, 2)
  Tokenizer, read_tokenizer            jllama.tokenizers.llama2c (tokenizer.bin, run.c's BPE)
  Sampler                              jllama.sampling (argmax, multinomial, top-p; run.c's rng)
  Backend, make_backend                jllama.backends ("numpy" reference, "jax" compiled)
  Session                              jllama.generation.session (a prepared model + backend)
  Generation                           jllama.generation.generate (the generation loop)
  load_model, open_model               jllama.model.loading (checkpoint + tokenizer)
  Conversation                         jllama.generation.conversation (multi-turn chat)
  ChatTemplate                         jllama.chat (chat templates, rendered as Hugging Face does)
  jllama.platform.fetch.fetch          known models into the local cache
  jllama.model.convert.convert         any checkpoint -> a llama2.c file

Modules that sat at the top level before 0.2 (`jllama.session`, `jllama.config`, ...) still
import, with a DeprecationWarning naming the new path; see `_MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import time
import warnings

_IMPORTED_AT = time.perf_counter()
"""When Python began importing jllama (a `time.perf_counter()` reading): the end of what the
process did before it ran jllama's code (a wrapper's work before exec, the interpreter's
start), `jllama.platform.runtime.python_start`."""

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "jllama.backends",
    "make_backend": "jllama.backends",
    "ModelConfig": "jllama.model.config",
    "JllamaError": "jllama.errors",
    "read_checkpoint": "jllama.formats.llama2c",
    "write_checkpoint": "jllama.formats.llama2c",
    "Generation": "jllama.generation.generate",
    "open_model": "jllama.model.loading",
    "Conversation": "jllama.generation.conversation",
    "ChatTemplate": "jllama.chat",
    "load_model": "jllama.model.loading",
    "Sampler": "jllama.sampling",
    "Session": "jllama.generation.session",
    "Tokenizer": "jllama.tokenizers.llama2c",
    "read_tokenizer": "jllama.tokenizers.llama2c",
    "TransformerWeights": "jllama.model.weights",
}

# The old top-level paths that the README and users imported before the regrouping; every
# other moved module has no alias (nothing outside jllama imported it).
_MOVED = {
    f"jllama.{name}": f"jllama.{package}.{name}"
    for package, names in {
        "generation": ("session", "generate", "conversation", "perplexity"),
        "model": ("config", "weights", "loading", "convert", "rope"),
        "platform": ("fetch",),
    }.items()
    for name in names
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module at its new one, once, with a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {_MOVED[spec.name]}; the old path goes in a later release",
            DeprecationWarning,
            stacklevel=4,
        )
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jllama' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
