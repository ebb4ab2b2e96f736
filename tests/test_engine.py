"""The scheduler: requests beside each other give what they give alone (the same seeded
tokens), slots interleave and free, a shared prefix is reused, cancelling, no recompilation
as slots fill and empty. Stories260K on the jax backend."""

from __future__ import annotations

import dataclasses

import pytest
from test_prefill import _compiles  # the programs compiled inside a `with` block

from jllama.backends import make_backend
from jllama.engine import Request, Scheduler, complete_all
from jllama.model.loading import open_model
from jllama.sampling import Sampler, SamplerConfig
from jllama.generation.session import Session


@pytest.fixture(scope="module")
def session():
    model = open_model(seq_len=256)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    return Session(model, backend, device_sampling=False)


PROMPTS = ["Once upon a time", "Tom had a dog", "The sun was", "Lily and Ben went",
           "One day", "A little bird", "The king said", "Sam liked"]


def _requests(session, n=8, max_tokens=40):
    tok = session.tokenizer
    return [Request(tok.encode(PROMPTS[i % len(PROMPTS)]),
                    SamplerConfig(temperature=0.9, top_p=0.9, seed=100 + i),
                    max_tokens=max_tokens) for i in range(n)]


def test_requests_side_by_side_give_what_they_give_alone(session):
    requests = _requests(session)
    alone = [session.text(r.prompt_ids, r.sampler, max_tokens=r.max_tokens) for r in requests]
    for slots in (1, 3, 8):
        streams = complete_all(session, requests, n_slots=slots)
        assert [s.text for s in streams] == alone, slots
        assert all(s.finish_reason in ("stop", "length") for s in streams)


def test_the_decoding_streams_share_one_batched_step_and_give_the_same_tokens(session):
    backend = session.backend
    calls = []
    batched = backend.decode_batch

    def counted(tokens, positions, caches):
        calls.append(len(tokens))
        return batched(tokens, positions, caches)

    requests = _requests(session, n=6, max_tokens=30)
    alone = [session.text(r.prompt_ids, r.sampler, max_tokens=r.max_tokens) for r in requests]
    backend.decode_batch = counted
    try:
        streams = complete_all(session, requests, n_slots=6)
    finally:
        del backend.decode_batch
    assert [s.text for s in streams] == alone
    assert calls and max(calls) == 6  # all six decoding at once, one call a step


def test_32_seeded_requests_side_by_side_give_what_they_give_alone(session):
    """32 slots decoding at once, their tokens drawn for all rows in one kernel call
    (`sample_batch`): each request's text is the host sampler's alone."""
    requests = _requests(session, n=32, max_tokens=24)
    alone = [session.text(r.prompt_ids, r.sampler, max_tokens=r.max_tokens) for r in requests]
    streams = complete_all(session, requests, n_slots=32)
    assert [s.text for s in streams] == alone


def test_every_decode_step_is_batched_even_for_tokens_that_release_no_text(session, monkeypatch):
    """A stop string holds back text that may start it ("e" before "e xq"), so some tokens
    release nothing: each still takes one batched step, no forward of its own (six
    streams of 30 tokens ending together, so none decodes alone), and every token after the
    first (drawn from the prompt's logits) is drawn by the batched kernel, not the host."""
    backend = session.backend
    forwards, host_draws = [], []
    forward = backend.forward
    host_sample = Sampler.__call__

    def counted(token, pos):
        forwards.append(pos)
        return forward(token, pos)

    def counted_draw(self, logits, *history):
        host_draws.append(1)
        return host_sample(self, logits, *history)

    requests = [dataclasses.replace(r, stop=["e xq"], ignore_eos=True)
                for r in _requests(session, n=6, max_tokens=30)]
    alone = [session.text(r.prompt_ids, r.sampler, max_tokens=r.max_tokens, stop=r.stop,
                          ignore_eos=True) for r in requests]
    assert any("e" in text for text in alone)
    backend.forward = counted
    monkeypatch.setattr(Sampler, "__call__", counted_draw)
    try:
        streams = complete_all(session, requests, n_slots=6)
    finally:
        del backend.forward
    assert [s.text for s in streams] == alone
    assert [len(s.generated_ids) for s in streams] == [30] * 6
    # No decode step goes through `forward`: at most a prompt's lone last token does (a prompt's
    # 2-7 tokens go as one padded chunk), where a decode step alone would be 29 per stream.
    assert len(forwards) <= len(requests)
    assert len(host_draws) == 6


def test_slots_take_turns_and_a_finished_request_frees_its_slot(session):
    order = []
    scheduler = Scheduler(session, n_slots=2, on_piece=lambda s, p: order.append((s, p)))
    short = scheduler.submit(Request(session.tokenizer.encode("Tom"), SamplerConfig(
        temperature=0.0), max_tokens=2))
    long = scheduler.submit(Request(session.tokenizer.encode("Lily"), SamplerConfig(
        temperature=0.0), max_tokens=30))
    third = scheduler.submit(Request(session.tokenizer.encode("Ben"), SamplerConfig(
        temperature=0.0), max_tokens=5))
    scheduler.step()
    # One round: the two admitted requests each released a piece; the third waits.
    assert [s for s, _ in order] == [short, long] and scheduler.waiting == 1
    while not short.done:
        scheduler.step()
    scheduler.step()  # the freed slot goes to the third request at the next step
    assert third._completion is not None and scheduler.running == 2
    scheduler.run()
    assert long.done and third.done and len(long.generated_ids) == 30


def test_a_shared_prefix_is_reused_and_changes_nothing(session):
    tok = session.tokenizer
    base = "Once upon a time, there was a little girl named Lily. She loved to play"
    first = Request(tok.encode(base), SamplerConfig(temperature=0.0), max_tokens=8)
    second = Request(tok.encode(base + " with her"), SamplerConfig(temperature=0.0),
                     max_tokens=8)
    cold = session.text(second.prompt_ids, second.sampler, max_tokens=8)
    scheduler = Scheduler(session, n_slots=2)
    one = scheduler.submit(first)
    scheduler.run()
    two = scheduler.submit(second)
    scheduler.run()
    assert one.cached_tokens == 0
    assert two.cached_tokens == len(first.prompt_ids)  # the whole first prompt
    assert two.text == cold


def test_cancelling_frees_the_slot_at_the_next_step(session):
    scheduler = Scheduler(session, n_slots=1)
    tok = session.tokenizer
    running = scheduler.submit(Request(tok.encode("Tom"), SamplerConfig(temperature=0.0),
                                       max_tokens=100))
    waiting = scheduler.submit(Request(tok.encode("Ben"), SamplerConfig(temperature=0.0),
                                       max_tokens=3))
    scheduler.step()
    running.cancel()
    scheduler.step()
    assert running.finish_reason == "cancelled" and len(running.generated_ids) < 100
    scheduler.step()
    assert waiting._completion is not None  # admitted into the freed slot
    scheduler.run()
    assert waiting.finish_reason in ("stop", "length")


def test_no_program_compiles_as_slots_fill_and_empty(session):
    requests = _requests(session, n=6, max_tokens=30)
    complete_all(session, requests, n_slots=3)  # compiles what these positions need
    with _compiles() as compiled:
        complete_all(session, _requests(session, n=12, max_tokens=30), n_slots=3)
    assert compiled == []


def test_no_program_compiles_for_fewer_slots_in_the_same_batch_size(session):
    """7 slots after 8: the batched step and the batched draw run in the size-8 programs
    (the draw compiled again for every number of drawing slots)."""
    complete_all(session, _requests(session, n=8, max_tokens=30), n_slots=8)
    with _compiles() as compiled:
        complete_all(session, _requests(session, n=7, max_tokens=30), n_slots=7)
    assert compiled == []


def test_a_long_prompt_admitted_mid_stream_pauses_the_others_one_chunk_at_a_time(session):
    tok = session.tokenizer
    long_prompt = tok.encode(" ".join(["Once upon a time, there was a little girl."] * 16))
    assert 150 < len(long_prompt) < 250
    pieces = {}
    scheduler = Scheduler(session, n_slots=2, prefill_chunk=64,
                          on_piece=lambda s, p: pieces.setdefault(id(s), []).append(p))
    running = scheduler.submit(Request(tok.encode("Tom"), SamplerConfig(temperature=0.0),
                                       max_tokens=60))
    for _ in range(3):
        scheduler.step()
    long = scheduler.submit(Request(long_prompt, SamplerConfig(temperature=0.0), max_tokens=5))
    steps_to_first = 0
    while id(long) not in pieces:
        before = len(pieces[id(running)])
        scheduler.step()
        steps_to_first += 1
        assert len(pieces[id(running)]) == before + 1  # the running stream never skips a step
    # A step per 64-token chunk; the last (<= 64 tokens) comes with the first new token.
    assert steps_to_first == -(-len(long_prompt) // 64)
    scheduler.run()
    alone = session.text(long_prompt, SamplerConfig(temperature=0.0), max_tokens=5)
    assert long.text == alone
