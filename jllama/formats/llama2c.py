"""llama2.c checkpoint files: the legacy version 0 and the versioned formats 1 (float32) and
2 (Q8_0), as llama2.c's `export.py` writes them (`legacy_export`, `version1_export`,
`version2_export`) and its run.c (version 0) and runq.c (version 2) read them.

This module reads them; the layouts (and their sizes, Q8_0 groups) are
`jllama.formats.llama2c_layout`'s, the writer `jllama.formats.llama2c_writer`'s, and their
public names are importable from here too.

Reading memory-maps the file: version 0 and 1 arrays are read-only views of it, no copy;
version 2 matrices are dequantized to new float32 arrays.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.platform.files import require_regular_file
from jllama.formats.llama2c_layout import (  # noqa: F401 (re-exported: names of this module)
    DEFAULT_GROUP_SIZE,
    FLOAT,
    HEADER,
    HEADER_FIELDS,
    MAGIC,
    Q8,
    VERSIONED,
    VERSIONED_HEADER_SIZE,
    VERSIONS,
    check_group_size,
    check_version,
    checkpoint_nbytes,
    dequantize_q80,
    fit_group_size,
    layout,
    q80_sizes,
    quantize_q80,
)
from jllama.formats.llama2c_writer import (  # noqa: F401 (re-exported)
    WrittenCheckpoint,
    rope_tables,
    write_checkpoint,
)
from jllama.model.weights import TransformerWeights

# Files often mistaken for a llama2.c checkpoint: named rather than misread.
FOREIGN_MAGIC = {b"GGUF": "a GGUF file, not a llama2.c checkpoint"}
_WEIGHT_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerWeights))


@dataclasses.dataclass(frozen=True)
class CheckpointHeader:
    """What a llama2.c checkpoint's header says.

    Attributes:
      version: 0 (legacy, no magic), 1 or 2.
      config: the model it describes; norm_eps and rope_theta llama2.c's fixed 1e-5 and 10000,
        head_dim = dim // n_heads.
      group_size: Q8_0 elements per scale (version 2), else 0.
      nbytes: size of the header in bytes (28 for version 0, else 256).
    """

    version: int
    config: ModelConfig
    group_size: int
    nbytes: int


def _describe(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def read_checkpoint_header(path: str | os.PathLike) -> CheckpointHeader:
    """Read and validate the header of a llama2.c checkpoint of any version.

    A file that starts with the uint32 0x616b3432 is a versioned file (256-byte header);
    any other file is read as version 0 (no legacy header can start with those bytes: as dim
    they would be 1634415666, far beyond any model).

    Raises:
      CheckpointError: missing or unreadable file, shorter than its header, an unknown
        version, a GGUF file, sizes that are non-positive, absurd or inconsistent, a
        shared_classifier byte other than 0 or 1, a version-2 group size that does not divide
        the tensors. The one-line message names the file and the numbers.
    """
    path = Path(path)
    what = f"checkpoint {path}"
    require_regular_file(path, what, CheckpointError)
    try:
        with open(path, "rb") as f:
            raw = f.read(VERSIONED_HEADER_SIZE)
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read: {e.strerror}") from None
    for magic, kind in FOREIGN_MAGIC.items():
        if raw.startswith(magic):
            raise CheckpointError(f"{what}: {kind}; this reader takes llama2.c checkpoints")
    if raw[:4] == struct.pack("<I", MAGIC):
        return _versioned_header(what, raw)
    if len(raw) < HEADER.size:
        raise CheckpointError(
            f"{what}: {len(raw)} bytes, shorter than the {HEADER.size}-byte header"
        )
    values = dict(zip(HEADER_FIELDS, HEADER.unpack_from(raw)))
    shared = values["vocab_size"] > 0
    fields = dict(values, vocab_size=abs(values["vocab_size"]))
    try:
        config = ModelConfig(**fields, shared_weights=shared)
    except ConfigError as e:
        raise CheckpointError(f"{what}: bad header ({_describe(values)}): {e}") from None
    return CheckpointHeader(version=0, config=config, group_size=0, nbytes=HEADER.size)


def _versioned_header(what: str, raw: bytes) -> CheckpointHeader:
    if len(raw) < 8:
        raise CheckpointError(
            f"{what}: {len(raw)} bytes, too short to hold the version of a llama2.c versioned "
            f"file (magic 0x{MAGIC:08x})"
        )
    (version,) = struct.unpack_from("<i", raw, 4)
    if version not in (1, 2):
        raise CheckpointError(
            f"{what}: llama2.c checkpoint version {version} is not supported (magic "
            f"0x{MAGIC:08x} files of versions 1 and 2 are; version 0 has no magic)"
        )
    if len(raw) < VERSIONED_HEADER_SIZE:
        raise CheckpointError(
            f"{what}: {len(raw)} bytes, shorter than the {VERSIONED_HEADER_SIZE}-byte header of "
            f"a llama2.c version-{version} file"
        )
    _, _, *sizes, shared, group_size = VERSIONED.unpack_from(raw)
    values = dict(zip(HEADER_FIELDS, sizes))
    bad = f"{what}: bad llama2.c version-{version} header"
    if shared not in (0, 1):
        raise CheckpointError(f"{bad}: shared_classifier byte is {shared}, not 0 or 1")
    try:
        config = ModelConfig(**values, shared_weights=bool(shared))
    except ConfigError as e:
        raise CheckpointError(f"{bad} ({_describe(values)}): {e}") from None
    if version == 1:
        group_size = 0
    else:
        try:
            check_group_size(group_size, q80_sizes(config))
        except ConfigError as e:
            raise CheckpointError(f"{bad}: {e}") from None
    return CheckpointHeader(
        version=version, config=config, group_size=group_size, nbytes=VERSIONED_HEADER_SIZE
    )


MAX_GROUP_SCALE = float(np.finfo(np.float32).max) / 128
"""The largest |scale| of a version-2 group whose every value `q * scale` (q an int8, so
|q| <= 128) is finite in float32: 3.4028235e38 / 128 = 2.66e36, exactly a float32 (a power of
two apart). export.py writes max|w| / 127, so a real file's scales are far below it."""


def _check_group_scales(scales: np.ndarray, path: Path, segment) -> None:
    """Raise CheckpointError unless every version-2 group scale of `segment` is finite with
    |scale| <= MAX_GROUP_SCALE, so dequantizing (runq.c's `q[i] * s[i // group_size]`, in
    float32) gives finite weights and NumPy no overflow warning.

    Vectorized: a min and a max over f32[n / group_size] (NaN propagates through both), a
    1/16 of the int8 bytes that dequantizing reads anyway at group size 64; the place of a bad
    scale is looked up only when there is one.
    """
    if not scales.size:
        return
    low, high = scales.min(), scales.max()
    if -MAX_GROUP_SCALE <= low and high <= MAX_GROUP_SCALE:
        return
    bad = np.flatnonzero(~(np.abs(scales) <= MAX_GROUP_SCALE))
    i = int(bad[0])
    name = segment.name if segment.layer is None else f"{segment.name}[{segment.layer}]"
    value = float(scales[i])
    why = ("a weight's scale must be finite" if not np.isfinite(value) else
           f"times an int8 (up to 128) it is not finite as float32; |scale| must be at most "
           f"{MAX_GROUP_SCALE:.6g}")
    raise CheckpointError(
        f"checkpoint {path}: version-2 tensor {name}: group scale [{i}] is {value:g}; {why}"
    )


def read_header(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a llama2.c checkpoint of any version (`read_checkpoint_header`'s
    config: shared_weights from the header, norm_eps and rope_theta llama2.c's fixed 1e-5 and
    10000).

    Raises:
      CheckpointError: as `read_checkpoint_header`.
    """
    return read_checkpoint_header(path).config


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, TransformerWeights]:
    """Read a llama2.c checkpoint of version 0, 1 or 2, memory-mapped.

    Returns:
      (config, weights): float32 weights in the file's layout (see
      `jllama.model.weights.TransformerWeights`). Versions 0 and 1: read-only views of the mapped
      file. Version 2: the norms are views, the matrices dequantized (runq.c's `dequantize`)
      into new arrays. When the classifier is shared, `wcls` is the embedding table array.

    Raises:
      CheckpointError: missing file, bad header or unknown version (see
        `read_checkpoint_header`), a file size different from what the header implies
        (truncated or with trailing bytes), naming the file, its version and both sizes, or
        (version 2) a group scale that is NaN, infinite or too large for its values to be
        finite in float32 (`MAX_GROUP_SCALE`), naming the tensor and the group.
    """
    path = Path(path)
    header = read_checkpoint_header(path)
    config, version, group_size = header.config, header.version, header.group_size
    segments = layout(config, version)
    expected = header.nbytes + sum(s.nbytes(group_size) for s in segments)
    actual = path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header implies"
        sizes = _describe({k: getattr(config, k) for k in HEADER_FIELDS})
        extra = f", group_size={group_size}" if version == 2 else ""
        raise CheckpointError(
            f"checkpoint {path}: {what}: {actual} bytes, but its version-{version} header "
            f"({sizes}, shared_weights={config.shared_weights}{extra}) implies {expected} bytes"
        )
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arrays: dict[str, np.ndarray] = {}
    offset = header.nbytes
    for segment in segments:
        n = segment.size
        if segment.name not in _WEIGHT_FIELDS:
            pass  # version 0's RoPE tables
        elif not segment.q80:
            floats = np.frombuffer(mapped, dtype=FLOAT, count=n, offset=offset)
            arrays[segment.name] = floats.reshape(segment.shape)
        else:
            q = np.frombuffer(mapped, dtype=Q8, count=n, offset=offset)
            s = np.frombuffer(mapped, dtype=FLOAT, count=n // group_size, offset=offset + n)
            _check_group_scales(s, path, segment)
            values = dequantize_q80(q, s, group_size).reshape(segment.shape)
            if segment.layer is None:
                arrays[segment.name] = values
            else:
                if segment.name not in arrays:
                    shape = (config.n_layers, *segment.shape)
                    arrays[segment.name] = np.empty(shape, np.float32)
                arrays[segment.name][segment.layer] = values
        offset += segment.nbytes(group_size)
    if config.shared_weights:
        arrays["wcls"] = arrays["token_embedding_table"]
    return config, TransformerWeights(**arrays)
