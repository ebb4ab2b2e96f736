"""Qwen's byte-level BPE (llama.cpp's pre-tokenizer `qwen2`: Qwen2, Qwen2.5, Qwen3), checked by
llama.cpp's own tokenizer test on its models/ggml-vocab-qwen2.gguf (the real 151936-token
vocabulary, tests/data/ggml-vocab-qwen2.gguf.gz with its .inp/.out cases)."""

from __future__ import annotations

import gzip
from pathlib import Path

from jllama.formats.gguf_header import read_header
from jllama.tokenizers.gguf import tokenizer_from_gguf

DATA = Path(__file__).parent / "data"


def test_qwen2_vocabulary_passes_llama_cpps_tokenizer_test(tmp_path):
    path = tmp_path / "ggml-vocab-qwen2.gguf"
    path.write_bytes(gzip.decompress((DATA / "ggml-vocab-qwen2.gguf.gz").read_bytes()))
    tok = tokenizer_from_gguf(dict(read_header(path).metadata), str(path))
    assert (tok.vocab_size, tok.pre, tok.add_bos) == (151936, "qwen2", False)
    texts = (DATA / "ggml-vocab-qwen2.gguf.inp").read_text(encoding="utf-8")
    texts = texts.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""  # every string ends with the separator
    expected = (DATA / "ggml-vocab-qwen2.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) - 1 == len(expected) == 46
    for text, line in zip(texts, expected):
        want = [int(x) for x in line.split()]
        assert tok.encode(text, bos=False) == want, text
        assert tok.decode(want) == text
    assert {151643, 151645} <= tok.stop_ids  # <|endoftext|>, <|im_end|>
