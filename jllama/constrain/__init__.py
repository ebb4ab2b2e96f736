"""Constrained decoding: generations that must match a JSON schema, any JSON value, a regular
expression or a grammar, as a sampler step (the token mask llguidance computes).

- `grammar`: `Grammar` (checked and compiled once; `GrammarError` for a bad one), `GRAMMAR_KINDS`.
"""

from jllama.constrain.grammar import GRAMMAR_KINDS, Grammar, GrammarError

__all__ = ["GRAMMAR_KINDS", "Grammar", "GrammarError"]
