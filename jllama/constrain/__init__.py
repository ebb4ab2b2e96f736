"""Constrained decoding: generations that must match a JSON schema, any JSON value, a regular
expression or a grammar, as a sampler step (the token mask llguidance computes).

- `grammar`: `Grammar` (checked and compiled once; `GrammarError` for a bad one), `GRAMMAR_KINDS`.
- `vocabulary`: a jllama tokenizer as llguidance's `LLTokenizer` (`Vocabulary`,
  `vocabulary_for`, cached per tokenizer).
- `sampler`: `ConstrainedSampler`, the mask before any other sampler step
  (`ConstraintError` where the matcher fails).
"""

from jllama.constrain.grammar import GRAMMAR_KINDS, Grammar, GrammarError
from jllama.constrain.sampler import ConstrainedSampler, ConstraintError, masked
from jllama.constrain.vocabulary import Vocabulary, build_vocabulary, vocabulary_for

__all__ = ["GRAMMAR_KINDS", "ConstrainedSampler", "ConstraintError", "Grammar", "GrammarError",
           "Vocabulary", "build_vocabulary", "masked", "vocabulary_for"]
