"""safetensors files: the header parsed, the tensors memory-mapped, a folder's shards found.

The file is an unsigned 64-bit little-endian header length N, N bytes of JSON ({name:
{"dtype", "shape", "data_offsets": [begin, end]}}, plus an optional "__metadata__"), then the
data, offsets counted from the end of the header (the format's specification in the
safetensors repository). This module parses that header itself and maps the file with
`np.memmap`, one path for every dtype: the `safetensors` package's numpy loader cannot
represent BF16 (NumPy has no bfloat16; it fails with "data type 'bfloat16' not understood"),
so BF16 data is viewed as `ml_dtypes.bfloat16`, and F32/F16 take the same path so that one set
of bounds and size checks covers all tensors. (The tests check this reader against
`safetensors.torch.load_file`.) Supported dtypes: F32, F16, BF16.

A model folder holds either one `model.safetensors` or shards named by
`model.safetensors.index.json` (what transformers' `save_pretrained` writes); what the tensors
mean is `jllama.formats.hf`'s business.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jllama.errors import CheckpointError
from jllama.platform.files import parse_json, parse_json_object, require_regular_file

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
"""The safetensors dtypes jllama reads, with the NumPy type their data is viewed as."""

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit on N


@dataclasses.dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file, as its header describes it.

    Attributes:
      name: the tensor's name.
      dtype: the safetensors dtype string ("F32", "BF16", "I64", ...).
      shape: dimensions, outermost first (row-major).
      path: the file.
      begin, end: byte offsets of the data in the file (absolute, end exclusive).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    begin: int
    end: int


def read_safetensors_header(path: str | os.PathLike) -> dict[str, SafetensorsEntry]:
    """The tensors of a safetensors file, from its header (the data is not read).

    Raises:
      CheckpointError: a missing or non-regular file, a header length past the end of the file,
        a header that is not a JSON object, or a tensor entry with a bad dtype, shape or
        offsets (data outside the file). One line naming the file (and the tensor).
    """
    path = Path(path)
    size = require_regular_file(path, f"checkpoint {path}", CheckpointError)
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file: header length {n} bytes, file "
                f"{size} bytes"
            )
        raw = f.read(n)
    header = parse_json_object(raw, f"{path}: safetensors header", CheckpointError)
    data_start, data_size = 8 + n, size - 8 - n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info_dict = info if isinstance(info, dict) else {}
        dtype, shape, offsets = (info_dict.get(k) for k in ("dtype", "shape", "data_offsets"))
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        )
        if not ok:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}")
        begin, end = offsets
        if end < begin:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] end before they begin"
            )
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] run outside the "
                f"{data_size} data bytes (truncated file?)"
            )
        entries[name] = SafetensorsEntry(
            name=name, dtype=dtype, shape=tuple(shape), path=path,
            begin=data_start + begin, end=data_start + end,
        )
    # The tensors must tile the data without overlapping (as the safetensors library checks):
    # a header whose offsets overlap would make one tensor silently read another's bytes.
    spans = sorted((e.begin, e.end, e.name) for e in entries.values())
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(
                f"{path}: the data of tensors {name_a!r} and {name_b!r} overlap (a malformed "
                "header)"
            )
    return entries


def entry_dtype(entry: SafetensorsEntry, source: str) -> np.dtype:
    """The NumPy dtype the entry's data is viewed as (`SAFETENSORS_DTYPES`).

    Raises:
      CheckpointError: a dtype jllama does not read, or a byte count that does not fit the
        dtype and shape; one line naming `source` and the tensor.
    """
    if entry.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{source}: tensor {entry.name!r} has dtype {entry.dtype}, not supported "
            f"(supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
    want = math.prod(entry.shape) * dtype.itemsize
    if entry.end - entry.begin != want:
        raise CheckpointError(
            f"{source}: tensor {entry.name!r}: {entry.end - entry.begin} data bytes, but "
            f"{entry.dtype} {list(entry.shape)} needs {want}"
        )
    return dtype


class MappedFiles:
    """The safetensors files of a checkpoint, memory-mapped once each (read-only)."""

    def __init__(self):
        self._maps: dict[Path, np.memmap] = {}

    def array(self, entry: SafetensorsEntry) -> np.ndarray:
        """The entry's data as a read-only array view of the mapped file, in its stored dtype."""
        dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
        if entry.begin == entry.end:
            return np.zeros(entry.shape, dtype)
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        return self._maps[entry.path][entry.begin : entry.end].view(dtype).reshape(entry.shape)


def read_json(path: Path, what: str, error: type[Exception]) -> Any:
    """The parsed JSON file at `path` (an index, or a folder's config.json).

    Raises:
      error: not a regular file, unreadable, or not valid JSON; one line naming `what` and
        the path.
    """
    require_regular_file(path, f"{what} {path}", error)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{what} {path}: cannot read: {e.strerror or e}") from None
    try:
        return parse_json(raw)
    except ValueError as e:
        raise error(f"{what} {path}: not valid JSON ({e})") from None


def find_tensors(folder: Path, source: str) -> dict[str, SafetensorsEntry]:
    """Every tensor of a model folder: from `model.safetensors`, else the shards that
    `model.safetensors.index.json` names (its `weight_map`: tensor name -> shard file name).

    Raises:
      CheckpointError: neither file, a malformed index, a shard name that is not a file name
        or is missing, a tensor that is not in the shard the index puts it in, or what
        `read_safetensors_header` raises. One line, naming `source` or the file.
    """
    single = folder / SAFETENSORS_FILE
    if single.exists():
        return read_safetensors_header(single)
    index_path = folder / SAFETENSORS_INDEX
    if not index_path.exists():
        raise CheckpointError(
            f"{source}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors weights "
            "are read, not PyTorch .bin files)"
        )
    index = read_json(index_path, "checkpoint index", CheckpointError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise CheckpointError(f"{index_path}: no weight_map of tensor names to shard files")
    headers: dict[str, dict[str, SafetensorsEntry]] = {}
    tensors = {}
    for name, shard in weight_map.items():
        if shard not in headers:
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"{index_path}: shard name {shard!r} is not a file name")
            if not (folder / shard).exists():
                raise CheckpointError(
                    f"{source}: shard {shard} (named by {SAFETENSORS_INDEX}) is missing"
                )
            headers[shard] = read_safetensors_header(folder / shard)
        if name not in headers[shard]:
            raise CheckpointError(
                f"{source}: tensor {name!r} is not in shard {shard}, where "
                f"{SAFETENSORS_INDEX} puts it"
            )
        tensors[name] = headers[shard][name]
    return tensors
