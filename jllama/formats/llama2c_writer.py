"""Writing llama2.c checkpoint files of versions 0, 1 and 2 (layouts in
`jllama.formats.llama2c_layout`), as llama2.c's `export.py` does.

The file appears atomically (a temporary file beside it, renamed); version 2 quantizes every
matrix to Q8_0 groups as export.py's `quantize_q80`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.llama2c_layout import (
    DEFAULT_GROUP_SIZE,
    FIXED_NORM_EPS,
    FIXED_ROPE_THETA,
    FLOAT,
    HEADER,
    MAGIC,
    VERSIONED,
    VERSIONED_HEADER_SIZE,
    check_version,
    fit_group_size,
    layout,
    quantize_q80,
)
from jllama.model.weights import TransformerWeights, check_shapes


@dataclasses.dataclass(frozen=True)
class WrittenCheckpoint:
    """What `write_checkpoint` wrote.

    Attributes:
      path: the file (a link's target when `path` was a symbolic link).
      version: 0, 1 or 2.
      nbytes: size of the file in bytes.
      group_size: the Q8_0 group size stored (version 2; may be smaller than asked, see
        `fit_group_size`), else 0.
      max_quantization_error: largest |dequantized - original| over every quantized weight
        (version 2, as export.py's "max quantization group error"), else 0.0.
      quantization_errors: the same per field (e.g. "wq": max over its layers), version 2 only.
    """

    path: Path
    version: int
    nbytes: int
    group_size: int = 0
    max_quantization_error: float = 0.0
    quantization_errors: dict[str, float] = dataclasses.field(default_factory=dict)


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The freq_cis_real / freq_cis_imag tables a version-0 file carries: cos and sin of
    `pos * rope_theta ** (-2i / head_dim)`, f32[seq_len, head_dim / 2] each (unused by run.c
    and by jllama, written so that other readers that expect them find real values)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / config.head_dim))
    angles = np.outer(np.arange(config.seq_len, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _check_representable(
    config: ModelConfig, weights: TransformerWeights, version: int, force: bool
) -> None:
    """Raise ConfigError for what a `version` file cannot record (see `write_checkpoint`)."""
    if config.dim % config.n_heads or config.head_dim != config.dim // config.n_heads:
        raise ConfigError(
            f"head_dim={config.head_dim} cannot be stored in a llama2.c version-{version} file, "
            f"whose readers take head_dim = dim / n_heads = {config.dim / config.n_heads:g} and "
            "size the attention matrices by it"
        )
    for name, what in (("qkv_bias", "q/k/v biases"), ("qk_norm", "q/k norms"),
                       ("moe", "Mixture-of-Experts router and experts")):
        if getattr(config, name):  # not even with force: the model would lose a part
            raise ConfigError(
                f"{name}=True: a llama2.c version-{version} file has no place for the {what} "
                "(Qwen models run from their GGUF or Hugging Face files)"
            )
    if not force:
        fixed = {
            "norm_eps": (np.float32(config.norm_eps) == np.float32(FIXED_NORM_EPS),
                         FIXED_NORM_EPS),
            "rope_theta": (np.float32(config.rope_theta) == np.float32(FIXED_ROPE_THETA),
                           FIXED_ROPE_THETA),
            "rope_scaling": (config.rope_scaling is None, None),
        }
        for name, (ok, assumed) in fixed.items():
            if not ok:
                raise ConfigError(
                    f"{name}={getattr(config, name)} cannot be stored in a llama2.c "
                    f"version-{version} file, whose readers assume {name}={assumed} (pass "
                    "force=True to write it anyway)"
                )
    tied = weights.wcls is weights.token_embedding_table
    if config.shared_weights and not tied and not np.array_equal(
        weights.wcls, weights.token_embedding_table
    ):
        raise ConfigError(
            f"shared_weights=True but wcls differs from token_embedding_table; a "
            f"version-{version} file would drop it (use shared_weights=False)"
        )


def _header_bytes(config: ModelConfig, version: int, group_size: int) -> bytes:
    sizes = [config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads]
    if version == 0:
        vocab = config.vocab_size if config.shared_weights else -config.vocab_size
        return HEADER.pack(*sizes, vocab, config.seq_len)
    packed = VERSIONED.pack(  # version 1 has no group_size: its bytes stay zero padding
        MAGIC, version, *sizes, config.vocab_size, config.seq_len, int(config.shared_weights),
        group_size if version == 2 else 0,
    )
    return packed.ljust(VERSIONED_HEADER_SIZE, b"\0")


def _write_atomically(path: str | os.PathLike, body: Callable[[BinaryIO], None]) -> Path:
    """Run `body` on a temporary file beside `path`, then rename it to `path` (through a
    symbolic link, to its target). Returns the path written."""
    if not str(path):
        raise CheckpointError("checkpoint path is empty")
    path = Path(os.path.realpath(path))  # write through links: replace the target, not them
    if path.exists() and not path.is_file():
        raise CheckpointError(f"checkpoint {path}: exists and is not a regular file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot write: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the checkpoint private
        with os.fdopen(fd, "wb") as f:
            body(f)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"checkpoint {path}: cannot write: {e.strerror}") from None
        raise
    return path


def write_checkpoint(
    path: str | os.PathLike,
    config: ModelConfig,
    weights: TransformerWeights,
    version: int = 0,
    group_size: int = DEFAULT_GROUP_SIZE,
    force: bool = False,
) -> WrittenCheckpoint:
    """Write `weights` as a llama2.c checkpoint of `version` 0, 1 or 2 (layouts in the module
    docstring).

    Version 2 quantizes every matrix with `quantize_q80` in groups of
    `fit_group_size(config, group_size)` elements; the norms stay float32. The classifier is
    stored separately when `config.shared_weights` is False (version 0: a negative vocab_size;
    versions 1 and 2: shared_classifier = 0). Weights of any float dtype are written as
    float32.

    The file appears atomically: it is written to a temporary file beside `path` and renamed,
    so a failure never leaves a half-written file. A symbolic link is written through (its
    target is replaced); an existing path that is not a regular file is refused.

    Args:
      path: the file to write.
      config: the model; must fit `weights`.
      weights: the tensors, shapes as `expected_shapes(config)`.
      version: 0 (run.c's legacy format), 1 (float32 with the 256-byte header) or 2 (Q8_0,
        for runq.c).
      group_size: version 2's Q8_0 group size before `fit_group_size` (export.py: 64).
      force: write even when norm_eps, rope_theta or rope_scaling differ from what llama2.c's
        readers assume (1e-5, 10000, none). The file then records the weights but not those
        settings: run.c, runq.c and `read_checkpoint` will use 1e-5, 10000 and plain RoPE, so
        they compute a different model from the one given. head_dim other than
        dim / n_heads is refused even so, since the readers size wq, wk, wv and wo from it.

    Returns:
      a `WrittenCheckpoint` with the file's size, and for version 2 the group size stored and
      the largest quantization error (what export.py prints).

    Raises:
      ConfigError: a weight whose shape does not fit `config`; an unknown version; a bad
        group_size; a config the format cannot record (head_dim; without force also norm_eps,
        rope_theta, rope_scaling), naming the field; `shared_weights` with a `wcls` that
        differs from the embedding table (it would be dropped); (version 2) NaN or infinite
        weights.
      CheckpointError: an empty path, a path that is not a regular file, or the file cannot be
        written.
    """
    version = check_version(version)
    check_shapes(config, weights)
    _check_representable(config, weights, version, force)
    stored_group = fit_group_size(config, group_size) if version == 2 else 0
    segments = layout(config, version)
    errors: dict[str, float] = {}

    def body(f: BinaryIO) -> None:
        f.write(_header_bytes(config, version, stored_group))
        tables = dict(zip(("freq_cis_real", "freq_cis_imag"), rope_tables(config)))
        if version != 0:
            tables = {}
        for segment in segments:
            if segment.name in tables:
                array = tables[segment.name]
            else:
                array = getattr(weights, segment.name)
                if segment.layer is not None:
                    array = array[segment.layer]
            if not segment.q80:
                f.write(np.ascontiguousarray(array, dtype=FLOAT).data)
                continue
            try:
                q, s, error = quantize_q80(array, stored_group)
            except ConfigError as e:
                raise ConfigError(f"weights.{segment.name}: {e}") from None
            errors[segment.name] = max(errors.get(segment.name, 0.0), error)
            f.write(q.data)
            f.write(s.astype(FLOAT, copy=False).data)

    written = _write_atomically(path, body)
    return WrittenCheckpoint(
        path=written,
        version=version,
        nbytes=written.stat().st_size,
        group_size=stored_group,
        max_quantization_error=max(errors.values(), default=0.0),
        quantization_errors=errors,
    )
