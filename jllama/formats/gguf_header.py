"""A GGUF file's header in one pass: its metadata as Python values and its tensors as NumPy
views of the memory-mapped file, as `gguf.GGUFReader` gives them, in a fraction of the time.

`gguf.GGUFReader` makes several NumPy views for every element of every metadata array; a
GPT-2-style vocabulary (SmolLM2: 49152 tokens, 48900 merges) took it about 3 s. Here long
arrays of strings are found and decoded at once with NumPy (`_strings_at_once`), other strings
sliced from one `memoryview` with `struct`, and numeric arrays read by `np.frombuffer`. Layout (ggml's docs/gguf.md, versions 2 and 3): magic "GGUF",
u32 version, u64 tensor count, u64 metadata count; each metadata entry a string key, a u32
value type and the value (a string is a u64 length and UTF-8 bytes; an array a u32 element
type, a u64 count and the elements); then per tensor a string name, u32 n_dims, u64 dims
(innermost first), u32 ggml type and a u64 offset into the data section, which starts at the
next multiple of `general.alignment` (default 32). A file written big-endian (its version
reads as 0 in the low half) is read in that byte order, as GGUFReader does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any, NamedTuple

import numpy as np

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
"""Metadata value types (`gguf.GGUFValueType`) with a fixed size, as `struct` formats."""
_DTYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8",
           11: "i8", 12: "f8"}
_PLAIN_TENSORS = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}
"""ggml types (F32, F16, I8, I16, I32, I64, F64) whose data is viewed element by element; the
others as bytes per row."""

BLOCK_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
               8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
               14: (256, 210), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
               30: (1, 2)}
"""(elements, bytes) of a block of the common ggml types (ggml's type traits: F32, F16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, the integers, F64, BF16); other types' sizes come from
the `gguf` package (imported only then: importing it costs 0.1 s, most of it YAML)."""


class HeaderTensor(NamedTuple):
    """One tensor, with the fields of `gguf.ReaderTensor` that jllama reads.

    Attributes:
      name: e.g. "blk.0.attn_q.weight".
      tensor_type: its ggml type id (an int; `gguf.GGMLQuantizationType` names them).
      shape: u64[n_dims], innermost dimension first (ggml's ne).
      n_elements, n_bytes: its element and byte counts.
      data_offset: where its data starts in the file, bytes.
      data: a read-only view of the mapped file: f32/f16/...[outermost .. innermost] for the
        plain types, else u8[outer dims..., bytes of a row].
    """

    name: str
    tensor_type: int
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """What `read_header` returns.

    Attributes:
      version: 2 or 3.
      metadata: every key to its value: int, float, bool, str, or a list of them for an array,
        as `gguf.ReaderField.contents()` gives (arrays of arrays are refused).
      tensors: `HeaderTensor`s in the file's order.
      alignment: of the data section, bytes.
      data_offset: where the data section starts, bytes.
    """

    version: int
    metadata: dict[str, Any]
    tensors: list[HeaderTensor]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads values forward from a buffer in one byte order; ValueError past its end."""

    def __init__(self, buf: memoryview, order: str):
        self.buf, self.order, self.pos = buf, order, 0
        self._u64 = struct.Struct(order + "Q")

    def _past_end(self, what: str) -> ValueError:
        return ValueError(f"{what} at byte {self.pos} runs past the end of the file "
                          f"({len(self.buf)} bytes)")

    def scalar(self, fmt: str, what: str):
        try:
            (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        except struct.error:
            raise self._past_end(what) from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, what: str) -> str:
        try:
            (n,) = self._u64.unpack_from(self.buf, self.pos)
        except struct.error:
            raise self._past_end(what) from None
        start = self.pos + 8
        if n > len(self.buf) - start:
            raise self._past_end(what)
        self.pos = start + n
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} at byte {start} is not UTF-8 ({e.reason})") from None

    def strings(self, count: int, what: str) -> list[str]:
        if count >= _AT_ONCE and self.order == "<":
            found = _strings_at_once(self.buf, self.pos, count)
            if found is not None:
                out, self.pos = found
                return out
        # The hot loop of a vocabulary: locals only.
        buf, unpack, pos, end = self.buf, self._u64.unpack_from, self.pos, len(self.buf)
        out = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise struct.error
                append(str(buf[pos:pos + n], "utf-8"))
                pos += n
        except struct.error:
            self.pos = pos
            raise self._past_end(what) from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{what}, element {len(out)}, is not UTF-8 ({e.reason})") from None
        self.pos = pos
        return out

    def numbers(self, value_type: int, count: int, what: str) -> list:
        dtype = np.dtype(self.order + _DTYPES[value_type])
        if count * dtype.itemsize > len(self.buf) - self.pos:
            raise self._past_end(what)
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += count * dtype.itemsize
        return values

    def value(self, value_type: int, what: str):
        if value_type == _STRING:
            return self.string(what)
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type], what)
        if value_type == _ARRAY:
            item_type = self.scalar("I", what)
            count = self.scalar("Q", what)
            if item_type == _STRING:
                return self.strings(count, what)
            if item_type in _SCALARS:
                return self.numbers(item_type, count, what)
            if item_type == _ARRAY:
                # ggml's gguf.cpp refuses arrays of arrays (gguf-py's reader flattens them): no
                # writer makes them, and flattened a nested token list passed for a flat one.
                raise ValueError(f"{what}: an array of arrays (llama.cpp refuses them too)")
            raise ValueError(f"{what}: unknown array element type {item_type}")
        raise ValueError(f"{what}: unknown value type {value_type}")


_AT_ONCE = 256
"""String arrays at least this long are first read by `_strings_at_once`."""


def _strings_at_once(buf: memoryview, pos: int, count: int) -> tuple[list[str], int] | None:
    """`count` little-endian GGUF strings from `pos` read with NumPy, and where they end; None
    when this way does not apply (a string of 64 KiB or more, an empty one, one holding a NUL,
    one that is not UTF-8, or one that runs past the end) and the caller reads them one by one,
    which also reports what is wrong.

    Why: Llama 3's vocabulary is 408,403 strings (tokens and merges); one `struct` read and
    one slice each took 0.3-0.5 s, this 0.03 s. A length below 64 KiB is a u64 whose bytes 2-7
    are zero, and UTF-8 text without NUL has no zero byte: the places of six zeros followed by
    a byte that is not (a string's first byte, or the next field's low byte after an empty
    string) are the length fields, exactly when each of them points at the next (checked:
    then each length is the u64 the loop would read). The fields then become NUL separators of
    one UTF-8 text, decoded and split at once.
    """
    end = len(buf)
    window = min(end - pos, count * 24)
    while True:
        a = np.frombuffer(buf, np.uint8, window, pos)
        zero = a == 0
        # bytes 2..7 of a u64 zero, and the string's first byte not (nor is byte 7 of the
        # field after a string, so the place before that field is not taken for one)
        field = ~zero[8:]
        for k in range(2, 8):
            field &= zero[k : k + len(field)]
        fields = np.flatnonzero(field)
        if len(fields) and fields[0] == 0:
            chain = fields[:count]
            after = chain + 8 + a[chain] + (a[chain + 1].astype(np.int64) << 8)
            if len(chain) == count and np.array_equal(chain[1:], after[:-1]):
                if after[-1] <= window:
                    break
            elif not np.array_equal(chain[1:], after[:-1][: len(chain) - 1]):
                return None  # not the chain of fields: a string this way cannot read
        if window == end - pos:
            return None
        window = min(end - pos, window * 2)  # the strings are longer than guessed
    stop = int(after[-1])
    keep = np.ones(stop, bool)
    for k in range(1, 8):
        keep[chain + k] = False
    region = a[:stop].copy()
    region[chain] = 0
    try:
        text = region[keep].tobytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    out = text.split("\0")
    if len(out) != count + 1:  # a NUL in a string
        return None
    del out[0]
    return out, pos + stop


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read the GGUF file at `path`: metadata, tensor infos, and views of its tensor data.

    Raises:
      ValueError: not GGUF, a version other than 2 or 3, a header or tensor that runs past the
        end of the file, a string that is not UTF-8, an unknown value or tensor type, a
        duplicate key or tensor name, an array of arrays, a bad `general.alignment`, or a
        tensor that does not begin where the one before it ends (padded to the alignment:
        overlapping, misplaced or misaligned tensors, a type declared over another type's
        bytes); one line.
      OSError: the file cannot be opened or mapped.
    """
    mapped = np.memmap(path, mode="r")
    buf = memoryview(mapped)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no 'GGUF' magic")
    cursor = _Cursor(buf, "<")
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version & 0xFFFF == 0 and version:  # written on a big-endian machine
        cursor.order = ">"
        cursor._u64 = struct.Struct(">Q")
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = cursor.scalar("Q", "the tensor count")
    n_keys = cursor.scalar("Q", "the metadata count")
    metadata: dict[str, Any] = {}
    for _ in range(n_keys):
        key = cursor.string("a metadata key")
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        value_type = cursor.scalar("I", f"metadata key {key!r}")
        metadata[key] = cursor.value(value_type, f"metadata key {key!r}")

    infos = []
    for _ in range(n_tensors):
        name = cursor.string("a tensor name")
        n_dims = cursor.scalar("I", f"tensor {name!r}")
        dims = cursor.numbers(10, n_dims, f"tensor {name!r}")
        type_id = cursor.scalar("I", f"tensor {name!r}")
        offset = cursor.scalar("Q", f"tensor {name!r}")
        infos.append((name, dims, type_id, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise ValueError(f"general.alignment={alignment!r} is not a power of two")
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors, names, expected = [], set(), 0
    for name, dims, type_id, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensor = _tensor(mapped, cursor.order, name, dims, type_id, data_offset + offset)
        # As llama.cpp's loader (gguf_init_from_file_impl): each tensor begins where the one
        # before it ends, padded to the alignment. So no two overlap, none is misaligned, and a
        # type declared over bytes sized for another type moves every later tensor's offset.
        if offset != expected:
            raise ValueError(f"tensor {name!r} has offset {offset}, expected {expected} (each "
                             f"tensor follows the one before it, padded to {alignment} bytes)")
        expected += -(-tensor.n_bytes // alignment) * alignment
        tensors.append(tensor)
    return GGUFHeader(version=version, metadata=metadata, tensors=tensors,
                      alignment=alignment, data_offset=data_offset)


def block_size(type_id: int) -> tuple[int, int] | None:
    """(elements, bytes) of one block of ggml type `type_id`, or None for an unknown type."""
    if type_id in BLOCK_SIZES:
        return BLOCK_SIZES[type_id]
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES.get(type_id)


def _tensor(mapped: np.memmap, order: str, name: str, dims: list[int], type_id: int,
            start: int) -> HeaderTensor:
    sizes = block_size(type_id)
    if sizes is None:
        raise ValueError(f"tensor {name!r} has unknown ggml type {type_id}")
    block, type_size = sizes
    # Python ints: a product of uint64 dims wraps (2^32 x 2^32 x 2 reads as 0 elements).
    n_elements = math.prod(int(d) for d in dims)
    shape = tuple(reversed(dims))
    if block > 1 and shape and shape[-1] % block:
        raise ValueError(f"tensor {name!r}: its rows of {shape[-1]} elements are not whole "
                         f"blocks of {block}")
    n_bytes = n_elements * type_size // block
    if start + n_bytes > len(mapped):
        raise ValueError(f"tensor {name!r}: its tensor data runs past the end of the file "
                         f"({start + n_bytes} > {len(mapped)} bytes)")
    plain = _PLAIN_TENSORS.get(type_id)
    if plain is not None:
        dtype, count = np.dtype(order + plain), n_elements
    else:
        dtype, count = np.dtype(np.uint8), n_bytes
        shape = (*shape[:-1], shape[-1] // block * type_size) if shape else shape
    data = np.frombuffer(mapped, dtype, count, start).reshape(shape)
    return HeaderTensor(name=name, tensor_type=type_id, shape=np.array(dims, np.uint64),
                        n_elements=n_elements, n_bytes=n_bytes, data_offset=start, data=data)
