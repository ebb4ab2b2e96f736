"""llama2.c tokenizer files (`tokenizer.bin`), read into the run.c-exact `Tokenizer`.

File layout, all little-endian (as written by llama2.c's `tokenizer.py` and read by run.c's
`build_tokenizer`):
  int32 max_token_length                      the longest piece, in bytes
  then for each token id 0 .. vocab_size-1:
    float32 score                             merge priority: higher merges first
    int32   len                               piece length in bytes, 0 <= len <= max_token_length
    len raw bytes                             the piece (UTF-8 text, SentencePiece's "▁" already
                                              replaced by a space; bytes tokens as "<0xNN>")
The file does not store vocab_size: it comes from the checkpoint header.

Conventions of the llama2.c vocabularies (Llama 2's 32000-token one and the small trained ones
such as tok512.bin): id 0 "<unk>", id 1 BOS (piece "\\n<s>\\n"), id 2 EOS (piece "\\n</s>\\n"),
ids 3..258 the byte-fallback tokens "<0x00>".."<0xFF>", then the merged pieces.

The tokenizer itself (run.c's encode and decode) is `jllama.tokenizers.spm.Tokenizer`, and the
helpers every tokenizer shares are in `jllama.tokenizers.base`; both are importable from here
under their old names (`Tokenizer`, `StreamDecoder`, `BOS_ID`, `EOS_ID`,
`BYTE_FALLBACK_OFFSET`, `split_special_tokens`, `bytes_for_display`).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from jllama.errors import TokenizerError
from jllama.platform.files import require_regular_file
from jllama.tokenizers.base import (
    BOS_ID,
    EOS_ID,
    StreamDecoder,
    bytes_for_display,
)
from jllama.tokenizers.specials import split_special_tokens
from jllama.tokenizers.spm import BYTE_FALLBACK_OFFSET, Tokenizer

__all__ = [
    "BOS_ID", "BYTE_FALLBACK_OFFSET", "EOS_ID", "StreamDecoder", "Tokenizer",
    "bytes_for_display", "read_tokenizer", "split_special_tokens",
]

_HEADER = struct.Struct("<i")
_ENTRY_HEADER = struct.Struct("<fi")


def _read_entries(
    data: bytes, offset: int, max_token_length: int, limit: int | None
) -> tuple[list[bytes], list[float], int, str | None]:
    """Parse (score, len, piece) entries from `offset` until EOF or `limit` entries.

    Returns (pieces, scores, offset after the last whole entry, problem): problem is None when
    parsing stopped cleanly (at EOF or at the limit), else a description of the bad entry.
    """
    pieces: list[bytes] = []
    scores: list[float] = []
    end = len(data)
    while offset < end and (limit is None or len(pieces) < limit):
        token = len(pieces)
        if offset + _ENTRY_HEADER.size > end:
            return pieces, scores, offset, (
                f"ends inside the score/length of token {token} "
                f"({end - offset} bytes left, {_ENTRY_HEADER.size} needed)"
            )
        score, length = _ENTRY_HEADER.unpack_from(data, offset)
        if length < 0:
            return pieces, scores, offset, (
                f"token {token} has a negative length {length} (at byte {offset + 4})"
            )
        if length > max_token_length:
            return pieces, scores, offset, (
                f"token {token} is {length} bytes long, more than the header's "
                f"max_token_length {max_token_length}"
            )
        start = offset + _ENTRY_HEADER.size
        if start + length > end:
            return pieces, scores, offset, (
                f"ends inside the piece of token {token} ({end - start} of {length} bytes)"
            )
        pieces.append(data[start : start + length])
        scores.append(score)
        offset = start + length
    return pieces, scores, offset, None


def read_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
    """Read a llama2.c tokenizer file (run.c's `build_tokenizer`, with its checks made strict).

    Args:
      path: the tokenizer.bin file (read whole; these files are under a megabyte).
      vocab_size: the checkpoint's vocab_size. When given, the file must hold exactly that many
        tokens. When None, tokens are read up to the end of the file, which must end exactly
        after a whole token.

    Returns:
      a `Tokenizer` with `source` set to the path.

    Raises:
      TokenizerError: missing, unreadable or directory path; a file shorter than its 4-byte
        header; max_token_length < 1; a token with a negative length or one longer than
        max_token_length; a file ending inside a token; fewer tokens than vocab_size; more
        tokens than vocab_size (probably the wrong tokenizer for the checkpoint); vocab_size
        < 1. The message is one line naming the path.
    """
    path = Path(path)
    what = f"tokenizer {path}"
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise TokenizerError(f"{what}: vocab_size must be a positive integer, got {vocab_size!r}")
    require_regular_file(path, what, TokenizerError)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{what}: cannot read: {e.strerror or e}") from None

    if data[:4] == b"GGUF":
        raise TokenizerError(
            f"{what}: is a GGUF model file, not a llama2.c tokenizer (a GGUF file carries its "
            "own tokenizer: pass it as --checkpoint)"
        )
    if len(data) < _HEADER.size:
        raise TokenizerError(
            f"{what}: {len(data)} bytes, shorter than the 4-byte header (max_token_length)"
        )
    (max_token_length,) = _HEADER.unpack_from(data, 0)
    if max_token_length < 1:
        raise TokenizerError(f"{what}: header max_token_length is {max_token_length}, not >= 1")

    pieces, scores, offset, problem = _read_entries(
        data, _HEADER.size, max_token_length, vocab_size
    )
    if problem is not None:
        if vocab_size is None:
            raise TokenizerError(f"{what}: {problem}")
        raise TokenizerError(
            f"{what}: {problem}, after {len(pieces)} whole tokens; "
            f"the checkpoint's vocab_size is {vocab_size}"
        )
    if not pieces:
        raise TokenizerError(f"{what}: holds no tokens (only the header)")
    if vocab_size is not None:
        if len(pieces) < vocab_size:
            raise TokenizerError(
                f"{what}: file ends after {len(pieces)} tokens "
                f"but the checkpoint's vocab_size is {vocab_size}"
            )
        if offset < len(data):
            rest, _, _, rest_problem = _read_entries(data, offset, max_token_length, None)
            if rest_problem is None:
                raise TokenizerError(
                    f"{what}: holds {vocab_size + len(rest)} tokens but the checkpoint's "
                    f"vocab_size is {vocab_size} (the wrong tokenizer for this checkpoint?)"
                )
            raise TokenizerError(
                f"{what}: holds more than the checkpoint's vocab_size of {vocab_size} tokens: "
                f"{len(data) - offset} bytes follow token {vocab_size - 1} "
                f"(the wrong tokenizer for this checkpoint?)"
            )
    return Tokenizer(
        pieces=tuple(pieces),
        scores=tuple(scores),
        max_token_length=max_token_length,
        source=str(path),
    )
