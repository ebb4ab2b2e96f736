"""A Hugging Face folder without a tokenizer of its own takes `--tokenizer` (`open_model`'s
`tokenizer`): a llama2.c tokenizer.bin, or a tokenizer.json from another folder; without one
the error is one line that says to pass --tokenizer. Folders with a tokenizer still refuse it.

The references are independent routes to the same tokenizer: the llama2.c reader on
tok512.bin, and the committed Llama 3.2-style folder read with its own tokenizer.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TOK512
from hf_models import Spec, build, save
from test_cli import _assert_one_line_error, run

from jllama.errors import TokenizerError
from jllama.formats.hf import read_hf
from jllama.model.loading import open_model
from jllama.tokenizers.llama2c import read_tokenizer

LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
TEXT = "Once upon a time, a girl named Lily"

SPEC = Spec("tok512", {  # the vocabulary of the embedded tok512.bin
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}, seed=5)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A folder of config.json and safetensors only: what save_pretrained writes for a model
    saved without its tokenizer."""
    folder = save(build(SPEC), SPEC, tmp_path_factory.mktemp("bare"))
    assert not (folder / "tokenizer.json").exists() and not (folder / "tokenizer.model").exists()
    return folder


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """The committed Llama 3.2-style folder's weights and config, its tokenizer files left out."""
    folder = tmp_path_factory.mktemp("weights_only")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(LLAMA32_TINY / name, folder / name)
    return folder


def test_a_bare_folder_takes_a_llama2c_tokenizer_bin(bare):
    model = open_model(bare, tokenizer=TOK512)
    reference = read_tokenizer(TOK512, vocab_size=512)
    assert model.file_format == "hf" and Path(model.tokenizer.source) == Path(TOK512)
    assert model.tokenizer.encode(TEXT) == reference.encode(TEXT)
    assert (model.tokenizer.bos_id, model.tokenizer.eos_id) == (reference.bos_id, reference.eos_id)
    assert np.array_equal(model.weights.wq, read_hf(bare).weights.wq)


def test_a_bare_folder_takes_a_tokenizer_json_from_elsewhere(weights_only):
    borrowed = open_model(weights_only, tokenizer=LLAMA32_TINY / "tokenizer.json").tokenizer
    own = open_model(LLAMA32_TINY).tokenizer
    for special in (False, True):
        text = "<|begin_of_text|>" + TEXT if special else TEXT
        assert borrowed.encode(text, parse_special=special) == own.encode(
            text, parse_special=special
        )
    assert (borrowed.bos_id, borrowed.eos_id, borrowed.add_bos) == (
        own.bos_id, own.eos_id, own.add_bos
    )
    assert borrowed.stop_ids == own.stop_ids


def test_a_borrowed_tokenizer_json_brings_its_chat_template(weights_only, tmp_path):
    """tokenizer_config.json beside a --tokenizer=.../tokenizer.json is read whole: its
    bos/eos and, for a folder with no chat template of its own, its chat template (as the
    folder that holds both files gives them); a folder's own template stays the folder's."""
    tokenizer = LLAMA32_TINY / "tokenizer.json"
    whole = open_model(LLAMA32_TINY)
    assert whole.chat_template  # the committed folder's, from its tokenizer_config.json
    assert open_model(weights_only, tokenizer=tokenizer).chat_template == whole.chat_template
    own = tmp_path / "own"
    shutil.copytree(weights_only, own)
    (own / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert open_model(own, tokenizer=tokenizer).chat_template == (
        "{{ messages[0]['content'] }}")


def test_a_borrowed_tokenizer_bin_brings_no_chat_template(bare):
    assert open_model(bare, tokenizer=TOK512).chat_template is None


def test_a_bare_folder_without_a_tokenizer_says_to_pass_one(bare):
    with pytest.raises(TokenizerError) as info:
        open_model(bare)
    message = str(info.value)
    assert "\n" not in message and str(bare) in message
    assert "tokenizer.json" in message and "--tokenizer" in message
    assert open_model(bare, need_tokenizer=False).tokenizer is None  # weights alone still read


def test_a_folder_with_its_own_tokenizer_still_refuses_another():
    with pytest.raises(TokenizerError, match="carries its own tokenizer"):
        open_model(LLAMA32_TINY, tokenizer=TOK512)


def _greedy(*args: str) -> dict:
    result = run(*args, f"--prompt={TEXT}", "--temperature=0", "--steps=24", "--backend=numpy",
                 "--output_format=json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_command_runs_a_bare_folder_with_tokenizer(bare, tmp_path):
    """The folder with --tokenizer=tok512.bin generates what its llama2.c conversion does with
    the same tokenizer (a route the llama2.c tests pin down)."""
    converted = tmp_path / "m.bin"
    assert run("convert", f"--checkpoint={bare}", f"--output={converted}").returncode == 0
    via_folder = _greedy(f"--checkpoint={bare}", f"--tokenizer={TOK512}")
    via_llama2c = _greedy(f"--checkpoint={converted}", f"--tokenizer={TOK512}")
    assert via_folder["prompt_ids"] == via_llama2c["prompt_ids"]
    assert via_folder["generated_ids"] == via_llama2c["generated_ids"]
    assert via_folder["generated_ids"]


def test_the_command_without_tokenizer_is_one_line(bare):
    _assert_one_line_error(run(f"--checkpoint={bare}", "--steps=4"), "--tokenizer", str(bare))
