"""The model shapes the benchmark knows, and the files each one needs on disk.

Random-weight shapes are llama2.c's published models (dim / hidden_dim / n_layers / n_heads /
n_kv_heads / vocab_size / seq_len) filled with `jllama.model.weights.random_weights`: the numbers
mean nothing, the work per token is the real model's. They are written once as llama2.c
version-0 files (what run.c reads) into the cache folder and reused.

Two shapes are real models: `stories260K` (the checkpoint shipped inside jllama, for smoke
tests) and `smollm2` (SmolLM2-135M-Instruct, the GGUF `jllama.platform.fetch.fetch("smollm2")` brings).
Any GGUF file is a shape too, named by its path (`--shapes=path/to/model-Q4_K_M.gguf`): the
same file is what a `--vs` program such as llama.cpp's llama-bench reads, so both run the very
same weights.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

from cli import write_whole  # bench/ is not a package: by file name

from jllama.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape.

    Attributes:
      name: what `--shapes` takes.
      kind: "random" (random weights of `dims`), "embedded" (jllama's stories260K), "known"
        (a `jllama.platform.fetch` model) or "file" (a GGUF file at `path`).
      dims: (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len) for
        "random" shapes, else None.
      shared_weights: the classifier is the embedding table (llama2.c's stories models) or a
        matrix of its own (TinyLlama).
      on_request: left out of the default set (large: minutes per measurement).
    """

    name: str
    kind: str
    dims: tuple[int, int, int, int, int, int, int] | None = None
    shared_weights: bool = True
    on_request: bool = False
    path: str | None = None

    def config(self) -> ModelConfig:
        """The `ModelConfig` of a "random" shape."""
        if self.dims is None:
            raise ValueError(f"shape {self.name} is a real model; read its config from the file")
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = self.dims
        return ModelConfig(
            dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
            vocab_size=vocab, seq_len=seq_len, shared_weights=self.shared_weights,
        )


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("stories260K", "embedded"),
        Shape("stories15M", "random", (288, 768, 6, 6, 6, 32000, 256)),
        Shape("stories42M", "random", (512, 1376, 8, 8, 8, 32000, 1024)),
        Shape("stories110M", "random", (768, 2048, 12, 12, 12, 32000, 1024)),
        Shape(
            "TinyLlama-1.1B", "random", (2048, 5632, 22, 32, 4, 32000, 2048),
            shared_weights=False, on_request=True,
        ),
        Shape("smollm2", "known"),
    )
}

DEFAULT_SHAPES = ("stories15M", "stories110M")


def get_shape(name: str) -> Shape:
    """The shape called `name`, or a GGUF file's (a name ending in .gguf); ValueError naming
    the known ones otherwise, or a GGUF file that is not there."""
    if name.lower().endswith(".gguf"):
        if not Path(name).is_file():
            raise ValueError(f"shape {name!r}: no such GGUF file")
        return Shape(name, "file", path=name)
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}, or a .gguf "
                         "file") from None


def checkpoint(shape: Shape, cache: Path) -> Path:
    """The file jllama reads for `shape`, made or fetched on first use.

    Random shapes: `cache/NAME.bin`, a llama2.c version-0 file of random weights (seed 0),
    written atomically; a file of the wrong size is rewritten. stories15M takes ~1 s and
    61 MB, TinyLlama-1.1B ~1 min and 4.4 GB (and ~7 GB of memory while it is made).
    """
    if shape.kind == "embedded":
        from jllama.model.loading import embedded_checkpoint

        return embedded_checkpoint()
    if shape.kind == "file":
        return Path(shape.path)
    if shape.kind == "known":
        from jllama.platform.fetch import fetch

        return fetch(shape.name, progress=False)
    from jllama.formats.llama2c import checkpoint_nbytes, write_checkpoint
    from jllama.model.weights import random_weights

    config = shape.config()
    path = cache / f"{shape.name}.bin"
    if path.is_file() and path.stat().st_size == checkpoint_nbytes(config, 0):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, config, random_weights(config, seed=0), version=0)
    return path


def llama2c_checkpoint(shape: Shape, cache: Path) -> Path:
    """A llama2.c version-0 file of `shape` for an external program such as run.c.

    The same file as `checkpoint` for llama2.c shapes. For `smollm2`, `cache/smollm2.bin`
    written from the GGUF's dequantized float32 weights; llama2.c files cannot record its
    rope_theta (100000), so run.c computes a slightly different model from it with exactly
    the same amount of work, which is what a speed comparison needs.
    """
    if shape.kind != "known":  # a GGUF file shape: the file itself (for GGUF readers)
        return checkpoint(shape, cache)
    from jllama.formats.llama2c import checkpoint_nbytes, write_checkpoint
    from jllama.model.loading import open_model

    model = open_model(checkpoint(shape, cache), need_tokenizer=False, dtype="float32")
    path = cache / f"{shape.name}.bin"
    if path.is_file() and path.stat().st_size == checkpoint_nbytes(model.config, 0):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, model.config, model.weights, version=0, force=True)
    return path


def placeholder_tokenizer(vocab_size: int, cache: Path) -> Path:
    """`cache/tokVOCAB.bin`: a llama2.c tokenizer file of `vocab_size` made-up pieces.

    run.c needs a tokenizer file whose size matches the checkpoint's vocabulary even when the
    prompt is empty (it then feeds BOS alone); for random weights any pieces do. Layout
    (run.c's `build_tokenizer`): int32 max_token_length, then per token float32 score,
    int32 byte length, the bytes.
    """
    path = cache / f"tok{vocab_size}.bin"
    specials = [b"<unk>", b"\n<s>\n", b"\n</s>\n"]
    pieces = (specials + [b" t%d" % i for i in range(3, vocab_size)])[:vocab_size]
    body = bytearray(struct.pack("<i", max(len(p) for p in pieces)))
    for i, piece in enumerate(pieces):
        body += struct.pack("<fi", -float(i), len(piece)) + piece
    if path.is_file() and path.read_bytes() == bytes(body):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: tmp.write_bytes(bytes(body)))  # a temporary of its own
    return path
