"""Tokenizers, one module per vocabulary format.

`llama2c`: llama2.c's `tokenizer.bin` (SentencePiece-style BPE with byte fallback), encoded
and decoded as llama2.c's `run.c` does. Its `Tokenizer` also serves SentencePiece
vocabularies from GGUF files.
`bpe`: GPT-2 style byte-level BPE (`ByteLevelBPE`) with llama.cpp's pre-tokenizers.
`gguf`: `tokenizer_from_gguf(metadata, source)`, the tokenizer of a GGUF file's metadata.

Every tokenizer has the same protocol:
  vocab_size, bos_id, eos_id: int
  add_bos: bool                 whether encode adds BOS when `bos` is None
  stop_ids: frozenset[int]      ids that end a generation
  encode(text, bos=None, eos=False, parse_special=False) -> list[int]
  encode_segments(segments, bos=None, eos=False) -> list[int]
                                segments: [(text, may_parse_special)], encoded as one text
  decode(ids, prev=-1, *, special=False) -> str
  stream_decoder(special=False) with push(prev_token, token) -> str and flush() -> str
  piece(id) -> str              display form of one token
"""
