"""Tests of jllama.tokenizers.llama2c against independent references.

References:
  - tests/data/encode_llama2c.json: ids produced by llama2.c's own run.c `encode(text, 1, 0)`
    for tokenizer.bin (Llama 2, 32000 tokens) and tok512.bin (stories260K, 512 tokens);
  - `reference_encode` below: a plain transcription of run.c's quadratic encode loop over a
    vocabulary parsed here with `struct`, independently of the module under test;
  - hand-computed UTF-8 bytes for the decoding checks.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jllama.errors import TokenizerError
from jllama.tokenizers import llama2c
from jllama.tokenizers.llama2c import BOS_ID, EOS_ID, Tokenizer, read_tokenizer

TESTS_DATA = Path(__file__).resolve().parent / "data"
PACKAGE_DATA = Path(llama2c.__file__).resolve().parents[1] / "data"
VOCAB_FILES = {
    "tokenizer.bin": TESTS_DATA / "tokenizer.bin",
    "tok512.bin": PACKAGE_DATA / "tok512.bin",
}
VOCAB_SIZES = {"tokenizer.bin": 32000, "tok512.bin": 512}
ORACLE = json.loads((TESTS_DATA / "encode_llama2c.json").read_text(encoding="utf-8"))["cases"]


def _case_id(name: str, index: int, text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", text[:20]).strip("_") or "nonascii"
    return f"{name}-{index:02d}-{slug}"


ORACLE_CASES = [
    pytest.param(name, case["text"], case["ids"], id=_case_id(name, i, case["text"]))
    for name in VOCAB_FILES
    for i, case in enumerate(ORACLE[name])
]


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return read_tokenizer(VOCAB_FILES[name], vocab_size=VOCAB_SIZES[name])


# ---------------------------------------------------------------------- the reference


@functools.cache
def raw_vocab(name: str) -> tuple[list[bytes], list[float], dict[bytes, int]]:
    """(pieces, float32 scores, piece -> id) parsed directly from the file."""
    data = VOCAB_FILES[name].read_bytes()
    pieces, scores = [], []
    offset = 4
    while offset < len(data):
        score, length = struct.unpack("<fi", data[offset : offset + 8])
        offset += 8
        pieces.append(data[offset : offset + length])
        scores.append(score)
        offset += length
    assert offset == len(data)
    lookup = {piece: i for i, piece in enumerate(pieces)}
    assert len(lookup) == len(pieces), "the shipped vocabularies have no duplicate pieces"
    return pieces, scores, lookup


def reference_encode(name: str, text: bytes) -> list[int]:
    """run.c's encode(text, bos=1, eos=0), transcribed loop for loop (quadratic)."""
    pieces, scores, lookup = raw_vocab(name)
    tokens = [1]
    if len(text) > 0:
        tokens.append(lookup[b" "])
    buffer = b""
    for k in range(len(text)):
        if (text[k] & 0xC0) != 0x80:
            buffer = b""
        buffer += text[k : k + 1]
        following = text[k + 1] if k + 1 < len(text) else 0
        if (following & 0xC0) == 0x80 and len(buffer) < 4:
            continue
        if buffer in lookup:
            tokens.append(lookup[buffer])
        else:
            tokens.extend(byte + 3 for byte in buffer)
        buffer = b""
    while True:
        best_score, best_id, best_index = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if merged is not None and scores[merged] > best_score:
                best_score, best_id, best_index = scores[merged], merged, i
        if best_index == -1:
            break
        tokens[best_index : best_index + 2] = [best_id]
    return tokens


def test_reference_matches_oracle():
    for name in VOCAB_FILES:
        for case in ORACLE[name]:
            assert reference_encode(name, case["text"].encode()) == case["ids"], case["text"]


# ---------------------------------------------------------------------- reading


@pytest.mark.parametrize("name", list(VOCAB_FILES))
def test_read_matches_independent_parse(name):
    tok = tokenizer(name)
    pieces, scores, _ = raw_vocab(name)
    assert tok.vocab_size == VOCAB_SIZES[name] == len(pieces)
    assert tok.pieces == tuple(pieces)
    assert tok.scores == tuple(scores)
    assert tok.max_token_length == max(len(p) for p in pieces)
    assert tok.pieces[:3] == (b"<unk>", b"\n<s>\n", b"\n</s>\n")
    assert read_tokenizer(VOCAB_FILES[name]) == tok  # vocab_size=None reads to EOF
    assert hash(read_tokenizer(VOCAB_FILES[name])) == hash(tok)


# ---------------------------------------------------------------------- encoding


@pytest.mark.parametrize("name, text, ids", ORACLE_CASES)
def test_encode_matches_run_c(name, text, ids):
    tok = tokenizer(name)
    assert tok.encode(text) == ids
    assert tok.encode(text.encode("utf-8")) == ids
    assert tok.encode(text, bos=False, eos=True) == ids[1:] + [EOS_ID]


def _long_text(seed: int, size: int) -> str:
    """Deterministic mixed text: oracle prompts, whitespace runs, emoji, CJK, control chars."""
    parts = [c["text"] for c in ORACLE["tokenizer.bin"]]
    parts += [" " * n for n in range(1, 9)] + ["\t\t", "\n\n\n", "\x07", "\x00", "\x7f"]
    parts += ["🦙🚀🤖", "日本語のテキスト", "中文", "Ωμέγα", "\U0010fffd", "\u00a0"]
    parts += ["🌍", "𝕜", "𝓝"]  # the only 4-byte UTF-8 pieces in tokenizer.bin
    out, state = [], seed
    while sum(map(len, out)) < size:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(parts[(state >> 33) % len(parts)])
    return "".join(out)[:size]


@pytest.mark.parametrize("name", list(VOCAB_FILES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_encode_long_text_matches_reference(name, seed):
    text = _long_text(seed, 3000).encode("utf-8")
    assert tokenizer(name).encode(text) == reference_encode(name, text)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
def test_encode_whitespace_runs_match_reference(name):
    # In tokenizer.bin all whitespace-run pieces share the score -1e9: leftmost-tie territory.
    text = b"a" + b" " * 37 + b"b\t \t  \n" + b" " * 16 + b"c" + b" " * 5
    assert tokenizer(name).encode(text) == reference_encode(name, text)


_WORDS = sorted({w for case in ORACLE["tokenizer.bin"] for w in case["text"].split()})
_TEXT_PARTS = st.one_of(
    st.characters(codec="utf-8"),  # any code point but surrogates
    st.characters(max_codepoint=0x7F),  # ASCII, control characters included
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji (4 UTF-8 bytes)
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK (3 bytes)
    st.text(alphabet=" \t\n\r\v\f\u00a0", min_size=1, max_size=12),  # whitespace runs
    st.sampled_from(_WORDS),
    st.sampled_from(["🌍", "𝕜", "𝓝", "é", "\u00a0"]),  # tokenizer.bin's 4-byte pieces, 2-byte ones
)
TEXTS = st.lists(_TEXT_PARTS, max_size=40).map("".join)
# Arbitrary bytes, with long runs of continuation bytes to exercise the 4-byte group cut.
BYTE_TEXTS = st.lists(
    st.one_of(
        st.binary(max_size=6),
        st.sampled_from([b"\x80" * 5, b"\xbf", "🦙".encode("utf-8"), "🌍".encode("utf-8")]),
    ),
    max_size=12,
).map(b"".join)
_HYPOTHESIS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
@_HYPOTHESIS
@given(text=TEXTS)
def test_encode_random_text_matches_reference(name, text):
    ids = tokenizer(name).encode(text)
    assert ids == reference_encode(name, text.encode("utf-8"))
    assert all(0 <= t < VOCAB_SIZES[name] for t in ids)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
@_HYPOTHESIS
@given(data=BYTE_TEXTS)
def test_encode_random_bytes_matches_reference(name, data):
    assert tokenizer(name).encode(data) == reference_encode(name, data)


def test_encode_groups_continuation_bytes_like_run_c():
    tok = tokenizer("tokenizer.bin")
    # A 4-byte character that is a piece is looked up whole.
    earth = tok.pieces.index("🌍".encode("utf-8"))
    assert tok.encode("🌍🌍", bos=False) == [29871, earth, earth]
    # Six continuation bytes after an ASCII byte: run.c cuts groups of at most 4 bytes.
    data = b"a\x80\x80\x80\x80\x80\x80"
    assert tok.encode(data) == reference_encode("tokenizer.bin", data)
    # A stray continuation byte after a 4-byte piece: the piece is still found, then 0x80 + 3.
    data = "🌍".encode("utf-8") + b"\x80"
    assert tok.encode(data, bos=False) == [29871, earth, 0x80 + 3]
    assert tok.encode(data) == reference_encode("tokenizer.bin", data)
    # A str is UTF-8 with surrogateescape: escaped bytes are the raw bytes.
    assert tok.encode("caf\udce9") == tok.encode(b"caf\xe9")


def test_encode_flags_and_empty_text():
    tok = tokenizer("tok512.bin")
    assert tok.encode("") == [BOS_ID]
    assert tok.encode("", bos=False) == []
    assert tok.encode("", bos=True, eos=True) == [BOS_ID, EOS_ID]


class _CountingDict(dict):
    lookups = 0

    def get(self, key, default=None):
        type(self).lookups += 1
        return super().get(key, default)


def test_encode_does_linear_work_on_long_text():
    # run.c rescans every adjacent pair after each merge: ~n^2 / 2 piece lookups for n initial
    # tokens. Counting lookups (not seconds) shows the heap version does O(n) of them.
    tok = tokenizer("tokenizer.bin")
    counting = Tokenizer(tok.pieces, tok.scores, tok.max_token_length)
    object.__setattr__(counting, "_ids", _CountingDict(counting._ids))
    text = _long_text(3, 20_000)
    _CountingDict.lookups = 0
    assert counting.encode(text) == tok.encode(text)
    n = len(text.encode())
    assert _CountingDict.lookups < 6 * n, (_CountingDict.lookups, n)


def _tiny_vocab(extra: list[tuple[bytes, float]]) -> Tokenizer:
    """A synthetic llama2.c-style vocabulary: specials, 256 byte tokens, then `extra`."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    scores = [0.0] * len(pieces)
    for piece, score in extra:
        pieces.append(piece)
        scores.append(score)
    return Tokenizer(tuple(pieces), tuple(scores), max(len(p) for p in pieces))


def test_encode_synthetic_vocab_edge_cases():
    tok = _tiny_vocab(
        [(b" ", -1.0), (b"ab", -2.0), (b"ab", -3.0), (b" ab", -4.0), (b"a", -5.0), (b"b", -6.0)]
    )
    # Duplicate piece b"ab" (ids 260 and 261): the lowest id wins, with its score.
    assert tok.encode("ab") == [BOS_ID, 262]
    assert tok.encode("abab", bos=False) == [262, 260]
    # NUL is an ordinary byte (byte fallback id 3).
    assert tok.encode("\x00", bos=False) == [259, 3]
    # No " " piece: the dummy prefix falls back to the byte token of 0x20.
    no_space = _tiny_vocab([(b"x", -1.0)])
    assert no_space.encode("x", bos=False) == [0x20 + 3, 259]
    # Too small for byte fallback.
    small = Tokenizer((b"<unk>", b"\n<s>\n", b"\n</s>\n", b" ", b"a"), (0.0,) * 5, 5)
    assert small.encode("aa") == [BOS_ID, 3, 4, 4]
    with pytest.raises(TokenizerError, match="byte-fallback"):
        small.encode("b")


# ---------------------------------------------------------------------- decoding


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    stream = tok.stream_decoder()
    outputs = [stream.push(prev, token) for prev, token in zip([-1] + ids[:-1], ids)]
    return outputs + [stream.flush()]


@pytest.mark.parametrize("name, text, ids", ORACLE_CASES)
def test_decode_oracle_ids_gives_back_the_text(name, text, ids):
    tok = tokenizer(name)
    outputs = _stream(tok, ids)
    # The dummy-prefix space is stripped after BOS, so the text comes back exactly.
    assert "".join(outputs) == text
    assert tok.decode(ids) == text
    # Characters split over byte tokens come out whole, never as replacement characters.
    assert not any("\ufffd" in out for out in outputs)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
@_HYPOTHESIS
@given(text=TEXTS)
def test_decode_encode_round_trip(name, text):
    tok = tokenizer(name)
    # Single-byte control characters are dropped as run.c's safe_printf does; C whitespace stays.
    dropped = {chr(c) for c in [*range(0x20), 0x7F]} - set("\t\n\v\f\r")
    assert tok.decode(tok.encode(text, eos=True)) == "".join(c for c in text if c not in dropped)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
def test_emoji_split_into_byte_tokens_streams_as_one_character(name):
    tok = tokenizer(name)
    llama = "🦙".encode("utf-8")
    assert llama == b"\xf0\x9f\xa6\x99"
    ids = [byte + 3 for byte in llama]
    assert [tok.pieces[i] for i in ids] == [b"<0xF0>", b"<0x9F>", b"<0xA6>", b"<0x99>"]
    stream = tok.stream_decoder()
    assert [stream.push(prev, t) for prev, t in zip([BOS_ID] + ids[:-1], ids)] == ["", "", "", "🦙"]
    assert stream.flush() == ""
    assert tok.decode([BOS_ID, *ids, EOS_ID]) == "🦙"


@pytest.mark.parametrize("name", list(VOCAB_FILES))
def test_control_bytes_dropped_whitespace_and_high_bytes_kept(name):
    tok = tokenizer(name)
    stream = tok.stream_decoder()
    for control in [0x00, 0x07, 0x1B, 0x1F, 0x7F]:
        assert tok.decode_piece(0, control + 3) == bytes([control])
        assert stream.push(0, control + 3) == ""
    for space in b"\t\n\v\f\r ":
        assert stream.push(0, space + 3) == chr(space)
    assert tok.decode([0x41 + 3, 0x07 + 3, 0x42 + 3]) == "AB"
    # A byte >= 0x80 goes to the UTF-8 decoder: alone it is invalid, so U+FFFD.
    assert tok.decode([0xE9 + 3]) == "\ufffd"
    assert tok.decode([0xE9 + 3, 0x61 + 3]) == "\ufffda"
    assert stream.push(0, 0xC3 + 3) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(0, 0xC3 + 3) + stream.push(0, 0xA9 + 3) == "é"


def test_decode_piece_follows_run_c():
    tok = tokenizer("tokenizer.bin")
    hello = tok.encode("Hello", bos=False)
    assert len(hello) == 1 and tok.pieces[hello[0]] == b" Hello"
    assert tok.decode_piece(BOS_ID, hello[0]) == b"Hello"  # dummy prefix stripped after BOS
    assert tok.decode_piece(0, hello[0]) == b" Hello"
    assert tok.decode_piece(BOS_ID, tok.encode(" ", bos=False)[0]) == b" "  # "  " -> " "
    assert tok.decode_piece(0, 13) == b"\n"  # <0x0A>
    assert tok.decode_piece(0, BOS_ID) == b"\n<s>\n"  # the raw piece; printers skip it
    assert tok.decode([BOS_ID, hello[0], EOS_ID]) == "Hello"
    assert tok.decode([hello[0]]) == " Hello"  # no BOS before: the space stays
    with pytest.raises(IndexError):
        tok.decode_piece(0, 32000)
    with pytest.raises(IndexError):
        tok.decode_piece(0, -1)


def test_decode_piece_strips_before_parsing_byte_pieces():
    # run.c strips the space, then sscanf("<0x%02hhX>") (hex in either case).
    tok = _tiny_vocab([(b" <0x41>", -1.0), (b"<0x4a>", -2.0), (b"<0x4>", -3.0)])
    assert tok.decode_piece(BOS_ID, 259) == b"A"
    assert tok.decode_piece(0, 259) == b" <0x41>"
    assert tok.decode_piece(0, 260) == b"J"
    assert tok.decode_piece(0, 261) == b"<0x4>"


# ---------------------------------------------------------------------- errors


def _assert_one_line_error(excinfo, path, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message


def _entry(score: float, piece: bytes, length: int | None = None) -> bytes:
    return struct.pack("<fi", score, len(piece) if length is None else length) + piece


def test_error_missing_file_and_directory(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(missing, vocab_size=512)
    _assert_one_line_error(excinfo, missing, "no such file")
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(tmp_path)
    _assert_one_line_error(excinfo, tmp_path, "directory")


def test_error_truncated_files(tmp_path):
    data = VOCAB_FILES["tok512.bin"].read_bytes()
    path = tmp_path / "tok.bin"

    path.write_bytes(data[:3])
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(path, vocab_size=512)
    _assert_one_line_error(excinfo, path, "header")

    path.write_bytes(data[: len(data) - 3])  # inside the last piece
    for vocab_size in (512, None):
        with pytest.raises(TokenizerError) as excinfo:
            read_tokenizer(path, vocab_size=vocab_size)
        _assert_one_line_error(excinfo, path, "ends inside", "token 511")

    offset = 4
    for _ in range(100):  # the end of token 99
        offset += 8 + struct.unpack_from("<i", data, offset + 4)[0]
    path.write_bytes(data[:offset])
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(path, vocab_size=512)
    _assert_one_line_error(excinfo, path, "ends after 100 tokens", "vocab_size is 512")
    assert read_tokenizer(path).vocab_size == 100


def test_error_vocab_size_mismatch():
    big, small = VOCAB_FILES["tokenizer.bin"], VOCAB_FILES["tok512.bin"]
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(big, vocab_size=512)
    _assert_one_line_error(
        excinfo, big, "holds 32000 tokens but the checkpoint's vocab_size is 512"
    )
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(small, vocab_size=32000)
    _assert_one_line_error(excinfo, small, "ends after 512 tokens", "vocab_size is 32000")


def test_error_malformed_entries(tmp_path):
    path = tmp_path / "bad.bin"
    cases = [
        (struct.pack("<i", 4) + _entry(0.0, b"", length=-1), "negative length"),
        (struct.pack("<i", 2) + _entry(0.0, b"abc"), "more than the header's max_token_length"),
        (struct.pack("<i", 0) + _entry(0.0, b""), "max_token_length"),
        (struct.pack("<i", 4) + _entry(0.0, b"ab") + b"\x00\x00", "ends inside"),
        (struct.pack("<i", 4), "no tokens"),
    ]
    for data, fragment in cases:
        path.write_bytes(data)
        with pytest.raises(TokenizerError) as excinfo:
            read_tokenizer(path)
        _assert_one_line_error(excinfo, path, fragment)
    # Extra bytes after vocab_size tokens that do not form whole tokens.
    path.write_bytes(struct.pack("<i", 4) + _entry(0.0, b"ab") + b"\x01\x02")
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(path, vocab_size=1)
    _assert_one_line_error(excinfo, path, "more than the checkpoint's vocab_size of 1")
    with pytest.raises(TokenizerError) as excinfo:
        read_tokenizer(path, vocab_size=0)
    _assert_one_line_error(excinfo, path, "vocab_size")


def test_encode_refuses_non_text():
    tok = tokenizer("tok512.bin")
    with pytest.raises(TypeError, match="str or bytes"):
        tok.encode(123)
