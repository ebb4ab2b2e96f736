"""`jllama.formats.gguf_header` against the `gguf` package's GGUFReader (the reference): the
same metadata values (types included) and the same tensor views, for the real SmolLM2 file and
for files gguf's own writer makes with every value type, both byte orders."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from jllama.formats.gguf_header import BLOCK_SIZES, read_header

T = gguf.GGUFValueType


def reference(path):
    reader = gguf.GGUFReader(path, "r")
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, reader.tensors


def assert_same(path):
    meta, tensors = reference(path)
    header = read_header(path)
    assert list(header.metadata) == list(meta)
    for key, value in meta.items():
        ours = header.metadata[key]
        assert type(ours) is type(value) and ours == value, key
        if isinstance(value, list):
            assert [type(v) for v in ours] == [type(v) for v in value], key
    assert len(header.tensors) == len(tensors)
    for ours, ref in zip(header.tensors, tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.n_elements, ours.n_bytes, ours.data_offset) == (
            ref.name, ref.tensor_type, ref.n_elements, ref.n_bytes, ref.data_offset)
        assert ours.shape.tolist() == ref.shape.tolist()
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape
        assert np.array_equal(ours.data, ref.data, equal_nan=True)
        assert not ours.data.flags.writeable
    return header


def test_smollm2_as_ggufreader_reads_it(smollm2_gguf):
    header = assert_same(smollm2_gguf)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152


def write_every_type(path, endianess=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    scalars = [(T.UINT8, 255), (T.INT8, -128), (T.UINT16, 65535), (T.INT16, -32768),
               (T.UINT32, 2**32 - 1), (T.INT32, -(2**31)), (T.UINT64, 2**64 - 1),
               (T.INT64, -(2**63)), (T.FLOAT32, 0.1), (T.FLOAT64, 0.1), (T.BOOL, True),
               (T.STRING, "héllo ✓ \U0001F600")]
    for vtype, value in scalars:
        w.add_key_value(f"scalar.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"array.{vtype.name.lower()}", [value, value], T.ARRAY, vtype)
    w.add_key_value("array.bools", [True, False, True], T.ARRAY, T.BOOL)
    w.add_key_value("array.floats", [1.5, -0.0, float("inf")], T.ARRAY, T.FLOAT32)
    w.add_key_value("string.empty", "", T.STRING)
    w.add_key_value("array.strings", ["", "a", "Ġthe", "\n"], T.ARRAY, T.STRING)
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    # A type outside gguf_header's own table (its size comes from the gguf package).
    iq4 = rng.integers(0, 256, (2, 18), dtype=np.uint8)
    w.add_tensor("iq4_nl", iq4, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_kind(tmp_path, endianess):
    header = assert_same(write_every_type(tmp_path / "all.gguf", endianess))
    assert header.alignment == 64 and header.data_offset % 64 == 0
    assert header.metadata["scalar.uint64"] == 2**64 - 1


def nested_array_file(path):
    """A file with an array of arrays of u32 (GGUFWriter flattens nothing: written by hand)."""
    def s(text):
        return struct.pack("<Q", len(text)) + text.encode()

    value = struct.pack("<IQ", T.ARRAY, 2)
    for row in ([1, 2], [3]):
        value += struct.pack("<IQ", T.UINT32, len(row)) + struct.pack(f"<{len(row)}I", *row)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("nested") + struct.pack("<I", T.ARRAY)
    path.write_bytes(data + value)
    return path


def test_nested_arrays_are_refused_as_llama_cpp_does(tmp_path):
    """GGUFReader flattens an array of arrays ([1, 2, 3] here); ggml's gguf.cpp refuses it, and
    so does jllama (a token list nested in an array passed for a flat one)."""
    path = nested_array_file(tmp_path / "nested.gguf")
    assert reference(path)[0]["nested"] == [1, 2, 3]
    with pytest.raises(ValueError, match="metadata key 'nested': an array of arrays"):
        read_header(path)


@pytest.mark.parametrize("cut, needle", [
    (lambda d: d[:10], "runs past the end of the file"),
    (lambda d: d[:200], "runs past the end of the file"),
    (lambda d: d[:-100], "tensor data runs past the end of the file"),
    (lambda d: b"GGML" + d[4:], "no 'GGUF' magic"),
    (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "version 1 is not supported"),
])
def test_damaged_files_are_one_line_value_errors(tmp_path, cut, needle):
    data = write_every_type(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(cut(data))
    with pytest.raises(ValueError) as info:
        read_header(bad)
    assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(Exception):  # the reference refuses them too
        reference(bad)


def test_invalid_utf8_and_repeated_keys_are_refused(tmp_path):
    def s(raw: bytes):
        return struct.pack("<Q", len(raw)) + raw

    entry = s(b"k") + struct.pack("<I", T.STRING) + s(b"\xff\xfe")
    (tmp_path / "utf8.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry)
    with pytest.raises(ValueError, match="not UTF-8"):
        read_header(tmp_path / "utf8.gguf")
    twice = s(b"k") + struct.pack("<IB", T.UINT8, 1)
    (tmp_path / "twice.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + twice * 2)
    with pytest.raises(ValueError, match="'k' appears twice"):
        read_header(tmp_path / "twice.gguf")
    with pytest.raises(KeyError):  # GGUFReader refuses a repeated key as well
        reference(tmp_path / "twice.gguf")


def test_block_sizes_are_ggmls():
    assert {t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)] for t in BLOCK_SIZES} == \
        BLOCK_SIZES


def _three_tensors(path):
    """A file with tensors a (Q8_0, 2 x 64), b (F32, 3) and c (F16, 40), written by gguf's
    writer: a at 0, b at 160 (2 blocks of 34 bytes a row = 136, padded to 32), c at 192."""
    writer = gguf.GGUFWriter(str(path), "llama")
    q8 = gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # u8[2, 68]
    writer.add_tensor("b", np.arange(3, dtype=np.float32))
    writer.add_tensor("c", np.ones(40, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _patched(path, tmp_path, name, offset=None, type_id=None):
    """A copy of path with tensor `name`'s offset or type id replaced (located with GGUFReader,
    whose tensor field ends with the type id and the offset)."""
    reader = gguf.GGUFReader(str(path))
    field = next(t.field for t in reader.tensors if t.name == name)
    data = bytearray(path.read_bytes())
    end = field.offset + sum(p.nbytes for p in field.parts)  # just past the offset
    if offset is not None:
        data[end - 8:end] = struct.pack("<Q", offset)
    if type_id is not None:
        data[end - 12:end - 8] = struct.pack("<I", type_id)
    out = tmp_path / f"{name}-{offset}-{type_id}.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("name, offset, type_id, needle", [
    ("b", 2**64 - 1, None, "runs past the end of the file"),
    ("b", 0, None, "tensor 'b' has offset 0, expected 160"),  # on top of a
    ("c", 0, None, "tensor 'c' has offset 0, expected 192"),
    ("b", 164, None, "tensor 'b' has offset 164, expected 160"),  # not a multiple of 32
    # Q4_0 declared over a's Q8_0 bytes: a is 2 x 2 x 18 = 72 bytes, so b should be at 96.
    ("a", None, int(gguf.GGMLQuantizationType.Q4_0), "tensor 'b' has offset 160, expected 96"),
])
def test_misplaced_tensors_are_refused(tmp_path, name, offset, type_id, needle):
    good = _three_tensors(tmp_path / "good.gguf")
    assert [t.data_offset - read_header(good).data_offset for t in read_header(good).tensors] \
        == [0, 160, 192]
    with pytest.raises(ValueError) as info:
        read_header(_patched(good, tmp_path, name, offset, type_id))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_tensor_sizes_do_not_wrap(tmp_path):
    """dims 2^32 x 2^32 x 4 make 2^66 elements (0 in uint64): refused as past the end."""
    def s(text):
        return struct.pack("<Q", len(text)) + text.encode()

    info = s("t") + struct.pack("<I", 3) + struct.pack("<3Q", 2**32, 2**32, 4) + \
        struct.pack("<IQ", 0, 0)
    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + info
    path = tmp_path / "wrap.gguf"
    path.write_bytes(data + bytes(-len(data) % 32 + 64))
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_header(path)


def _strings_file(path, arrays: dict[str, list[str]]):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, values in arrays.items():
        w.add_key_value(key, values, T.ARRAY, T.STRING)
    w.add_key_value("after", 7, T.UINT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_long_string_arrays_read_at_once_or_one_by_one_are_ggufreaders(tmp_path):
    """Arrays of 256 strings and more are read with NumPy where they can be (no string holding
    a NUL or of 64 KiB or more), else one by one: each case here reads as GGUFReader reads
    it."""
    rng = np.random.default_rng(4)
    alphabet = list("abcĠ ✓\n") + ["\U0001F600", "é"]
    plain = ["".join(rng.choice(alphabet, rng.integers(1, 12))) for _ in range(700)]
    plain[5] = "x" * 256  # a length whose low byte is 0
    plain[6] = "y" * 300
    cases = {"plain": plain, "empty": plain[:300] + [""] + plain[300:],
             "nul": plain[:10] + ["a\x00b"] + plain[10:300],
             "long": plain[:300] + ["z" * 70000], "ends.long": plain[:299] + ["q" * 5000]}
    header = assert_same(_strings_file(tmp_path / "strings.gguf", cases))
    assert header.metadata["after"] == 7 and header.metadata["plain"] == plain


def test_long_string_arrays_that_are_not_utf8_or_cut_short_are_refused(tmp_path):
    good = _strings_file(tmp_path / "good.gguf", {"s": ["ab"] * 300}).read_bytes()
    at = good.index(struct.pack("<Q", 2) + b"ab")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[: at + 8] + b"\xff\xfe" + good[at + 10 :])
    with pytest.raises(ValueError, match="element 0, is not UTF-8"):
        read_header(bad)
    bad.write_bytes(good[: at + 2000])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_header(bad)
