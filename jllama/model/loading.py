"""Finding and loading a model: checkpoint, tokenizer, and the embedded default.

A checkpoint is a llama2.c file (tokenizer in a separate file) or a GGUF file (tokenizer and
chat template inside), told apart by the GGUF magic; a known model's name such as `smollm2`
stands for its file in the cache (`jllama.platform.fetch`).

The embedded default is llama2.c's stories260K (a 260K-parameter Llama 2 trained on
TinyStories) with its 512-token tokenizer, shipped as package data in `jllama/data/`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError, TokenizerError
from jllama.platform.fetch import KNOWN_MODELS, cached_path, resolve_checkpoint
from jllama.formats.gguf import is_gguf, read_gguf
from jllama.formats.llama2c import read_checkpoint
from jllama.tokenizers.llama2c import Tokenizer, read_tokenizer
from jllama.model.weights import DTYPES, TransformerWeights, cast_weights


def _data_file(name: str) -> Path:
    return Path(str(resources.files("jllama") / "data" / name))


def embedded_checkpoint() -> Path:
    """Path of the embedded stories260K checkpoint (llama2.c version 0, 1 MB)."""
    return _data_file("stories260K.bin")


def embedded_tokenizer() -> Path:
    """Path of the embedded 512-token tokenizer of stories260K (llama2.c tokenizer.bin format)."""
    return _data_file("tok512.bin")


def find_tokenizer(checkpoint: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """The tokenizer for a checkpoint given none: the first of `tok{vocab_size}.bin` and
    `tokenizer.bin` in the checkpoint's folder (llama2.c's names for its custom and Llama 2
    vocabularies) that holds `vocab_size` tokens, else the embedded tok512.bin when
    vocab_size is 512.

    Raises:
      TokenizerError: none fits; the message names the files looked at and why each was not
        taken, and suggests --tokenizer.
    """
    folder = Path(checkpoint).parent
    candidates = [folder / f"tok{vocab_size}.bin", folder / "tokenizer.bin"]
    if vocab_size == 512:
        candidates.append(embedded_tokenizer())
    refused = []
    for path in candidates:
        if not path.exists():
            continue
        try:
            return read_tokenizer(path, vocab_size=vocab_size)
        except TokenizerError as e:
            refused.append(str(e))
    looked = ", ".join(str(p) for p in candidates)
    detail = f" ({'; '.join(refused)})" if refused else ""
    raise TokenizerError(
        f"no tokenizer with vocab_size={vocab_size} for checkpoint {checkpoint}: looked for "
        f"{looked}{detail}; pass --tokenizer"
    )


@dataclasses.dataclass(frozen=True)
class Model:
    """A model ready to run: what `open_model` returns.

    Attributes:
      config: hyperparameters; seq_len is the context the KV cache will hold (tokens).
      weights: `TransformerWeights`, f32.
      tokenizer: a llama2.c `Tokenizer` or a GGUF vocabulary's tokenizer (same protocol:
        encode, decode, stream_decoder, bos_id, eos_id, stop_ids, add_bos).
      chat_template: jinja source of the model's chat template, or None (llama2.c files).
      source: the checkpoint's path.
      file_format: "llama2c", "gguf" or "hf".
      context_length: the context the model was trained for, tokens (>= config.seq_len).
      tensor_types: GGML type name per tensor as stored (GGUF), else {}.
    """

    config: ModelConfig
    weights: TransformerWeights
    tokenizer: Any
    chat_template: str | None
    source: str
    file_format: str
    context_length: int
    tensor_types: dict[str, str] = dataclasses.field(default_factory=dict)


def open_model(
    checkpoint: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    seq_len: int | None = None,
    need_tokenizer: bool = True,
    dtype: str | None = None,
) -> Model:
    """Read a checkpoint (llama2.c file, GGUF file, Hugging Face folder, or a known model's
    name) with its tokenizer.

    Args:
      checkpoint: a path, a known model's name (`smollm2`), or None for the embedded
        stories260K.
      tokenizer: the tokenizer file of a llama2.c checkpoint, or of a Hugging Face folder that
        carries none (no tokenizer.json, no tiktoken tokenizer.model): a llama2.c
        tokenizer.bin, a tokenizer.json (read with its folder's configs) or Meta's tiktoken
        tokenizer.model, as `load_tokenizer` reads them. None: `find_tokenizer` picks one for
        a llama2.c checkpoint. GGUF files and folders with a tokenizer carry their own.
      seq_len: cap on the context (tokens) the KV cache is sized for; None = the model's.
      need_tokenizer: False leaves the tokenizer unread (tokenizer None), e.g. to inspect or
        convert the weights alone.
      dtype: "float32", "bfloat16" or "int8" (per-row scales, `jllama.model.quant`; a GGUF's
        Q8_0 and Q4_0 matrices keep their own scale per 32 weights, exactly) to hold the
        weight matrices in (RMSNorm gains stay float32); None keeps what the reader gives: float32 for llama2.c and GGUF files (GGUF
        quantized tensors are dequantized), the stored type for Hugging Face folders (a
        bfloat16 model stays bfloat16).

    Raises:
      CheckpointError: a missing or malformed checkpoint (see `read_checkpoint`, `read_gguf`,
        `read_hf`).
      TokenizerError: a missing, malformed or mismatched tokenizer, `tokenizer` given for a
        GGUF file or a Hugging Face folder that carries its own, or none given for a folder
        that carries none (the one-line message says to pass --tokenizer).
      FetchError: a known model's name that has not been fetched.
      ConfigError: seq_len < 1, or an unknown dtype.
    """
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 1")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    path = resolve_checkpoint(checkpoint) if checkpoint else embedded_checkpoint()
    model = _read(path, checkpoint, tokenizer, seq_len, need_tokenizer, dtype)
    if dtype is not None:
        try:
            model = dataclasses.replace(model, weights=cast_weights(model.weights, dtype))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return model


def _refuse_tokenizer(tokenizer, path, kind: str) -> None:
    if tokenizer is not None:
        raise TokenizerError(
            f"--tokenizer={tokenizer} is for llama2.c checkpoints: the {kind} {path} carries "
            "its own tokenizer"
        )


def _folder_tokenizer(folder: Path) -> str | None:
    """The tokenizer file a Hugging Face folder carries: "tokenizer.json", else Meta's tiktoken
    "tokenizer.model", else None."""
    if (folder / "tokenizer.json").exists():
        return "tokenizer.json"
    if is_tiktoken_file(folder / "tokenizer.model"):
        return "tokenizer.model"
    return None


def _read(path: Path, checkpoint, tokenizer, seq_len, need_tokenizer, dtype) -> Model:
    if path.is_file() and (
        path.suffix == ".safetensors"
        or (path.suffix == ".json" and (path.parent / "config.json").is_file())
    ):
        raise CheckpointError(
            f"{path} is a file of a Hugging Face model folder: pass the folder {path.parent}"
        )
    if path.is_dir():
        from jllama.formats.hf import read_hf

        own = _folder_tokenizer(path)
        if own is not None:
            _refuse_tokenizer(tokenizer, path, "Hugging Face folder")
        # int8 and q4 are quantized from the stored floats afterwards (`cast_weights`).
        h = read_hf(path, seq_len=seq_len, dtype=None if dtype in ("int8", "q4") else dtype)
        hf_tokenizer = None
        template = h.chat_template
        if need_tokenizer and own == "tokenizer.model":
            # Meta's tiktoken tokenizer.model beside the weights, and no tokenizer.json.
            from jllama.chat import LLAMA3_CHAT_TEMPLATE
            from jllama.tokenizers.tiktoken_model import read_tiktoken_model

            hf_tokenizer = read_tiktoken_model(path / own)
            template = template or LLAMA3_CHAT_TEMPLATE
            _check_fits(hf_tokenizer, path, h.config.vocab_size)
        elif need_tokenizer and own == "tokenizer.json":
            from jllama.tokenizers.hf import read_hf_tokenizer

            hf_tokenizer = read_hf_tokenizer(path)
            _check_fits(hf_tokenizer, path, h.config.vocab_size)
        elif need_tokenizer and tokenizer is not None:
            hf_tokenizer = load_tokenizer(path, h.config.vocab_size, tokenizer)
            # A tokenizer.json is read with the configs beside it (load_tokenizer): its
            # tokenizer_config.json's chat template too, where the folder has none of its own.
            template = template or _borrowed_chat_template(tokenizer)
        elif need_tokenizer:
            raise TokenizerError(
                f"the Hugging Face folder {path} has no tokenizer.json (nor Meta's tiktoken "
                "tokenizer.model): pass --tokenizer (a tokenizer.json, a llama2.c tokenizer.bin "
                "or a tiktoken tokenizer.model)"
            )
        return Model(
            config=h.config, weights=h.weights, tokenizer=hf_tokenizer,
            chat_template=template,
            source=str(path), file_format="hf", context_length=h.context_length,
            tensor_types=dict(h.dtypes),
        )
    # A .gguf name is read as GGUF even without the magic, so a damaged file is called that.
    if is_gguf(path) or (path.suffix.lower() == ".gguf" and path.is_file()):
        _refuse_tokenizer(tokenizer, path, "GGUF file")
        try:
            # Blocks as stored unless a float dtype was asked for (then dequantized once, here).
            g = read_gguf(path, seq_len=seq_len, stored=dtype not in ("float32", "bfloat16"))
        except CheckpointError as e:
            name = os.fspath(checkpoint)
            if name in KNOWN_MODELS and path == cached_path(name):
                raise CheckpointError(
                    f"{e} (the cached {name} is damaged: `jllama fetch {name}` repairs it)"
                ) from None
            raise
        return Model(
            config=g.config, weights=g.weights, tokenizer=g.tokenizer,
            chat_template=g.chat_template, source=str(path), file_format="gguf",
            context_length=g.context_length, tensor_types=g.tensor_types,
        )
    config, weights = read_checkpoint(path)
    context_length = config.seq_len
    if seq_len is not None and seq_len < config.seq_len:
        config = dataclasses.replace(config, seq_len=seq_len)
    return Model(
        config=config, weights=weights,
        tokenizer=load_tokenizer(path, config.vocab_size, tokenizer) if need_tokenizer else None,
        chat_template=None, source=str(path), file_format="llama2c",
        context_length=context_length,
    )


def required_memory(model: Model, devices: int = 1, cache_types=("f32", "f32"), *,
                    slots: int = 1, draft=None) -> str:
    """One line saying what running `model` needs, before the weights are placed and the KV
    cache allocated (as Distributed Llama's "RequiredMemory"): `jllama.platform.memory.memory_plan`'s
    weights in their dtype, the KV cache of `slots` sequences of seq_len tokens in its (key,
    value) `cache_types` (`jllama.model.cache_types`, named in the line), a draft model where
    `draft` is one (a self: type or the draft checkpoint's `Model`: its weights and one KV
    cache per slot, `memory_plan`'s `draft`), and the process itself (measured, plus its
    programs and activations), in MB (10^6 bytes).

    With devices > 1 (tensor parallelism, `jllama.platform.sharding`; the count must pass
    `check_divisible`) the line goes on with what each device holds: its slice of the
    weights and of the KV cache (`jllama.platform.sharding.device_memory`), and the embedding table
    the host keeps."""
    from jllama.platform.memory import memory_plan

    config = model.config
    line = memory_plan(model, slots=slots, cache_type=cache_types[0],
                       value_type=cache_types[1], draft=draft).line()
    if devices > 1:
        from jllama.platform.sharding import device_memory

        per = device_memory(config, model.weights, devices, cache_types)
        line += (
            f"; per device ({devices} devices): {per.total / 1e6:.1f} MB = weights "
            f"{per.weights / 1e6:.1f} MB + KV cache {per.kv_cache / 1e6:.1f} MB"
        )
        if per.host_embedding:
            line += f" (the embedding table, {per.host_embedding / 1e6:.1f} MB, stays on the host)"
    return line


def load_model(
    checkpoint: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None
) -> tuple[ModelConfig, TransformerWeights, Any]:
    """`open_model`'s config, weights and tokenizer as a tuple (defaults: the embedded
    stories260K and the tokenizer `find_tokenizer` picks).

    Raises:
      as `open_model`.
    """
    model = open_model(checkpoint, tokenizer)
    return model.config, model.weights, model.tokenizer


def load_tokenizer(
    checkpoint: str | os.PathLike, vocab_size: int, tokenizer: str | os.PathLike | None = None
) -> Tokenizer:
    """`tokenizer` read and checked against `vocab_size`, or `find_tokenizer`'s pick when None.

    Raises:
      TokenizerError: as `read_tokenizer` and `find_tokenizer`.
    """
    if tokenizer is None:
        return find_tokenizer(checkpoint, vocab_size)
    head = _head(tokenizer)
    if head.lstrip()[:1] == b"{":  # a Hugging Face tokenizer.json (with its folder's configs)
        from jllama.tokenizers.hf import read_hf_tokenizer

        if Path(tokenizer).name != "tokenizer.json":
            raise TokenizerError(
                f"tokenizer {tokenizer}: a JSON tokenizer must be named tokenizer.json, in its "
                "model folder beside tokenizer_config.json"
            )
        found = read_hf_tokenizer(Path(tokenizer).parent)
        _check_fits(found, tokenizer, vocab_size)
        return found
    if head[:1] == b"\x0a" and b"\x00" in head[:64]:  # protobuf: a SentencePiece .model
        raise TokenizerError(
            f"tokenizer {tokenizer}: is a SentencePiece model, which jllama does not read; pass "
            "a llama2.c tokenizer.bin, Meta's tiktoken tokenizer.model, or a tokenizer.json"
        )
    if is_tiktoken_file(tokenizer):
        from jllama.tokenizers.tiktoken_model import read_tiktoken_model

        found = read_tiktoken_model(tokenizer)
        _check_fits(found, tokenizer, vocab_size)
        return found
    return read_tokenizer(tokenizer, vocab_size=vocab_size)


def _borrowed_chat_template(tokenizer: str | os.PathLike) -> str | None:
    """The chat template beside a tokenizer.json given as --tokenizer (its folder's
    chat_template.jinja or tokenizer_config.json, as for the folder that holds it); None for
    another kind of tokenizer file."""
    if Path(tokenizer).name != "tokenizer.json":
        return None
    from jllama.tokenizers.hf import read_hf_chat_template

    return read_hf_chat_template(Path(tokenizer).parent)


def _head(path: str | os.PathLike, n: int = 4096) -> bytes:
    try:
        if not Path(path).is_file():  # opening a FIFO would block; the readers name the error
            return b""
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _check_fits(found, path, vocab_size: int) -> None:
    """A tokenizer may have fewer tokens than the model (a padded vocabulary), never more."""
    if found.vocab_size > vocab_size:
        raise TokenizerError(
            f"tokenizer {path}: holds {found.vocab_size} tokens but the checkpoint's "
            f"vocab_size is {vocab_size} (the wrong tokenizer for this checkpoint?)"
        )


def is_tiktoken_file(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a tiktoken BPE file (Meta's Llama 3 `tokenizer.model`): its
    first line is `<base64 token> <rank>`. False for llama2.c's binary tokenizer.bin."""
    first = _head(path, 200).split(b"\n", 1)[0] + b"\n"
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", first) is not None
