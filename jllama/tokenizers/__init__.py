"""Tokenizers, one module per job.

`base`: the `Tokenizer` protocol every tokenizer implements (vocab_size, bos_id, eos_id,
  add_bos, stop_ids, control_ids, drops_unknown_bytes, encode, encode_segments, decode,
  stream_decoder, piece, token_bytes, printed_bytes), BOS_ID / EOS_ID, and the helpers the
  tokenizers share (special-token splitting, the stream decoder, decoding).
`files`: `open_tokenizer(path)`, a tokenizer from its file alone (GGUF, tokenizer.json or its
  folder, Meta's tiktoken tokenizer.model, llama2.c tokenizer.bin). Not imported here: it
  loads every reader.
`spm`, `spm_encode`: SentencePiece-style BPE with byte fallback (`spm.Tokenizer`), encoded and
  decoded as llama2.c's run.c does; it serves llama2.c files, GGUF "llama" vocabularies and
  SentencePiece-style tokenizer.json files.
`llama2c`: llama2.c's `tokenizer.bin` (`read_tokenizer`); also the old home of `Tokenizer`.
`bpe`, `byte_level`: GPT-2 style byte-level BPE (`ByteLevelBPE`) with llama.cpp's
  pre-tokenizers.
`gguf`: the tokenizer of a GGUF file's metadata (`read_gguf_tokenizer`, `tokenizer_from_gguf`).
`hf`, `hf_build`: the tokenizer of a Hugging Face folder (`read_hf_tokenizer`).
`tiktoken_model`: Meta's Llama 3 `tokenizer.model` (`read_tiktoken_model`).
"""
