"""llama2.c checkpoint files: the legacy version 0 and the versioned formats 1 (float32) and
2 (Q8_0), as llama2.c's `export.py` writes them (`legacy_export`, `version1_export`,
`version2_export`) and its run.c (version 0) and runq.c (version 2) read them.

All numbers are little-endian. Shapes are those of `jllama.weights.TransformerWeights`
(L = n_layers, matrices out x in); q_dim = dim and head_dim = dim / n_heads in every version,
since the header has no field for them.

Version 0 (no magic):
  header: 7 x int32 = dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
          (28 bytes); a negative vocab_size means the classifier is stored separately.
  float32 tensors: token_embedding_table, rms_att_weight, wq, wk, wv, wo, rms_ffn_weight, w1,
  w2, w3, rms_final_weight, freq_cis_real [seq_len, head_dim/2], freq_cis_imag (RoPE tables
  that run.c skips; so does this reader), wcls when unshared.

Versions 1 and 2 share a 256-byte header:
  byte 0: uint32 magic 0x616b3432 ("ak42" as a little-endian number; the bytes read "24ka")
  byte 4: int32 version
  byte 8: 7 x int32 = dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (positive),
          seq_len
  byte 36: uint8 shared_classifier (1: wcls is the embedding table and is not stored)
  byte 37: int32 group_size (version 2 only; unaligned, as export.py's struct.pack puts it)
  zeros up to byte 256.

Version 1, float32 tensors: rms_att_weight, rms_ffn_weight, rms_final_weight,
  token_embedding_table, wq, wk, wv, wo, w1, w2, w3 (each all layers, layer 0 first), wcls when
  unshared. No RoPE tables.

Version 2: rms_att_weight, rms_ffn_weight, rms_final_weight as float32; then every matrix as a
  Q8_0 tensor in this order: token_embedding_table, wq[0], ..., wq[L-1], wk[0..L-1],
  wv[0..L-1], wo[0..L-1], w1[0..L-1], w2[0..L-1], w3[0..L-1], wcls when unshared. A Q8_0 tensor
  of n elements is int8 q[n] followed by float32 s[n / group_size] (runq.c's
  `init_quantized_tensors`), and element i is `q[i] * s[i // group_size]` over the flattened
  row-major matrix (runq.c's `dequantize`). Note the order of the current export.py: each
  tensor's scales right after its values (an early export.py wrote all scales at the end;
  runq.c never read that layout).

wq and wk rows are in Meta's original order, where RoPE rotates adjacent pairs (x[2i], x[2i+1])
as run.c does (export.py's Hugging Face loader permutes them back to it). jllama's weights are
held in that order whatever file they came from, so they are written as they are.

Reading memory-maps the file: version 0 and 1 arrays are read-only views of it, no copy;
version 2 matrices are dequantized to new float32 arrays.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jllama.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.files import require_regular_file
from jllama.weights import TransformerWeights, check_shapes, expected_shapes

MAGIC = 0x616B3432
"""uint32 at byte 0 of a version 1 or 2 file (export.py: "ak42" in ASCII)."""
VERSIONS = (0, 1, 2)
"""Versions this module reads and writes."""
VERSIONED_HEADER_SIZE = 256
"""Bytes of the header of a version 1 or 2 file."""
DEFAULT_GROUP_SIZE = 64
"""export.py's default Q8_0 group size (elements per float32 scale)."""

HEADER = struct.Struct("<7i")  # version 0's whole header
_VERSIONED = struct.Struct("<Ii7iBi")  # magic, version, the 7 sizes, shared, group_size
HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
# Files often mistaken for a llama2.c checkpoint: named rather than misread.
FOREIGN_MAGIC = {b"GGUF": "a GGUF file, not a llama2.c checkpoint"}
_FLOAT = np.dtype("<f4")
_Q8 = np.dtype("i1")
_WEIGHT_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerWeights))
# What llama2.c's readers assume, as run.c's and runq.c's float constants (1e-5f, 10000.0f).
_FIXED_NORM_EPS = 1e-5
_FIXED_ROPE_THETA = 10000.0


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


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One stored tensor: a `TransformerWeights` field (all layers, or one layer's matrix in
    version 2), or one of version 0's RoPE tables (name "freq_cis_real" / "freq_cis_imag")."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None  # the layer of a stacked field, when stored one layer at a time
    q80: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def nbytes(self, group_size: int) -> int:
        if self.q80:
            return self.size * _Q8.itemsize + self.size // group_size * _FLOAT.itemsize
        return self.size * _FLOAT.itemsize


def _layout(config: ModelConfig, version: int) -> list[_Segment]:
    """The stored tensors of a `version` file for `config`, in file order."""
    shapes = expected_shapes(config)
    norms = ["rms_att_weight", "rms_ffn_weight", "rms_final_weight"]
    matrices = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    if version == 0:
        order = [_Segment(name, shape) for name, shape in shapes.items() if name != "wcls"]
        half = (config.seq_len, config.head_dim // 2)
        order += [_Segment("freq_cis_real", half), _Segment("freq_cis_imag", half)]
    elif version == 1:
        names = norms + ["token_embedding_table"] + matrices
        order = [_Segment(name, shapes[name]) for name in names]
    else:
        order = [_Segment(name, shapes[name]) for name in norms]
        order.append(_Segment("token_embedding_table", shapes["token_embedding_table"], q80=True))
        for name in matrices:
            order += [
                _Segment(name, shapes[name][1:], layer=l, q80=True) for l in range(config.n_layers)
            ]
    if not config.shared_weights:
        order.append(_Segment("wcls", shapes["wcls"], q80=version == 2))
    return order


def _header_nbytes(version: int) -> int:
    return HEADER.size if version == 0 else VERSIONED_HEADER_SIZE


def check_version(version) -> int:
    """`version` as an int if it is one this module writes (0, 1, 2), else ConfigError."""
    if isinstance(version, bool) or version not in VERSIONS:
        raise ConfigError(
            f"version={version!r}: llama2.c checkpoints come in versions "
            f"{', '.join(map(str, VERSIONS))}"
        )
    return int(version)


def _check_group_size(group_size, divides: dict[str, int]) -> None:
    """Raise ConfigError unless `group_size` is a positive int dividing every value of
    `divides` (name -> element count)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ConfigError(f"group_size must be an integer, got {group_size!r}")
    if group_size < 1:
        raise ConfigError(f"group_size={group_size} must be positive")
    for name, n in divides.items():
        if n % group_size:
            raise ConfigError(f"group_size={group_size} does not divide {name} ({n} elements)")


def _q80_sizes(config: ModelConfig) -> dict[str, int]:
    return {
        s.name if s.layer is None else f"{s.name}[{s.layer}]": s.size
        for s in _layout(config, 2)
        if s.q80 and (s.layer is None or s.layer == 0)
    }


def checkpoint_nbytes(config: ModelConfig, version: int = 0, group_size: int = 0) -> int:
    """Size in bytes of a llama2.c checkpoint file for `config`.

    Args:
      config: the model.
      version: 0, 1 or 2.
      group_size: version 2's Q8_0 group size as stored in the file (see `fit_group_size` for
        the one `write_checkpoint` stores); ignored for versions 0 and 1.

    Raises:
      ConfigError: an unknown version, or (version 2) a group size that is not positive or
        does not divide every matrix's element count.
    """
    version = check_version(version)
    if version == 2:
        _check_group_size(group_size, _q80_sizes(config))
    body = sum(s.nbytes(group_size) for s in _layout(config, version))
    return _header_nbytes(version) + body


def fit_group_size(config: ModelConfig, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """The Q8_0 group size `write_checkpoint` stores for `config` when asked for `group_size`:
    halved (integer division, as export.py's BACKOFF loop) until it divides both dim and
    hidden_dim.

    export.py halves only until it divides dim, though its message says hidden_dim; runq.c
    quantizes every matmul input (length dim, or hidden_dim for w2) in groups of group_size
    and its matmul drops a last partial group, so a group size that does not divide
    hidden_dim makes runq.c compute w2 wrongly (stories260K: hidden_dim 172 gives 4, not 64).

    Raises:
      ConfigError: `group_size` is not a positive integer.
    """
    _check_group_size(group_size, {})
    group_size = int(group_size)
    while config.dim % group_size or config.hidden_dim % group_size:
        group_size //= 2
    return group_size


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
    _, _, *sizes, shared, group_size = _VERSIONED.unpack_from(raw)
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
            _check_group_size(group_size, _q80_sizes(config))
        except ConfigError as e:
            raise CheckpointError(f"{bad}: {e}") from None
    return CheckpointHeader(
        version=version, config=config, group_size=group_size, nbytes=VERSIONED_HEADER_SIZE
    )


def read_header(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a llama2.c checkpoint of any version (`read_checkpoint_header`'s
    config: shared_weights from the header, norm_eps and rope_theta llama2.c's fixed 1e-5 and
    10000).

    Raises:
      CheckpointError: as `read_checkpoint_header`.
    """
    return read_checkpoint_header(path).config


def dequantize_q80(q: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """Q8_0 values back to float32, as runq.c's `dequantize`: `x[i] = q[i] * s[i // group_size]`
    (one float32 product, exact for an int8 times a float32 up to rounding of the product).

    Args:
      q: int8[n], n a multiple of group_size.
      scales: f32[n / group_size].
      group_size: elements per scale.

    Returns:
      f32[n], a new array.
    """
    q = np.asarray(q).reshape(-1, group_size)
    s = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    return np.multiply(q, s, dtype=np.float32).reshape(-1)


def quantize_q80(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Symmetric int8 quantization in groups, as export.py's `quantize_q80`.

    Over the flattened `w`, per group of `group_size` elements: scale = max|w| / 127 (float32),
    q = round(w / scale) rounding half to even (torch.round), so q lies in [-127, 127]. A group
    of zeros gets scale 0 and q = 0 (export.py would divide 0 by 0 there).

    Args:
      w: any shape whose size is a multiple of `group_size`; converted to float32.
      group_size: elements per scale.

    Returns:
      (q int8[n], scales f32[n / group_size], max_error): max_error is the largest
      |q * scale - w| over all elements (float32 arithmetic, as export.py's maxerr).

    Raises:
      ConfigError: NaN or infinite values (they have no Q8_0 form).
    """
    w = np.asarray(w, dtype=np.float32).reshape(-1, group_size)
    if not np.isfinite(w).all():
        raise ConfigError("NaN or infinite values cannot be quantized to Q8_0")
    scale = np.abs(w).max(axis=1) / np.float32(127.0)
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    q = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    error = np.abs(np.multiply(q, scale[:, None], dtype=np.float32) - w)
    return q.reshape(-1), scale, float(error.max()) if error.size else 0.0


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, TransformerWeights]:
    """Read a llama2.c checkpoint of version 0, 1 or 2, memory-mapped.

    Returns:
      (config, weights): float32 weights in the file's layout (see
      `jllama.weights.TransformerWeights`). Versions 0 and 1: read-only views of the mapped
      file. Version 2: the norms are views, the matrices dequantized (runq.c's `dequantize`)
      into new arrays. When the classifier is shared, `wcls` is the embedding table array.

    Raises:
      CheckpointError: missing file, bad header or unknown version (see
        `read_checkpoint_header`), or a file size different from what the header implies
        (truncated or with trailing bytes), naming the file, its version and both sizes.
    """
    path = Path(path)
    header = read_checkpoint_header(path)
    config, version, group_size = header.config, header.version, header.group_size
    layout = _layout(config, version)
    expected = header.nbytes + sum(s.nbytes(group_size) for s in layout)
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
    for segment in layout:
        n = segment.size
        if segment.name not in _WEIGHT_FIELDS:
            pass  # version 0's RoPE tables
        elif not segment.q80:
            floats = np.frombuffer(mapped, dtype=_FLOAT, count=n, offset=offset)
            arrays[segment.name] = floats.reshape(segment.shape)
        else:
            q = np.frombuffer(mapped, dtype=_Q8, count=n, offset=offset)
            s = np.frombuffer(mapped, dtype=_FLOAT, count=n // group_size, offset=offset + n)
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
    if not force:
        fixed = {
            "norm_eps": (np.float32(config.norm_eps) == np.float32(_FIXED_NORM_EPS),
                         _FIXED_NORM_EPS),
            "rope_theta": (np.float32(config.rope_theta) == np.float32(_FIXED_ROPE_THETA),
                           _FIXED_ROPE_THETA),
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
    packed = _VERSIONED.pack(  # version 1 has no group_size: its bytes stay zero padding
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
    layout = _layout(config, version)
    errors: dict[str, float] = {}

    def body(f: BinaryIO) -> None:
        f.write(_header_bytes(config, version, stored_group))
        tables = dict(zip(("freq_cis_real", "freq_cis_imag"), rope_tables(config)))
        if version != 0:
            tables = {}
        for segment in layout:
            if segment.name in tables:
                array = tables[segment.name]
            else:
                array = getattr(weights, segment.name)
                if segment.layer is not None:
                    array = array[segment.layer]
            if not segment.q80:
                f.write(np.ascontiguousarray(array, dtype=_FLOAT).data)
                continue
            try:
                q, s, error = quantize_q80(array, stored_group)
            except ConfigError as e:
                raise ConfigError(f"weights.{segment.name}: {e}") from None
            errors[segment.name] = max(errors.get(segment.name, 0.0), error)
            f.write(q.data)
            f.write(s.astype(_FLOAT, copy=False).data)

    written = _write_atomically(path, body)
    return WrittenCheckpoint(
        path=written,
        version=version,
        nbytes=written.stat().st_size,
        group_size=stored_group,
        max_quantization_error=max(errors.values(), default=0.0),
        quantization_errors=errors,
    )
