"""llama2.c checkpoint files, legacy version 0 (as written by llama2.c's `export.py --version 0`
and read by run.c's `read_checkpoint`).

Layout, all little-endian:
  header: 7 x int32 = dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
          a negative vocab_size means the classifier is stored separately (unshared).
  then float32 tensors in this order (shapes as in `jllama.weights.TransformerWeights`):
  token_embedding_table, rms_att_weight, wq, wk, wv, wo, rms_ffn_weight, w1, w2, w3,
  rms_final_weight, freq_cis_real [seq_len, head_dim/2], freq_cis_imag [seq_len, head_dim/2]
  (RoPE tables that run.c skips; so does this reader), and wcls [vocab_size, dim] when unshared.

Reading memory-maps the file: the returned arrays are read-only views of it, no copy.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from jllama.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.files import require_regular_file
from jllama.weights import TransformerWeights, check_shapes, expected_shapes

HEADER = struct.Struct("<7i")
# Files that are not version 0 but are often mistaken for it: named rather than misread.
FOREIGN_MAGIC = {
    struct.pack("<I", 0x616B3432): "a llama2.c versioned file (magic 0x616b3432, export.py "
    "--version 1 or 2), not the legacy version 0",
    b"GGUF": "a GGUF file, not a llama2.c checkpoint",
}
HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
_FLOAT = np.dtype("<f4")


def _tensor_layout(config: ModelConfig) -> list[tuple[str | None, tuple[int, ...]]]:
    """(field name or None for skipped tables, shape) in file order."""
    shapes = expected_shapes(config)
    names = list(shapes)
    order = [(name, shapes[name]) for name in names if name != "wcls"]
    half = config.head_dim // 2
    order += [(None, (config.seq_len, half)), (None, (config.seq_len, half))]
    if not config.shared_weights:
        order.append(("wcls", shapes["wcls"]))
    return order


def checkpoint_nbytes(config: ModelConfig) -> int:
    """Size in bytes of a version-0 checkpoint file for `config`."""
    floats = sum(int(np.prod(shape)) for _, shape in _tensor_layout(config))
    return HEADER.size + _FLOAT.itemsize * floats


def _describe(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def read_header(path: str | os.PathLike) -> ModelConfig:
    """Read and validate the 28-byte header of a version-0 checkpoint.

    Returns:
      the `ModelConfig` it describes (shared_weights from the sign of vocab_size; norm_eps and
      rope_theta llama2.c's fixed 1e-5 and 10000).

    Raises:
      CheckpointError: missing or unreadable file, shorter than a header, sizes that are
        non-positive, absurd or inconsistent. The message names the file and the numbers.
    """
    path = Path(path)
    what = f"checkpoint {path}"
    require_regular_file(path, what, CheckpointError)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read: {e.strerror}") from None
    for magic, kind in FOREIGN_MAGIC.items():
        if raw.startswith(magic):
            raise CheckpointError(f"{what}: {kind}; this reader takes llama2.c version-0 files")
    if len(raw) < HEADER.size:
        raise CheckpointError(
            f"{what}: {len(raw)} bytes, shorter than the {HEADER.size}-byte header"
        )
    values = dict(zip(HEADER_FIELDS, HEADER.unpack(raw)))
    shared = values["vocab_size"] > 0
    fields = dict(values, vocab_size=abs(values["vocab_size"]))
    try:
        return ModelConfig(**fields, shared_weights=shared)
    except ConfigError as e:
        raise CheckpointError(
            f"checkpoint {path}: bad header ({_describe(values)}): {e}"
        ) from None


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, TransformerWeights]:
    """Read a llama2.c version-0 checkpoint, memory-mapped.

    Returns:
      (config, weights): weights are read-only float32 views of the mapped file, in the file's
      layout (see `jllama.weights.TransformerWeights`); when the classifier is shared, `wcls`
      is the embedding table array itself.

    Raises:
      CheckpointError: missing file, bad header, or a file size different from what the header
        implies (truncated or with trailing bytes), naming the file and both sizes.
    """
    path = Path(path)
    config = read_header(path)
    expected = checkpoint_nbytes(config)
    actual = path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header implies"
        header = _describe({k: getattr(config, k) for k in HEADER_FIELDS})
        raise CheckpointError(
            f"checkpoint {path}: {what}: {actual} bytes, but the header ({header}, "
            f"shared_weights={config.shared_weights}) implies {expected} bytes"
        )
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    floats = np.frombuffer(mapped, dtype=_FLOAT, offset=HEADER.size)
    arrays = {}
    offset = 0
    for name, shape in _tensor_layout(config):
        n = int(np.prod(shape))
        if name is not None:
            arrays[name] = floats[offset : offset + n].reshape(shape)
        offset += n
    if config.shared_weights:
        arrays["wcls"] = arrays["token_embedding_table"]
    return config, TransformerWeights(**arrays)


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The freq_cis_real / freq_cis_imag tables a version-0 file carries: cos and sin of
    `pos * rope_theta ** (-2i / head_dim)`, f32[seq_len, head_dim / 2] each (unused by run.c
    and by jllama, written so that other readers that expect them find real values)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / config.head_dim))
    angles = np.outer(np.arange(config.seq_len, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _check_representable(config: ModelConfig, weights: TransformerWeights) -> None:
    fixed = ModelConfig(
        config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
        config.vocab_size, config.seq_len, config.shared_weights,
    )
    for name in ("head_dim", "norm_eps", "rope_theta"):
        if getattr(config, name) != getattr(fixed, name):
            raise ConfigError(
                f"{name}={getattr(config, name)} cannot be stored in a llama2.c version-0 "
                f"file, whose readers assume {name}={getattr(fixed, name)}"
            )
    if config.shared_weights and weights.wcls is not weights.token_embedding_table:
        if not np.array_equal(weights.wcls, weights.token_embedding_table):
            raise ConfigError(
                "shared_weights=True but wcls differs from token_embedding_table; a version-0 "
                "file would drop it (use shared_weights=False)"
            )


def write_checkpoint(
    path: str | os.PathLike, config: ModelConfig, weights: TransformerWeights
) -> None:
    """Write `weights` as a llama2.c version-0 checkpoint.

    The classifier is written separately (negative vocab_size in the header) when
    `config.shared_weights` is False. The file appears atomically: it is written to a
    temporary file beside `path` and renamed, so a failure never leaves a half-written file.

    A symbolic link is written through (its target is replaced); an existing path that is not
    a regular file (a device, a pipe, a directory) is refused.

    Raises:
      ConfigError: a weight whose shape does not fit `config`; a config the format cannot
        record (head_dim other than dim // n_heads, norm_eps other than 1e-5, rope_theta other
        than 10000: a reader would silently use those); `shared_weights` with a `wcls` that
        differs from the embedding table (it would be dropped).
      CheckpointError: an empty path, a path that is not a regular file, or the file cannot be
        written.
    """
    check_shapes(config, weights)
    _check_representable(config, weights)
    if not str(path):
        raise CheckpointError("checkpoint path is empty")
    path = Path(os.path.realpath(path))  # write through links: replace the target, not them
    if path.exists() and not path.is_file():
        raise CheckpointError(f"checkpoint {path}: exists and is not a regular file")
    vocab = config.vocab_size if config.shared_weights else -config.vocab_size
    header = HEADER.pack(
        config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
        vocab, config.seq_len,
    )
    cos, sin = rope_tables(config)
    tables = iter([cos, sin])
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot write: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the checkpoint private
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for name, _ in _tensor_layout(config):
                array = next(tables) if name is None else getattr(weights, name)
                f.write(np.ascontiguousarray(array, dtype=_FLOAT).tobytes())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"checkpoint {path}: cannot write: {e.strerror}") from None
        raise
