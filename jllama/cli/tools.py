"""The small commands: `jllama fetch NAME`, `jllama tokenize`, `jllama convert`."""

from __future__ import annotations

import sys

from jllama.cli.generate import warn_invalid_utf8
from jllama.cli.options import Options
from jllama.errors import JllamaError
from jllama.platform.fetch import KNOWN_MODELS, fetch as fetch_model


def fetch(options: Options, args: list[str]) -> int:
    if len(args) != 1:
        known = "; ".join(f"{m.name}: {m.description}" for m in KNOWN_MODELS.values())
        raise JllamaError(f"usage: jllama fetch NAME, one model at a time (known models: {known})")
    print(fetch_model(args[0], progress=True, force=options.tools.force), flush=True)
    return 0


def tokenize(options: Options) -> int:
    """The prompt's ids (--pieces: each with its text): the tokenizer of --checkpoint (a GGUF's
    header alone), or --tokenizer alone when no checkpoint is given (as llama.cpp's
    llama-tokenize needs only a vocabulary, a vocab-only GGUF included)."""
    m, text = options.model, options.text
    from jllama.platform.fetch import resolve_checkpoint
    from jllama.formats.gguf import is_gguf
    from jllama.tokenizers.files import open_tokenizer

    if m.checkpoint is None and m.tokenizer is not None:
        tokenizer = open_tokenizer(m.tokenizer)
    elif m.checkpoint is not None and m.tokenizer is None and is_gguf(
            resolve_checkpoint(m.checkpoint)):
        # A GGUF's vocabulary is in its header: no tensors read (a vocab-only file works).
        tokenizer = open_tokenizer(resolve_checkpoint(m.checkpoint))
    else:
        from jllama.model.loading import open_model

        tokenizer = open_model(m.checkpoint, m.tokenizer, seq_len=m.seq_len).tokenizer
    warn_invalid_utf8(text.prompt, tokenizer)
    ids = tokenizer.encode(text.prompt, parse_special=text.parse_special)
    if not options.tools.pieces:
        print(ids, flush=True)
        return 0
    for token in ids:
        print(f"{token:>6} -> {tokenizer.piece(token)!r}")
    sys.stdout.flush()
    return 0


def convert(options: Options) -> int:
    m, t = options.model, options.tools
    if not m.checkpoint or not t.output:
        raise JllamaError("convert needs --checkpoint=SOURCE and --output=FILE.bin")
    from jllama.model.convert import convert as convert_checkpoint

    try:
        report = convert_checkpoint(
            m.checkpoint, t.output, version=t.llama2c_version, group_size=t.group_size,
            force=t.force, exact_group_size=t.group_size_given,
        )
    except JllamaError as e:
        message = str(e).replace("force=True", "--force")
        # The writer names its file "checkpoint"; here that file is --output.
        written = f"checkpoint {t.output}:"
        if message.startswith(written):
            message = f"--output={t.output}:" + message[len(written):]
        raise type(e)(message) from None
    line = (f"wrote {report.destination}: llama2.c version {report.version}, "
            f"{report.nbytes} bytes, from {report.source_format} {report.source}")
    if report.version == 2:
        line += (f"; Q8_0 group size {report.group_size}, max quantization error "
                 f"{report.max_quantization_error:.3g}")
    print(line, flush=True)
    return 0
