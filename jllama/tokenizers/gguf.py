"""The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*` keys).

`read_gguf_tokenizer(path)` reads it from a file without touching the tensors, so it also
reads llama.cpp's vocab-only files (the tokenizer metadata and no tensors, as llama.cpp's
models/ggml-vocab-*.gguf); `tokenizer_from_gguf(metadata, source)` builds it from metadata
already read.

Two vocabulary models are supported, as llama.cpp reads them (src/llama-vocab.cpp,
`llama_vocab::impl::load`):
  - "llama": SentencePiece BPE with byte fallback (Llama 2, TinyLlama, Mistral v0.1 ...),
    built as a `jllama.tokenizers.llama2c.Tokenizer`;
  - "gpt2": byte-level BPE (GPT-2, SmolLM, Qwen2, Llama 3 ...), built as a
    `jllama.tokenizers.bpe.ByteLevelBPE`.

Keys read (GGUF spec, gguf-py's `Keys.Tokenizer`):
  tokenizer.ggml.model            str, "llama" or "gpt2" (required)
  tokenizer.ggml.tokens           [str] token texts (required)
  tokenizer.ggml.token_type       [int] GGUF token types (default: all normal)
  tokenizer.ggml.scores           [float] SentencePiece scores ("llama"; default 0.0)
  tokenizer.ggml.merges           [str] "left right" merges ("gpt2", required)
  tokenizer.ggml.pre              str, the pre-tokenizer ("gpt2"; default "default")
  tokenizer.ggml.bos_token_id, .eos_token_id, .eot_token_id, .eom_token_id   int
  tokenizer.ggml.add_bos_token    bool (default: True for "llama", per pre-tokenizer for "gpt2")
  tokenizer.ggml.add_space_prefix bool ("llama"; default True)
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Mapping
from pathlib import Path

from jllama.errors import TokenizerError
from jllama.platform.files import require_regular_file
from jllama.formats.gguf_header import read_header
from jllama.tokenizers.bpe import (
    BYTE,
    CONTROL,
    END_OF_GENERATION_TEXTS,
    NORMAL,
    PRE_TOKENIZERS,
    UNKNOWN,
    USER_DEFINED,
    ByteLevelBPE,
)
from jllama.tokenizers.spm import NO_MERGE_SCORE, SPACE_MARK, Tokenizer

_PREFIX = "tokenizer.ggml."
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# llama.cpp's default special ids when the GGUF has none (src/llama-vocab.cpp).
_DEFAULT_IDS = {"llama": (1, 2), "gpt2": (11, 11)}


def read_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer | ByteLevelBPE:
    """The tokenizer of the GGUF file at `path`, from its metadata alone.

    The header is read by `jllama.formats.gguf_header.read_header` (the values of the `gguf`
    package's GGUFReader, 40 times faster on Llama 3's 128256 tokens and 280147 merges); the
    tensors, if any, are neither needed nor read, so llama.cpp's vocab-only files work.

    Args:
      path: a GGUF file (version 2 or 3) of any architecture whose `tokenizer.ggml.model` is
        "llama" or "gpt2".

    Returns:
      as `tokenizer_from_gguf`, with `source` the path.

    Raises:
      TokenizerError: a missing, unreadable or non-regular file, a file that is not GGUF or
        whose header is malformed or truncated, or a vocabulary `tokenizer_from_gguf` refuses.
        One line naming the path.
    """
    path = Path(path)
    require_regular_file(path, f"tokenizer {path}", TokenizerError)
    try:
        header = read_header(path)
    except ValueError as e:  # not GGUF, or a header that runs past the end or is malformed
        detail = " ".join(str(e).split()) or type(e).__name__
        raise TokenizerError(f"tokenizer {path}: not a readable GGUF file: {detail}") from None
    except OSError as e:
        raise TokenizerError(f"tokenizer {path}: cannot read: {e.strerror or e}") from None
    return tokenizer_from_gguf(header.metadata, str(path))


def tokenizer_from_gguf(metadata: Mapping[str, object], source: str) -> Tokenizer | ByteLevelBPE:
    """Build the tokenizer described by a GGUF file's metadata.

    Args:
      metadata: GGUF key -> Python value (str, int, float, bool, or a list of them), e.g.
        `{k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}`.
      source: the file's path, for error messages.

    Returns:
      for "llama", an `spm.Tokenizer`: pieces are the token texts with "▁" replaced by a
      space (byte tokens "<0xNN>" as they are), control/unknown/unused/byte tokens scored so
      they never come out of a merge, control/unknown/user-defined tokens parsable as special
      tokens, bos/eos/add_bos/add_space_prefix from the metadata, "▁" in the text read as a
      space (as llama.cpp and SentencePiece read it), and the first piece's dummy-prefix
      space dropped in decoding (`strip_text_start`, as llama.cpp's llama_detokenize). For
      "gpt2", a `ByteLevelBPE`. Both have `stop_ids` = EOS, EOT/EOM when given, and the tokens whose
      text is in `END_OF_GENERATION_TEXTS`.

    Raises:
      TokenizerError: a missing required key (tokenizer.ggml.model, .tokens, and .merges for
        "gpt2"), a value of the wrong type, lists of different lengths, an unknown model or
        pre-tokenizer, or a special id out of range. One line naming the key and `source`.
    """
    model = _get(metadata, "model", str, source, required=True)
    if model not in _DEFAULT_IDS:
        raise TokenizerError(
            f"{source}: {_PREFIX}model is {model!r}; jllama reads 'llama' (SentencePiece) and "
            f"'gpt2' (byte-level BPE) vocabularies"
        )
    tokens = _get_list(metadata, "tokens", str, source, required=True)
    if not tokens:
        raise TokenizerError(f"{source}: {_PREFIX}tokens is empty")
    types = _get_list(metadata, "token_type", int, source) or [NORMAL] * len(tokens)
    _same_length(types, tokens, "token_type", source)
    bos_default, eos_default = _DEFAULT_IDS[model]
    bos_id = _get_id(metadata, "bos_token_id", len(tokens), source, bos_default)
    eos_id = _get_id(metadata, "eos_token_id", len(tokens), source, eos_default)
    eot_id = _get_id(metadata, "eot_token_id", len(tokens), source, None)
    eom_id = _get_id(metadata, "eom_token_id", len(tokens), source, None)

    if model == "gpt2":
        merges = _get_list(metadata, "merges", str, source, required=True)
        pre = _get(metadata, "pre", str, source)
        pre = "default" if pre is None else pre
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"{source}: {_PREFIX}pre is {pre!r}, a pre-tokenizer jllama does not know "
                f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        add_bos = _get(metadata, "add_bos_token", bool, source)
        return ByteLevelBPE(
            tokens=tuple(tokens),
            token_types=tuple(types),
            merges=tuple(merges),
            pre=pre,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_id=eot_id,
            eom_id=eom_id,
            add_bos=PRE_TOKENIZERS[pre].add_bos if add_bos is None else add_bos,
            source=source,
        )

    scores = _get_list(metadata, "scores", (int, float), source) or [0.0] * len(tokens)
    _same_length(scores, tokens, "scores", source)
    add_bos = _get(metadata, "add_bos_token", bool, source)
    add_space_prefix = _get(metadata, "add_space_prefix", bool, source)
    pieces, merge_scores, hidden, specials = [], [], set(), []
    for i, (text, kind, score) in enumerate(zip(tokens, types, scores)):
        if kind == BYTE and _BYTE_TOKEN.fullmatch(text):
            pieces.append(text.encode("ascii"))  # decoded to its byte by decode_piece
        else:
            pieces.append(text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape"))
        merge_scores.append(float(score) if kind in (NORMAL, USER_DEFINED) else NO_MERGE_SCORE)
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            specials.append((text, i, kind == USER_DEFINED))
        if kind not in (NORMAL, USER_DEFINED, BYTE):
            hidden.add(i)  # control, unknown, unused: print nothing (llama.cpp token_to_piece)
    ids = {}
    for i, text in enumerate(tokens):
        ids.setdefault(text, i)
    stop = {eos_id} | {i for i in (eot_id, eom_id) if i is not None}
    stop |= {ids[t] for t in END_OF_GENERATION_TEXTS if t in ids}
    return Tokenizer(
        pieces=tuple(pieces),
        scores=tuple(merge_scores),
        max_token_length=max(len(p) for p in pieces),
        source=source,
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=True if add_bos is None else add_bos,
        add_space_prefix=True if add_space_prefix is None else add_space_prefix,
        control_ids=frozenset(hidden),
        special_tokens=tuple(specials),
        stop_ids=frozenset(stop),
        space_mark_is_space=True,
        strip_text_start=True,  # as llama.cpp's llama_detokenize
    )


def _type_name(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(k.__name__ for k in kinds)


def _get(metadata, name, kind, source, required=False):
    key = _PREFIX + name
    if key not in metadata:
        if required:
            raise TokenizerError(f"{source}: missing GGUF key {key} (no tokenizer in the file?)")
        return None
    value = metadata[key]
    # bool is an int subclass: an int key must not accept True, a bool key must be a bool.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TokenizerError(
            f"{source}: GGUF key {key} is {type(value).__name__} {value!r:.40}, "
            f"expected {_type_name(kind)}"
        )
    return value


def _get_list(metadata, name, kind, source, required=False) -> list | None:
    key = _PREFIX + name
    value = _get(metadata, name, (list, tuple), source, required)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if set(map(type, value)) <= set(kinds):  # all of them at once: 408,000 in Llama 3's vocab
        return list(value)
    for i, item in enumerate(value):
        if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
            raise TokenizerError(
                f"{source}: GGUF key {key}[{i}] is {type(item).__name__} {item!r:.40}, "
                f"expected {_type_name(kind)}"
            )
    return list(value)


def _same_length(values, tokens, name, source) -> None:
    if len(values) != len(tokens):
        raise TokenizerError(
            f"{source}: GGUF key {_PREFIX}{name} has {len(values)} entries but "
            f"{_PREFIX}tokens has {len(tokens)}"
        )


def _get_id(metadata, name, n, source, default):
    value = _get(metadata, name, int, source)
    if value is None:
        return default
    value = operator.index(value)
    if not 0 <= value < n:
        raise TokenizerError(
            f"{source}: GGUF key {_PREFIX}{name} is {value}, outside the {n}-token vocabulary"
        )
    return value
