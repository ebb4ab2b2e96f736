"""llama.cpp's samplers in jllama.sampling (logit bias, penalties, top-k, min-p, their order),
checked against values worked out by hand from llama.cpp's documented formulas
(llama_sampler_penalties, llama_sampler_top_k, llama_sampler_min_p) and OpenAI's."""

import math

import numpy as np
import pytest

from jllama.errors import SamplerError
from jllama.generation.generate import Generation
from jllama.sampling import (
    LLAMA_CPP_ORDER,
    Candidates,
    Sampler,
    SamplerConfig,
    SamplerSettingError,
    apply_logit_bias,
    apply_penalties,
    log_softmax,
    min_p_filter,
    restrict_to_vocabulary,
    check_setting,
    top_k_filter,
)

F32 = np.float32


def test_penalties_by_hand():
    logits = np.array([2.0, -1.0, 0.5, 3.0], F32)
    # counts: id0 once, id1 twice, id3 three times, id2 never; 7 is outside the vocabulary.
    out = apply_penalties(logits, [0, 1, 1, 3, 3, 3, 7], 2.0, 0.5, 0.25)
    # id0: 2/2 - 1*0.5 - 0.25; id1: -1*2 - 2*0.5 - 0.25; id2 untouched; id3: 3/2 - 3*0.5 - 0.25
    np.testing.assert_array_equal(out, np.array([0.25, -3.25, 0.5, -0.25], F32))
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0])  # not modified


def test_logit_bias_by_hand():
    out = apply_logit_bias(np.zeros(3, F32), {1: -100.0, 2: 5.0})
    np.testing.assert_array_equal(out, [0.0, -100.0, 5.0])
    assert Sampler(temperature=0, logit_bias={2: 5.0})(np.array([3.0, 1.0, 0.0], F32)) == 2
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(np.zeros(3, F32), {3: 1.0})


def test_top_k_keeps_the_k_best_sorted():
    c = top_k_filter(Candidates.of(np.array([1.0, 4.0, 3.0, 2.0], F32)), 2)
    assert c.ids.tolist() == [1, 2]
    assert top_k_filter(Candidates.of(np.ones(3, F32)), 0).ids.tolist() == [0, 1, 2]


def test_min_p_keeps_tokens_within_a_ratio_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], F32))
    assert min_p_filter(Candidates.of(logits), 0.2).ids.tolist() == [0, 1, 2]  # >= 0.1
    assert min_p_filter(Candidates.of(logits), 0.5).ids.tolist() == [0, 1]  # >= 0.25
    assert min_p_filter(Candidates.of(logits), 0.0).ids.tolist() == [0, 1, 2, 3]


def _frequencies(sampler, logits, n=4000):
    return np.bincount([sampler(logits) for _ in range(n)], minlength=logits.shape[0]) / n


def test_top_k_draws_from_the_renormalized_k_best():
    probs = np.array([0.1, 0.2, 0.3, 0.4], F32)
    freq = _frequencies(Sampler(temperature=1.0, top_p=1.0, top_k=2, seed=5), np.log(probs))
    np.testing.assert_allclose(freq, [0, 0, 0.3 / 0.7, 0.4 / 0.7], atol=0.03)


def test_min_p_draws_from_the_renormalized_survivors():
    probs = np.array([0.5, 0.3, 0.15, 0.05], F32)
    freq = _frequencies(Sampler(temperature=1.0, top_p=1.0, min_p=0.2, seed=9), np.log(probs))
    np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], atol=0.03)


def test_order_temperature_before_or_after_top_p():
    # probs 0.6, 0.3, 0.1 and top_p=0.55. llama.cpp's order cuts the untempered distribution:
    # 0.6 > 0.55 keeps token 0 alone. The default (run.c's) order cuts it after temperature 2:
    # p ~ sqrt(probs) = 0.473, 0.334, 0.193, so tokens 0 and 1 stay.
    logits = np.log(np.array([0.6, 0.3, 0.1], F32))
    default = {Sampler(temperature=2.0, top_p=0.55, seed=s)(logits) for s in range(1, 300)}
    llama = {
        Sampler(temperature=2.0, top_p=0.55, seed=s, order=LLAMA_CPP_ORDER)(logits)
        for s in range(1, 300)
    }
    assert default == {0, 1}
    assert llama == {0}


def test_greedy_applies_bias_and_penalties_first():
    logits = np.array([0.0, 2.0, 1.9], F32)
    assert Sampler(temperature=0, repeat_penalty=1.1)(logits, [1]) == 2  # 2/1.1 < 1.9
    assert Sampler(temperature=0, repeat_penalty=1.1, penalty_last_n=0)(logits, [1]) == 1


def test_generation_passes_the_history_prompt_included():
    # Token 3 has logit 2.0, token 4 1.5, the rest -10. A frequency penalty of 1 per occurrence
    # (llama.cpp's window includes the prompt) makes greedy decoding alternate, by hand:
    # prompt [1, 3]: 3 -> 1.0 < 1.5 -> 4; then 3 at 1.0 > 4 at 0.5 -> 3; 3 at 0.0 < 0.5 -> 4 ...
    logits = np.full(6, -10.0, F32)
    logits[3], logits[4] = 2.0, 1.5
    sampler = Sampler(temperature=0, frequency_penalty=1.0)
    gen = Generation(lambda token, pos: logits, [1, 3], sampler, steps=7, stop_ids=())
    list(gen)
    assert gen.generated_ids == [4, 3, 4, 3, 4, 3]
    # A window of one token: only the last token is penalized, so it alternates from the start.
    sampler = Sampler(temperature=0, frequency_penalty=1.0, penalty_last_n=1)
    gen = Generation(lambda token, pos: logits, [1, 3], sampler, steps=5, stop_ids=())
    list(gen)
    assert gen.generated_ids == [4, 3, 4, 3]
    # context_ids count too (a conversation's earlier turns).
    gen = Generation(
        lambda token, pos: logits, [1], Sampler(temperature=0, presence_penalty=1.0),
        steps=1, stop_ids=(), start_pos=2, context_ids=[3, 3],
    )
    list(gen)
    assert gen.generated_ids == [4]


def test_restrict_to_vocabulary_passes_the_history():
    sample = restrict_to_vocabulary(Sampler(temperature=0, presence_penalty=5.0), 3)
    assert sample.uses_history
    assert sample(np.array([3.0, 2.0, 0.0, 9.0], F32), [0]) == 1


def test_log_softmax_by_hand():
    out = log_softmax(np.array([0.0, math.log(3.0)], F32))
    np.testing.assert_allclose(out, [math.log(0.25), math.log(0.75)], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(top_k=True), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p="0.1"), "min_p"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(penalty_last_n=-2), "penalty_last_n"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={1: "x"}), "logit_bias"),
        (dict(order=("top_k", "top_p")), "order"),
        (dict(wrong=1), "wrong"),
    ],
)
def test_bad_chain_settings_name_the_field(kwargs, name):
    with pytest.raises(SamplerError, match=name):
        Sampler(**kwargs)


def test_top_k_zero_or_less_is_off_as_llama_cpp_reads_it():
    # llama.cpp's llama_sampler_top_k: k <= 0 keeps every token. Stored as 0, so the configs
    # are equal, and the draws follow the whole distribution 0.1, 0.2, 0.3, 0.4.
    assert SamplerConfig(top_k=-1).top_k == 0 and SamplerConfig(top_k=-40) == SamplerConfig()
    probs = np.array([0.1, 0.2, 0.3, 0.4], F32)
    freq = _frequencies(Sampler(temperature=1.0, top_p=1.0, top_k=-1, seed=5), np.log(probs))
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_check_setting_gives_the_reason_apart_from_the_name():
    with pytest.raises(SamplerSettingError) as error:
        check_setting("top_p", 1.5)
    assert (error.value.name, error.value.reason) == (
        "top_p", "must be a number in [0, 1], got 1.5")
    assert str(error.value) == "top_p: must be a number in [0, 1], got 1.5"
    assert isinstance(error.value, SamplerError)
    with pytest.raises(SamplerSettingError, match="^temperature: must be a finite number >= 0"):
        SamplerConfig(temperature=-1)
    assert check_setting("top_k", -3) == 0
    assert check_setting("logit_bias", {5: 1, 2: -1.5}) == ((2, -1.5), (5, 1.0))
    assert check_setting("order", list(LLAMA_CPP_ORDER)) == LLAMA_CPP_ORDER
    with pytest.raises(SamplerSettingError, match="^wrong: is not a sampler setting"):
        check_setting("wrong", 1)


def test_config_with_bias_is_hashable_and_round_trips():
    config = SamplerConfig(seed=3, logit_bias={5: 1.0, 2: -1.0}, top_k=4)
    assert config.logit_bias == ((2, -1.0), (5, 1.0))
    assert hash(config) == hash(SamplerConfig(seed=3, logit_bias=((2, -1.0), (5, 1.0)), top_k=4))
    assert Sampler.from_config(config).config == config


def test_conversation_gives_the_sampler_the_whole_conversation():
    # Each turn re-encodes the conversation and feeds only what the KV cache lacks; a sampler
    # that reads the history must still see every id, the reused ones included (llama.cpp
    # counts the whole context window for its penalties).
    import types

    from jllama.model.config import ModelConfig
    from jllama.generation.conversation import Conversation
    from jllama.generation.session import Session

    logits = np.full(8, -10.0, F32)
    logits[3] = 2.0

    class Tok:  # 'x' is id 1, a digit is its own id
        stop_ids = frozenset({2})
        vocab_size = 8

        def encode_segments(self, segments, bos=False):
            return [1 if c == "x" else int(c) for text, _ in segments for c in text]

        def decode(self, ids):
            return "".join(str(i) for i in ids)

    class Template:
        def render_segments(self, messages, add_generation_prompt=True):
            text = "".join("x" + (m["content"] if m["content"].isdigit() else "")
                           for m in messages)
            return [(text + "x", True)]

    class Recorder:
        uses_history = True

        def __init__(self):
            self.histories = []

        def __call__(self, logits, history):
            self.histories.append(list(history))
            return int(np.argmax(logits))

    class Backend:
        name = "constant"

        def forward(self, token, pos):
            return logits

    config = ModelConfig(dim=8, hidden_dim=16, n_layers=1, n_heads=2, n_kv_heads=2,
                         vocab_size=8, seq_len=64)
    model = types.SimpleNamespace(config=config, tokenizer=Tok(), chat_template=None,
                                  source="mock")
    chat = Conversation(Session(model, Backend()), Template())
    sample = Recorder()
    for message in ("a", "b", "c"):
        assert [t.id for t in chat.say(message, sample, max_tokens=2)] == [3, 3]
    # turn 3 renders x, x33, x, x33, x, x: [1, 1, 3, 3, 1, 1, 3, 3, 1, 1], most of them
    # already in the KV cache from turn 2 (not fed again, but part of the history).
    assert sample.histories[-2] == [1, 1, 3, 3, 1, 1, 3, 3, 1, 1]
    assert sample.histories[-1] == [1, 1, 3, 3, 1, 1, 3, 3, 1, 1, 3]
