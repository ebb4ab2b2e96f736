"""Tests of jllama.tokenizers.gguf: the tokenizer of a GGUF file's metadata.

References:
  - `sentencepiece` (Google's library) running tests/data/tokenizer.model, Llama 2's
    SentencePiece model. The test writes that vocabulary into a GGUF file with gguf-py's
    GGUFWriter (pieces, scores and types as sentencepiece reports them, as llama.cpp's
    convert_hf_to_gguf.py does) and reads it back with GGUFReader;
  - llama.cpp's documented rules where sentencepiece has no counterpart (special tokens parsed
    from text, the dummy-prefix space after a special token, llama.cpp's defaults);
  - hand-written expectations for the error messages.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jllama.errors import TokenizerError
from jllama.tokenizers.bpe import BYTE_TO_UNICODE, ByteLevelBPE
from jllama.tokenizers.gguf import tokenizer_from_gguf
from jllama.tokenizers.llama2c import Tokenizer

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")

MODEL = Path(__file__).resolve().parent / "data" / "tokenizer.model"
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(MODEL))


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_unused(i):
        return gguf.TokenType.UNUSED
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def gguf_file(sp, tmp_path_factory) -> Path:
    """A GGUF file holding only Llama 2's vocabulary (no tensors)."""
    path = tmp_path_factory.mktemp("gguf") / "llama2-vocab.gguf"
    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([int(_token_type(sp, i)) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def metadata(gguf_file) -> dict:
    reader = gguf.GGUFReader(gguf_file)
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def tok(metadata, gguf_file) -> Tokenizer:
    tokenizer = tokenizer_from_gguf(metadata, str(gguf_file))
    assert isinstance(tokenizer, Tokenizer)
    return tokenizer


# ---------------------------------------------------------------------- SentencePiece vocabularies


def test_vocabulary_facts(tok, sp):
    assert tok.vocab_size == sp.get_piece_size() == 32000
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (BOS, EOS, True, True)
    assert tok.control_ids == {0, 1, 2}  # <unk>, <s>, </s>
    assert tok.stop_ids == {EOS}
    assert tok.pieces[sp.piece_to_id("▁Hello")] == b" Hello"
    assert tok.pieces[sp.piece_to_id("<0x0A>")] == b"<0x0A>"


SPM_STRINGS = [
    "Hello world",
    "  two leading spaces",
    " x",
    "trailing space ",
    "tabs\tand\nnewlines\r\n\n",
    "émoji 🦙 test 👍🏽",
    "日本語のテキスト 中文",
    "1234567890 3.14",
    "don't stop, we're here",
    "<s>typed markers</s> [INST] <<SYS>>",
    "a" * 50,
    "Ωμέγα 🌍 𝕜 𝓝",
    "\u00a0nbsp\u3000ideographic",
    "multiple   spaces\n\nnewlines",
    "▁already▁marked",
    "def f(x):\n    return x  # code\n",
    "\x00 \x07 control",
    "",
]


@pytest.mark.parametrize("text", SPM_STRINGS, ids=repr)
def test_encode_matches_sentencepiece(tok, sp, text):
    assert tok.encode(text) == [BOS] + sp.encode(text)  # add_bos_token=true
    assert tok.encode(text, bos=False, eos=True) == sp.encode(text) + [EOS]


def _assigned(c: str) -> bool:
    return unicodedata.category(c) not in ("Cn", "Cs", "Co")


TEXTS = st.lists(
    st.one_of(
        st.characters(codec="utf-8").filter(_assigned),
        st.characters(max_codepoint=0x7F),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF).filter(_assigned),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
        st.text(alphabet=" \t\n\r\u00a0\u2581", min_size=1, max_size=8),
        st.sampled_from([" the", "Hello", "world", "<s>", "</s>", "[INST]", "'s", "ing"]),
    ),
    max_size=30,
).map("".join)
_HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_HYPOTHESIS
@given(text=TEXTS)
def test_encode_random_text_matches_sentencepiece(tok, sp, text):
    ids = tok.encode(text)
    assert ids == [BOS] + sp.encode(text)
    # Decoding gives sentencepiece's text back, except that jllama drops single non-whitespace
    # ASCII control bytes as llama2.c's safe_printf does.
    dropped = {chr(c) for c in [*range(0x20), 0x7F]} - set("\t\n\v\f\r")
    assert tok.decode(ids) == "".join(c for c in sp.decode(ids[1:]) if c not in dropped)


def test_add_bos_and_space_prefix_from_metadata(metadata, sp):
    meta = dict(metadata)
    meta["tokenizer.ggml.add_bos_token"] = False
    assert tokenizer_from_gguf(meta, "x.gguf").encode("Hello") == sp.encode("Hello")
    meta["tokenizer.ggml.add_space_prefix"] = False
    no_prefix = tokenizer_from_gguf(meta, "x.gguf")
    assert no_prefix.encode("Hello") == [sp.piece_to_id("Hello")]
    assert no_prefix.decode_piece(BOS, sp.piece_to_id("▁Hello")) == b" Hello"  # nothing to strip
    # llama.cpp's defaults for "llama" when the keys are missing: BOS added, dummy prefix on.
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        del meta[key]
    default = tokenizer_from_gguf(meta, "x.gguf")
    assert default.encode("Hello") == [BOS] + sp.encode("Hello")
    assert (default.bos_id, default.eos_id) == (1, 2)


def test_special_tokens_parsed_on_request(tok, sp):
    text = "<s>hi</s>"
    assert tok.encode(text, bos=False) == sp.encode(text)  # plain text by default
    # Parsed: the markers' ids, and llama.cpp's dummy prefix on the text after a special token.
    assert tok.encode(text, bos=False, parse_special=True) == [BOS] + sp.encode("hi") + [EOS]
    unk = tok.encode("a<unk>b", bos=False, parse_special=True)
    assert unk == sp.encode("a") + [0] + sp.encode("b")
    segments = [("<s>", True), ("[INST] hi <s> [/INST]", False), ("</s>", True)]
    expected = [BOS] + sp.encode("[INST] hi <s> [/INST]") + [EOS]
    assert tok.encode_segments(segments, bos=False) == expected
    assert tok.encode_segments([("Hel", False), ("lo", True)]) == tok.encode("Hello")


def test_decode_and_pieces(tok, sp):
    ids = tok.encode("Hello world", eos=True)
    assert tok.decode(ids) == "Hello world" == sp.decode(ids)
    assert tok.decode(ids, special=True) == "<s>Hello world</s>"
    assert tok.decode([0]) == "" and tok.decode([0], special=True) == "<unk>"
    assert tok.piece(sp.piece_to_id("▁Hello")) == " Hello"
    assert tok.piece(sp.piece_to_id("<0x0A>")) == "\n"
    assert tok.piece(sp.piece_to_id("<0xE2>")) == "<0xE2>"
    assert tok.piece(BOS) == "<s>"
    llama = [sp.piece_to_id(f"<0x{b:02X}>") for b in "🦙".encode()]
    assert tok.encode("🦙", bos=False) == [sp.piece_to_id("▁")] + llama
    stream = tok.stream_decoder()
    assert [stream.push(p, t) for p, t in zip([BOS] + llama, llama)] == ["", "", "", "🦙"]


_DROPPED = {chr(c) for c in [*range(0x20), 0x7F]} - set("\t\n\v\f\r")
"""Single non-whitespace ASCII control bytes, which jllama drops as llama2.c's safe_printf."""


@pytest.mark.parametrize("text", SPM_STRINGS, ids=repr)
def test_decode_without_bos_is_sentencepieces_text(tok, sp, text):
    # sentencepiece drops the dummy-prefix space of the text's first piece, BOS or not.
    ids = sp.encode(text)
    assert tok.encode(text, bos=False) == ids
    want = "".join(c for c in sp.decode(ids) if c not in _DROPPED)
    assert tok.decode(ids) == want
    assert tok.decode([BOS, *ids]) == want  # run.c's rule after BOS, unchanged
    stream = tok.stream_decoder()
    streamed = [stream.push(p, t) for p, t in zip([-1, *ids], ids)] + [stream.flush()]
    assert "".join(streamed) == want


def test_a_continuation_keeps_its_space(tok, sp):
    ids = sp.encode("Hello world")
    assert sp.decode(ids) == "Hello world" and len(ids) == 2
    # The piece after the prompt's last token prints as it does inside the whole text.
    assert tok.decode(ids[1:], prev=ids[0]) == " world"
    assert tok.decode(ids[:1]) + tok.decode(ids[1:], prev=ids[0]) == sp.decode(ids)


@_HYPOTHESIS
@given(text=TEXTS)
def test_decode_random_text_without_bos_matches_sentencepiece(tok, sp, text):
    ids = sp.encode(text)
    assert tok.decode(ids) == "".join(c for c in sp.decode(ids) if c not in _DROPPED)


def test_gguf_file_on_disk_matches_metadata_dict(tok, gguf_file, sp):
    # The round trip through the file keeps every piece and score.
    assert tok.source == str(gguf_file)
    for i in (0, 1, 2, 3, 259, 29871, 31999):
        piece = sp.id_to_piece(i)
        if not sp.is_byte(i):
            assert tok.pieces[i] == piece.replace("▁", " ").encode()
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            assert tok.scores[i] == -1e10  # never merged into
        else:
            assert tok.scores[i] == pytest.approx(sp.get_score(i))


# ---------------------------------------------------------------------- byte-level BPE


def _bpe_metadata(**overrides) -> dict:
    tokens = list(BYTE_TO_UNICODE) + ["ab", "<|eot_id|>", "<|eom_id|>", "<|begin_of_text|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3, 3, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 259,
        "tokenizer.ggml.eos_token_id": 257,
    }
    meta.update(overrides)
    return meta


def test_gpt2_model_builds_byte_level_bpe():
    tok = tokenizer_from_gguf(_bpe_metadata(), "l3.gguf")
    assert isinstance(tok, ByteLevelBPE)
    assert tok.add_bos  # llama.cpp's default for llama-bpe when add_bos_token is missing
    assert tok.encode("ab") == [259, 256]
    assert tok.stop_ids == {257, 258}  # EOS, and "<|eom_id|>" by its text
    meta = _bpe_metadata(**{"tokenizer.ggml.add_bos_token": False,
                            "tokenizer.ggml.eot_token_id": 258, "tokenizer.ggml.pre": "smollm"})
    tok = tokenizer_from_gguf(meta, "l3.gguf")
    assert not tok.add_bos and tok.eot_id == 258 and tok.encode("ab") == [256]


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "change, fragments",
    [
        ({"model": None}, ["missing GGUF key tokenizer.ggml.model"]),
        ({"tokens": None}, ["missing GGUF key tokenizer.ggml.tokens"]),
        ({"merges": None}, ["missing GGUF key tokenizer.ggml.merges"]),
        ({"model": "bert"}, ["tokenizer.ggml.model is 'bert'"]),
        ({"model": 3}, ["tokenizer.ggml.model is int", "expected str"]),
        ({"pre": "qwen9"}, ["tokenizer.ggml.pre is 'qwen9'"]),
        ({"tokens": []}, ["tokenizer.ggml.tokens is empty"]),
        ({"tokens": ["a", 5]}, ["tokenizer.ggml.tokens[1] is int"]),
        ({"token_type": [1, 1]}, ["token_type has 2 entries", "tokens has 260"]),
        ({"bos_token_id": 9999}, ["bos_token_id is 9999, outside the 260-token vocabulary"]),
        ({"eos_token_id": True}, ["eos_token_id is bool"]),
        ({"add_bos_token": 1}, ["add_bos_token is int", "expected bool"]),
    ],
)
def test_errors_name_the_key_and_the_file(change, fragments):
    meta = _bpe_metadata()
    for name, value in change.items():
        key = "tokenizer.ggml." + name
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    with pytest.raises(TokenizerError) as excinfo:
        tokenizer_from_gguf(meta, "/models/bad.gguf")
    message = str(excinfo.value)
    assert "/models/bad.gguf" in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_spm_errors(metadata):
    meta = dict(metadata)
    meta["tokenizer.ggml.scores"] = [0.0] * 3
    with pytest.raises(TokenizerError, match="tokenizer.ggml.scores has 3 entries"):
        tokenizer_from_gguf(meta, "spm.gguf")
