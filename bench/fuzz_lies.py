"""The fuzz harness's crafted lies (bench/fuzz.py): per format, the header values a hostile file
would hold (counts and lengths past the file's end, offsets of 2^64-1, wrong types, deep and huge
JSON, non-finite hyperparameters, ...).

A lie is (name, apply(data) -> data, expectation); the Hugging Face ones also name the file they
change. None draws a random number, so every run holds the same lies.

Issue 33's float32 lies: numbers finite as float64 but not in float32, where the forward pass
computes (an RMS epsilon or RoPE base of 1e300 or 1e308 stored as FLOAT64, a RoPE factor of
1e-300, rope_freqs of 1e-45, a llama2.c group scale of 3e38), and values the formulas cannot
take (a negative epsilon, a base of 1, llama3 factors equal in float32): each refused in one
line. And K-quant lies: an f16 d or dmin of inf or NaN in a Q4_K / Q6_K block of a real
llama.cpp Q4_K_M file (tests/data/llama32_tiny). Those are not looked for at load (llama.cpp
runs them too, unless --check-tensors; scanning every block would read the whole file): the
weights turn inf/NaN, the logits do, and the generator refuses them in one line; "refuse"
holds them to that, with no NumPy warning on the way.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator

import gguf

from fuzz_mutations import (  # bench/ is the script's folder
    HUGE_DIGITS, U64_MAX, deep, patch, pow_name, safetensors_edit)
from fuzz_seeds import REPO, GGUFLayout, Seed, tiny_config

KQUANT_FILE = REPO / "tests" / "data" / "llama32_tiny" / "llama32-tiny-Q4_K_M.gguf"
"""A Q4_K_M file llama.cpp's llama-quantize wrote (the GGUF seed's rows of 64 cannot hold
256-element K-quant blocks): Q4_K and Q6_K tensors, and a rope_freqs tensor."""


# --- GGUF lies ---


def gguf_splice(data: bytes, lay: GGUFLayout, at: int, remove: int, add: bytes) -> bytes:
    """`remove` header bytes at `at` replaced by `add`, the padding before the data section
    redone so the tensors' data stays where their offsets say (offsets count from the start
    of the data section, which is the end of the tensor infos rounded up to the alignment)."""
    info_end = lay.info_end - remove + len(add)
    padding = -info_end % lay.alignment
    head = data[:at] + add + data[at + remove:lay.info_end]
    return head + bytes(padding) + data[lay.data_offset:]


def gguf_lies(seed: Seed) -> Iterator[tuple[str, Callable[[bytes], bytes], str]]:
    """Crafted GGUF header lies: (name, apply(data) -> data, expectation)."""
    lay = seed.layout
    kv, tensors = lay.kv, lay.tensors
    names = list(tensors)
    big_counts = (10**7, 2**40, U64_MAX)

    # Class 1: arrays declaring more items than the file holds (the count is the 5th part).
    extra_key = "fuzz.u8"
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                extra_key):
        for count in big_counts:
            if key == extra_key:
                def apply(d, count=count):
                    return gguf_add_u8_array(d, lay, extra_key, count)
            else:
                def apply(d, at=kv[key][4][0], count=count):
                    return patch(d, at, "<Q", count)
            yield f"gguf.array_count[{key}]={pow_name(count)}", apply, "refuse"

    # Strings declaring more bytes than the file holds.
    strings = {"general.architecture value": kv["general.architecture"][3][0],
               "tokenizer.chat_template value": kv["tokenizer.chat_template"][3][0],
               "key of llama.block_count": kv["llama.block_count"][0][0],
               "tokenizer.ggml.tokens[100]": kv["tokenizer.ggml.tokens"][5 + 2 * 100][0],
               f"name of tensor {names[-1]}": tensors[names[-1]][0][0]}
    for what, at in strings.items():
        for length in (10**7, 2**40, 2**63, U64_MAX):
            yield (f"gguf.string_length[{what}]={pow_name(length)}",
                   lambda d, at=at, n=length: patch(d, at, "<Q", n), "refuse")

    # Class 3: tensor placement.
    def offset_at(name):
        return tensors[name][5][0]

    for which in (names[0], names[-1]):
        for offset in (U64_MAX, 2**63, U64_MAX - 31):
            yield (f"gguf.tensor_offset[{which}]={pow_name(offset)}",
                   lambda d, at=offset_at(which), v=offset: patch(d, at, "<Q", v),
                   "refuse")

    def all_at_zero(d):
        for name in names:
            d = patch(d, offset_at(name), "<Q", 0)
        return d

    yield "gguf.tensor_overlap[all tensors at offset 0]", all_at_zero, "refuse"

    def second_on_first(d):
        (first,) = struct.unpack_from("<Q", d, offset_at(names[3]))
        return patch(d, offset_at(names[4]), "<Q", first)

    yield f"gguf.tensor_overlap[{names[4]} at {names[3]}'s offset]", second_on_first, "refuse"
    for shift in (1, 4, 16):
        def misalign(d, shift=shift, at=offset_at(names[5])):
            (offset,) = struct.unpack_from("<Q", d, at)
            return patch(d, at, "<Q", offset + shift)

        yield f"gguf.tensor_misaligned[{names[5]}]+{shift}", misalign, "refuse"

    # A type id over bytes sized for another type (F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8,
    # Q4_K = 12; 4 was Q4_2, removed; 1000 is none).
    q8 = next(n for n, t in lay.tensor_types.items() if t == 8)
    f32 = "blk.0.attn_q.weight"
    for name, new in ((f32, 8), (f32, 2), (f32, 1), (f32, 12), (q8, 0), (q8, 2), (f32, 4),
                      (f32, 1000)):
        yield (f"gguf.tensor_type[{name}: {lay.tensor_types[name]} -> {new}]",
               lambda d, at=tensors[name][4][0], v=new: patch(d, at, "<I", v),
               "refuse")

    # Dims and n_dims.
    for dim in (0, 2**32, 2**40, 2**63, U64_MAX):
        yield (f"gguf.tensor_dim[{f32} ne0]={pow_name(dim)}",
               lambda d, at=tensors[f32][3][0], v=dim: patch(d, at, "<Q", v), "refuse")
    for n_dims in (0, 5, 2**31):
        yield (f"gguf.tensor_n_dims[{f32}]={pow_name(n_dims)}",
               lambda d, at=tensors[f32][2][0], v=n_dims: patch(d, at, "<I", v),
               "refuse")

    # Header counts.
    for field, at in (("tensor_count", 8), ("kv_count", 16)):
        for count in (2**40, U64_MAX):
            yield (f"gguf.{field}={pow_name(count)}",
                   lambda d, at=at, v=count: patch(d, at, "<Q", v), "refuse")

    # Class 6: non-finite float metadata (the value is the 4th part).
    for key in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
        for value in (math.inf, -math.inf, math.nan):
            yield (f"gguf.float[{key}]={value}",
                   lambda d, at=kv[key][3][0], v=value: patch(d, at, "<f", v), "refuse")

    # Sizes: a 4M and a 2^31 context are class 4 (bounded); the others contradict the tensors.
    for value in (2**22, 2**31):
        yield (f"gguf.uint[llama.context_length]={pow_name(value)}",
               lambda d, v=value: patch(d, kv["llama.context_length"][3][0], "<I", v),
               "bounded")
    for key, value in (("llama.embedding_length", 2**31), ("llama.block_count", 2**32 - 1),
                       ("llama.attention.head_count", 0), ("llama.vocab_size", 2**31),
                       ("llama.feed_forward_length", 2**32 - 1),
                       ("tokenizer.ggml.bos_token_id", 2**32 - 1)):
        yield (f"gguf.uint[{key}]={pow_name(value)}",
               lambda d, at=kv[key][3][0], v=value: patch(d, at, "<I", v), "refuse")

    # Issue 33: float32 values. A FLOAT32 entry rewritten as FLOAT64 (finite there, inf in
    # float32), float32 values the formulas cannot take, a linear factor added as FLOAT64,
    # and a rope_freqs tensor added.
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        for value in (1e300, 1e308):
            yield (f"gguf.float64[{key}]={value:g}",
                   lambda d, k=key, v=value: gguf_as_float64(d, lay, k, v), "refuse")
    for key, value in (("llama.attention.layer_norm_rms_epsilon", -1e-5),
                       ("llama.rope.freq_base", 1.0)):
        yield (f"gguf.float[{key}]={value:g}",
               lambda d, at=kv[key][3][0], v=value: patch(d, at, "<f", v), "refuse")
    yield ("gguf.float64[llama.rope.scaling.factor]=1e-300",
           lambda d: gguf_add_entry(d, lay, "llama.rope.scaling.factor",
                                    struct.pack("<Id", gguf.GGUFValueType.FLOAT64, 1e-300)),
           "refuse")
    yield "gguf.rope_freqs=1e-45", lambda d: gguf_add_rope_freqs(d, lay, 1e-45), "refuse"
    # K-quant blocks with an f16 scale of inf or NaN (byte offsets of d / dmin in the block).
    for tensor, at, name, bits in (("blk.0.attn_q.weight", 0, "Q4_K d", 0x7C00),
                                   ("blk.0.attn_q.weight", 2, "Q4_K dmin", 0x7C00),
                                   ("blk.1.ffn_down.weight", 208, "Q6_K d", 0x7E00)):
        value = "inf" if bits == 0x7C00 else "nan"
        yield (f"gguf.kquant[{tensor} block 0 {name}]={value}",
               lambda d, t=tensor, at=at, b=bits: kquant_scale(t, at, b), "refuse")

    # Weights that are not numbers: the file is well formed; what jllama does is recorded.
    for value in (math.nan, math.inf):
        at = tensors[f32][5][0]
        yield (f"gguf.weight[{f32}][0]={value}",
               lambda d, v=value: patch(
                   d, lay.data_offset + struct.unpack_from("<Q", d, at)[0], "<f", v), "any")

    # A value type that does not exist, and (class 7) the token list nested in an array.
    yield ("gguf.value_type[llama.block_count]=13",
           lambda d: patch(d, kv["llama.block_count"][2][0], "<I", 13), "refuse")
    yield "gguf.nested_array[tokenizer.ggml.tokens]", lambda d: gguf_nest_tokens(d, lay), \
        "refuse"


def gguf_add_u8_array(data: bytes, lay: GGUFLayout, key: str, count: int,
                      present: int = 10) -> bytes:
    """A new metadata entry: a uint8 array declaring `count` items with `present` there (the
    issue's 1 KB file that took minutes), added after the last entry with kv_count + 1."""
    value = (struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8, count)
             + bytes(range(present)))
    return gguf_add_entry(data, lay, key, value)


def gguf_add_entry(data: bytes, lay: GGUFLayout, key: str, value: bytes) -> bytes:
    """A new metadata entry `key` (value: its u32 type and the value's bytes), added after the
    last entry with kv_count + 1."""
    raw = key.encode()
    entry = struct.pack("<Q", len(raw)) + raw + value
    last_kv_end = max(o + n for parts in lay.kv.values() for o, n in parts[-1:])
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    data = patch(data, 16, "<Q", n_kv + 1)
    return gguf_splice(data, lay, last_kv_end, 0, entry)


def gguf_as_float64(data: bytes, lay: GGUFLayout, key: str, value: float) -> bytes:
    """The FLOAT32 entry `key` rewritten as a FLOAT64 holding `value` (a type and 8 bytes in
    place of a type and 4; GGUF allows FLOAT64 for any value)."""
    (type_at, _), (value_at, _) = lay.kv[key][2], lay.kv[key][3]
    return gguf_splice(data, lay, type_at, value_at + 4 - type_at,
                       struct.pack("<Id", gguf.GGUFValueType.FLOAT64, value))


def gguf_add_rope_freqs(data: bytes, lay: GGUFLayout, value: float) -> bytes:
    """A rope_freqs.weight tensor of head_dim / 2 factors all `value` (F32), added after the
    last tensor as llama.cpp's converter adds Llama 3.1's: its info after the last info
    (tensor_count + 1), its data at the end of the data section (each tensor starts at the
    previous end, aligned)."""
    (head_dim,) = struct.unpack_from("<I", data, lay.kv["llama.attention.key_length"][3][0])
    values = [value] * (head_dim // 2)
    name = b"rope_freqs.weight"
    section = len(data) - lay.data_offset
    offset = -(-section // lay.alignment) * lay.alignment
    info = (struct.pack("<Q", len(name)) + name
            + struct.pack("<IQIQ", 1, len(values), gguf.GGMLQuantizationType.F32, offset))
    (n_tensors,) = struct.unpack_from("<Q", data, 8)
    data = gguf_splice(patch(data, 8, "<Q", n_tensors + 1), lay, lay.info_end, 0, info)
    return data + bytes(offset - section) + struct.pack(f"<{len(values)}f", *values)


def kquant_scale(tensor: str, at: int, bits: int) -> bytes:
    """KQUANT_FILE with the f16 at byte `at` of `tensor`'s first block set to `bits`."""
    from jllama.formats.gguf_header import read_header

    start = next(t.data_offset for t in read_header(KQUANT_FILE).tensors if t.name == tensor)
    return patch(KQUANT_FILE.read_bytes(), start + at, "<H", bits)


def gguf_nest_tokens(data: bytes, lay: GGUFLayout) -> bytes:
    """tokenizer.ggml.tokens stored as an array holding one array of the strings (valid GGUF
    syntax, which gguf's reader flattens; not a token list)."""
    parts = lay.kv["tokenizer.ggml.tokens"]
    at = parts[3][0]  # item type (u32) and count (u64)
    (count,) = struct.unpack_from("<Q", data, parts[4][0])
    outer = struct.pack("<IQ", gguf.GGUFValueType.ARRAY, 1)
    inner = struct.pack("<IQ", gguf.GGUFValueType.STRING, count)
    return gguf_splice(data, lay, at, 12, outer + inner)


# --- llama2.c lies ---


def llama2c_lies(seed: Seed) -> Iterator[tuple[str, Callable, str]]:
    """Header fields of a llama2.c checkpoint set to zero, negative and huge values."""
    version = int(seed.name[-1])
    base = 0 if version == 0 else 8
    fields = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    for i, field in enumerate(fields):
        for value in (0, -1, -2**31, 2**31 - 1):
            yield (f"llama2c.header[{field}]={value}",
                   lambda d, at=base + 4 * i, v=value: patch(d, at, "<i", v), "refuse")
    # Class 4: a 4M-token context and no RoPE tables to contradict it (version 2) is a valid
    # file whose KV cache would be 2 GB.
    if version == 2:
        yield ("llama2c.header[seq_len]=2^22",
               lambda d: patch(d, base + 24, "<i", 2**22), "bounded")
        for value in (0, -1, 7, 2**31 - 1):
            yield (f"llama2c.header[group_size]={value}",
                   lambda d, v=value: patch(d, 37, "<i", v), "refuse")
        for value in (3, -1):
            yield (f"llama2c.header[version]={value}",
                   lambda d, v=value: patch(d, 4, "<i", v), "refuse")
        # Issue 33: the first group scale of the first Q8_0 tensor (the embedding, after the
        # three norms) at 3e38, finite in float32 but not times an int8 of 127, and NaN.
        config = tiny_config(512)
        norms = (2 * config.n_layers + 1) * config.dim
        first_scale = 256 + 4 * norms + config.vocab_size * config.dim
        for value in (3e38, math.nan):
            yield (f"llama2c.group_scale[token_embedding_table 0]={value:g}",
                   lambda d, v=value: patch(d, first_scale, "<f", v), "refuse")


def tokenizer_bin_lies(seed: Seed) -> Iterator[tuple[str, Callable, str]]:
    """tokenizer.bin's max_token_length and one token's length and score lied about."""
    regions = seed.regions["tokenizer.bin"]
    lengths = [s for s, _, label in regions if label == "token length"]
    scores = [s for s, _, label in regions if label == "token score"]
    for value in (0, -1, -2**31):
        yield (f"tokenizer_bin.max_token_length={value}",
               lambda d, v=value: patch(d, 0, "<i", v), "refuse")
    yield ("tokenizer_bin.max_token_length=2^31-1",
           lambda d: patch(d, 0, "<i", 2**31 - 1), "bounded")
    for token in (0, 300):
        for value in (-1, 2**31 - 1, 10**6):
            yield (f"tokenizer_bin.token_length[{token}]={value}",
                   lambda d, at=lengths[token], v=value: patch(d, at, "<i", v),
                   "refuse")
    for value in (math.inf, math.nan):
        yield (f"tokenizer_bin.score[300]={value}",
               lambda d, v=value: patch(d, scores[300], "<f", v), "bounded")
    yield ("tokenizer_bin.extra_token",
           lambda d: d + struct.pack("<fi", 0.0, 2) + b"zz", "refuse")


# --- JSON lies (Hugging Face) ---


def json_with(data: bytes, key: str, raw_value: str) -> bytes:
    """A JSON object's text with `key` set to `raw_value` (JSON text, e.g. "1e999" or a
    10^5-deep list), written as the first entry so nothing else moves."""
    obj = json.loads(data)
    obj.pop(key, None)
    rest = json.dumps(obj, ensure_ascii=False)[1:]
    sep = ", " if rest.strip() != "}" else ""
    return ("{" + json.dumps(key) + ": " + raw_value + sep + rest).encode()


def config_lies(seed: Seed) -> Iterator[tuple[str, Callable, str, str]]:
    """config.json: deep and huge JSON, non-finite and out-of-range hyperparameters."""
    t = "hf/config.json"
    yield t, "json.deep[config.json fuzz]", lambda d: json_with(d, "fuzz", deep()), "refuse"
    yield t, "json.deep[config.json document]", lambda d: deep().encode(), "refuse"
    for key in ("vocab_size", "fuzz"):
        yield (t, f"json.huge_int[config.json {key}]",
               lambda d, k=key: json_with(d, k, HUGE_DIGITS), "refuse")
    for key in ("rms_norm_eps", "rope_theta"):
        for raw in ("1e999", "-1e999", "NaN"):
            yield (t, f"json.value[config.json {key}]={raw}",
                   lambda d, k=key, v=raw: json_with(d, k, v), "refuse")
    # Issue 33: finite as float64, not as float32 (or 0 there), and llama3 factors that are
    # equal in float32 (transformers divides by high_freq_factor - low_freq_factor).
    for key, raw in (("rms_norm_eps", "1e300"), ("rope_theta", "1e308"),
                     ("rope_scaling", '{"rope_type": "linear", "factor": 1e-300}'),
                     ("rope_scaling", '{"rope_type": "llama3", "factor": 8.0, '
                      '"low_freq_factor": 1.0, "high_freq_factor": 1.00000001, '
                      '"original_max_position_embeddings": 64}')):
        yield (t, f"json.float32[config.json {key}]={raw}",
               lambda d, k=key, v=raw: json_with(d, k, v), "refuse")
    yield (t, "json.value[config.json max_position_embeddings]=2^22",
           lambda d: json_with(d, "max_position_embeddings", str(2**22)), "bounded")
    for key, raw in (("hidden_size", str(2**40)), ("num_hidden_layers", str(10**9)),
                     ("vocab_size", str(10**12)), ("intermediate_size", "-1"),
                     ("num_attention_heads", "0"), ("num_key_value_heads", "3"),
                     ("hidden_size", "64.5"), ("vocab_size", '"300"')):
        yield (t, f"json.value[config.json {key}]={raw}",
               lambda d, k=key, v=raw: json_with(d, k, v), "refuse")
    yield ("hf/tokenizer_config.json", "json.deep[tokenizer_config.json fuzz]",
           lambda d: json_with(d, "fuzz", deep()), "refuse")


def tokenizer_json_lies(seed: Seed) -> Iterator[tuple[str, Callable, str, str]]:
    """tokenizer.json: ids far beyond the vocabulary (class 2), deep and huge JSON, no
    single-byte tokens (class 7)."""
    t = "hf/tokenizer.json"
    # 2^20 + 299: the largest id jllama lets a 300-token file name today (MAX_UNNAMED_IDS).
    for id_ in (10**6, 2**20 + 299, 10**7, 10**9, 10**12, -1):
        yield t, f"tokenizer_json.vocab_id={pow_name(id_) if id_ > 0 else id_}", \
            (lambda d, i=id_: _edit_tokenizer(d, vocab_id=i)), "refuse"
        yield t, f"tokenizer_json.added_token_id={pow_name(id_) if id_ > 0 else id_}", \
            (lambda d, i=id_: _edit_tokenizer(d, added_id=i)), "refuse"
    yield t, "json.deep[tokenizer.json fuzz]", lambda d: json_with(d, "fuzz", deep()), "refuse"
    yield t, "json.deep[tokenizer.json model.vocab value]", \
        (lambda d: _edit_tokenizer(d, vocab_raw=deep())), "refuse"
    yield t, "json.huge_int[tokenizer.json model.vocab value]", \
        (lambda d: _edit_tokenizer(d, vocab_raw=HUGE_DIGITS)), "refuse"
    yield t, "tokenizer_json.no_byte_tokens", lambda d: _without_byte_tokens(d), \
        "refuse_or_warn"
    yield t, "tokenizer_json.no_byte_tokens[',' '!']", \
        (lambda d: _without_byte_tokens(d, drop=",!")), "refuse_or_warn"


def _edit_tokenizer(data: bytes, vocab_id: int | None = None, added_id: int | None = None,
                    vocab_raw: str | None = None) -> bytes:
    """tokenizer.json with one vocab entry's id (or raw JSON value) or the first added token's
    id changed."""
    tok = json.loads(data)
    if vocab_id is not None:
        tok["model"]["vocab"]["Ġth"] = vocab_id
    if added_id is not None:
        tok["added_tokens"][0]["id"] = added_id
    text = json.dumps(tok, ensure_ascii=False)
    if vocab_raw is not None:
        text = text.replace('"Ġth": ' + str(tok["model"]["vocab"]["Ġth"]), '"Ġth": ' + vocab_raw)
    return text.encode()


def _without_byte_tokens(data: bytes, drop: str | None = None) -> bytes:
    """tokenizer.json without single-byte tokens: all of them (and so no merges), or those of
    the characters in `drop` (PROMPT's punctuation): a prompt has text the vocabulary cannot
    spell."""
    tok = json.loads(data)
    vocab = tok["model"]["vocab"]
    kept = [t for t in sorted(vocab, key=vocab.get)
            if (t not in drop if drop is not None else len(t) > 1)]
    tok["model"]["vocab"] = {t: i for i, t in enumerate(kept)}
    if drop is None:
        tok["model"]["merges"] = []
    for i, added in enumerate(tok["added_tokens"]):
        added["id"] = len(kept) + i
    return json.dumps(tok, ensure_ascii=False).encode()


def safetensors_lies(seed: Seed) -> Iterator[tuple[str, Callable, str, str]]:
    """model.safetensors: header length, JSON, offsets, shapes and dtypes lied about."""
    t = "hf/model.safetensors"
    for n in (0, 1, 10**9, 2**63, U64_MAX):
        yield t, f"safetensors.header_length={pow_name(n)}", \
            (lambda d, n=n: patch(d, 0, "<Q", n)), "refuse"
    yield t, "json.deep[safetensors header fuzz]", \
        (lambda d: safetensors_edit(d, raw=("fuzz", deep()))), "refuse"
    yield t, "json.huge_int[safetensors data_offsets]", \
        (lambda d: safetensors_edit(d, raw=("model.norm.weight", '{"dtype": "F32", "shape": [64], '
                                       f'"data_offsets": [0, {HUGE_DIGITS}]}}'))), "refuse"
    name = "model.layers.0.self_attn.q_proj.weight"
    edits = {
        "data_offsets past the end": {"data_offsets": [0, 2**40]},
        "data_offsets reversed": {"data_offsets": [16384, 0]},
        "data_offsets overlapping model.norm": "overlap",
        "shape huge": {"shape": [2**40, 64]},
        "shape negative": {"shape": [-64, -64]},
        "shape too small": {"shape": [32, 64]},
        "dtype F16": {"dtype": "F16"},
        "dtype BF16": {"dtype": "BF16"},
        "dtype I64": {"dtype": "I64"},
        "dtype unknown": {"dtype": "Q9"},
    }
    for what, change in edits.items():
        yield t, f"safetensors.tensor[{name}: {what}]", \
            (lambda d, c=change: safetensors_edit(d, name=name, change=c)), "refuse"
