"""Tests of jllama.tokenizers.base: the Tokenizer protocol, printed_bytes and the stream decoder.

References:
  - llama2.c's run.c for BOS_ID / EOS_ID (its hard-coded 1 and 2) and for what a piece prints
    (`decode`: the space after BOS goes; `safe_printf`: lone control bytes go), worked by hand
    on the pieces of tests/data/tokenizer.bin (Llama 2's vocabulary);
  - GPT-2's byte table (openai/gpt-2 encoder.py: "Ġ" stands for the byte 0x20) for the
    byte-level tokens of tests/data/llama32_tiny (the first 1024 ranks of Llama 3's vocabulary);
  - UTF-8 as RFC 3629 defines it, and Python's codec (Unicode's "maximal subpart" U+FFFD
    substitution), for the bytes a stream holds back, drops or replaces; hand-computed bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jllama.formats.gguf_header import read_header
from jllama.tokenizers import base, bpe, llama2c, spm, tiktoken_model
from jllama.tokenizers.base import BOS_ID, EOS_ID, StreamDecoder, TextStream, Tokenizer
from jllama.tokenizers.gguf import tokenizer_from_gguf
from jllama.tokenizers.hf import read_hf_tokenizer
from jllama.tokenizers.llama2c import read_tokenizer
from jllama.tokenizers.tiktoken_model import tiktoken_tokenizer

DATA = Path(__file__).resolve().parent / "data"
PACKAGE_DATA = Path(llama2c.__file__).resolve().parents[1] / "data"
TINY = DATA / "llama32_tiny"
LLAMA = "🦙".encode()  # b"\xf0\x9f\xa6\x99", four bytes


def _tiny_spm_metadata() -> dict:
    """A GGUF "llama" vocabulary written by hand: <unk>, <s>, </s>, the 256 byte tokens, "▁a"."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581a"]
    types = [2, 3, 3, *[6] * 256, 1]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": [0.0] * len(tokens)}


def _tiny_tiktoken() -> tiktoken_model.TiktokenTokenizer:
    ranks = {bytes((b,)): b for b in range(256)}
    ranks[b"ab"] = 256
    return tiktoken_tokenizer(ranks, source="tiny")


BUILDERS = {
    "llama2c tokenizer.bin": lambda: read_tokenizer(DATA / "tokenizer.bin", vocab_size=32000),
    "llama2c tok512.bin": lambda: read_tokenizer(PACKAGE_DATA / "tok512.bin", vocab_size=512),
    "gguf llama": lambda: tokenizer_from_gguf(_tiny_spm_metadata(), "tiny.gguf"),
    "gguf gpt2": lambda: tokenizer_from_gguf(
        dict(read_header(TINY / "llama32-tiny-Q2_K.gguf").metadata), "tiny.gguf"),
    "hf byte-level": lambda: read_hf_tokenizer(TINY / "hf"),
    "tiktoken": _tiny_tiktoken,
}
KINDS = {
    "llama2c tokenizer.bin": spm.Tokenizer, "llama2c tok512.bin": spm.Tokenizer,
    "gguf llama": spm.Tokenizer, "gguf gpt2": bpe.ByteLevelBPE,
    "hf byte-level": bpe.ByteLevelBPE, "tiktoken": tiktoken_model.TiktokenTokenizer,
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_tokenizer_implements_the_protocol(name):
    tok = BUILDERS[name]()
    assert type(tok) is KINDS[name]
    assert isinstance(tok, Tokenizer)
    assert isinstance(tok.stream_decoder(), TextStream)
    assert tok.drops_unknown_bytes is (KINDS[name] is bpe.ByteLevelBPE)
    assert {tok.bos_id, tok.eos_id} <= set(range(tok.vocab_size))
    text = "ab c"
    ids = tok.encode(text, bos=False)
    assert tok.encode_segments([(text, False)], bos=False) == ids
    assert all(0 <= t < tok.vocab_size for t in ids)
    # printed_bytes are what the stream decoder prints, token by token.
    stream = tok.stream_decoder()
    for prev, token in zip([-1, *ids], ids):
        assert stream.push(prev, token) == tok.printed_bytes(prev, token).decode()
    assert tok.piece(ids[-1]) == tok.token_bytes(ids[-1]).decode()


def test_old_names_are_the_shared_ones():
    assert (BOS_ID, EOS_ID) == (1, 2)  # run.c: BOS 1, EOS 2
    assert (llama2c.BOS_ID, llama2c.EOS_ID) == (1, 2)
    assert llama2c.Tokenizer is spm.Tokenizer
    assert llama2c.StreamDecoder is bpe.ByteStreamDecoder is StreamDecoder
    assert llama2c.split_special_tokens is bpe.split_special_tokens
    assert llama2c.bytes_for_display is base.bytes_for_display
    tok = BUILDERS["llama2c tokenizer.bin"]()
    assert tok.control_ids == {BOS_ID, EOS_ID}
    assert tok.decode_piece(BOS_ID, 0x41 + 3) == b"A"  # run.c's decode, kept under its name
    assert isinstance(tok.stream_decoder(), StreamDecoder)


# ---------------------------------------------------------------------- printed_bytes


def test_printed_bytes_follow_run_c_for_llama2c_files():
    tok = BUILDERS["llama2c tokenizer.bin"]()
    hello = tok.encode("Hello", bos=False)[0]
    assert tok.pieces[hello] == b" Hello"
    assert tok.printed_bytes(BOS_ID, hello) == b"Hello"  # run.c: the space after BOS goes
    assert tok.printed_bytes(0, hello) == b" Hello"
    assert tok.printed_bytes(-1, hello) == b" Hello"  # llama2.c files keep run.c's rule alone
    assert tok.printed_bytes(0, BOS_ID) == b"" == tok.printed_bytes(0, EOS_ID)
    assert tok.printed_bytes(0, BOS_ID, special=True) == b"\n<s>\n"
    assert tok.printed_bytes(0, 0x07 + 3) == b""  # safe_printf drops a lone BEL byte
    assert tok.printed_bytes(0, 0x0A + 3) == b"\n"  # and keeps C whitespace
    assert tok.printed_bytes(0, 0xF0 + 3) == b"\xf0"  # bytes >= 0x80 go to UTF-8 decoding
    assert tok.token_bytes(hello) == b" Hello" and tok.token_bytes(0x41 + 3) == b"A"
    with pytest.raises(IndexError):
        tok.printed_bytes(0, 32000)


def test_printed_bytes_of_byte_level_tokens():
    tok = BUILDERS["hf byte-level"]()
    the = tok.tokens.index("\u0120the")  # "Ġthe": Ġ stands for the byte 0x20 in GPT-2's table
    assert tok.printed_bytes(-1, the) == b" the" == tok.printed_bytes(tok.bos_id, the)
    assert tok.printed_bytes(-1, tok.bos_id) == b""
    assert tok.printed_bytes(-1, tok.bos_id, special=True) == b"<|begin_of_text|>"
    with pytest.raises(IndexError):
        tok.printed_bytes(-1, tok.vocab_size)
    tik = _tiny_tiktoken()
    assert tik.printed_bytes(-1, 256) == b"ab"
    assert tik.printed_bytes(-1, tik.bos_id) == b""
    assert tik.printed_bytes(-1, tik.eos_id, special=True) == b"<|end_of_text|>"


# ---------------------------------------------------------------------- the stream's end


def _push_bytes(stream: StreamDecoder, data: bytes) -> str:
    """Feed llama2.c byte tokens (byte b is id b + 3 in tokenizer.bin) after a non-BOS token."""
    return "".join(stream.push(0, b + 3) for b in data)


def test_flush_drops_a_character_cut_short_only_when_asked():
    tok = BUILDERS["llama2c tokenizer.bin"]()
    for cut in range(1, 4):
        stream = tok.stream_decoder()
        assert _push_bytes(stream, b"ok" + LLAMA[:cut]) == "ok"  # held back, unfinished
        assert stream.flush(drop_incomplete=True) == ""
        assert _push_bytes(stream, LLAMA) == "🦙"  # flush reset the stream
        assert stream.flush(drop_incomplete=True) == ""
    stream = tok.stream_decoder()
    _push_bytes(stream, LLAMA[:2])
    assert stream.flush() == "\ufffd"  # by default the text is whole: a broken character


@pytest.mark.parametrize("held, could_finish", [
    (b"\xc3", True),  # é = C3 A9
    (b"\xe2\x82", True),  # € = E2 82 AC
    (b"\xe0", True),  # E0 then A0..BF (RFC 3629)
    (b"\xed\x9f", True),  # ED 9F BF = U+D7FF, the last before the surrogates
    (b"\xed\xa0", False),  # ED A0..BF would be a surrogate: never a character
    (b"\xf4\x8f\xbf", True),  # F4 8F BF BF = U+10FFFF
])
def test_flush_keeps_u_fffd_for_bytes_that_cannot_become_a_character(held, could_finish):
    tok = BUILDERS["llama2c tokenizer.bin"]()
    stream = tok.stream_decoder()
    assert _push_bytes(stream, held) == ""  # Python's decoder holds all of these
    want = "" if could_finish else held.decode("utf-8", "replace")
    assert stream.flush(drop_incomplete=True) == want
    if not could_finish:
        assert want == "\ufffd\ufffd"  # one per maximal ill-formed subpart (ED, A0)


def test_invalid_bytes_mid_stream_stay_u_fffd():
    tok = BUILDERS["llama2c tokenizer.bin"]()
    stream = tok.stream_decoder()
    assert _push_bytes(stream, b"\xe9a") == "\ufffda"  # é in Latin-1: not UTF-8
    assert _push_bytes(stream, b"\x80") == "\ufffd"  # a lone continuation byte
    assert stream.flush(drop_incomplete=True) == ""


def test_byte_level_stream_cut_inside_an_emoji():
    tok = BUILDERS["hf byte-level"]()
    ids = tok.encode("hi 🦙", bos=False)
    assert b"".join(tok.token_bytes(t) for t in ids) == b"hi " + LLAMA
    stream = tok.stream_decoder()
    text = "".join(stream.push(p, t) for p, t in zip([-1, *ids], ids[:-1]))  # cut: no last
    assert text + stream.flush(drop_incomplete=True) == "hi "
    assert tok.decode(ids[:-1]) == "hi \ufffd"  # a whole-text decode still shows the break
