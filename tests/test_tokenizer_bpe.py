"""Tests of jllama.tokenizers.bpe (byte-level BPE) on SmolLM2's GGUF vocabulary.

References:
  - tests/data/smollm2_llamacpp.json: ids from llama.cpp's llama-tokenize (special tokens
    parsed, no BOS) and the prompt ids / generated text of its greedy runs;
  - the Hugging Face `tokenizers` library (Rust) given the same vocabulary and merges, with
    SmolLM2's own pre-tokenizer configuration (individual digits, then GPT-2's ByteLevel
    regex) and the ByteLevel decoder; for the other pre-tokenizers, its `Split` pre-tokenizer
    with llama.cpp's regexes (behavior "isolated": the text between matches is kept);
  - hand-written expectations (UTF-8 bytes, ids of single tokens looked up in the vocabulary).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jllama.errors import TokenizerError
from jllama.tokenizers import bpe
from jllama.tokenizers.bpe import (
    BYTE_TO_UNICODE,
    PRE_TOKENIZERS,
    ByteLevelBPE,
    pre_tokenize,
)
from jllama.tokenizers.gguf import tokenizer_from_gguf
from jllama.tokenizers.llama2c import split_special_tokens

tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

DATA = Path(__file__).resolve().parent / "data"
ORACLE = json.loads((DATA / "smollm2_llamacpp.json").read_text(encoding="utf-8"))
IM_START, IM_END, ENDOFTEXT = 1, 2, 0  # SmolLM2's control tokens
# Bytes SmolLM2's vocabulary has no token for (checked in test_missing_byte_tokens): llama.cpp,
# HF and jllama drop them. The random texts below avoid them.
SMOLLM2_MISSING_BYTES = frozenset({0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2,
                                   *range(0xF5, 0x100)})


@pytest.fixture(scope="session")
def metadata(smollm2_gguf) -> dict:
    reader = gguf.GGUFReader(smollm2_gguf)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def tok(metadata, smollm2_gguf) -> ByteLevelBPE:
    tokenizer = tokenizer_from_gguf(metadata, str(smollm2_gguf))
    assert isinstance(tokenizer, ByteLevelBPE)
    return tokenizer


def _hf_model(metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    assert all(len(m) == 2 for m in merges)
    return tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges)


@pytest.fixture(scope="session")
def hf(metadata) -> tokenizers.Tokenizer:
    """SmolLM2's tokenizer rebuilt in Hugging Face `tokenizers`, no special tokens added (so
    "<|im_start|>" typed in text is text, as parse_special=False)."""
    pre = tokenizers.pre_tokenizers
    reference = tokenizers.Tokenizer(_hf_model(metadata))
    reference.pre_tokenizer = pre.Sequence(
        [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    reference.decoder = tokenizers.decoders.ByteLevel()
    return reference


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------- llama.cpp's ids


@pytest.mark.parametrize("case", ORACLE["tokenize"], ids=lambda c: repr(c["text"][:24]))
def test_encode_matches_llama_cpp_tokenize(tok, case):
    assert tok.encode(case["text"], parse_special=True) == case["ids"]


@pytest.mark.parametrize(
    "case", ORACLE["greedy"] + ORACLE["greedy_q4_1"], ids=lambda c: repr(c["prompt"][:24])
)
def test_prompt_ids_and_generated_text_match_llama_cpp(tok, case):
    assert tok.encode(case["prompt"]) == case["prompt_ids"]  # the GGUF adds no BOS
    assert tok.decode(case["generated_ids"]) == case["generated_text"]


def test_vocabulary_facts(tok, metadata):
    assert tok.vocab_size == len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (IM_START, IM_END, False)
    assert tok.tokens[IM_START] == "<|im_start|>" and tok.tokens[IM_END] == "<|im_end|>"
    # EOS, and the end-of-generation texts present: <|im_end|> and <|endoftext|>.
    assert tok.stop_ids == {IM_END, ENDOFTEXT}
    assert tok.control_ids == set(range(17))  # the 17 control tokens print nothing
    assert tok.encode("Hi", bos=True) == [IM_START] + tok.encode("Hi")
    assert tok.encode("Hi", eos=True) == tok.encode("Hi") + [IM_END]
    assert tok.encode(b"caf\xc3\xa9") == tok.encode("café")
    assert tok.encode(b"\xc3") == tok.encode("\udcc3")  # bytes: surrogateescape, raw byte
    # Bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5..0xFF) have no token in SmolLM2:
    # dropped, as llama.cpp does.
    assert tok.encode(b"Hi\xff") == tok.encode("Hi")
    with pytest.raises(TypeError, match="str or bytes"):
        tok.encode(12)


def test_gpt2_byte_table():
    # GPT-2's table: printable bytes map to themselves; space is "Ġ" (U+0120), newline "Ċ".
    assert BYTE_TO_UNICODE[ord("a")] == "a" and BYTE_TO_UNICODE[0xFF] == "ÿ"
    assert BYTE_TO_UNICODE[0x20] == "Ġ" and BYTE_TO_UNICODE[0x0A] == "Ċ"
    assert BYTE_TO_UNICODE[0x00] == "\u0100" and BYTE_TO_UNICODE[0xAD] == "\u0143"
    assert len(set(BYTE_TO_UNICODE)) == 256
    assert set(BYTE_TO_UNICODE) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())


# ---------------------------------------------------------------------- against HF tokenizers

HARD_STRINGS = [
    "Hello world",
    "   leading and trailing   ",
    "numbers 1234567890 3.14159 -42 1,000,000 ٣٤ ²³ Ⅻ",
    "CJK 日本語のテキスト 中文 한국어",
    "emoji 🦙🚀🤖 👍🏽 👨‍👩‍👧 🇫🇷",
    "whitespace runs:  \t\t \n\n\n   \r\n\r\n \u00a0\u3000 x\u2028y",
    "tabs\tinside\twords\t",
    "contractions: don't I'm we're they've she'll he'd it's DON'T I'M",
    "code: def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))",
    "json {\"a\": [1, 2, {\"b\": null}]}",
    "punctuation!!! ... ??? --- ''' \"\"\" ;;; :::",
    "mixed: naïve café résumé Ωμέγα Привет мир",
    "<|im_start|>user\nhi<|im_end|>",  # plain text here: no special tokens in `hf`
    "\x00\x01\x07\x1b\x7f control bytes",
    "a\u0301 e\u0308 combining marks",
    "\n",
    " ",
    "",
]


@pytest.mark.parametrize("text", HARD_STRINGS, ids=repr)
def test_encode_matches_hf_tokenizers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert tok.decode(ids) == hf.decode(ids) == text


def _assigned(c: str) -> bool:
    return unicodedata.category(c) not in ("Cn", "Cs", "Co") and _encodable(c)


def _encodable(c: str) -> bool:
    return not SMOLLM2_MISSING_BYTES.intersection(c.encode("utf-8"))


_PARTS = st.one_of(
    st.characters(codec="utf-8").filter(_assigned),
    st.characters(max_codepoint=0x7F).filter(_encodable),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF).filter(_assigned),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.text(alphabet=" \t\n\r\v\f\u00a0\u3000\u2028\x85", min_size=1, max_size=8),
    st.text(alphabet="0123456789٣²Ⅻ", min_size=1, max_size=6),
    st.sampled_from(["'s", "'S", "'ll", "'LL", "'ve", "n't", "'re", "'d", "'m"]),
    st.sampled_from(["the", " the", "Hello", "world", " fibonacci", "<|im_start|>", "<|im_end|>"]),
)
TEXTS = st.lists(_PARTS, max_size=30).map("".join)
_HYPOTHESIS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_HYPOTHESIS
@given(text=TEXTS)
def test_encode_random_text_matches_hf_tokenizers(tok, hf, text):
    assert tok.encode(text) == hf_ids(hf, text)


@_HYPOTHESIS
@given(text=TEXTS)
def test_decode_encode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # With special tokens parsed, decode(special=True) prints them as they were typed.
    assert tok.decode(tok.encode(text, parse_special=True), special=True) == text


def _stream(tok, ids):
    stream = tok.stream_decoder()
    return [stream.push(prev, t) for prev, t in zip([-1] + ids[:-1], ids)] + [stream.flush()]


@_HYPOTHESIS
@given(text=TEXTS)
def test_stream_decoder_emits_whole_characters(tok, text):
    ids = tok.encode(text)
    outputs = _stream(tok, ids)
    assert "".join(outputs) == tok.decode(ids) == text
    data = text.encode("utf-8")
    emitted, fed = "", 0
    for output, token in zip(outputs, ids):
        emitted += output
        fed += len(tok.token_bytes(token))
        assert text.startswith(emitted)  # never a replacement character for a partial one
        assert fed - 3 <= len(emitted.encode("utf-8")) <= fed  # and never held back longer
    assert len(data) == fed


def test_emoji_split_over_tokens_streams_as_one_character(tok):
    ids = tok.encode("🦙")
    assert b"".join(tok.token_bytes(t) for t in ids) == b"\xf0\x9f\xa6\x99"
    assert len(ids) == 3  # llama.cpp's ids in the oracle: 15107 (" \xf0\x9f"), 116, 243
    outputs = _stream(tok, ids)
    assert outputs == ["", "", "🦙", ""]
    assert [tok.piece(t) for t in ids] == ["<0xF0><0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(ids[:1]) == "\ufffd"  # an unfinished character alone


def test_piece_and_special_decoding(tok):
    assert tok.piece(IM_START) == "<|im_start|>"
    assert tok.piece(tok.encode(" world")[0]) == " world"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=True)
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, special=True) == "<|im_start|>user\nhi<|im_end|>"
    stream = tok.stream_decoder(special=True)
    assert stream.push(-1, IM_END) == "<|im_end|>"
    with pytest.raises(IndexError):
        tok.piece(tok.vocab_size)
    with pytest.raises(IndexError):
        tok.decode([-1])


# ---------------------------------------------------------------------- special tokens


def test_control_tokens_typed_as_text_stay_text(tok, hf):
    text = "<|im_start|>user"
    ids = tok.encode(text)
    assert IM_START not in ids and ids == hf_ids(hf, text)
    assert tok.encode(text, parse_special=True) == [IM_START] + hf_ids(hf, "user")


def test_encode_segments(tok, hf):
    # Template markers (flagged) become ids; the user's text (unflagged) stays text.
    segments = [
        ("<|im_start|>user\n", True),
        ("hi <|im_start|> there<|im_end|>", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
    ]
    user = "user\nhi <|im_start|> there<|im_end|>"
    expected = [IM_START] + hf_ids(hf, user) + [IM_END] + hf_ids(hf, "\n")
    expected += [IM_START] + hf_ids(hf, "assistant\n")
    assert tok.encode_segments(segments) == expected
    assert tok.encode_segments(segments, bos=True, eos=True) == [IM_START, *expected, IM_END]
    # Seams inside a word do not change the ids (each run is encoded whole)...
    seams = [("hel", False), ("lo wor", True), ("ld", False)]
    assert tok.encode_segments(seams) == tok.encode("hello world") == hf_ids(hf, "hello world")
    assert tok.encode("hel") + tok.encode("lo wor") != tok.encode("hello world")
    # ...a marker split over two flagged segments is still one, but not if part is unflagged.
    assert tok.encode_segments([("<|im_", True), ("start|>", True)]) == [IM_START]
    assert tok.encode_segments([("<|im_", True), ("start|>", False)]) == hf_ids(hf, "<|im_start|>")
    unflagged_start = [("a<|im_", False), ("start|>", True)]
    assert tok.encode_segments(unflagged_start) == hf_ids(hf, "a<|im_start|>")
    assert tok.encode_segments([]) == [] and tok.encode_segments([("", True)], bos=True) == [1]


_SEGMENT_TEXTS = st.lists(
    st.tuples(
        st.one_of(TEXTS, st.sampled_from(["<|im_start|>", "<|im_end|>", "<|im_", "end|>"])),
        st.booleans(),
    ),
    max_size=6,
)


@_HYPOTHESIS
@given(segments=_SEGMENT_TEXTS)
def test_encode_segments_all_flagged_or_none_equals_encode(tok, segments):
    text = "".join(t for t, _ in segments)
    assert tok.encode_segments([(t, False) for t, _ in segments]) == tok.encode(text)
    assert tok.encode_segments([(t, True) for t, _ in segments]) == tok.encode(
        text, parse_special=True
    )
    # Whatever the flags, the ids decode to the text.
    assert tok.decode(tok.encode_segments(segments), special=True) == text


def test_split_special_tokens_follows_llama_cpp_order():
    # llama.cpp tries special tokens longest first, each over the fragments the previous ones
    # left: "bcd" claims "abcd" before "ab" can.
    specials = [("bcd", 2, False), ("ab", 1, False)]
    assert split_special_tokens([("abcd", True)], specials) == ["a", 2]
    assert split_special_tokens([("abab", True)], specials) == [1, 1]
    assert split_special_tokens([("xabx", False)], specials) == ["xabx"]
    assert split_special_tokens([("xabx", False)], [("ab", 7, True)]) == ["x", 7, "x"]
    # An occurrence refused (unflagged) does not hide a later one.
    assert split_special_tokens([("ab", False), ("ab", True)], specials) == ["ab", 1]
    assert split_special_tokens([("aab", False), ("cd", True)], specials) == ["aabcd"]
    assert split_special_tokens([("aa", False), ("bcd", True)], specials) == ["aa", 2]


def test_user_defined_tokens_always_match(metadata):
    meta = dict(metadata)
    types = list(meta["tokenizer.ggml.token_type"])
    types[3] = bpe.USER_DEFINED  # "<repo_name>"
    meta["tokenizer.ggml.token_type"] = types
    tok = tokenizer_from_gguf(meta, "user-defined.gguf")
    ids = tok.encode("x<repo_name>y")
    assert ids == tok.encode("x") + [3] + tok.encode("y")
    assert tok.decode(ids) == "x<repo_name>y"  # user-defined tokens print their text
    assert 3 not in tok.control_ids


# ---------------------------------------------------------------------- other pre-tokenizers

_SPLIT_CASES = HARD_STRINGS + ["a \nb", "x  \n  y", "12345 1234567", "I'VE you'Re", "$+<=>^~|`"]


def _hf_split(patterns: tuple[str, ...], text: str) -> list[str]:
    pre = tokenizers.pre_tokenizers
    splitter = pre.Sequence([pre.Split(tokenizers.Regex(p), "isolated") for p in patterns])
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


@pytest.mark.parametrize("name", ["smollm", "gpt-2", "llama-bpe", "default"])
@pytest.mark.parametrize("text", _SPLIT_CASES, ids=repr)
def test_pre_tokenize_matches_hf_split(name, text):
    patterns = PRE_TOKENIZERS[name].patterns
    compiled = bpe._compile(patterns)
    assert pre_tokenize(text, compiled) == _hf_split(patterns, text)


def test_pre_tokenize_keeps_text_between_matches():
    (gpt2,) = bpe._compile(PRE_TOKENIZERS["gpt-2"].patterns)
    # "\n" before a letter matches no alternative of GPT-2's regex; it stays a fragment.
    assert pre_tokenize("a \nb", [gpt2]) == ["a", " ", "\n", "b"]
    smollm = bpe._compile(PRE_TOKENIZERS["smollm"].patterns)
    assert pre_tokenize("ab 12", smollm) == ["ab", " ", "1", "2"]


def test_llama3_pre_tokenizer_with_ignore_merges_matches_hf(metadata, hf):
    # SmolLM2's vocabulary under Llama 3's pre-tokenizer and ignore_merges, against HF's BPE
    # with the same settings.
    meta = dict(metadata)
    meta["tokenizer.ggml.pre"] = "llama-bpe"
    del meta["tokenizer.ggml.add_bos_token"]
    tok = tokenizer_from_gguf(meta, "llama3-style.gguf")
    assert tok.add_bos  # llama.cpp's default for llama-bpe
    vocab = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    reference = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, ignore_merges=True))
    pre = tokenizers.pre_tokenizers
    reference.pre_tokenizer = pre.Sequence(
        [pre.Split(tokenizers.Regex(bpe._LLAMA3_PATTERN), "isolated"),
         pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    for text in HARD_STRINGS + ["12345 1234567", "I'VE you'Re", "hello\n\n  world"]:
        ids = tok.encode(text, bos=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text


# ---------------------------------------------------------------------- construction


def _tiny(**overrides) -> ByteLevelBPE:
    """A tiny byte-level vocabulary: the 256 byte characters, "ab" and "abc"."""
    fields = {
        "tokens": list(BYTE_TO_UNICODE) + ["ab", "abc", "<ctl>"],
        "token_types": [1] * 258 + [3],
        "merges": ["a b", "ab c"],
        "pre": "gpt-2",
        "bos_id": 258,
        "eos_id": 258,
        "source": "tiny.gguf",
    }
    fields.update(overrides)
    return ByteLevelBPE(**fields)


def test_tiny_vocabulary():
    tok = _tiny()
    space, x = 0x20 + 0, ord("x")  # ids 0..255 are the byte characters, in byte order
    assert tok.tokens[space] == "Ġ" and tok.tokens[x] == "x"
    assert tok.encode("abc") == [257]
    # " abx" is one pre-token "Ġabx": only "a b" merges (there is no "Ġ a" merge).
    assert tok.encode(" abx") == [space, 256, x]
    assert tok.encode("abc abx") == [257, space, 256, x]
    assert tok.encode("<ctl>", parse_special=True) == [258]
    assert tok.decode([258]) == "" and tok.decode([258], special=True) == "<ctl>"


def test_missing_byte_tokens(tok, hf):
    missing = {b for b in range(256) if BYTE_TO_UNICODE[b] not in set(tok.tokens)}
    assert missing == SMOLLM2_MISSING_BYTES
    # HF (like llama.cpp) drops such a byte: "a", "\x16", "b" are three pre-tokens.
    assert hf_ids(hf, "a\x16b") == hf_ids(hf, "a") + hf_ids(hf, "b")
    for byte in sorted(missing):
        text = "a" + bytes([byte]).decode("latin-1") + " b"
        assert tok.encode(text) == hf_ids(hf, text), hex(byte)


def test_missing_byte_token_is_dropped():
    tokens = list(BYTE_TO_UNICODE)
    tokens[ord("z")] = "zz"  # no token for byte "z" any more
    tok = _tiny(tokens=tokens + ["ab", "abc", "<ctl>"])
    assert tok.encode("z") == []
    assert tok.encode("yzy") == tok.encode("y") * 2


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"pre": "qwen9"}, "unknown pre-tokenizer tokenizer.ggml.pre='qwen9'"),
        ({"merges": ["ab"]}, "merge 0 'ab' is not two tokens"),
        ({"bos_id": 259}, "bos_id 259 is out of range"),
        ({"eot_id": -1}, "eot_id -1 is out of range"),
        ({"token_types": [1]}, "259 tokens but 1 token types"),
        ({"tokens": [], "token_types": []}, "empty"),
    ],
)
def test_construction_errors(overrides, fragment):
    with pytest.raises(TokenizerError) as excinfo:
        _tiny(**overrides)
    message = str(excinfo.value)
    assert fragment in message and "tiny.gguf" in message and "\n" not in message


def test_word_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(bpe, "_CACHE_LIMIT", 5)
    tok = _tiny()
    for i in range(20):
        tok.encode(f"w{i}")
        assert len(tok._cache) <= 5
