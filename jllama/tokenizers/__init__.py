"""Tokenizers, one module per vocabulary file format.

`llama2c`: llama2.c's `tokenizer.bin` (SentencePiece-style BPE with byte fallback), encoded
and decoded as llama2.c's `run.c` does.
"""
