"""`ChatTemplate.for_tokenizer`: bos_token / eos_token filled from the model's tokenizer, checked
against prompt texts written out by hand from the models' documented formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from jllama.chat import DEFAULT_CHATML, ChatTemplate
from jllama.errors import ChatError
from jllama.tokenizers.hf import read_hf_chat_template, read_hf_tokenizer

LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"


class ChatMLVocab:
    """A ChatML (Qwen-style) tokenizer's special tokens: no BOS, EOS <|im_end|>."""

    bos_id = None
    eos_id = 7

    def decode(self, ids, prev=-1, *, special=False):
        assert special and list(ids) == [7]
        return "<|im_end|>"


def test_llama32_template_and_tokenizer_start_with_begin_of_text():
    tokenizer = read_hf_tokenizer(LLAMA32_TINY)
    template = ChatTemplate.for_tokenizer(
        read_hf_chat_template(LLAMA32_TINY), tokenizer, source=str(LLAMA32_TINY)
    )
    assert (template.bos_token, template.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    text = template.render([{"role": "user", "content": "Hi"}], date_string="26 Jul 2024")
    # Meta's Llama 3.2 prompt format (llama.com's model card): BOS, a default system turn with
    # the knowledge cutoff and the date, the user's turn, the assistant header.
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chatml_tokenizer_without_bos():
    template = ChatTemplate.for_tokenizer(DEFAULT_CHATML, ChatMLVocab())
    assert (template.bos_token, template.eos_token) == ("", "<|im_end|>")
    text = template.render([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ends = ChatTemplate.for_tokenizer("{{ bos_token }}|{{ eos_token }}", ChatMLVocab())
    assert ends.render([{"role": "user", "content": "x"}]) == "|<|im_end|>"


def test_negative_ids_give_no_text():
    class NoSpecials(ChatMLVocab):
        bos_id = -1
        eos_id = None

    template = ChatTemplate.for_tokenizer("{{ bos_token }}{{ eos_token }}.", NoSpecials())
    assert (template.bos_token, template.eos_token) == ("", "")


def test_errors_name_the_source():
    with pytest.raises(ChatError) as error:
        ChatTemplate.for_tokenizer("{% if %}", ChatMLVocab(), source="models/x.gguf")
    assert str(error.value).startswith("models/x.gguf: chat template: line 1: ")
    with pytest.raises(ChatError, match=r"^chat template: line 1: "):
        ChatTemplate.for_tokenizer("{% if %}", ChatMLVocab())
    with pytest.raises(ChatError, match=r"^m\.gguf: chat template: source must be a str"):
        ChatTemplate.for_tokenizer(None, ChatMLVocab(), source="m.gguf")
