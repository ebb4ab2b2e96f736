"""A Llama 3 style Hugging Face folder end to end: weights + tokenizer.json + chat template
through `open_model` and a chat turn, checked against transformers' own `apply_chat_template`;
and the same model with Meta's tiktoken `tokenizer.model` instead of tokenizer.json."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hf_models import Spec, build, save
from test_tokenizer_hf import BASE, llama3, tiktoken_file  # noqa: F401  (fixtures)

from jllama.backends import make_backend
from jllama.chat import LLAMA3_CHAT_TEMPLATE, ChatTemplate
from jllama.generation.conversation import Conversation
from jllama.generation.session import Session
from jllama.model.loading import open_model
from jllama.sampling import Sampler

VOCAB = BASE + 256  # the trained base vocabulary, then Llama 3's 256 special tokens
SPEC = Spec("llama3-chat", {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 128, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}, seed=21)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there <|eot_id|> 1234567"},
]


@pytest.fixture(scope="module")
def folder(llama3):  # noqa: F811
    path = llama3[0]
    save(build(SPEC), SPEC, path)
    return path


def test_llama3_folder_chat_turn_matches_transformers_template(folder):
    from transformers import AutoTokenizer

    model = open_model(folder, seq_len=128)
    tok = model.tokenizer
    assert model.file_format == "hf" and model.chat_template == LLAMA3_CHAT_TEMPLATE
    assert tok.add_bos and tok.decode([tok.bos_id], special=True) == "<|begin_of_text|>"
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    session = Session(model, backend, prefill="token", compile_ahead=False)
    chat = Conversation(
        session, ChatTemplate(model.chat_template, bos_token="<|begin_of_text|>"),
        system_prompt=MESSAGES[0]["content"],
    )
    replies = list(chat.say(MESSAGES[1]["content"], Sampler(temperature=0.0), max_tokens=4))
    assert len(replies) <= 4
    ids = chat.last.prompt_ids
    # Written by hand from the Llama 3 template.
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there <|eot_id|> 1234567<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.decode(ids, special=True) == expected
    # transformers renders the same text; its ids differ only where the user typed
    # <|eot_id|>: transformers makes it the special token, jllama keeps user text as text.
    hf = AutoTokenizer.from_pretrained(folder)
    hf_ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if hasattr(hf_ids, "keys"):
        hf_ids = hf_ids["input_ids"]
    eot = tok.encode("<|eot_id|>", parse_special=True, bos=False)
    assert len(eot) == 1
    assert ids.count(eot[0]) == 2 and list(hf_ids).count(eot[0]) == 3
    plain = tok.encode(" <|eot_id|>", bos=False)
    special = tok.encode(" ", bos=False) + eot
    at = _find(ids, plain)
    assert list(hf_ids) == ids[:at] + special + ids[at + len(plain):]


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    raise AssertionError(f"{needle} not in {haystack}")


def test_meta_tiktoken_tokenizer_model_beside_the_weights(folder, tiktoken_file, tmp_path):  # noqa: F811
    meta = tmp_path / "meta"
    meta.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, meta / name)
    shutil.copy(tiktoken_file, meta / "tokenizer.model")
    via_meta = open_model(meta, seq_len=64)
    via_hf = open_model(folder, seq_len=64)
    assert type(via_meta.tokenizer).__name__ == "TiktokenTokenizer"
    assert via_meta.chat_template == LLAMA3_CHAT_TEMPLATE
    text = "Numbers 1234567, CJK 日本語, emoji 🦙 and <|eot_id|>"
    for special in (False, True):
        assert via_meta.tokenizer.encode(text, parse_special=special) == via_hf.tokenizer.encode(
            text, parse_special=special
        )
    assert via_meta.tokenizer.stop_ids >= {VOCAB - 256 + 1, VOCAB - 256 + 9}  # end_of_text, eot
    assert np.array_equal(via_meta.weights.wq, via_hf.weights.wq)


PLAIN = Spec("llama2c-able-llama3-vocab", {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB + 64,  # padded
    "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}, seed=22)


@pytest.fixture(scope="module")
def padded(llama3, tmp_path_factory):  # noqa: F811
    """A folder whose model has 64 more vocabulary rows than its tokenizer has tokens."""
    path = tmp_path_factory.mktemp("padded")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(llama3[0] / name, path / name)
    save(build(PLAIN), PLAIN, path)
    return path


def test_padded_vocabulary_never_samples_an_id_without_a_token(padded):
    import json as json_module

    from test_cli import run

    for extra in ([], ["--mode=chat"]):
        result = run(f"--checkpoint={padded}", "--prompt=Hello world", "--temperature=1.5",
                     "--top_p=1", "--seed=3", "--steps=40", *extra,
                     *(["--output_format=json"] if not extra else []))
        assert result.returncode == 0, result.stderr
        if not extra:
            ids = json_module.loads(result.stdout)["generated_ids"]
            assert ids and max(ids) < VOCAB


def test_converted_model_runs_with_its_tokenizer_json(padded, tmp_path):
    from test_cli import run

    out = tmp_path / "m.bin"
    result = run("convert", f"--checkpoint={padded}", f"--output={out}")
    assert result.returncode == 0, result.stderr
    runs = [
        run(f"--checkpoint={ckpt}", *tok, "--prompt=Hello world", "--temperature=0",
            "--steps=24", "--output_format=json")
        for ckpt, tok in ((padded, []), (out, [f"--tokenizer={padded / 'tokenizer.json'}"]))
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
    import json as json_module

    a, b = (json_module.loads(r.stdout) for r in runs)
    assert a["prompt_ids"] == b["prompt_ids"] and a["generated_ids"] == b["generated_ids"]
