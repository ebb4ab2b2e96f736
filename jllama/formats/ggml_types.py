"""GGML tensor types: their ids, names and block sizes (what a GGUF tensor's bytes hold is
`jllama.formats.ggml_quants`' business).

A GGUF file stores each tensor as rows of its innermost dimension, each row a run of blocks of
a fixed number of elements in a fixed number of bytes (ggml's `block_*` structs, ggml-common.h;
the type traits' `blck_size` and `type_size`).
"""

from __future__ import annotations

from jllama.errors import CheckpointError

# Type ids of ggml's `enum ggml_type`, as stored in a GGUF tensor-info record.
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14

# The names of every id in ggml's `enum ggml_type` (gaps are ids ggml has retired), so an error
# can name a type this module does not read.
_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}

BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}
"""type id -> (elements per block, bytes per block), for the types `ggml_quants.dequantize`
reads."""

SUPPORTED: frozenset[int] = frozenset(BLOCK_SIZES)
_SUPPORTED_LIST = ", ".join(_TYPE_NAMES[t] for t in BLOCK_SIZES)


def type_name(type_id: int) -> str:
    """The ggml name of a type id, e.g. 14 -> "Q6_K"; "type <id>" for an id ggml does not have."""
    return _TYPE_NAMES.get(type_id, f"type {type_id}")


def _describe(type_id: int) -> str:
    if type_id in _TYPE_NAMES:
        return f"{_TYPE_NAMES[type_id]} (type {type_id})"
    return f"type {type_id} (not a ggml type)"


def block_layout(type_id: int) -> tuple[int, int]:
    """(elements, bytes) per block of a type `dequantize` reads, e.g. Q4_K -> (256, 144); a
    row of n elements (n a multiple of the first) takes n // elements * bytes bytes.

    Raises:
      CheckpointError: `type_id` is not in `SUPPORTED` (the one-line message names the type
        and lists the supported ones).
    """
    try:
        return BLOCK_SIZES[type_id]
    except (KeyError, TypeError):
        raise CheckpointError(
            f"{_describe(type_id)} is not supported; supported: {_SUPPORTED_LIST}"
        ) from None


def row_nbytes(type_id: int, cols: int) -> int:
    """Bytes of one row of `cols` elements of type `type_id`.

    Raises:
      CheckpointError: an unsupported type, a negative `cols`, or `cols` not a multiple of the
        type's block size.
    """
    block, nbytes = block_layout(type_id)
    if cols < 0:
        raise CheckpointError(f"{type_name(type_id)} row of {cols} elements: negative length")
    if cols % block:
        raise CheckpointError(
            f"{type_name(type_id)} rows of {cols} elements: not a multiple of the block size "
            f"{block}"
        )
    return cols // block * nbytes
