"""Constrained decoding (jllama.constrain) on the embedded stories260K: the vocabulary llguidance
sees, the mask as the first sampler step, and generations under JSON schemas, a regex, a Lark
and a GBNF grammar, each output checked by a reference independent of llguidance (`jsonschema`,
Python's `re`, a check written here), alone and in the batching engine."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from conftest import load_json
from constrain_cases import SCHEMAS

from jllama import Session
from jllama.constrain import (
    ConstrainedSampler, ConstraintError, Grammar, GrammarError, build_vocabulary, masked,
    vocabulary_for,
)
from jllama.generation.device_loop import ConstrainedLoopDecoder
from jllama.engine import Request, complete_all
from jllama.sampling import Sampler, SamplerConfig

SEEDS = (None, 1, 2, 3)  # None: greedy


@pytest.fixture(scope="module")
def session():
    return Session.open(seq_len=512)


def _sampler(seed):
    return Sampler(temperature=0.0) if seed is None else Sampler(temperature=1.0, seed=seed)


def _complete(session, grammar, seed, prompt="Once upon a time", max_tokens=100):
    completion = session.complete(prompt, _sampler(seed), max_tokens=max_tokens, grammar=grammar)
    return "".join(piece.text for piece in completion), completion


class _Recording:
    """A HistorySampler that keeps the logits it was given and picks their argmax."""

    uses_history = False

    def __init__(self):
        self.seen = []

    def __call__(self, logits, history=()):
        self.seen.append(np.array(logits))
        return int(np.argmax(logits))


def test_vocabulary_of_stories260k(session):
    tok = session.tokenizer
    v = vocabulary_for(tok)
    assert vocabulary_for(tok) is v  # built once per tokenizer
    assert v.n_logits == 512 and v.stop_ids == (1, 2) and v.end_id == 2
    assert v.special_ids == {1, 2}
    lt = v.lltokenizer
    assert [lt.is_special_token(i) for i in (0, 1, 2, 3, 300)] == [False, True, True, False, False]
    # Byte-fallback ids 3..258 are their byte; pieces keep the space they have mid-text.
    assert lt.decode_bytes([3 + 0x0A, 3 + ord("{")]) == b"\n{"
    assert lt.decode_bytes([300]) == tok.token_bytes(300) == b" ha"
    # Forced text is tokenized without SentencePiece's dummy-prefix space.
    assert lt.decode_bytes(lt.tokenize_bytes(b"ab")) == b"ab"


def test_a_padded_model_never_allows_the_ids_past_the_tokenizer(session):
    v = build_vocabulary(session.tokenizer, n_logits=520)
    c = ConstrainedSampler(_Recording(), Grammar.of("json", ""), v)
    allowed = c.allowed()
    assert allowed.shape == (520,) and allowed[:512].any() and not allowed[512:].any()
    with pytest.raises(ValueError, match="below the tokenizer"):
        build_vocabulary(session.tokenizer, n_logits=100)


def test_masked_sets_minus_inf_exactly_where_a_bit_is_0():
    bits = np.array([0b1011, 1 << 31], np.uint32).view(np.int32)
    logits = np.arange(40, dtype=np.float32)
    out = masked(logits, bits)
    allowed = [0, 1, 3, 63]
    assert [i for i in range(40) if np.isfinite(out[i])] == [i for i in allowed if i < 40]
    assert np.array_equal(out[[0, 1, 3]], logits[[0, 1, 3]])


def test_the_mask_comes_before_every_other_sampler_step(session):
    v = vocabulary_for(session.tokenizer)
    grammar = Grammar.of("regex", "(cat|dog)s")
    recording = _Recording()
    c = ConstrainedSampler(recording, grammar, v)
    allowed = c.allowed()
    logits = np.random.default_rng(0).normal(size=512).astype(np.float32)
    c(logits)
    seen = recording.seen[0]
    assert np.array_equal(np.isfinite(seen), allowed)
    assert np.array_equal(seen[allowed], logits[allowed])
    # A bias of +1000 on a disallowed id, top-k 1, greedy or not: never picked.
    banned = int(np.flatnonzero(~allowed)[5])
    for temperature in (0.0, 1.0):
        sampler = Sampler(temperature=temperature, seed=7, top_k=1, logit_bias={banned: 1000.0})
        c = ConstrainedSampler(sampler, grammar, v)
        assert c(logits) != banned


def test_end_of_generation_only_when_the_grammar_accepts(session):
    v = vocabulary_for(session.tokenizer)
    tok = session.tokenizer
    recording = _Recording()
    c = ConstrainedSampler(recording, Grammar.of("regex", "ab(cd)?"), v)
    eos_first = np.zeros(512, np.float32)
    eos_first[tok.eos_id] = 100.0
    text = b""
    while not c.accepting:
        assert not c.allowed()[tok.eos_id]
        text += tok.token_bytes(c(eos_first))
    assert text == b"ab" and c.allowed()[tok.eos_id] and not c.done
    assert c(eos_first) == tok.eos_id  # accepting: the model may end it
    d = ConstrainedSampler(_Recording(), Grammar.of("regex", "ab"), v)
    d(eos_first), d(eos_first)  # "a", "b"
    calls = len(d._sample.seen)
    assert d.done and d(eos_first) == v.end_id
    assert len(d._sample.seen) == calls  # nothing drawn once the grammar is done
    assert d.masks == 2 and d.mask_seconds > 0


def test_a_sampler_that_picks_a_masked_id_is_an_error(session):
    class Bad:
        uses_history = False

        def __call__(self, logits, history=()):
            return 300  # " ha": not allowed by "ab"

    c = ConstrainedSampler(Bad(), Grammar.of("regex", "ab"), vocabulary_for(session.tokenizer))
    with pytest.raises(ConstraintError, match="refused token 300"):
        c(np.zeros(512, np.float32))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schemas_give_valid_json(session, index):
    schema = SCHEMAS[index]
    grammar = Grammar.json_schema(schema)
    for seed in SEEDS:
        text, completion = _complete(session, grammar, seed)
        assert completion.finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), schema)
        constraint = completion.generation.constraint
        assert constraint.done or constraint.accepting
        assert constraint.masks == len(completion.generation.generated_ids)


def test_any_json_value(session):
    for seed in SEEDS:
        text, completion = _complete(session, Grammar.of("json", ""), seed, max_tokens=200)
        assert completion.finish_reason == "stop"
        json.loads(text)


def test_regex(session):
    pattern = r"(cat|dog)s? [a-z]{2,5}(, [a-z]{1,3})?"
    for seed in SEEDS + (4, 5):
        text, completion = _complete(session, Grammar.of("regex", pattern), seed)
        assert completion.finish_reason == "stop" and re.fullmatch(pattern, text), text


LARK = r"""
start: pair | pair ";" pair
pair: KEY "=" VALUE
KEY: /[a-z]{1,4}/
VALUE: /[0-9]{1,2}/
"""


def _keeps_to_lark(text: str) -> bool:
    """The language of LARK, checked by hand: one or two key=value pairs split by ";"."""
    pairs = text.split(";")
    if not 1 <= len(pairs) <= 2:
        return False
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (sep and 1 <= len(key) <= 4 and all("a" <= ch <= "z" for ch in key)
                and 1 <= len(value) <= 2 and all("0" <= ch <= "9" for ch in value)):
            return False
    return True


def test_lark_and_gbnf_grammars(session):
    assert not _keeps_to_lark("ab=1;c=22;d=3") and _keeps_to_lark("ab=1;c=22")
    for seed in SEEDS:
        text, completion = _complete(session, Grammar.of("lark", LARK), seed)
        assert completion.finish_reason == "stop" and _keeps_to_lark(text), text
    gbnf = 'root ::= ("yes" | "no" | "maybe") "!"'
    for seed in SEEDS:
        text, completion = _complete(session, Grammar.of("gbnf", gbnf), seed)
        assert completion.finish_reason == "stop" and text in ("yes!", "no!", "maybe!"), text


def test_bad_grammars_are_one_line_errors():
    for kind, text in [("json_schema", "{bad"), ("json_schema", '{"type": "nope"}'),
                       ("regex", "("), ("lark", "start: missing_rule"), ("gbnf", "root ::= (")]:
        with pytest.raises(GrammarError) as info:
            Grammar.of(kind, text)
        assert "\n" not in str(info.value) and str(info.value)


def test_grammars_that_cannot_be_matched_are_refused_before_generating(session):
    """A schema that only refers to itself matches no text, `root ::= "a" root` forces an
    endless one: both refused by `Grammar` (llguidance itself fails only mid-generation).
    `true` is any value, `false` none (JSON Schema's boolean schemas)."""
    for kind, text, reason in [
        ("json_schema", {"$ref": "#"}, "matches no text"),
        ("json_schema", {"anyOf": [{"$ref": "#"}]}, "matches no text"),
        ("json_schema", False, "matches no value"),
        ("gbnf", 'root ::= ("a" root)\n', "forces an endless text"),
        ("lark", 'start: "a" start', "forces an endless text"),
    ]:
        with pytest.raises(GrammarError, match=reason):
            Grammar.of(kind, text)
    text, _ = _complete(session, Grammar.json_schema(True), None, max_tokens=60)
    json.loads(text)


def test_without_a_grammar_the_tokens_are_unchanged(session):
    case = next(c for c in load_json("generate_stories260K.json")["cases"]
                if c["temperature"] == 0.0 and c["prompt"] == "")
    completion = session.complete(case["prompt_ids"], Sampler(temperature=0.0),
                                  max_tokens=case["steps"] - 1, grammar=None)
    "".join(piece.text for piece in completion)
    expected = case["generated_ids"]
    assert completion.generation.generated_ids == expected[: len(completion.generation.generated_ids)]
    assert completion.generation.constraint is None


def test_the_device_loop_mode_masks_on_the_device_as_graph_mode_on_the_host():
    """The loop mode's masked program (one token per call) gives the tokens and the random
    draws of the host path, and the schema holds; a chat turn after it (the cache it left)
    is the same in both modes."""
    loop = Session.open(seq_len=512, decode="loop")
    graph = Session.open(seq_len=512, decode="graph")
    grammar = Grammar.json_schema(SCHEMAS[6])
    assert loop.decode_mode(Sampler(temperature=0.0)) == "loop"
    for seed in SEEDS:
        a, done = _complete(loop, grammar, seed)
        b, _ = _complete(graph, grammar, seed)
        assert isinstance(done.generation._decode_loop, ConstrainedLoopDecoder)  # not graph mode
        assert a == b
        jsonschema.validate(json.loads(a), SCHEMAS[6])
    for seed in (None, 5):
        turns = []
        for session in (loop, graph):
            sampler = _sampler(seed)
            first = session.complete("Once", sampler, max_tokens=40, grammar=grammar)
            "".join(p.text for p in first)
            gen = first.generation
            ids = gen.prompt_ids + gen.generated_ids
            assert gen.end_pos == len(ids)  # the last token fed, as in graph mode
            after = session.complete(ids + [5, 6], sampler, max_tokens=12, start_pos=len(ids))
            turns.append(("".join(p.text for p in after), seed and sampler.rng.state))
        assert turns[0] == turns[1]
    # The loop still runs a free generation after a constrained one.
    assert loop.decode_mode(Sampler(temperature=0.0)) == "loop"


def test_the_engine_gives_each_slot_its_own_matcher_and_the_tokens_alone(session):
    ids = session.encode("Once upon a time")
    grammars = [Grammar.json_schema(SCHEMAS[i]) for i in (6, 9, 11)] + [
        Grammar.of("regex", r"(cat|dog)s? [a-z]{2,5}"), None]
    requests = []
    for k in range(10):
        temperature = 0.0 if k % 3 == 0 else 1.0
        requests.append(Request(ids, SamplerConfig(temperature=temperature, seed=k + 1),
                                max_tokens=60, grammar=grammars[k % len(grammars)]))
    streams = complete_all(session, requests, n_slots=4)
    for request, stream in zip(requests, streams):
        alone = session.complete(ids, Sampler.from_config(request.sampler), max_tokens=60,
                                 grammar=request.grammar)
        text = "".join(piece.text for piece in alone)
        assert stream.generated_ids == alone.generation.generated_ids
        assert stream.text == text and stream.finish_reason == alone.finish_reason
        if request.grammar is not None:
            assert stream.finish_reason == "stop"
            if request.grammar.kind == "regex":
                assert re.fullmatch(r"(cat|dog)s? [a-z]{2,5}", text)
            else:
                jsonschema.validate(json.loads(text), json.loads(request.grammar.source))


def test_ignore_eos_still_ends_when_the_grammar_is_complete(session):
    completion = session.complete("Once", Sampler(temperature=0.0), max_tokens=50,
                                  ignore_eos=True, grammar=Grammar.of("regex", "(cat|dog)s?"))
    text = "".join(piece.text for piece in completion)
    assert completion.finish_reason == "stop" and re.fullmatch("(cat|dog)s?", text)


def _tiktoken_tokenizer(folder):
    import base64

    from jllama.tokenizers.files import open_tokenizer

    ranks = {bytes((b,)): b for b in range(256)}
    for i, token in enumerate([b"ab", b" c", b"abab", b"{\"", b"\":"]):
        ranks[token] = 256 + i
    path = folder / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()),
                    encoding="ascii")
    return open_tokenizer(path)


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory, session):
    """name -> tokenizer: each kind jllama reads (llama2.c, SentencePiece and byte-level BPE
    from GGUF with Llama 2's and Llama 3's vocabularies, a tokenizer.json, tiktoken)."""
    import gzip

    from conftest import DATA

    from jllama.tokenizers.files import open_tokenizer

    folder = tmp_path_factory.mktemp("constrain_vocab")
    out = {"llama2c-512": session.tokenizer}
    for name in ("llama-spm", "llama-bpe"):
        path = folder / f"{name}.gguf"
        path.write_bytes(gzip.decompress((DATA / f"ggml-vocab-{name}.gguf.gz").read_bytes()))
        out[name] = open_tokenizer(path)
    out["tokenizer.json"] = open_tokenizer(DATA / "llama32_tiny" / "hf")
    out["tiktoken"] = _tiktoken_tokenizer(folder)
    return out


@pytest.mark.parametrize("name", ["llama2c-512", "llama-spm", "llama-bpe", "tokenizer.json",
                                  "tiktoken"])
def test_every_vocabulary_kind(vocabularies, name):
    tok = vocabularies[name]
    v = vocabulary_for(tok)
    lt = v.lltokenizer
    n = tok.vocab_size
    assert v.n_logits == n and set(v.stop_ids) == set(tok.stop_ids) and v.end_id in v.stop_ids
    assert set(tok.control_ids) <= v.special_ids
    ids = range(n) if n < 2000 else range(0, n, 97)
    for i in ids:
        if i in v.special_ids or tok.token_bytes(i)[:1] == b"\xff":
            # 0xFF (never in UTF-8) is llguidance's mark of a special token: a byte token
            # b"\xff" is one too, and no text grammar allows it.
            assert lt.is_special_token(i), i
        else:
            assert lt.decode_bytes([i]) == tok.token_bytes(i), i
    for text in (b"hello world", b"ab", b'{"x": 1}\n'):
        assert lt.decode_bytes(lt.tokenize_bytes(text)) == text
    # Random logits under a schema: the tokens' bytes, joined, are valid (no model involved).
    schema = SCHEMAS[6]
    rng = np.random.default_rng(len(name))
    for seed in (1, 2):
        c = ConstrainedSampler(Sampler(temperature=1.0, seed=seed), Grammar.json_schema(schema),
                               v)
        out = []
        while (token := c(rng.normal(size=n).astype(np.float32) * 3)) not in v.stop_ids:
            out.append(token)
            assert len(out) < 400
        jsonschema.validate(json.loads(b"".join(tok.token_bytes(t) for t in out)), schema)
