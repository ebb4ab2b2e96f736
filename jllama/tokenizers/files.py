"""A tokenizer from its file alone, whatever the format (`open_tokenizer`).

For `jllama tokenize --tokenizer=FILE` without a checkpoint, as llama.cpp's `llama-tokenize`
needs only a vocabulary. The format is told by the content, not the name:
  - a GGUF file ("GGUF" magic): `jllama.tokenizers.gguf.read_gguf_tokenizer`, a model file or
    one of llama.cpp's vocab-only files (models/ggml-vocab-*.gguf);
  - a Hugging Face `tokenizer.json` (a JSON object), or a folder holding one:
    `jllama.tokenizers.hf.read_hf_tokenizer` on its folder (which also reads the
    tokenizer_config.json and generation_config.json beside it);
  - Meta's Llama 3 `tokenizer.model` (tiktoken text: `<base64> <rank>` lines), or a folder
    holding one and no tokenizer.json: `jllama.tokenizers.tiktoken_model.read_tiktoken_model`;
  - anything else is read as llama2.c's `tokenizer.bin`
    (`jllama.tokenizers.llama2c.read_tokenizer`, every token to the end of the file).
A SentencePiece `.model` (protobuf) is named and refused: jllama reads its vocabulary from a
GGUF file or a tokenizer.json instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jllama.errors import TokenizerError
from jllama.platform.files import require_regular_file
from jllama.tokenizers.base import Tokenizer
from jllama.tokenizers.gguf import read_gguf_tokenizer
from jllama.tokenizers.hf import TOKENIZER_JSON, read_hf_tokenizer
from jllama.tokenizers.llama2c import read_tokenizer
from jllama.tokenizers.tiktoken_model import read_tiktoken_model

_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/=]+ \d+\r?\n?")
_TIKTOKEN_FILE = "tokenizer.model"


def open_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer held by the file (or Hugging Face folder) at `path`.

    Args:
      path: a GGUF file, a tokenizer.json or a folder holding one, Meta's tiktoken
        tokenizer.model (or a folder holding one), or a llama2.c tokenizer.bin.

    Returns:
      a `jllama.tokenizers.base.Tokenizer`: a `ByteLevelBPE` (byte-level GGUF or tokenizer.json
      vocabularies), an `spm.Tokenizer` (llama2.c files, GGUF "llama" and SentencePiece-style
      tokenizer.json vocabularies) or a `TiktokenTokenizer`.

    Raises:
      TokenizerError: a missing path, a folder with neither tokenizer.json nor a tiktoken
        tokenizer.model, a JSON file not named tokenizer.json, a SentencePiece model, or any
        error of the reader the content chose. One line naming the path.
    """
    path = Path(path)
    if path.is_dir():
        if (path / TOKENIZER_JSON).exists():
            return read_hf_tokenizer(path)
        if _is_tiktoken(path / _TIKTOKEN_FILE):
            return read_tiktoken_model(path / _TIKTOKEN_FILE)
        raise TokenizerError(
            f"tokenizer {path}: a folder without {TOKENIZER_JSON} (or Meta's tiktoken "
            f"{_TIKTOKEN_FILE}); pass the tokenizer file itself"
        )
    require_regular_file(path, f"tokenizer {path}", TokenizerError)
    head = _head(path)
    if head[:4] == b"GGUF":
        return read_gguf_tokenizer(path)
    if head.lstrip()[:1] == b"{":
        if path.name != TOKENIZER_JSON:
            raise TokenizerError(
                f"tokenizer {path}: a JSON tokenizer must be named {TOKENIZER_JSON}, in its "
                "model folder beside tokenizer_config.json"
            )
        return read_hf_tokenizer(path.parent)
    if head[:1] == b"\x0a" and b"\x00" in head[:64]:
        raise TokenizerError(
            f"tokenizer {path}: is a SentencePiece model, which jllama does not read; pass a "
            "GGUF file or the tokenizer.json of the same vocabulary"
        )
    if _is_tiktoken(path):
        return read_tiktoken_model(path)
    return read_tokenizer(path)


def _head(path: Path, n: int = 4096) -> bytes:
    """The first `n` bytes of a regular file, b"" if it is none or cannot be read."""
    try:
        if not path.is_file():  # opening a FIFO would block; the readers name the error
            return b""
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _is_tiktoken(path: Path) -> bool:
    """Whether the first line is `<base64 token> <rank>` (tiktoken's BPE file)."""
    first = _head(path, 200).split(b"\n", 1)[0] + b"\n"
    return _TIKTOKEN_LINE.fullmatch(first) is not None
