"""The n-gram pool the generations of one Session share (`--draft=ngram-pool`, llama.cpp's
ngram-mod as model): a drafter proposes what followed its last tokens in another sequence
when its own holds nothing, and a request accepts drafts it could only have got from another
request, with the ids of plain decoding."""

from __future__ import annotations

import pytest

from jllama.generation.ngram import NgramPool, PooledNgramDrafter
from jllama.generation.session import Session
from jllama.model.loading import open_model
from jllama.sampling import Sampler


def test_a_drafter_proposes_from_another_sequence_when_its_own_has_nothing():
    pool = NgramPool()
    a, b = PooledNgramDrafter(pool), PooledNgramDrafter(pool)
    assert a.draft([9, 1, 2, 3, 4, 5, 6, 7], 4) == []  # nothing before: a indexes it
    assert b.draft([8, 8, 1, 2, 3], 3) == [4, 5, 6]  # only a's sequence holds 1 2 3
    assert b.draft([8, 8, 1, 2, 3, 4, 5, 6, 7], 3) == []  # past a's end: nothing follows
    # its own occurrence first: 1 2 3 was followed by 4 in a, by 0 in b itself
    assert b.draft([8, 8, 1, 2, 3, 0, 1, 2, 3], 2) == [0, 1]


def test_a_rewound_sequence_is_no_longer_offered():
    pool = NgramPool()
    a, b = PooledNgramDrafter(pool), PooledNgramDrafter(pool)
    a.draft([1, 2, 3, 4, 5], 2)
    a.draft([7, 7, 7], 2)  # another sequence in a's list: 1 2 3 4 5 is gone
    assert b.draft([0, 1, 2, 3], 2) == []


def test_the_oldest_sequences_are_forgotten():
    pool = NgramPool(max_sequences=2)
    a = PooledNgramDrafter(pool)
    a.draft([1, 2, 3, 4, 5], 2)
    PooledNgramDrafter(pool), PooledNgramDrafter(pool)  # two more: a's is evicted
    assert pool.lookup([0, 1, 2, 3], 2) == []
    with pytest.raises(ValueError):
        NgramPool(max_sequences=0)


def test_a_request_accepts_drafts_seen_only_in_another_request():
    """The same short prompt twice through the engine (one slot, one request after the
    other): the second reply is the first's (greedy), which only the first request's sequence
    holds, so with the pool most of it is drafted from there and accepted, with plain
    decoding's ids; with `ngram` (its own tokens only) far less."""
    from jllama.engine.scheduler import Request, complete_all

    model = open_model(None)
    prompts = ["Once upon a time, Tom", "Once upon a time, Tom"]
    runs = {}
    for draft in ("none", "ngram", "ngram-pool"):
        session = Session.prepare(model, "jax", draft=draft, device_sampling=False)
        requests = [Request(session.encode(p), Sampler(temperature=0.0), max_tokens=120)
                    for p in prompts]
        streams = complete_all(session, requests, n_slots=1)
        runs[draft] = ([s.generated_ids for s in streams],
                       streams[1]._completion.generation.stats)
    plain = runs["none"][0]
    assert runs["ngram"][0] == plain and runs["ngram-pool"][0] == plain
    alone, pooled = runs["ngram"][1], runs["ngram-pool"][1]
    assert plain[1] == plain[0]
    assert pooled.accepted_tokens > alone.accepted_tokens + 40, (alone, pooled)  # 98, 25
    assert pooled.accepted_tokens > 0.6 * pooled.drafted_tokens  # 98 of 132 here
