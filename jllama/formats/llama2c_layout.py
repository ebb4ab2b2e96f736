"""llama2.c checkpoint files: the layouts of versions 0, 1 and 2 and their sizes, and Q8_0
groups (`jllama.formats.llama2c` reads them, `jllama.formats.llama2c_writer` writes them).

All numbers are little-endian. Shapes are those of `jllama.model.weights.TransformerWeights`
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
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from jllama.model.config import ModelConfig
from jllama.errors import ConfigError
from jllama.model.weights import expected_shapes

MAGIC = 0x616B3432
"""uint32 at byte 0 of a version 1 or 2 file (export.py: "ak42" in ASCII)."""
VERSIONS = (0, 1, 2)
"""Versions jllama reads and writes."""
VERSIONED_HEADER_SIZE = 256
"""Bytes of the header of a version 1 or 2 file."""
DEFAULT_GROUP_SIZE = 64
"""export.py's default Q8_0 group size (elements per float32 scale)."""

HEADER = struct.Struct("<7i")  # version 0's whole header
VERSIONED = struct.Struct("<Ii7iBi")  # magic, version, the 7 sizes, shared, group_size
HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
FLOAT = np.dtype("<f4")
Q8 = np.dtype("i1")
# What llama2.c's readers assume, as run.c's and runq.c's float constants (1e-5f, 10000.0f).
FIXED_NORM_EPS = 1e-5
FIXED_ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class Segment:
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
            return self.size * Q8.itemsize + self.size // group_size * FLOAT.itemsize
        return self.size * FLOAT.itemsize


def layout(config: ModelConfig, version: int) -> list[Segment]:
    """The stored tensors of a `version` file for `config`, in file order."""
    shapes = expected_shapes(config)
    norms = ["rms_att_weight", "rms_ffn_weight", "rms_final_weight"]
    matrices = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    if version == 0:
        order = [Segment(name, shape) for name, shape in shapes.items() if name != "wcls"]
        half = (config.seq_len, config.head_dim // 2)
        order += [Segment("freq_cis_real", half), Segment("freq_cis_imag", half)]
    elif version == 1:
        names = norms + ["token_embedding_table"] + matrices
        order = [Segment(name, shapes[name]) for name in names]
    else:
        order = [Segment(name, shapes[name]) for name in norms]
        order.append(Segment("token_embedding_table", shapes["token_embedding_table"], q80=True))
        for name in matrices:
            order += [
                Segment(name, shapes[name][1:], layer=l, q80=True) for l in range(config.n_layers)
            ]
    if not config.shared_weights:
        order.append(Segment("wcls", shapes["wcls"], q80=version == 2))
    return order


def header_nbytes(version: int) -> int:
    """Bytes of a `version` file's header: 28 for version 0, else 256."""
    return HEADER.size if version == 0 else VERSIONED_HEADER_SIZE


def check_version(version) -> int:
    """`version` as an int if it is one jllama reads and writes (0, 1, 2), else ConfigError."""
    if isinstance(version, bool) or version not in VERSIONS:
        raise ConfigError(
            f"version={version!r}: llama2.c checkpoints come in versions "
            f"{', '.join(map(str, VERSIONS))}"
        )
    return int(version)


def check_group_size(group_size, divides: dict[str, int]) -> None:
    """Raise ConfigError unless `group_size` is a positive int dividing every value of
    `divides` (name -> element count)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ConfigError(f"group_size must be an integer, got {group_size!r}")
    if group_size < 1:
        raise ConfigError(f"group_size={group_size} must be positive")
    for name, n in divides.items():
        if n % group_size:
            raise ConfigError(f"group_size={group_size} does not divide {name} ({n} elements)")


def q80_sizes(config: ModelConfig) -> dict[str, int]:
    """{tensor: element count} of the Q8_0 tensors of a version 2 file (one entry per field,
    layer 0 standing for all layers): what a group size must divide."""
    return {
        s.name if s.layer is None else f"{s.name}[{s.layer}]": s.size
        for s in layout(config, 2)
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
        check_group_size(group_size, q80_sizes(config))
    body = sum(s.nbytes(group_size) for s in layout(config, version))
    return header_nbytes(version) + body


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
    check_group_size(group_size, {})
    group_size = int(group_size)
    while config.dim % group_size or config.hidden_dim % group_size:
        group_size //= 2
    return group_size


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
