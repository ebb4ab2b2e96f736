"""The fuzz harness's random mutations (bench/fuzz.py): a `Mutation`, byte damage, and a random
header field or JSON value set to a hostile value, with the helpers the crafted lies share.

Every random function draws from the `random.Random` it is given, so a case's damage depends
only on the number the plan drew for it, never on which cases ran before.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import struct
from pathlib import Path

from fuzz_seeds import Seed  # bench/ is the script's folder

U64_MAX = 2**64 - 1
INTERESTING = (0, 1, 2**7, 2**8 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 10**7,
               10**9, 2**40, 2**63 - 1, 2**63, U64_MAX)
"""Integers that break size arithmetic (AFL's idea): limits of each width, and huge counts."""


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One change to one file of a seed.

    Attributes:
      name: what was done, e.g. "bitflip@1234x3" or "gguf.array_count[tokenizer.ggml.tokens]=2^40".
      target: the file changed (a key of `Seed.files`).
      data: its new content; None leaves the file out.
      expect: "any" (random damage: a clean error or a run are both fine), "refuse" (a
        crafted lie: must be a clean error), "refuse_or_warn" (may run with a warning line), or
        "bounded" (may run, within the limits).
      touched: (start, end) ranges of the seed's file that changed (for "ran" reasons).
      unchanged: the mutation wrote what was there already (set when the case starts).
    """

    name: str
    target: str
    data: bytes | None
    expect: str = "any"
    touched: tuple[tuple[int, int], ...] = ()
    unchanged: bool = False  # set when the case starts: the bytes are the seed's


def pow_name(n: int) -> str:
    """2^40 for 2**40, 10^7 for 10**7, 2^64-1 for 2**64 - 1: the interesting numbers named."""
    if n <= 1000:
        return str(n)
    for base in (2, 10):
        e = round(math.log(n, base))
        if base**e == n:
            return f"{base}^{e}"
    e = n.bit_length()
    return f"2^{e}-{2**e - n}" if 2**e - n < 1000 else str(n)


def bitflip(rng: random.Random, data: bytes, at: int) -> tuple[str, bytes, tuple]:
    """1 to 8 bits flipped within 8 bytes of `at`."""
    buf = bytearray(data)
    flips = rng.randint(1, 8)
    for _ in range(flips):
        buf[min(len(buf) - 1, at + rng.randrange(8))] ^= 1 << rng.randrange(8)
    return f"bitflip@{at}x{flips}", bytes(buf), ((at, at + 8),)


def truncate(rng: random.Random, data: bytes, at: int) -> tuple[str, bytes, tuple]:
    """The file cut at `at` (a download that stopped)."""
    return f"truncate@{at}", data[:at], ((at, len(data)),)


def insert(rng: random.Random, data: bytes, at: int) -> tuple[str, bytes, tuple]:
    """1 to 64 random bytes inserted at `at` (everything after them shifts)."""
    n = rng.randint(1, 64)
    return f"insert@{at}+{n}", data[:at] + rng.randbytes(n) + data[at:], ((at, len(data)),)


def delete(rng: random.Random, data: bytes, at: int) -> tuple[str, bytes, tuple]:
    """1 to 64 bytes deleted at `at` (everything after them shifts)."""
    n = rng.randint(1, 64)
    return f"delete@{at}-{n}", data[:at] + data[at + n:], ((at, len(data)),)


def interesting_int(rng: random.Random, data: bytes, at: int) -> tuple[str, bytes, tuple]:
    """An interesting integer written as a little-endian u32 or u64 over the 4-byte-aligned
    word at or before `at` (headers are mostly such words)."""
    value, width = rng.choice(INTERESTING), rng.choice((4, 8))
    value &= (1 << (8 * width)) - 1
    at -= at % 4
    buf = bytearray(data)
    buf[at:at + width] = value.to_bytes(width, "little")[: len(buf) - at]
    return f"int{8 * width}@{at}={pow_name(value)}", bytes(buf), ((at, at + width),)


BYTE_MUTATORS = (bitflip, bitflip, truncate, insert, delete, interesting_int, interesting_int)


def random_damage(rng: random.Random, seed: Seed, target: str) -> Mutation:
    """One random byte mutation of `target`, at a spot in its header half the time (a few
    hundred header bytes would otherwise be hit once in a thousand)."""
    data = seed.files[target]
    header_end = _header_end(seed, target)
    at = rng.randrange(header_end if rng.random() < 0.5 else len(data))
    name, new, touched = rng.choice(BYTE_MUTATORS)(rng, data, at)
    return Mutation(name, target, new, "any", touched)


def _header_end(seed: Seed, target: str) -> int:
    """Where a file's header ends: before the first tensor data (the whole file if none)."""
    starts = [s for s, _, label in seed.regions[target]
              if label.startswith(("tensor data", "weights"))]
    return min(starts, default=len(seed.files[target]))


# ----------------------------------------------------------------------- shared by the lies


def patch(data: bytes, at: int, fmt: str, value) -> bytes:
    """`data` with `value` packed by struct format `fmt` at byte `at` (a header field lied
    about, in any of the formats)."""
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


DEEP = 10**5
HUGE_DIGITS = "1" + "0" * 4999
"""A 5,000-digit integer: Python's json refuses ints over 4,300 digits (ValueError)."""


def deep(n: int = DEEP) -> str:
    """JSON text of lists nested `n` deep."""
    return "[" * n + "]" * n


def safetensors_edit(data: bytes, name: str | None = None, change=None,
             raw: tuple[str, str] | None = None) -> bytes:
    """A safetensors file with one header entry changed (or a raw JSON entry added first),
    the header re-padded to 8 bytes and its length rewritten; the data stays as it is."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    if change == "overlap":
        change = {"data_offsets": header["model.norm.weight"]["data_offsets"]}
    if name is not None:
        header[name] = dict(header[name], **change)
    text = json.dumps(header)
    if raw is not None:
        key, value = raw
        header.pop(key, None)
        text = "{" + json.dumps(key) + ": " + value + ", " + json.dumps(header)[1:]
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + body


# --------------------------------------------------------------------- random header fields


def json_value_lie(rng: random.Random, seed: Seed, target: str) -> Mutation:
    """A random value somewhere in a JSON file replaced by a hostile one."""
    doc = json.loads(seed.files[target])
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        if isinstance(node[key], (dict, list)):
            node = node[key]
        else:
            break
    raw = rng.choice(["1e999", "-1e999", "NaN", "-1", "0", str(2**63), str(10**12), '""', "[]",
                      "{}", "null", "true", '"x"', HUGE_DIGITS, deep(rng.choice((50, DEEP)))])
    marker = "\u0000FUZZ\u0000"
    copy_ = copy.deepcopy(doc)
    node = copy_
    for key in path[:-1]:
        node = node[key]
    if path:
        node[path[-1]] = marker
        text = json.dumps(copy_, ensure_ascii=False).replace(json.dumps(marker), raw, 1)
    else:
        text = raw
    where = ".".join(str(p) for p in path) or "document"
    return Mutation(f"json.value[{Path(target).name} {where}]={raw[:12]}", target, text.encode())


FLOAT_BITS = tuple(struct.unpack("<I", struct.pack("<f", v))[0]
                   for v in (math.inf, -math.inf, math.nan, 0.0, -1.0, 3.4e38, 1e-45))
"""float32 values as their bits, for a 4-byte field that may be a float."""


def gguf_field_lie(rng: random.Random, seed: Seed) -> Mutation:
    """A random 4- or 8-byte word of a random metadata entry or tensor info (a length, a type,
    a count, a value, a dim, an offset) set to an interesting value."""
    lay = seed.layout
    fields = [(f"metadata {k}", p) for k, p in lay.kv.items()]
    fields += [(f"tensor info {k}", p) for k, p in lay.tensors.items()]
    label, parts = rng.choice(fields)
    words = [(i, at + w, width) for i, (at, n) in enumerate(parts) if n <= 64
             for width in ((8,) if n % 8 == 0 else (4,) if n % 4 == 0 else ())
             for w in range(0, n, width)]
    i, at, width = rng.choice(words)
    value = rng.choice(INTERESTING + (FLOAT_BITS if width == 4 else ())) % (1 << 8 * width)
    data = bytearray(seed.files["model.gguf"])
    data[at:at + width] = value.to_bytes(width, "little")
    return Mutation(f"gguf.field[{label} part {i} @{at}]={pow_name(value)}", "model.gguf",
                    bytes(data), "any", ((at, at + width),))


def llama2c_field_lie(rng: random.Random, seed: Seed) -> Mutation:
    """A random int32 of a llama2.c header (the 7 sizes; version 2 also its version and
    group_size) set to an interesting value."""
    version = int(seed.name[-1])
    base = 0 if version == 0 else 8
    offsets = [base + 4 * i for i in range(7)] + ([4, 37] if version == 2 else [])
    at = rng.choice(offsets)
    value = rng.choice((-1, 0, 1, 2, 3, 7, 2**16, 2**20, 2**24, 2**31 - 1, -2**31))
    data = patch(seed.files["model.bin"], at, "<i", value)
    return Mutation(f"llama2c.field[@{at}]={value}", "model.bin", data, "any",
                    ((at, at + 4),))


def safetensors_entry_lie(rng: random.Random, seed: Seed) -> Mutation:
    """A random tensor's dtype, shape or data_offsets in the safetensors header set to a
    hostile value."""
    target = "hf/model.safetensors"
    data = seed.files[target]
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    key = rng.choice(("dtype", "shape", "data_offsets"))
    hostile = {
        "dtype": ["F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "", 0, None],
        "shape": [[], [0], [-1], [2**40], [2**63, 2], [1] * 64, "64", [64.5, 64], None],
        "data_offsets": [[0, 0], [0, 2**64], [-8, 8], [1, 5], [0], "0,4", None],
    }[key]
    value = rng.choice(hostile)
    return Mutation(f"safetensors.entry[{name}.{key}]={json.dumps(value)[:24]}", target,
                    safetensors_edit(data, name=name, change={key: value}), "any", ((8, 8 + n),))
