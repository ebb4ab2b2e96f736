"""Tests of jllama.tokenizers.files.open_tokenizer and jllama.tokenizers.gguf.read_gguf_tokenizer:
a tokenizer from its file alone, whatever the format.

References:
  - llama.cpp's own tokenizer tests: its vocab-only files models/ggml-vocab-{llama-spm,
    llama-bpe, phi-3, gpt-2, starcoder}.gguf (gzipped in tests/data) with their .inp strings
    and the .out ids llama.cpp's test-tokenizer-0 expects (add_special=false,
    parse_special=false), from the llama.cpp of llama-cpp-python 0.3.36 (tests/data/README.md);
  - tests/data/encode_llama2c.json: llama2.c run.c's ids for tokenizer.bin and tok512.bin;
  - tests/data/llama32_tiny/llamacpp.json: llama.cpp's tokenization with the tiny model's GGUF
    file, whose tokenizer.json is in its hf/ folder;
  - the `tiktoken` package's own encoding of a tiktoken file;
  - hand-written expectations for the vocabularies' facts and the error messages.
"""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import pytest

from jllama.errors import JllamaError, TokenizerError
from jllama.tokenizers import llama2c
from jllama.tokenizers.base import Tokenizer
from jllama.tokenizers.bpe import ByteLevelBPE
from jllama.tokenizers.files import open_tokenizer
from jllama.tokenizers.gguf import read_gguf_tokenizer
from jllama.tokenizers.spm import Tokenizer as SentencePieceBPE
from jllama.tokenizers.tiktoken_model import LLAMA3_PATTERN, TiktokenTokenizer

gguf = pytest.importorskip("gguf")
tiktoken = pytest.importorskip("tiktoken")

DATA = Path(__file__).resolve().parent / "data"
PACKAGE_DATA = Path(llama2c.__file__).resolve().parents[1] / "data"
TINY = DATA / "llama32_tiny"

# name: (class, vocab_size, bos_id, eos_id), as each vocabulary is published.
VOCABS = {
    "llama-spm": (SentencePieceBPE, 32000, 1, 2),  # Llama 2
    "llama-bpe": (ByteLevelBPE, 128256, 128000, 128001),  # Llama 3
    "phi-3": (SentencePieceBPE, 32064, 1, 32000),  # Llama 2's and 64 added tokens
    "gpt-2": (ByteLevelBPE, 50257, 50256, 50256),
    "starcoder": (ByteLevelBPE, 49152, 0, 0),  # SmolLM's family of pre-tokenizers
}


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vocab")
    out = {}
    for name in VOCABS:
        path = folder / f"ggml-vocab-{name}.gguf"
        path.write_bytes(gzip.decompress((DATA / f"ggml-vocab-{name}.gguf.gz").read_bytes()))
        out[name] = path
    return out


def _llama_cpp_cases(name: str) -> list[tuple[str, list[int]]]:
    texts = (DATA / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = texts.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""  # every string ends with the separator
    lines = (DATA / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) - 1 == len(lines) == 46
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


@pytest.mark.parametrize("name", list(VOCABS))
def test_llama_cpp_vocab_only_files(vocab_files, name):
    tok = open_tokenizer(vocab_files[name])
    kind, n, bos, eos = VOCABS[name]
    assert isinstance(tok, Tokenizer) and type(tok) is kind
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n, bos, eos)
    assert tok.source == str(vocab_files[name])
    for text, want in _llama_cpp_cases(name):
        assert tok.encode(text, bos=False) == want, text
        assert tok.decode(want) == text, text  # SentencePiece ones too: no leading space


def test_read_gguf_tokenizer_reads_a_model_file_without_its_tensors():
    oracle = json.loads((TINY / "llamacpp.json").read_text(encoding="utf-8"))["tokenize"]
    for path in (TINY / "llama32-tiny-Q2_K.gguf", TINY / "hf" / "tokenizer.json", TINY / "hf"):
        tok = read_gguf_tokenizer(path) if path.suffix == ".gguf" else open_tokenizer(path)
        assert isinstance(tok, ByteLevelBPE) and tok.vocab_size == 1280, path
        for case in oracle:
            assert tok.encode(case["text"], bos=False) == case["ids"], (path, case["text"])
            assert tok.encode(case["text"], bos=False, parse_special=True) == case[
                "ids_parse_special"]


@pytest.mark.parametrize("path, name, n", [
    (DATA / "tokenizer.bin", "tokenizer.bin", 32000),
    (PACKAGE_DATA / "tok512.bin", "tok512.bin", 512),
])
def test_llama2c_files(path, name, n):
    tok = open_tokenizer(path)
    assert type(tok) is SentencePieceBPE and tok.vocab_size == n
    cases = json.loads((DATA / "encode_llama2c.json").read_text(encoding="utf-8"))["cases"]
    for case in cases[name]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def _tiktoken_file(path: Path) -> dict[bytes, int]:
    ranks = {bytes((b,)): b for b in range(256)}
    for i, token in enumerate([b"ab", b" c", b"abab"]):
        ranks[token] = 256 + i
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()),
                    encoding="ascii")
    return ranks


def test_tiktoken_file_and_its_folder(tmp_path):
    ranks = _tiktoken_file(tmp_path / "tokenizer.model")
    reference = tiktoken.Encoding("ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={})
    for path in (tmp_path / "tokenizer.model", tmp_path):
        tok = open_tokenizer(path)
        assert type(tok) is TiktokenTokenizer and tok.vocab_size == 259 + 256
        for text in ["abab c", "ab ab  c\n", "🦙 x"]:
            assert tok.encode(text, bos=False) == reference.encode_ordinary(text)


def _gguf(path: Path, **keys) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _error(path) -> str:
    with pytest.raises(TokenizerError) as info:
        open_tokenizer(path)
    message = str(info.value)
    assert isinstance(info.value, JllamaError) and "\n" not in message
    assert str(path) in message
    return message


def test_errors_name_the_file_and_what_is_wrong(tmp_path, vocab_files):
    assert "no such file" in _error(tmp_path / "missing.bin")
    assert "without tokenizer.json" in _error(tmp_path)
    (tmp_path / "vocab.json").write_text("{}", encoding="utf-8")
    assert "must be named tokenizer.json" in _error(tmp_path / "vocab.json")
    assert "SentencePiece model" in _error(DATA / "tokenizer.model")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(vocab_files["llama-spm"].read_bytes()[:5000])
    assert "not a readable GGUF file" in _error(cut)
    no_vocab = _gguf(tmp_path / "weights-only.gguf", **{"general.name": "x"})
    assert "missing GGUF key tokenizer.ggml.model" in _error(no_vocab)
    bert = _gguf(tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert"})
    assert "tokenizer.ggml.model is 'bert'" in _error(bert)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01\x00\x00\x00" + b"\xff" * 3)  # max_token_length 1, then a cut entry
    assert "ends inside" in _error(junk)
