"""The Session's orchestration alone, on mock backends (no model), as JetStream's MockEngine:
which backend calls a generation makes, in which order, with which arguments; the decode-mode
choice; the step count; vocabulary restriction; stop ids, stop strings, log-probs, cancelling;
a conversation's turns. Expected values are worked out by hand from the scripted logits."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from jllama.backends.base import Backend, CompilePlanning, DeviceLoop, Prefill
from jllama.model.config import ModelConfig
from jllama.errors import SamplerError
from jllama.model.loading import load_model
from jllama.sampling import Sampler
from jllama.generation.session import Session

VOCAB = 512
EOS = 2


def _config(seq_len=64, vocab_size=VOCAB):
    return ModelConfig(dim=8, hidden_dim=16, n_layers=1, n_heads=2, n_kv_heads=2,
                       vocab_size=vocab_size, seq_len=seq_len)


def _model(seq_len=64, vocab_size=VOCAB, chat_template=None):
    tokenizer = load_model()[2]  # the embedded tok512: 512 tokens, BOS 1, EOS 2
    return types.SimpleNamespace(config=_config(seq_len, vocab_size), tokenizer=tokenizer,
                                 chat_template=chat_template, source="mock", weights=None)


def _next_of(token: int) -> int:
    """The mock model's rule: after token t comes t + 1 (wrapping below EOS's neighbours)."""
    return 300 + (token + 1) % 100


class ScriptedBackend:
    """forward: logits with one clear favourite, `_next_of(token)` (logit 10; every other id
    0), and, from position `eos_at` on, EOS instead. Records every call."""

    name = "scripted"

    def __init__(self, eos_at=None, vocab_size=VOCAB, favourite_of=_next_of):
        self.calls = []
        self.eos_at = eos_at
        self.vocab_size = vocab_size
        self.favourite_of = favourite_of

    def prepare(self, config, weights):
        self.calls.append(("prepare",))

    def logits(self, token, pos):
        out = np.zeros(self.vocab_size, np.float32)
        best = EOS if self.eos_at is not None and pos >= self.eos_at else self.favourite_of(token)
        out[best] = 10.0
        return out

    def forward(self, token, pos):
        self.calls.append(("forward", token, pos))
        return self.logits(token, pos)


class PlanningBackend(ScriptedBackend):
    """ScriptedBackend with batched prefill and compile planning."""

    compile_seconds = 0.0

    def prefill(self, tokens, start_pos):
        self.calls.append(("prefill", list(tokens), start_pos))
        return self.logits(tokens[-1], start_pos + len(tokens) - 1)

    def compile_for(self, prompt_len, last, kind=None, chunked=True, start=0, masked=False):
        self.calls.append(("compile_for", prompt_len, last, kind, chunked, start))
        return 0.0


class LoopBackend(PlanningBackend):
    """PlanningBackend with a device loop that samples greedily by the same rule."""

    loop_chunk = 4
    loop_masks = False  # a grammar decodes in graph mode here

    def decode_loop(self, token, pos, n, kind="greedy", temperature=1.0, top_p=1.0, coins=None,
                    stop_ids=(), allowed_bits=None):
        self.calls.append(("decode_loop", token, pos, n, kind))
        ids = []
        for _ in range(min(n, self.loop_chunk)):
            token = int(np.argmax(self.logits(token, pos)))
            ids.append(token)
            pos += 1
            if token in stop_ids:
                break
        return ids, True

    def compile_loop(self, kind="greedy", masked=False):
        self.calls.append(("compile_loop", kind))
        return 0.0


def _kinds(calls):
    return [c[0] for c in calls]


def test_the_mock_backends_have_the_capabilities_they_claim():
    assert isinstance(ScriptedBackend(), Backend)
    assert not isinstance(ScriptedBackend(), (Prefill, CompilePlanning, DeviceLoop))
    assert isinstance(PlanningBackend(), (Prefill, CompilePlanning))
    assert not isinstance(PlanningBackend(), DeviceLoop)
    assert isinstance(LoopBackend(), DeviceLoop)


def test_a_generation_compiles_then_prefills_then_decodes_token_by_token():
    backend = PlanningBackend()
    session = Session(_model(), backend, decode="graph")
    prompt = [1, 310, 320]
    generation = session.generate(prompt, Sampler(temperature=0.0), 8)
    tokens = [t.id for t in generation if t.sampled]
    # compile_for(prompt_len, last position = steps - 1, no loop kind, chunked, from 0) first;
    # then one prefill of the whole prompt; then forward of each sampled token but the last.
    assert backend.calls[0] == ("compile_for", 3, 7, None, True, 0)
    assert backend.calls[1] == ("prefill", prompt, 0)
    assert tokens == [321, 322, 323, 324, 325, 326]  # 320 -> 321 -> ... (8 - 3 + 1 tokens)
    assert backend.calls[2:] == [("forward", t, pos) for t, pos in zip(tokens[:-1], range(3, 8))]


def test_prefill_token_and_no_compile_ahead_feed_every_position_through_forward():
    backend = PlanningBackend()
    session = Session(_model(), backend, decode="graph", prefill="token", compile_ahead=False)
    list(session.generate([1, 310, 320], Sampler(temperature=0.0), 5))
    assert _kinds(backend.calls) == ["forward"] * 5  # one per position, 0 .. steps - 1
    assert [c[2] for c in backend.calls] == [0, 1, 2, 3, 4]


def test_auto_picks_the_device_loop_only_for_run_c_sampling_it_can_run():
    for sampler, host_logits, device_sampling, uses_loop in [
        (Sampler(temperature=0.0), False, True, True),
        (Sampler(temperature=0.0, top_k=40), False, True, False),  # llama.cpp's chain: host
        (Sampler(temperature=0.0), True, True, False),  # log-probs need the host's logits
        (Sampler(temperature=0.0), False, False, False),  # the server samples on the host
    ]:
        backend = LoopBackend()
        session = Session(_model(), backend, device_sampling=device_sampling)
        generation = session.generate([1, 310], sampler, 12, host_logits=host_logits)
        ids = [t.id for t in generation if t.sampled]
        assert ids == [311 + i for i in range(11)]  # the same tokens either way
        assert ("decode_loop" in _kinds(backend.calls)) == uses_loop, (sampler, host_logits)
        if uses_loop:
            # compile_loop once before the sequence, then compile_for with the loop's kind.
            assert backend.calls[0] == ("compile_loop", "greedy")
            assert backend.calls[1] == ("compile_for", 2, 11, "greedy", True, 0)
            # the first token from prefill's logits, the rest in chunks of loop_chunk = 4.
            loops = [c for c in backend.calls if c[0] == "decode_loop"]
            assert [(c[2], c[3]) for c in loops] == [(2, 10), (6, 6), (10, 2)]


def test_decode_loop_asked_for_with_a_sampler_it_cannot_run_is_refused():
    session = Session(_model(), LoopBackend(), decode="loop")
    with pytest.raises(SamplerError, match="temperature, top_p and seed only"):
        session.generate([1, 310], Sampler(temperature=0.5, top_k=3, seed=1), 8)
    padded = Session(_model(vocab_size=VOCAB + 8), LoopBackend(vocab_size=VOCAB + 8),
                     decode="loop")
    with pytest.raises(SamplerError, match="padding"):
        padded.generate([1, 310], Sampler(temperature=0.0), 8)


def test_the_loop_compiles_once_and_only_before_a_sequence():
    backend = LoopBackend()
    session = Session(_model(), backend)
    list(session.generate([1, 310], Sampler(temperature=0.0), 6))
    list(session.generate([320], Sampler(temperature=0.0), 6, start_pos=6))
    list(session.generate([1, 330], Sampler(temperature=0.0), 6))
    assert _kinds(backend.calls).count("compile_loop") == 1
    later = [c for c in backend.calls if c[0] == "compile_for"][1]
    assert later == ("compile_for", 1, 11, "greedy", True, 6)  # from start_pos 6 to 6 + 6 - 1


def test_steps_from_max_tokens_and_the_context():
    session = Session(_model(seq_len=20), PlanningBackend(), decode="graph")
    three = session.generate([1, 310, 320], Sampler(temperature=0.0), max_tokens=4)
    assert len([t for t in three if t.sampled]) == 4
    rest = session.generate([1, 310, 320], Sampler(temperature=0.0))
    assert len([t for t in rest if t.sampled]) == 20 - 3 + 1  # logits at positions 2 .. 19
    with pytest.raises(ValueError, match="steps=21"):
        session.generate([1], Sampler(temperature=0.0), 21)


def test_a_padded_vocabulary_is_never_sampled():
    # The favourite is an id past the tokenizer's 512 tokens; the runner-up is 400.
    def favourite(token):
        return VOCAB + 3

    backend = PlanningBackend(vocab_size=VOCAB + 8, favourite_of=favourite)
    real = backend.logits

    def logits(token, pos):
        out = real(token, pos)
        out[400] = 5.0
        return out

    backend.logits = logits
    session = Session(_model(vocab_size=VOCAB + 8), backend)
    ids = [t.id for t in session.generate([1], Sampler(temperature=0.0), 5) if t.sampled]
    assert ids == [400] * 5


def test_a_stop_id_ends_the_generation_and_the_completion_says_stop():
    session = Session(_model(), PlanningBackend(eos_at=5), decode="graph")
    completion = session.complete([1, 310], temperature=0.0, max_tokens=30)
    text = "".join(piece.text for piece in completion)
    # positions 1..4 predict 311..314 ... the EOS at position 5 is not part of the text.
    assert completion.generation.generated_ids == [311, 312, 313, 314]
    assert completion.finish_reason == "stop"
    tok = session.tokenizer
    assert text == tok.decode([311, 312, 313, 314], prev=310)


def test_stop_strings_cut_the_text_before_them_and_max_tokens_says_length():
    tok = _model().tokenizer
    session = Session(_model(), PlanningBackend(), decode="graph")
    whole = tok.decode(list(range(311, 321)), prev=310)
    cut = tok.decode([315], prev=314)  # a piece in the middle
    completion = session.complete([1, 310], temperature=0.0, max_tokens=10, stop=[cut])
    text = "".join(piece.text for piece in completion)
    assert text == whole[: whole.index(cut)] and completion.finish_reason == "stop"
    free = session.complete([1, 310], temperature=0.0, max_tokens=10)
    assert "".join(p.text for p in free) == whole and free.finish_reason == "length"


def test_logprobs_are_log_softmax_of_the_logits_before_sampling():
    session = Session(_model(), PlanningBackend(), decode="graph")
    pieces = list(session.complete([1, 310], temperature=0.0, max_tokens=2, logprobs=2))
    lps = [lp for piece in pieces for lp in piece.logprobs]
    # One logit of 10 among 512 zeros: p = e^10 / (e^10 + 511); each other id: 1 / (e^10 + 511)
    denominator = math.exp(10) + 511
    assert len(lps) == 2
    for lp in lps:
        assert lp.logprob == pytest.approx(10 - math.log(denominator), abs=1e-5)
        assert lp.top[0][2] == pytest.approx(lp.logprob, abs=1e-6)
        assert lp.top[1][2] == pytest.approx(-math.log(denominator), abs=1e-5)


def test_a_stream_cut_inside_a_character_ends_before_it():
    # tok512's byte tokens: <0xNN> is id 3 + NN. "é" is C3 A9; the cut leaves C3 alone.
    def favourite(token):
        return {310: 3 + 0x41, 3 + 0x41: 3 + 0xC3}.get(token, 3 + 0xA9)

    session = Session(_model(), PlanningBackend(favourite_of=favourite), decode="graph")
    cut = session.complete([1, 310], temperature=0.0, max_tokens=2)
    assert "".join(p.text for p in cut) == "A" and cut.finish_reason == "length"
    whole = session.complete([1, 310], temperature=0.0, max_tokens=3)
    assert "".join(p.text for p in whole) == "A\u00e9"


def test_cancelling_ends_the_stream_at_the_next_token():
    backend = PlanningBackend()
    session = Session(_model(), backend, decode="graph")
    seen = []
    completion = session.complete([1, 310], temperature=0.0, max_tokens=50,
                                  cancelled=lambda: len(seen) >= 3)
    for piece in completion:
        seen.append(piece)
    assert completion.finish_reason == "cancelled"
    assert _kinds(backend.calls).count("forward") <= 4


def test_a_conversation_goes_through_the_session_and_reuses_the_cache():
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    backend = PlanningBackend(eos_at=None)
    session = Session(_model(seq_len=200, chat_template=template), backend, decode="graph")
    chat = session.chat()
    first = [t.id for t in chat.say("Hi", Sampler(temperature=0.0), max_tokens=3)]
    assert len(first) == 3 and chat.last.reused == 0
    turn1 = chat.last
    compile1 = [c for c in backend.calls if c[0] == "compile_for"][-1]
    assert compile1 == ("compile_for", len(turn1.prompt_ids), len(turn1.prompt_ids) + 1, None,
                        True, 0)
    del backend.calls[:]
    list(chat.say("Again", Sampler(temperature=0.0), max_tokens=3))
    turn2 = chat.last
    held = (turn1.prompt_ids + turn1.generated_ids)[: turn2.reused]
    assert turn2.reused > len(turn1.prompt_ids) and turn2.prompt_ids[: turn2.reused] == held
    fed = len(turn2.prompt_ids) - turn2.reused
    assert backend.calls[0] == ("compile_for", fed, turn2.reused + fed + 3 - 2, None, True,
                                turn2.reused)
    assert backend.calls[1] == ("prefill", turn2.prompt_ids[turn2.reused:], turn2.reused)
    # The model's own template rendered the turns (no BOS: the template writes none).
    assert session.tokenizer.decode(turn1.prompt_ids, prev=1) == "<user>Hi<assistant>"


def test_chat_needs_a_template():
    from jllama.errors import ChatError

    session = Session(_model(), PlanningBackend())
    with pytest.raises(ChatError):
        session.chat()


def test_a_generation_overtaken_by_another_cannot_go_on():
    session = Session(_model(), PlanningBackend(), decode="graph")
    first = session.complete([1, 310], temperature=0.0, max_tokens=20)
    pieces = iter(first)
    next(pieces)
    assert session.text([1, 350], temperature=0.0, max_tokens=3)  # takes the KV cache
    with pytest.raises(RuntimeError, match="another generation"):
        list(pieces)
    # A finished generation is not affected by later ones.
    done = session.generate([1, 310], Sampler(temperature=0.0), 4)
    ids = [t.id for t in done]
    list(session.generate([1, 350], Sampler(temperature=0.0), 4))
    assert ids == [310, 311, 312, 313] and done.finished


def test_a_conversation_feeds_itself_again_after_another_generation():
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    backend = PlanningBackend()
    session = Session(_model(seq_len=200, chat_template=template), backend, decode="graph")
    chat, other = session.chat(), session.chat()
    list(chat.say("Hi", Sampler(temperature=0.0), max_tokens=3))
    list(other.say("Yo", Sampler(temperature=0.0), max_tokens=3))  # overwrites the cache
    list(chat.say("Again", Sampler(temperature=0.0), max_tokens=3))
    assert chat.last.reused == 0  # fed from position 0, not from the other's keys
    list(chat.say("More", Sampler(temperature=0.0), max_tokens=3))
    assert chat.last.reused > 0  # nothing ran in between: the cache is its own again


def test_complete_takes_one_stop_string_and_refuses_what_it_cannot_do():
    tok = _model().tokenizer
    session = Session(_model(seq_len=32), PlanningBackend(), decode="graph")
    cut = tok.decode([315], prev=314)
    text = session.text([1, 310], temperature=0.0, max_tokens=10, stop=cut)
    assert text == tok.decode(list(range(311, 315)), prev=310)
    with pytest.raises(ValueError, match="longer than"):
        session.complete(list(range(300, 340)), temperature=0.0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            session.complete([1, 310], temperature=0.0, logprobs=bad)
    with pytest.raises(TypeError, match="not both"):
        session.complete([1, 310], Sampler(temperature=0.0), temperature=1.5)
    with pytest.raises(ValueError, match="not both"):
        session.generate([1, 310], Sampler(temperature=0.0), 10, max_tokens=3)
    with pytest.raises(ValueError, match="start_pos=40"):
        session.generate([1], Sampler(temperature=0.0), start_pos=40)
