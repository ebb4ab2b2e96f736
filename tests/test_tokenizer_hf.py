"""Tests of jllama.tokenizers.hf (Hugging Face tokenizer.json folders) and
jllama.tokenizers.tiktoken_model (Meta's Llama 3 tokenizer.model), and LLAMA3_CHAT_TEMPLATE.

Oracles, all independent of the code under test:
  - Hugging Face `tokenizers` (Rust): each vocabulary is trained here with its `BpeTrainer` on
    a small corpus (this repository's sources and some multilingual text), with the
    pre-tokenizer of the model family it stands for (Llama 3, GPT-2, SmolLM), saved as a model
    folder, and read back by `read_hf_tokenizer`. The ids `tokenizers` gives for the same file
    are the expected ones;
  - `tokenizers` with the added tokens and post-processor removed, for text whose
    special-token lookalikes must stay plain text;
  - `sentencepiece` with tests/data/tokenizer.model (Llama 2) for the SentencePiece-style
    tokenizer.json written from it here;
  - transformers' `AutoTokenizer` and `apply_chat_template`, when transformers imports.
The Llama 3 vocabulary is also written in tiktoken's format and read by `read_tiktoken_model`,
which must give `tokenizers`' ids (tiktoken does the BPE there; the test checks the file
reading, the special tokens and the pattern).
"""

from __future__ import annotations

import base64
import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jllama.chat import LLAMA3_CHAT_TEMPLATE, ChatTemplate
from jllama.errors import TokenizerError
from jllama.tokenizers.bpe import UNICODE_TO_BYTE, ByteLevelBPE
from jllama.tokenizers.hf import read_hf_chat_template, read_hf_tokenizer
from jllama.tokenizers.llama2c import Tokenizer
from jllama.tokenizers.tiktoken_model import (
    LLAMA3_PATTERN,
    LLAMA3_SPECIAL_TOKENS,
    TiktokenTokenizer,
    read_tiktoken_model,
)

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

REPO = Path(__file__).resolve().parent.parent
LLAMA2_MODEL = REPO / "tests" / "data" / "tokenizer.model"
BASE = 1500  # size of the trained Llama 3 style base vocabulary
BOT, EOT_TEXT, EOT, EOM, SOH, EOH = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
    "<|start_header_id|>", "<|end_header_id|>",
)


def sid(text: str) -> int:
    """Id of a Llama 3 special token in a vocabulary of BASE base tokens."""
    return BASE + LLAMA3_SPECIAL_TOKENS.index(text)


HARD_STRINGS = [
    "",
    " ",
    "Hello world",
    "1234567",
    "3.14159",
    "12,345,678.90 and 0.5%",
    "日本語のテキストです。",
    "你好，世界！",
    "🎉🦙 emoji 👩‍👩‍👧 ok",
    "   leading and trailing   ",
    "a  b   c    d",
    "\t\ttabs\tinside\t",
    "line\r\nbreak\r\n\r\nend",
    "\n\n\nnewlines\n",
    "I'M",
    "they'll",
    "we'VE said don't",
    "x'ſab",  # "'ſ" is a contraction for Meta's (?i:'s) regex, not for llama.cpp's '[sS]
    "def f(x):\n    return x ** 2  # square\n",
    "if (a<b) { c[i] = d->e; }",
    "naïve café Ünïcödé",
    "Привет, мир",
    "\u00a0nbsp\u3000ideographic\u2028sep",
    "<|eot_id|>",
    "user text <|eot_id|> more<|eom_id|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
    "<|eot_id",
    "a" * 300,
]


def _assigned(c: str) -> bool:
    return unicodedata.category(c) not in ("Cn", "Cs", "Co")


_PARTS = st.one_of(
    st.characters(codec="utf-8").filter(_assigned),
    st.characters(max_codepoint=0x7F),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF).filter(_assigned),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.text(alphabet=" \t\n\r\v\f\u00a0\u3000\x85", min_size=1, max_size=8),
    st.text(alphabet="0123456789.,٣²", min_size=1, max_size=8),
    st.sampled_from(["'s", "'S", "'ll", "'LL", "'ve", "n't", "'ſ", "'re", "'d", "'M"]),
    st.sampled_from(["the", " the", "Hello", " world", "def", "return", EOT, EOM, BOT, SOH]),
)
TEXTS = st.lists(_PARTS, max_size=25).map("".join)
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def corpus() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "jllama").rglob("*.py"))]
    texts.append((REPO / "README.md").read_text(encoding="utf-8"))
    texts += [p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md"))]
    texts += [
        "日本語のテキストです。你好，世界！Привет, мир. naïve café Ünïcödé 🎉🦙👩‍👩‍👧",
        "I'M here, they'll see, we'VE won, don't stop. 1234567 3.14159",
        "ſab ſabſab Wiſſenſchaft",  # a token "ſab", so that "x'ſab" tells the regexes apart
    ] * 20
    return texts


def train(pre_tokenizer, vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE trained by `tokenizers` on `corpus()`."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def tiktoken_merges(vocab: dict[str, int]) -> list[list[str]]:
    """Merges for a vocabulary given as ranks, as Llama 3's tokenizer.json has them (made from
    Meta's tiktoken file): every cut of a token into two tokens, in the order of the merged
    token's rank, then of the two sides' ranks."""
    merges = []
    for token, rank in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    return [[left, right] for *_, left, right in sorted(merges)]


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")


def without_specials(data: dict) -> tokenizers.Tokenizer:
    """The same tokenizer with no added tokens and no post-processor: special-token text is
    plain text there."""
    data = dict(data, added_tokens=[], post_processor=None)
    return tokenizers.Tokenizer.from_str(json.dumps(data))


# ---------------------------------------------------------------------- Llama 3 style


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A Llama 3 style model folder: (folder, tokenizers.Tokenizer, plain oracle)."""
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trained = train(pre_tokenizers.Sequence([split, byte_level]), BASE)
    data = json.loads(trained.to_str())
    vocab = data["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(BASE))
    data["model"]["merges"] = tiktoken_merges(vocab)
    data["model"]["ignore_merges"] = True
    tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in LLAMA3_SPECIAL_TOKENS])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOT}:0 $A:0", pair=f"{BOT}:0 $A:0 {BOT}:1 $B:1",
            special_tokens=[(BOT, sid(BOT))],
        ),
    ])
    folder = tmp_path_factory.mktemp("llama3")
    tok.save(str(folder / "tokenizer.json"))
    # As Meta's Llama 3.1 Instruct folder: no add_bos_token, EOS <|eot_id|>, three stop ids.
    write_json(folder / "tokenizer_config.json", {
        "bos_token": BOT, "eos_token": EOT, "chat_template": LLAMA3_CHAT_TEMPLATE,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
    })
    write_json(folder / "generation_config.json", {
        "bos_token_id": sid(BOT), "eos_token_id": [sid(EOT_TEXT), sid(EOM), sid(EOT)],
    })
    saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return folder, tok, without_specials(saved)


@pytest.fixture(scope="module")
def ours(llama3) -> ByteLevelBPE:
    return read_hf_tokenizer(llama3[0])


@pytest.fixture(scope="module")
def tiktoken_file(llama3, tmp_path_factory) -> Path:
    """The Llama 3 style base vocabulary in tiktoken's format: base64 of the bytes, rank."""
    vocab = llama3[1].get_vocab(with_added_tokens=False)
    lines = []
    for text, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
        data = bytes(UNICODE_TO_BYTE[c] for c in text)
        lines.append(f"{base64.b64encode(data).decode()} {rank}\n")
    path = tmp_path_factory.mktemp("meta") / "tokenizer.model"
    path.write_text("".join(lines), encoding="ascii")
    return path


@pytest.fixture(scope="module")
def meta(tiktoken_file) -> TiktokenTokenizer:
    return read_tiktoken_model(tiktoken_file)


def test_llama3_reads_as_byte_level_bpe(ours):
    assert isinstance(ours, ByteLevelBPE)
    assert ours.pre == "llama-bpe"
    assert ours.vocab_size == BASE + 256
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (sid(BOT), sid(EOT), True)
    assert ours.stop_ids == {sid(EOT_TEXT), sid(EOM), sid(EOT)}
    assert ours.control_ids == {BASE + i for i in range(256)}
    assert ours.piece(sid(EOT)) == EOT


def test_llama3_stop_ids_without_generation_config(llama3, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama3[0] / name).read_bytes())
    tok = read_hf_tokenizer(tmp_path)
    assert tok.stop_ids == {sid(EOT_TEXT), sid(EOM), sid(EOT)}


@pytest.mark.parametrize("text", HARD_STRINGS, ids=repr)
def test_llama3_ids_equal_tokenizers(llama3, ours, text):
    _, hf, plain = llama3
    assert ours.encode(text, parse_special=True) == hf.encode(text).ids
    assert ours.encode(text) == [sid(BOT)] + plain.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, bos=False) == plain.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", HARD_STRINGS, ids=repr)
def test_tiktoken_model_ids_equal_tokenizers(llama3, meta, text):
    _, hf, plain = llama3
    assert meta.encode(text, parse_special=True) == hf.encode(text).ids
    assert meta.encode(text, bos=False) == plain.encode(text, add_special_tokens=False).ids


@PROPERTY
@given(text=TEXTS)
def test_llama3_random_text(llama3, ours, meta, text):
    _, hf, plain = llama3
    expected = hf.encode(text).ids
    assert ours.encode(text, parse_special=True) == expected
    assert meta.encode(text, parse_special=True) == expected
    plain_ids = plain.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, bos=False) == plain_ids
    assert meta.encode(text, bos=False) == plain_ids
    assert ours.decode(ours.encode(text)) == text
    assert meta.decode(meta.encode(text)) == text
    assert ours.decode(expected, special=True) == BOT + text


def without_special_texts(text: str) -> str:
    """`text` as it decodes after parse_special: special tokens print nothing."""
    for special in sorted(LLAMA3_SPECIAL_TOKENS, key=len, reverse=True):
        text = text.replace(special, "")
    return text


@pytest.mark.parametrize("text", HARD_STRINGS, ids=repr)
def test_decode_round_trip_and_tokenizers_decode(llama3, ours, meta, text):
    _, _, plain = llama3
    ids = plain.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == meta.decode(ids) == plain.decode(ids) == text
    for tok in (ours, meta):
        assert tok.decode(tok.encode(text, parse_special=True)) == without_special_texts(text)
        assert tok.decode(tok.encode(text, parse_special=True), special=True) == BOT + text


@pytest.mark.parametrize("which", ["ours", "meta"])
def test_stream_decoder_never_splits_a_character(ours, meta, which):
    tok = ours if which == "ours" else meta
    text = "🦙 日本語 👩‍👩‍👧 naïve"
    ids = tok.encode(text, bos=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    stream = tok.stream_decoder()
    pieces = [stream.push(-1, t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("which", ["ours", "meta"])
def test_special_tokens_only_in_flagged_segments(ours, meta, which):
    tok = ours if which == "ours" else meta
    segments = [(f"{BOT}{SOH}user{EOH}\n\n", True), (f"say {EOT} now", False), (EOT, True)]
    ids = tok.encode_segments(segments, bos=False)
    assert ids[:2] == [sid(BOT), sid(SOH)]
    assert ids.count(sid(EOT)) == 1 and ids[-1] == sid(EOT)
    assert tok.decode(ids, special=True) == "".join(text for text, _ in segments)
    whole = "".join(text for text, _ in segments)
    assert tok.encode_segments([(whole, True)], bos=False) == tok.encode(
        whole, bos=False, parse_special=True)


def test_tiktoken_model_protocol(meta):
    assert meta.vocab_size == BASE + 256
    assert (meta.bos_id, meta.eos_id, meta.add_bos) == (sid(BOT), sid(EOT_TEXT), True)
    assert meta.stop_ids == {sid(EOT_TEXT), sid(EOM), sid(EOT)}
    assert meta.control_ids == set(range(BASE, BASE + 256))
    assert meta.encode("hi", eos=True)[-1] == sid(EOT_TEXT)
    assert meta.piece(sid("<|python_tag|>")) == "<|python_tag|>"
    assert meta.decode([sid(EOT)]) == ""
    with pytest.raises(IndexError):
        meta.decode([BASE + 256])
    with pytest.raises(TypeError):
        meta.encode(1234)


def test_llama3_special_token_list():
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    named = {BOT: 0, EOT_TEXT: 1, SOH: 6, EOH: 7, EOM: 8, EOT: 9, "<|python_tag|>": 10}
    assert {t: LLAMA3_SPECIAL_TOKENS.index(t) for t in named} == named
    assert LLAMA3_SPECIAL_TOKENS[-1] == "<|reserved_special_token_245|>"


# ---------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def auto_tokenizer(llama3):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(llama3[0]))


CHAT = [
    {"role": "system", "content": "You are a helpful assistant.  "},
    {"role": "user", "content": "What is 1234567 * 3.14159? Say <|eot_id|> too."},
    {"role": "assistant", "content": "\nAbout 3878506.8 <|eot_id|>\n"},
]


def test_llama3_chat_template_layout():
    template = ChatTemplate(LLAMA3_CHAT_TEMPLATE, bos_token=BOT, eos_token=EOT)
    expected = (
        f"{BOT}{SOH}system{EOH}\n\nYou are a helpful assistant.{EOT}"
        f"{SOH}user{EOH}\n\nWhat is 1234567 * 3.14159? Say <|eot_id|> too.{EOT}"
        f"{SOH}assistant{EOH}\n\nAbout 3878506.8 <|eot_id|>{EOT}"
    )
    assert template.render(CHAT, add_generation_prompt=False) == expected
    assert template.render(CHAT) == expected + f"{SOH}assistant{EOH}\n\n"


@pytest.mark.parametrize("text", HARD_STRINGS[:12], ids=repr)
def test_transformers_ids_equal_ours(auto_tokenizer, ours, text):
    assert auto_tokenizer(text)["input_ids"] == ours.encode(text, parse_special=True)


def test_llama3_chat_template_equals_transformers(auto_tokenizer, ours, llama3):
    template = ChatTemplate(LLAMA3_CHAT_TEMPLATE, bos_token=BOT, eos_token=EOT)
    for add in (True, False):
        expected = auto_tokenizer.apply_chat_template(
            CHAT, chat_template=LLAMA3_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=add)
        assert template.render(CHAT, add_generation_prompt=add) == expected
    text = template.render(CHAT)
    assert read_hf_chat_template(llama3[0]) == LLAMA3_CHAT_TEMPLATE
    assert text.startswith(BOT + SOH + "system" + EOH + "\n\nYou are a helpful assistant." + EOT)
    assert text.endswith(EOT + SOH + "assistant" + EOH + "\n\n")
    # transformers parses special tokens everywhere; rendered with segments, the <|eot_id|>
    # users typed stays text, and the two agree once it is counted as text.
    hf_ids = auto_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, bos=False, parse_special=True) == hf_ids
    segment_ids = ours.encode_segments(template.render_segments(CHAT), bos=False)
    assert segment_ids.count(sid(EOT)) == hf_ids.count(sid(EOT)) - 2 == 3
    assert ours.decode(segment_ids, special=True) == text


# ---------------------------------------------------------------------- GPT-2 and SmolLM


def _gpt2_style_folder(tmp_path, pre_tokenizer, config):
    tok = train(pre_tokenizer, 600)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.add_tokens([AddedToken("<|user_defined|>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    write_json(tmp_path / "tokenizer_config.json", config)
    return tok


@pytest.mark.parametrize("family, pre_tokenizer", [
    ("gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False)),
    ("smollm", pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])),
])
def test_gpt2_and_smollm_families(tmp_path, family, pre_tokenizer):
    hf = _gpt2_style_folder(tmp_path, pre_tokenizer,
                            {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    end = hf.token_to_id("<|endoftext|>")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [end, 300]})
    tok = read_hf_tokenizer(tmp_path)
    assert isinstance(tok, ByteLevelBPE) and tok.pre == family
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (end, end, False)
    assert tok.stop_ids == {end, 300} and end in tok.control_ids
    user = hf.token_to_id("<|user_defined|>")
    for text in [*HARD_STRINGS, "a<|endoftext|>b<|user_defined|>c"]:
        assert tok.encode(text, parse_special=True) == hf.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    # user-defined added tokens match always, as in tokenizers; control ones only when asked
    assert user in tok.encode("x<|user_defined|>")
    assert end not in tok.encode("x<|endoftext|>")


def test_ignore_merges_follows_the_file(tmp_path):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for text in ("bc", "ab", "abc"):
        vocab[text] = len(vocab)
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    for ignore in (True, False):
        data = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": pre,
                "post_processor": None, "decoder": None,
                "model": {"type": "BPE", "vocab": vocab, "merges": ["b c", "a b"],
                          "ignore_merges": ignore}}
        write_json(tmp_path / "tokenizer.json", data)
        write_json(tmp_path / "tokenizer_config.json", {"eos_token": "abc"})
        hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        tok = read_hf_tokenizer(tmp_path)
        expected = [vocab["abc"]] if ignore else [vocab["a"], vocab["bc"]]
        assert hf.encode("abc").ids == expected
        assert tok.encode("abc") == expected
        assert tok.encode("xabc") == hf.encode("xabc").ids


def test_ids_no_file_names_are_unused(tmp_path):
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    added = [{"id": 260, "content": "<|end|>", "special": True}]
    write_json(tmp_path / "tokenizer.json", {
        "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": []}})
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|end|>"})
    tok = read_hf_tokenizer(tmp_path)
    assert tok.vocab_size == 261 and tok.eos_id == 260 and tok.bos_id == 260
    assert tok.decode([256, vocab["h"], 257, vocab["i"], 258, 259]) == "hi"
    assert {256, 257, 258, 259, 260} <= tok.control_ids


# ---------------------------------------------------------------------- Llama 2 (SentencePiece)


def llama2_tokenizer_json(sp) -> dict:
    """tokenizer.json of a SentencePiece BPE model, laid out as Llama 2's on Hugging Face:
    byte-fallback BPE, merges for every cut of a piece into two pieces (ordered by the merged
    piece's id, then the sides' ids), "▁" prefix and spaces by the normalizer."""
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, i in vocab.items():
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((i, vocab[left], vocab[right], f"{left} {right}"))
    specials = [{"id": i, "content": sp.id_to_piece(i), "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True} for i in range(3)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [m for *_, m in sorted(merges)]},
    }


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(LLAMA2_MODEL))
    folder = tmp_path_factory.mktemp("llama2")
    data = llama2_tokenizer_json(sp)
    write_json(folder / "tokenizer.json", data)
    write_json(folder / "tokenizer_config.json",
               {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    return folder, data, sp, tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


LLAMA2_STRINGS = [s for s in HARD_STRINGS if s] + ["<s>hello</s> world", "▁under▁scores"]


def test_llama2_reads_as_sentencepiece(llama2, llama2_ours):
    _, _, sp, hf = llama2
    tok = llama2_ours
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (32000, 1, 2, True)
    assert tok.stop_ids == {2} and tok.control_ids == {0, 1, 2}
    for text in LLAMA2_STRINGS:
        expected = hf.encode(text).ids
        assert tok.encode(text, parse_special=True) == expected, text
        # sentencepiece cuts a run of spaces ("▁" included, and the dummy prefix) from the word
        # after it (whitespace-only pieces); Hugging Face's BPE, like run.c, does not.
        if "<s>" not in text and "</s>" not in text and "  " not in " " + text.replace("▁", " "):
            assert expected == [1] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text.replace("▁", " ")


@pytest.fixture(scope="module")
def llama2_ours(llama2) -> Tokenizer:
    return read_hf_tokenizer(llama2[0])


@pytest.mark.parametrize("text", [s for s in LLAMA2_STRINGS if "<s>" not in s and "</s>" not in s])
def test_llama2_decode_without_bos_matches_tokenizers(llama2, llama2_ours, text):
    # tokenizers' Strip decoder drops the leading space of the text, with BOS or without.
    hf = llama2[3]
    ids = hf.encode(text, add_special_tokens=False).ids
    assert llama2_ours.encode(text, bos=False) == ids
    assert llama2_ours.decode(ids) == hf.decode(ids) == text.replace("▁", " ")


@PROPERTY
@given(text=TEXTS)
def test_llama2_random_text(llama2, llama2_ours, text):
    hf = llama2[3]
    assert llama2_ours.encode(text, parse_special=True) == hf.encode(text).ids


def _write_llama2(folder: Path, data: dict) -> None:
    write_json(folder / "tokenizer.json", data)
    write_json(folder / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})


def test_llama2_merges_that_scores_cannot_express_are_refused(llama2, tmp_path):
    _, data, _, _ = llama2
    merges = data["model"]["merges"]
    assert {"▁ the", "▁t he", "▁th e"} <= set(merges)
    # "▁the" from "▁" + "the" and "▁th" + "e" but not from "▁t" + "he": run.c's rule (any
    # two tokens that make a token) cannot say that.
    _write_llama2(tmp_path, dict(data, model=dict(
        data["model"], merges=[m for m in merges if m != "▁t he"])))
    _one_line_error(tmp_path, r"'▁the' is both '▁t' \+ 'he' and a merge result.*could not")


def test_llama2_token_without_merges_is_never_made(llama2, tmp_path):
    _, data, _, _ = llama2
    merges = [m for m in data["model"]["merges"] if m != "▁ t"]  # "▁t"'s only merge
    _write_llama2(tmp_path, dict(data, model=dict(data["model"], merges=merges)))
    tok = read_hf_tokenizer(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["to the top", "t", " tt", "Tom the tall tree"]:
        assert tok.encode(text) == hf.encode(text).ids, text


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_llama2_metaspace_prefix_refused(llama2, tmp_path, scheme):
    _, data, _, _ = llama2
    changed = dict(data, normalizer=None, pre_tokenizer={
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False})
    write_json(tmp_path / "tokenizer.json", changed)
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    with pytest.raises(TokenizerError, match=f"Metaspace\\(prepend_scheme={scheme}"):
        read_hf_tokenizer(tmp_path)


# ---------------------------------------------------------------------- chat templates


def test_chat_template_forms(tmp_path):
    assert read_hf_chat_template(tmp_path) is None
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert read_hf_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert read_hf_chat_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").unlink()
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": [{"name": "x",
                                                                       "template": "X"}]})
    with pytest.raises(TokenizerError, match="no 'default'"):
        read_hf_chat_template(tmp_path)
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": 3})
    with pytest.raises(TokenizerError, match="chat_template is int"):
        read_hf_chat_template(tmp_path)


# ---------------------------------------------------------------------- errors


def _copy_llama3(llama3, tmp_path) -> dict:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama3[0] / name).read_bytes())
    return json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))


def _one_line_error(folder, match) -> str:
    with pytest.raises(TokenizerError, match=match) as info:
        read_hf_tokenizer(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_folder_and_files(tmp_path):
    _one_line_error(tmp_path / "nope", "no such folder")
    message = _one_line_error(tmp_path, "no such file")
    assert "tokenizer.json" in message


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_malformed_json(llama3, tmp_path, name):
    _copy_llama3(llama3, tmp_path)
    (tmp_path / name).write_text('{"model": {"type": "BPE",', encoding="utf-8")
    message = _one_line_error(tmp_path, "not valid JSON: line 1 column")
    assert name in message


@pytest.mark.parametrize("pre, found", [
    ({"type": "Whitespace"}, "Whitespace"),
    ({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True},
     "ByteLevel\\(add_prefix_space=True"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated"},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
     "Sequence\\[Split\\("),
])
def test_unknown_pre_tokenizer(llama3, tmp_path, pre, found):
    data = _copy_llama3(llama3, tmp_path)
    write_json(tmp_path / "tokenizer.json", dict(data, pre_tokenizer=pre))
    _one_line_error(tmp_path, f"pre_tokenizer {found}.*is not one jllama knows")


@pytest.mark.parametrize("change, match", [
    (lambda d: d["model"].update(type="WordPiece"), "model type 'WordPiece'"),
    (lambda d: d.update(normalizer={"type": "NFKC"}), "normalizer NFKC"),
    (lambda d: d["added_tokens"][0].update(rstrip=True), "rstrip=true"),
    (lambda d: d["model"].update(merges=[["a"]]), "merges\\[0\\].*not two tokens"),
    (lambda d: d.update(model=[]), "model is list, expected dict"),
])
def test_unsupported_tokenizer_json(llama3, tmp_path, change, match):
    data = _copy_llama3(llama3, tmp_path)
    change(data)
    write_json(tmp_path / "tokenizer.json", data)
    _one_line_error(tmp_path, match)


def test_special_token_errors(llama3, tmp_path):
    _copy_llama3(llama3, tmp_path)
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<|nope|>", "eos_token": EOT})
    _one_line_error(tmp_path, "bos_token '<\\|nope\\|>' is not a token")
    write_json(tmp_path / "tokenizer_config.json", {})
    _one_line_error(tmp_path, "no EOS token")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [BASE + 256]})
    _one_line_error(tmp_path, "generation_config.json: eos_token_id")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": sid(EOT)})
    write_json(tmp_path / "tokenizer_config.json", {"add_bos_token": "yes"})
    _one_line_error(tmp_path, "add_bos_token is 'yes', not a bool")


def test_llama_cpp_spelling_of_the_llama3_pattern(llama3, tmp_path):
    from jllama.tokenizers.bpe import PRE_TOKENIZERS

    data = _copy_llama3(llama3, tmp_path)
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = (
        PRE_TOKENIZERS["llama-bpe"].patterns[0])
    write_json(tmp_path / "tokenizer.json", data)
    tok = read_hf_tokenizer(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.pre == "llama-bpe"
    for text in HARD_STRINGS:
        assert tok.encode(text, parse_special=True) == hf.encode(text).ids, text


@pytest.mark.parametrize("content, match", [
    ("IQ== 0\nIg==\n", "line 2: expected '<base64 token> <rank>'"),
    ("IQ== 0\n\n!!!! 1\n", "line 3: '!!!!' is not base64"),
    ("IQ== 0\nIg== -1\n", "line 2: rank '-1' is not a non-negative integer"),
    ("IQ== 0\nIQ== 1\n", "line 2: token b'!' is listed twice"),
    ("IQ== 0\nIg== 0\n", "line 2: rank 0 was already given on line 1"),
    ("IQ== 0\nIg== 2\n", "rank 1 is missing"),
    ("IQ== 0\nIg== 1\n", "no token for the byte 0x00"),
    ("", "holds no tokens"),
    ("\xff", "invalid UTF-8"),
])
def test_malformed_tiktoken_file(tmp_path, content, match):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(TokenizerError, match=match) as info:
        read_tiktoken_model(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_tiktoken_file_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        read_tiktoken_model(tmp_path / "missing.model")
    with pytest.raises(TokenizerError, match="binary file"):
        read_tiktoken_model(LLAMA2_MODEL)
