"""`ChatTemplate`: a model's chat template, rendered to prompt text as Hugging Face renders it
(transformers' `apply_chat_template(..., tokenize=False)`), and the built-in templates for
models that carry none (`DEFAULT_CHATML`, `LLAMA3_CHAT_TEMPLATE`).

The template is compiled and rendered in `jllama.chat.sandbox`; `render_segments` finds the
messages' contents in the rendered text with `jllama.chat.segments`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2

from jllama.chat.messages import Message, check_messages
from jllama.chat.sandbox import compile_template, render_template
from jllama.chat.segments import content_spans, cut
from jllama.errors import ChatError

DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the template for a model that carries none.

Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and the generation prompt is
`<|im_start|>assistant\\n`. No system line is added and no BOS is written (the tokenizer adds
BOS if the model wants one). This is the layout of OpenAI's ChatML, used by Qwen and SmolLM2.
"""

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
"""The Llama 3 instruct layout, for a Llama 3 model that carries no template (Meta's
`tokenizer.model` has none).

The text starts with `bos_token` (`<|begin_of_text|>`: the tokenizer must then not add another
BOS); each message becomes `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`
with the content stripped of surrounding whitespace, and the generation prompt is
`<|start_header_id|>assistant<|end_header_id|>\\n\\n`. This renders as Meta's Llama 3 Instruct
template on Hugging Face does. No system line or date is added (Llama 3.1's template adds
a "Cutting Knowledge Date" system message; that model's folder carries its own template).
"""


class SpecialTokenTokenizer(Protocol):
    """What `ChatTemplate.for_tokenizer` reads of a tokenizer (every jllama tokenizer has it)."""

    bos_id: int | None
    eos_id: int | None

    def decode(self, ids: Sequence[int], prev: int = -1, *, special: bool = False) -> str: ...


def _token_text(tokenizer: SpecialTokenTokenizer, token_id: int | None) -> str:
    """The text of a special token (decoded with `special=True`), "" for an id None or < 0."""
    if token_id is None or token_id < 0:
        return ""
    return tokenizer.decode([token_id], special=True)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, compiled once.

    Attributes:
      source: the Jinja text, as GGUF's `tokenizer.chat_template` or the `chat_template` of
        Hugging Face's `tokenizer_config.json` holds it (`DEFAULT_CHATML` for a model with
        none).
      bos_token: the text of the BOS token, given to the template as `bos_token` ("" if none).
      eos_token: the text of the EOS token, given to the template as `eos_token` ("" if none).

    Raises:
      ChatError: if a field is not a str, or the source does not compile ("chat template: line
        N: ...").
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in (
            ("source", self.source), ("bos_token", self.bos_token), ("eos_token", self.eos_token)
        ):
            if not isinstance(value, str):
                raise ChatError(f"chat template: {name} must be a str, got {type(value).__name__}")
        object.__setattr__(self, "_compiled", compile_template(self.source))

    @classmethod
    def for_tokenizer(
        cls,
        template_text: str,
        tokenizer: SpecialTokenTokenizer,
        *,
        source: str | None = None,
    ) -> ChatTemplate:
        """The template with `bos_token` and `eos_token` taken from the model's tokenizer, as
        transformers fills them from `tokenizer.bos_token` / `eos_token`: the one way the CLI,
        the server and scripts build a model's template.

        Args:
          template_text: the Jinja text (e.g. `Model.chat_template`, or `DEFAULT_CHATML`).
          tokenizer: the model's tokenizer; `bos_id` and `eos_id` are decoded with
            `special=True` (Llama 3: "<|begin_of_text|>", "<|eot_id|>"). An id that is None or
            negative (no such token) gives "".
          source: where the template came from (a file or folder, e.g. `Model.source`), put
            before the message of an error; None: no prefix.

        Returns:
          A `ChatTemplate`.

        Raises:
          ChatError: `template_text` is not a str or does not compile, as the constructor's,
            with "SOURCE: " in front when `source` is given.
        """
        try:
            return cls(
                template_text,
                bos_token=_token_text(tokenizer, tokenizer.bos_id),
                eos_token=_token_text(tokenizer, tokenizer.eos_id),
            )
        except ChatError as e:
            if source is None:
                raise
            raise ChatError(f"{source}: {e}") from None

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to prompt text, as transformers' `apply_chat_template(...,
        tokenize=False)`.

        Args:
          messages: the conversation (see `check_messages`).
          add_generation_prompt: ask the template to end with the header of an assistant turn
            (e.g. `<|im_start|>assistant\\n`), so the model's next tokens are the reply.
          **kwargs: more template variables (e.g. `tools`, `date_string`,
            `enable_thinking`); they override `bos_token`, `eos_token`, `tools` and `documents`.

        Returns:
          The rendered text. It may begin with `bos_token` if the template writes it: a
          tokenizer must then not add another BOS (transformers tokenizes a rendered chat with
          `add_special_tokens=False`).

        Raises:
          ChatError: a malformed message, or a template that fails as it renders (a call of
            `raise_exception`, a forbidden attribute, an error in an expression), with the
            template line where known.
        """
        return self._render(check_messages(messages), add_generation_prompt, kwargs)

    def render_segments(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[tuple[str, bool]]:
        """`render(...)`'s text cut into the template's own text and the messages' contents.

        Contract:
          - `"".join(text for text, _ in segments) == render(messages, add_generation_prompt,
            **kwargs)`, exactly.
          - A piece flagged True is text the template wrote: role headers, separators,
            `bos_token`, a default system line. Special-token text in it (`<|im_start|>`) is
            meant as special tokens.
          - A piece flagged False is text of a message's `content`, copied by the template:
            user text, whose special-token-looking characters are to be tokenized as plain
            text, so a message cannot inject control tokens. (transformers and llama.cpp both
            tokenize the whole rendered prompt with special tokens parsed, so their ids differ
            from these only where a content holds special-token text.)
          - Pieces are non-empty, and neighbours have different flags (two contents the
            template wrote side by side form one False piece). An empty content makes no piece.
          - The cuts say where special tokens may be parsed, not where to cut the text for the
            tokenizer: to get the ids transformers gets from the whole string, find special
            tokens only inside True pieces, then tokenize each stretch of text between two
            special tokens as one string, across piece boundaries (a cut between "[INST] " and
            "Hello" must not change how " Hello" is split).

        How contents are found. The conversation is rendered once as is, and once more with
        every non-empty content replaced by a unique marker (random text that occurs nowhere
        else). The marked render gives the template's text around each content. Walking both
        renders side by side, each marker must be matched in the real text by its content as
        is, or stripped of surrounding whitespace (what Llama 3's `content | trim` leaves: the
        stripped text is flagged False, the removed whitespace does not appear), followed by
        the template's text up to the next marker; and the template's text must match exactly
        everywhere. If the whole real text is rebuilt that way, those places are the contents,
        however often the same characters ("user", "\\n") occur in the template's text. A
        content the template copies twice gives two False pieces; one it drops gives none.

        If the rebuild fails, the template treats some content other than as an opaque string
        (it splits it, tests it, escapes it, changes its case). Each message is then tried on
        its own, with one marked render per message and the same matching. A message whose
        content still cannot be matched is left inside True pieces: a tokenizer then parses
        special-token text in it as special tokens, which is what llama.cpp does for the
        whole prompt.

        Args:
          messages: as for `render`.
          add_generation_prompt: as for `render`.
          **kwargs: as for `render`.

        Returns:
          `[(text, from_template), ...]` in order.

        Raises:
          ChatError: as `render`.
        """
        checked = check_messages(messages)
        text = self._render(checked, add_generation_prompt, kwargs)

        def marked_render(copies: list[dict[str, Any]]) -> str | None:
            try:
                return self._render(copies, add_generation_prompt, kwargs)
            except ChatError:  # the template objects to a marker: no match
                return None

        avoid = [self.source, *(v for v in kwargs.values() if isinstance(v, str))]
        return cut(text, content_spans(checked, text, marked_render, avoid))

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": None,
            "documents": None,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return render_template(self._compiled, variables)
