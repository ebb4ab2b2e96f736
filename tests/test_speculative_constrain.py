"""Speculative decoding under a grammar (issue 35, point 4): drafts cut where the grammar forbids
them, each verified row masked by the grammar's state after the rows before it, so greedy
constrained ids are plain constrained decoding's (n-gram drafts and a draft model, loop and
graph decode) and a sampled token's distribution is the masked one."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from constrain_cases import SCHEMAS

from jllama.constrain import ConstrainedSampler, Grammar, vocabulary_for
from jllama.generation.session import Session
from jllama.generation.speculative import SpeculativeDecoder
from jllama.model.loading import open_model
from jllama.sampling import Sampler

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. "
          "Once upon a time, there was a little girl named")

GRAMMARS = {
    "schema": lambda: Grammar.json_schema(SCHEMAS[19]),
    "regex": lambda: Grammar.of("regex", r"( [A-Za-z]+[.,]?){1,60}"),
}


@pytest.fixture(scope="module")
def model():
    return open_model(None)


@pytest.fixture(scope="module")
def sessions(model):
    made = {}

    def session(decode, draft):
        if (decode, draft) not in made:
            made[decode, draft] = Session.prepare(model, "jax", decode=decode, draft=draft)
        return made[decode, draft]

    return session


def _constrained(session, grammar, prompt=PROMPT, sampler=None, steps=200):
    generation = session.generate(session.encode(prompt), sampler or Sampler(temperature=0.0),
                                  steps=steps, grammar=grammar)
    for _ in generation:
        pass
    return generation


@pytest.mark.parametrize("decode", ["auto", "graph"])
@pytest.mark.parametrize("draft", ["ngram", "self:int8"])
@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_greedy_constrained_with_drafts_is_plain_constrained(sessions, decode, draft, kind):
    plain = _constrained(sessions(decode, "none"), GRAMMARS[kind]())
    drafted = _constrained(sessions(decode, draft), GRAMMARS[kind]())
    assert plain.speculation is None and drafted.speculation is not None
    assert len(plain.generated_ids) > 8
    assert drafted.generated_ids == plain.generated_ids
    assert drafted.stop_token == plain.stop_token
    assert drafted.stats.drafted_tokens > 0
    if kind == "schema":
        text = sessions(decode, draft).tokenizer.decode(drafted.generated_ids)
        jsonschema.validate(json.loads(text), SCHEMAS[19])


def test_drafts_are_accepted_where_the_grammar_repeats_the_prompt(sessions, model):
    """A regex that spells out a phrase of the prompt: the n-gram drafter proposes it, the
    grammar allows it, the target's masked argmax agrees, so most of it is accepted."""
    phrase = " She loved to play outside. Once upon a time, there was a little girl named Lily."
    grammar = Grammar.of("regex", r" Lily\." + phrase.replace(".", r"\.").replace(",", r"\,"))
    plain = _constrained(sessions("auto", "none"), grammar)
    drafted = _constrained(sessions("auto", "ngram"), grammar)
    assert drafted.generated_ids == plain.generated_ids
    assert model.tokenizer.decode(plain.generated_ids) == " Lily." + phrase
    stats = drafted.stats
    assert stats.accepted_tokens > 10 and stats.accepted_tokens / stats.drafted_tokens > 0.8


def test_sampled_constrained_with_drafts_keeps_to_the_grammar_and_its_seed(sessions, model):
    grammar = GRAMMARS["regex"]
    runs = [_constrained(sessions("auto", "ngram"), grammar(), sampler=Sampler(
        temperature=0.8, seed=7)) for _ in range(2)]
    assert runs[0].generated_ids == runs[1].generated_ids  # seeded: reproducible
    assert runs[0].speculation is not None and len(runs[0].generated_ids) > 8
    text = model.tokenizer.decode(runs[0].generated_ids)
    assert all(word.rstrip(".,").isalpha() for word in text.split(" ")[1:]), text


class _Fixed:
    """A drafter that proposes the same tokens every time, recording what was verified."""

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, history, k):
        return list(self.tokens[:k])


def _decoder(model, grammar, drafter, logits, sampler=None, verified=None):
    vocabulary = vocabulary_for(model.tokenizer, model.config.vocab_size)
    constraint = ConstrainedSampler(Sampler(temperature=0.0), grammar, vocabulary)

    def verify(tokens, start_pos):
        if verified is not None:
            verified.append(list(tokens))
        return np.tile(logits, (len(tokens), 1))

    decoder = SpeculativeDecoder(verify, drafter, [1], (vocabulary.end_id,), 64, max_draft=8,
                                 sampler=sampler, constraint=constraint)
    return decoder, constraint


def test_a_draft_is_cut_at_the_first_token_the_grammar_forbids(model):
    tok = model.tokenizer
    cat, dog = tok.encode("cat", bos=False), tok.encode("dog", bos=False)  # " c", "at"
    logits = np.zeros(model.config.vocab_size, np.float32)
    logits[cat[0]] = 5.0  # the target prefers " c.."
    verified = []
    decoder, _ = _decoder(model, Grammar.of("regex", " (cat|dog)s"),
                                   _Fixed([*cat, *dog]), logits, verified=verified)
    decoder.k = 8
    ids, finite = decoder(1, 0, 16)
    assert finite
    assert verified == [[1, *cat]]  # " dog" after " cat" is not the grammar's: never verified
    assert ids[:len(cat)] == cat  # the draft accepted, then the masked argmax
    assert decoder.stats.drafted_tokens == len(cat)


def test_sampled_rows_under_a_grammar_have_the_masked_distribution(model):
    """At temperature 1 with a draft of one allowed token, the first token's frequencies over
    4000 draws match softmax of the logits restricted to what the grammar allows."""
    from scipy.stats import chisquare

    tok = model.tokenizer
    grammar = Grammar.of("regex", " (cat|dog|cow|pig|hen)s")
    firsts = [tok.encode(w, bos=False)[0] for w in ("cat", "dog", "cow", "pig", "hen")]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=model.config.vocab_size).astype(np.float32)
    sampler = Sampler(temperature=1.0, top_p=1.0, seed=11)  # no nucleus: the whole softmax
    decoder, constraint = _decoder(model, grammar, _Fixed([firsts[0]]), logits, sampler)
    allowed = np.flatnonzero(constraint.allowed())
    assert set(firsts) <= set(allowed.tolist())
    counts = dict.fromkeys(allowed.tolist(), 0)
    runs = 4000
    for _ in range(runs):
        decoder.k, decoder._rest = 1, 0
        ids, _ = decoder(1, 0, 2)
        counts[ids[0]] += 1
        constraint.matcher.rollback(len(ids))  # the same state for the next draw
        del decoder.history[1:]
    p = np.exp(logits[allowed].astype(np.float64) - logits[allowed].max())
    p /= p.sum()
    observed = np.array([counts[t] for t in allowed.tolist()])
    assert observed.sum() == runs
    keep = p * runs >= 5
    rest = [] if keep.all() else [~keep]  # the rare tokens pooled, where there are any
    observed = np.array([*observed[keep], *(observed[m].sum() for m in rest)])
    wanted = np.array([*p[keep], *(p[m].sum() for m in rest)])
    assert len(observed) > 2
    assert chisquare(observed, wanted * runs / wanted.sum()).pvalue > 0.01


def test_scheduled_constrained_requests_with_drafts_give_the_plain_tokens(model):
    """Through the engine (the server's scheduler): a request drafts while alone and takes the
    batched step's masked row beside others; either way its ids are the plain ones."""
    from jllama.engine.scheduler import Request, complete_all

    runs = {}
    for draft in ("none", "ngram"):
        session = Session.prepare(model, "jax", draft=draft, device_sampling=False)
        requests = [Request(session.encode(prompt), Sampler(temperature=0.0), max_tokens=80,
                            grammar=grammar)
                    for prompt, grammar in [(PROMPT, GRAMMARS["regex"]()),
                                            ("Once upon a time", GRAMMARS["schema"]()),
                                            ("Lily and Ben", None)]]
        streams = complete_all(session, requests, n_slots=3)
        runs[draft] = [s.generated_ids for s in streams]
        alone = complete_all(session, requests[:1], n_slots=1)[0]
        runs[draft, "alone"] = alone.generated_ids
        stats = alone._completion.generation.stats
    assert runs["ngram"] == runs["none"]
    assert runs["ngram", "alone"] == runs["none", "alone"] == runs["none"][0]
    assert stats.drafted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "self:int8"])
def test_smollm2_json_under_a_schema_with_drafts_is_plain(smollm2_gguf, draft):
    """SmolLM2 (Q4_1 blocks) asked to copy a JSON object from the prompt under its schema:
    the same ids with and without drafts, and most of the object drafted and accepted."""
    from jllama.chat import ChatTemplate

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer"}, "landmarks": {"type": "array", "maxItems": 4,
                                                         "items": {"type": "string",
                                                                   "maxLength": 40}}},
        "required": ["city", "country", "population", "landmarks"], "additionalProperties": False}
    record = ('{"city": "Lyon", "country": "France", "population": 522250, "landmarks": '
              '["Fourviere Basilica", "Parc de la Tete d\'Or", "Vieux Lyon"]}')
    model = open_model(smollm2_gguf)
    prompt = ChatTemplate(model.chat_template).render(
        [{"role": "user", "content": f"Repeat this JSON exactly:\n{record}"}])
    runs = {}
    for drafter in ("none", draft):
        session = Session.prepare(model, "jax", draft=drafter, draft_tokens=15)
        generation = session.generate(session.encode(prompt, parse_special=True),
                                      Sampler(temperature=0.0), max_tokens=80,
                                      grammar=Grammar.json_schema(schema))
        ids = [t.id for t in generation]
        runs[drafter] = (ids, generation.stats, generation.generated_ids)
    (plain, _, generated), (drafted, stats, _) = runs["none"], runs[draft]
    assert drafted == plain
    jsonschema.validate(json.loads(model.tokenizer.decode(generated)), schema)
    assert stats.accepted_tokens > 15, stats
