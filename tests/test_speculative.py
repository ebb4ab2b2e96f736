"""Speculative decoding (issue 35): the verification step's rows are `forward`'s bits, and a
greedy generation with n-gram drafts gives exactly the tokens plain greedy decoding gives.

References: `forward` one position at a time (the decode path every other test checks against
llama2.c's run.c and llama.cpp), and drafts worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_batch_decode import GGUF_GQA, GQA, gguf_backend  # noqa: F401 (a fixture)

from jllama.backends import make_backend
from jllama.backends.base import Verify
from jllama.generation.session import Session
from jllama.generation.speculative import MAX_DRAFT_TOKENS, NgramDrafter, SpeculativeDecoder
from jllama.model.loading import open_model
from jllama.model.weights import cast_weights, random_weights
from jllama.sampling import Sampler

# Runs of positions fed to one `verify` call: single rows, every compiled size, and runs that
# cross the cache block boundary at 256 (254 .. 261 and 509 .. 515 with GQA's 600 positions).
RUNS = [1, 3, 16, 8, 2, 15, 4, 9, 5, 1, 7, 12, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 14,
        8, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 13]


def _verify_against_forward(backend, n_tokens, seed=0, runs=RUNS):
    """Logits of random tokens through `forward` on one fresh cache and through `verify` runs
    on another: every row must have the same bits."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, backend.config.vocab_size, n_tokens)]
    before = backend.use_caches(backend.new_caches())
    try:
        ref = np.stack([backend.forward(t, p) for p, t in enumerate(tokens)])
        backend.use_caches(backend.new_caches())
        got, pos = [], 0
        for n in runs:
            n = min(n, n_tokens - pos)
            if n <= 0:
                break
            got.extend(backend.verify(tokens[pos:pos + n], pos))
            pos += n
    finally:
        backend.use_caches(before)
    got = np.stack(got)
    for p in range(pos):
        assert np.array_equal(got[p], ref[p]), (p, float(np.abs(got[p] - ref[p]).max()))
    return pos


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_verify_rows_are_forward_bits(dtype):
    backend = make_backend("jax", matvec="kernel")
    backend.prepare(GQA, cast_weights(random_weights(GQA, seed=4, scale=0.1), dtype))
    assert isinstance(backend, Verify) and backend.batch_kernels()
    assert _verify_against_forward(backend, 530) == 530  # across both block boundaries


def test_verify_rows_of_ggml_blocks_are_forward_bits(gguf_backend):  # noqa: F811
    assert gguf_backend.batch_kernels()
    assert _verify_against_forward(gguf_backend, 300, seed=3) == 300


def test_verify_through_xla_products_is_forward_per_position():
    backend = make_backend("jax", matvec="xla")
    backend.prepare(GQA, random_weights(GQA, seed=4, scale=0.1))
    assert not backend.batch_kernels()
    assert _verify_against_forward(backend, 40, runs=[1, 5, 16, 8, 10]) == 40


# ------------------------------------------------------------------------------------------
# Drafts worked out by hand.

def test_ngram_drafter_proposes_what_followed_the_latest_occurrence():
    d = NgramDrafter(max_n=3, min_n=2)
    history = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    # The suffix (5, 6) last occurred at 5..6, followed by 7, 1, 2, 5, 6.
    assert d.draft(history, 3) == [7, 1, 2]
    assert d.draft(history + [7], 4) == [1, 2, 5, 6]  # (5, 6, 7): latest at 5..7
    assert d.draft([1, 2, 3, 4], 4) == []  # nothing repeats
    assert d.draft([3, 3], 4) == []  # a bigram needs an earlier occurrence
    assert d.draft([3, 3, 3], 4) == [3]  # (3, 3) at 0..1, followed by 3
    assert d.draft(history, 0) == []


def test_ngram_drafter_reindexes_another_sequence():
    d = NgramDrafter(max_n=2, min_n=2)
    assert d.draft([1, 2, 3, 1, 2], 2) == [3, 1]
    assert d.draft([7, 8, 9, 7, 8], 2) == [9, 7]  # not [3, 1] from the first sequence
    d = NgramDrafter()  # trigrams and longer
    assert d.draft([1, 2, 3, 1, 2], 2) == []
    assert d.draft([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]


def test_decoder_accepts_up_to_the_first_mismatch_and_keeps_the_targets_token():
    """A fake target whose argmax after token t is t + 1 (mod 10): drafts of the right tokens
    are accepted, the first wrong one is replaced by the target's."""
    vocab = 10

    def verify(tokens, start_pos):
        rows = np.zeros((len(tokens), vocab), np.float32)
        for r, t in enumerate(tokens):
            rows[r, (t + 1) % vocab] = 1.0
        return rows

    class Fixed:
        def __init__(self, draft):
            self.next = draft

        def draft(self, history, k):
            return self.next[:k]

    drafter = Fixed([4, 5, 9, 9])
    dec = SpeculativeDecoder(verify, drafter, [1, 2], stop_ids=[0], seq_len=100, max_draft=4)
    # token 3 at pos 2: target 4, 5, 6; the draft's 4, 5 match, its 9 does not -> 4, 5, 6.
    assert dec(3, 2, 50) == ([4, 5, 6], True)
    assert dec.history == [1, 2, 3, 4, 5]
    assert (dec.stats.drafted_tokens, dec.stats.accepted_tokens) == (4, 2)
    drafter.next = [8, 9, 0, 1]  # the stop token 0 is not fed: the draft is cut before it
    assert dec(7, 5, 50) == ([8, 9, 0], True)  # ends at the target's stop token
    drafter.next = [1, 2, 3]
    assert dec(0, 9, 2) == ([1, 2], True)  # n = 2 tokens wanted: one draft token fed
    assert dec(0, 98, 50) == ([1, 2], True)  # position 99 is the context's last
    assert dec(0, 99, 50) == ([1], True)  # no room after it to feed a draft


def test_decoder_stops_at_logits_that_are_not_finite():
    def verify(tokens, start_pos):
        rows = np.zeros((len(tokens), 4), np.float32)
        rows[:, 1] = 1
        rows[1, 2] = np.nan
        return rows

    class Ones:
        def draft(self, history, k):
            return [1] * k

    dec = SpeculativeDecoder(verify, Ones(), [0], stop_ids=[], seq_len=50, max_draft=3)
    assert dec(1, 1, 10) == ([1], False)


def test_max_draft_is_checked():
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeDecoder(lambda t, p: None, NgramDrafter(), [], [], 10,
                           max_draft=MAX_DRAFT_TOKENS + 1)


# ------------------------------------------------------------------------------------------
# Whole generations: the same tokens with and without drafts.

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. "
          "Once upon a time, there was a little girl named")


def _greedy(model, backend, draft, steps, decode="auto", prompt=PROMPT, **options):
    session = Session.prepare(model, backend, decode=decode, draft=draft, **options)
    generation = session.generate(session.encode(prompt), Sampler(temperature=0.0),
                                  steps=steps)
    return [t.id for t in generation], generation.speculation


@pytest.mark.parametrize("backend, decode", [("jax", "auto"), ("jax", "graph"),
                                             ("numpy", "auto")])
def test_greedy_with_ngram_drafts_is_plain_greedy(backend, decode):
    model = open_model(None)
    steps = 256 if backend == "jax" else 120
    plain, none = _greedy(model, backend, "none", steps, decode)
    drafted, decoder = _greedy(model, backend, "ngram", steps, decode)
    assert none is None
    assert drafted == plain
    assert decoder.stats.drafted_tokens > 0 and decoder.stats.accepted_tokens > 0  # used


def test_an_unknown_drafter_is_refused():
    with pytest.raises(ValueError, match="draft='eagle'"):
        Session(open_model(None), make_backend("numpy"), draft="eagle")


_AVX2_CHECK = """
import json, sys
sys.path.insert(0, "tests")
from test_speculative import _greedy, _verify_against_forward
from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.kernels import library
model = open_model(None)
backend = make_backend("jax", matvec="kernel")
backend.prepare(model.config, model.weights)
rows = _verify_against_forward(backend, 270)
plain, _ = _greedy(model, "jax", "none", 200)
drafted, decoder = _greedy(model, "jax", "ngram", 200)
print(json.dumps({"rows": rows, "same": plain == drafted,
                  "accepted": decoder.stats.accepted_tokens}))
"""


def test_the_x86_64_v3_kernels_verify_bit_exactly_too():
    """An AVX2-only machine's build (JLLAMA_MARCH=x86-64-v3: the kernels' other branches)."""
    env = {**os.environ, "JLLAMA_MARCH": "x86-64-v3"}
    done = subprocess.run([sys.executable, "-c", _AVX2_CHECK], capture_output=True, text=True,
                          env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"rows": 270, "same": True, "accepted": result["accepted"]}
    assert result["accepted"] > 0


EDIT = ("Repeat the following passage exactly, but change 'keeper' to 'guardian':\n\n"
        "The old lighthouse stood at the edge of the cliff, its white paint peeling in long "
        "strips. Every evening the keeper climbed the one hundred and twelve steps to light the "
        "lamp, and every morning he climbed them again to put it out.")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, draft, decode", [
    (None, "ngram", "auto"), (None, "ngram", "graph"), ("int8", "ngram", "auto"),
    ("float32", "self:q4", "auto"), (None, "self:int8", "graph")])
def test_smollm2_greedy_with_drafts_is_plain_greedy(smollm2_gguf, dtype, draft, decode):
    """The shipped Q4_1 SmolLM2 (GGML blocks through the x8 kernels), as Q8_0 blocks
    (--dtype=int8) and dequantized to float32, asked to repeat a passage with one change: most
    of the reply is drafted and accepted, and the ids are plain decoding's."""
    from jllama.chat import ChatTemplate

    model = open_model(smollm2_gguf, dtype=dtype)
    prompt = ChatTemplate(model.chat_template).render([{"role": "user", "content": EDIT}])
    runs = {}
    for drafter in ("none", draft):
        session = Session.prepare(model, "jax", decode=decode, draft=drafter, draft_tokens=15)
        generation = session.generate(session.encode(prompt, parse_special=True),
                                      Sampler(temperature=0.0), max_tokens=96)
        runs[drafter] = ([t.id for t in generation], generation.stats)
    (plain, _), (drafted, stats) = runs["none"], runs[draft]
    assert len(plain) > 60 and drafted == plain
    assert stats.accepted_tokens > 20


@pytest.mark.slow
def test_a_random_stories110m_shape_model_with_drafts_is_plain_greedy():
    """llama2.c's stories110M shape (dim 768, 12 layers, 12 heads, vocab 32000), random
    weights: its greedy tokens repeat little, so the n-gram drafter is mostly rejected and
    the int8 self-draft mostly accepted; plain decoding's ids either way."""
    from jllama.model.config import ModelConfig
    from jllama.model.loading import Model

    config = ModelConfig(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12,
                         vocab_size=32000, seq_len=1024)
    weights = random_weights(config, seed=7, scale=0.05)
    prompt = [1] + [int(t) for t in np.random.default_rng(3).integers(3, 32000, 40)] * 2
    ids = {}
    backend = make_backend("jax")
    backend.prepare(config, weights)
    for draft in ("none", "ngram"):
        backend.use_caches(backend.new_caches())
        drafter = NgramDrafter() if draft == "ngram" else None
        decoder = SpeculativeDecoder(backend.verify, drafter, prompt, [], config.seq_len,
                                     15) if drafter else None
        out, token, pos = [], prompt[-1], len(prompt) - 1
        backend.prefill(prompt[:-1], 0)
        while len(out) < 96:
            if decoder is None:
                nxt = [int(np.argmax(backend.forward(token, pos)))]
            else:
                nxt, _ = decoder(token, pos, 96 - len(out))
            out += nxt
            token, pos = nxt[-1], pos + len(nxt)
        ids[draft] = out[:96]
        if decoder is not None:
            assert decoder.stats.drafted_tokens > 0
    assert ids["ngram"] == ids["none"]


# ------------------------------------------------------------------------------------------
# The scheduler (the server's engine): drafts while a request decodes alone, the batched step
# beside others; the same tokens either way.

def _scheduled(draft, prompts, n_slots=4):
    from jllama.engine.scheduler import Request, complete_all

    model = open_model(None)
    session = Session.prepare(model, "jax", draft=draft, device_sampling=False)
    requests = [Request(session.encode(p), Sampler(temperature=0.0), max_tokens=150)
                for p in prompts]
    streams = complete_all(session, requests, n_slots=n_slots)
    return [s.generated_ids for s in streams], [s._completion.generation.stats for s in streams]


def test_scheduled_requests_with_drafts_give_the_plain_tokens():
    prompts = [PROMPT, "Lily and Ben went to the park. Lily and Ben", "Once upon a time"]
    alone_plain, _ = _scheduled("none", prompts[:1])
    alone, stats = _scheduled("ngram", prompts[:1])
    assert alone == alone_plain and stats[0].accepted_tokens > 0  # drafted while alone
    together_plain, _ = _scheduled("none", prompts)
    together, stats = _scheduled("ngram", prompts)
    assert together == together_plain
    assert together[0] == alone[0]  # batch-invariant rows, drafted or not


# ------------------------------------------------------------------------------------------
# Sampled generations: each token's distribution is the sampler's, drafts or not.

def test_sampled_drafts_keep_the_samplers_distribution():
    """A Markov chain of 5 tokens (the logits after token t are row t of a fixed table) with
    drafts of 2 tokens, right or wrong: the frequencies of 3-token continuations over 6000
    runs against the chain's probabilities worked out in float64 (chi-square, p > 0.01), and
    against plain draws' frequencies."""
    from scipy.stats import chisquare

    vocab, temperature = 5, 1.5
    table = np.random.default_rng(2).normal(0, 1, (vocab, vocab)).astype(np.float32)

    def verify(tokens, start_pos):
        return np.stack([table[t] for t in tokens])

    class NextTwo:  # drafts the two tokens after the last one, cyclically
        def draft(self, history, k):
            return [(history[-1] + 1) % vocab, (history[-1] + 2) % vocab][:k]

    p = np.exp(table.astype(np.float64) / np.float32(temperature))
    p /= p.sum(axis=1, keepdims=True)
    expected = np.array([p[0, a] * p[a, b] * p[b, c] for a in range(vocab)
                         for b in range(vocab) for c in range(vocab)])
    runs = 6000
    counts = np.zeros(vocab ** 3)
    drafted = accepted = 0
    for seed in range(runs):
        decoder = SpeculativeDecoder(verify, NextTwo(), [], stop_ids=[], seq_len=100,
                                     max_draft=2, sampler=Sampler(temperature, 1.0, seed + 1))
        out, token, pos = [], 0, 0
        while len(out) < 3:
            ids, _ = decoder(token, pos, 3 - len(out))
            out += ids
            token, pos = ids[-1], pos + len(ids)
        counts[(out[0] * vocab + out[1]) * vocab + out[2]] += 1
        drafted += decoder.stats.drafted_tokens
        accepted += decoder.stats.accepted_tokens
    assert 0 < accepted < drafted  # both paths taken
    keep = expected * runs >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    wanted = np.append(expected[keep], expected[~keep].sum()) * runs
    assert chisquare(observed, wanted).pvalue > 0.01


def test_sampled_generations_with_drafts_run_and_count_them():
    model = open_model(None)
    session = Session.prepare(model, "jax", draft="ngram")
    generation = session.generate(session.encode(PROMPT), Sampler(temperature=0.5, seed=3),
                                  steps=200)
    ids = [t.id for t in generation]
    assert len(ids) > 40 and generation.speculation is not None
    again = session.generate(session.encode(PROMPT), Sampler(temperature=0.5, seed=3),
                             steps=200)
    assert [t.id for t in again] == ids  # seeded: reproducible


# ------------------------------------------------------------------------------------------
# A draft model: the target's own weights at a narrower type, or another checkpoint.

@pytest.mark.parametrize("draft", ["self:int8", "self:q4"])
def test_a_draft_model_gives_the_plain_tokens(draft):
    model = open_model(None)
    plain, _ = _greedy(model, "jax", "none", 200)
    drafted, decoder = _greedy(model, "jax", draft, 200)
    assert drafted == plain
    assert decoder.stats.accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(smollm2_gguf):
    from jllama.errors import JllamaError

    with pytest.raises(JllamaError) as info:
        Session.prepare(open_model(None), "jax", draft=str(smollm2_gguf))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--draft={smollm2_gguf}: ")
    assert "49152 tokens" in message and "512" in message


def test_the_command_decodes_with_a_draft_model():
    done = subprocess.run(
        [sys.executable, "-m", "jllama", "--temperature=0", "--steps=120", "--draft=self:int8",
         f"--prompt={PROMPT}", "--output_format=json"], capture_output=True, text=True,
        timeout=300)
    plain = subprocess.run(
        [sys.executable, "-m", "jllama", "--temperature=0", "--steps=120", f"--prompt={PROMPT}",
         "--output_format=json"], capture_output=True, text=True, timeout=300)
    got, want = json.loads(done.stdout), json.loads(plain.stdout)
    assert got["generated_ids"] == want["generated_ids"]
    assert got["accepted_tokens"] > 0 and want["drafted_tokens"] == 0


def test_the_server_drafts_a_lone_request_and_counts_it_in_metrics():
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from jllama.backends import prepared_backend
    from jllama.server import ServerThread

    model = open_model(None)
    body = {"model": "m", "prompt": PROMPT, "temperature": 0, "max_tokens": 120}
    texts, counts = {}, {}
    for draft in ("none", "ngram"):
        with ServerThread(model, prepared_backend(model, "jax"), "m", parallel=2,
                          draft=draft) as server:
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
            texts[draft] = reply["choices"][0]["text"]
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
        counts[draft] = {s.name: s.value for f in text_string_to_metric_families(metrics)
                         for s in f.samples if s.name.startswith("jllama_spec_decode")}
    assert texts["ngram"] == texts["none"] and len(texts["none"]) > 100
    assert counts["none"]["jllama_spec_decode_draft_tokens_total"] == 0
    drafted = counts["ngram"]["jllama_spec_decode_draft_tokens_total"]
    accepted = counts["ngram"]["jllama_spec_decode_accepted_tokens_total"]
    assert 0 < accepted <= drafted


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "self:int8"])
def test_sampled_next_tokens_of_stories260k_have_the_models_distribution(draft):
    """stories260K at temperature 1, the 3 tokens after a fixed prompt, 4000 draws with drafts
    (each from its own seed; the cache holds the prompt once, every draw rewrites the
    positions after it), against the model's own probabilities of each continuation worked
    out in float64 from `forward`'s logits (p(a) p(b | a) p(c | a, b)): chi-square, p > 0.01."""
    from scipy.stats import chisquare

    from jllama.generation.draft_model import open_draft
    from jllama.generation.speculative import make_drafter, verifier

    model = open_model(None)
    backend = make_backend("jax", matvec="kernel")
    backend.prepare(model.config, model.weights)
    prompt = model.tokenizer.encode("Lily and Ben went to the park. Lily and Ben went to the")
    backend.prefill(prompt[:-1], 0)
    drafter = make_drafter(open_draft(draft, model) if draft != "ngram" else draft)
    counts: dict[tuple, int] = {}
    drafted = 0
    for seed in range(1, 4001):
        decoder = SpeculativeDecoder(verifier(backend), drafter, prompt, [],
                                     model.config.seq_len, 4,
                                     sampler=Sampler(temperature=1.0, top_p=1.0, seed=seed))
        out, token, pos = [], prompt[-1], len(prompt) - 1
        while len(out) < 3:
            ids, _ = decoder(token, pos, 3 - len(out))
            out += ids
            token, pos = ids[-1], pos + len(ids)
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
        drafted += decoder.stats.drafted_tokens
    assert drafted > 1000  # the drafts were tested

    def probs(logits):
        z = np.asarray(logits, np.float64)
        e = np.exp(z - z.max())
        return e / e.sum()

    start = len(prompt) - 1
    first = probs(backend.forward(prompt[-1], start))
    expected = {}
    for a, b, c in counts:
        second = probs(backend.forward(a, start + 1))
        third = probs(backend.forward(b, start + 2))
        expected[(a, b, c)] = first[a] * second[b] * third[c]
    # Bins: the continuations expected 5 times or more (each is all but sure to be drawn, so
    # among those seen), and one for all the rest, drawn or not.
    keys = [k for k in sorted(counts) if expected[k] * 4000 >= 5]
    observed = np.array([counts[k] for k in keys], np.float64)
    wanted = np.array([expected[k] for k in keys]) * 4000
    observed = np.append(observed, 4000 - observed.sum())
    wanted = np.append(wanted, 4000 - wanted.sum())
    assert len(keys) >= 5 and chisquare(observed, wanted).pvalue > 0.01
