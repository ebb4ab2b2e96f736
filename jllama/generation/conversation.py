"""A multi-turn chat over one KV cache: the chat template, the tokenizer and a `Session`.

Each turn renders the whole conversation with the model's chat template (as Hugging Face's
`apply_chat_template(..., add_generation_prompt=True)`), encodes it with special tokens parsed
only where the template itself wrote them (`ChatTemplate.render_segments`), and feeds the model
only the tokens after the longest prefix already in the KV cache (as llama.cpp's server reuses
its prompt cache). The reply is sampled until an end-of-generation token (`tokenizer.stop_ids`,
e.g. `<|im_end|>`), a length limit, or the end of the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jllama.errors import ChatError, JllamaError
from jllama.generation.generate import Generation, Token


class ContextFullError(JllamaError):
    """The conversation no longer fits in the model's context (seq_len)."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading elements `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class TurnStats:
    """What the last turn did.

    Attributes:
      prompt_ids: the whole conversation as encoded for this turn, tokens.
      reused: leading tokens of prompt_ids already in the KV cache (not fed again).
      prefilled: tokens fed before the first sampled one (len(prompt_ids) - reused).
      generated_ids: the reply's tokens (the end-of-turn token not included).
      stop_reason: "stop" (an end-of-generation token), "length" (max_tokens reached),
        "context" (seq_len reached) or "interrupted" (the reply was abandoned: its iterator
        closed before the end).
      generation: the underlying `Generation` (rates in `generation.stats`).
    """

    prompt_ids: list[int]
    reused: int
    prefilled: int
    generated_ids: list[int]
    stop_reason: str
    generation: Generation


class Conversation:
    """A chat whose turns share one KV cache: a `jllama.generation.session.Session`'s (positions are reused
    from 0; the session's other generations would overwrite them).

    Args:
      session: the `Session` whose model and backend the turns run on; its decode and prefill
        plan applies to every reply.
      template: a `jllama.chat.ChatTemplate`; None: the model's own, with the tokenizer's BOS
        and EOS text (`ChatTemplate.for_tokenizer`).
      system_prompt: the first message's content, role "system" (None: the template's default).
      template_kwargs: more template variables for every turn (e.g. `{"enable_thinking":
        False}`, Qwen3's switch); None: none.

    Attributes:
      messages: the conversation so far, as {"role", "content"} dicts.
      cached_ids: the tokens whose keys and values fill positions 0 .. len-1 of the KV cache.
      last: `TurnStats` of the last turn, or None.
      prompt_text: the text of the last prompt rendered ("" before the first): a reply starts
        inside a think block where it ends with an open `<think>`
        (`jllama.chat.reasoning.opens_thinking`).

    Raises:
      ChatError: no template given and the model has none, or it does not compile (the message
        names the model's file).
    """

    def __init__(self, session, template=None, system_prompt: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None):
        self.session = session
        self.tokenizer = session.tokenizer
        if template is None:
            from jllama.chat import ChatTemplate  # jinja2: imported only for a chat

            model = session.model
            template = ChatTemplate.for_tokenizer(model.chat_template, self.tokenizer,
                                                  source=model.source)
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.prompt_text = ""
        self.seq_len = session.config.seq_len
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.cached_ids: list[int] = []
        self.last: TurnStats | None = None
        self._generation_count = session.generations  # the session's count after our turn

    def encode(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
               ) -> list[int]:
        """Token ids of `messages` rendered by the template (no BOS added: the template writes
        it where it wants one, as with Hugging Face's add_special_tokens=False)."""
        segments = self.template.render_segments(
            list(messages), add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )
        self.prompt_text = "".join(text for text, _ in segments)
        return self.tokenizer.encode_segments(segments, bos=False)

    def say(self, text: str, sample, max_tokens: int = 0, grammar=None) -> Iterator[Token]:
        """Add a user message and generate the assistant's reply, token by token.

        Args:
          text: the user's message.
          sample: a `jllama.sampling.Sampler` (or what `Session.generate` takes).
          max_tokens: the most tokens the reply may have; < 1 = until the context is full.
          grammar: a `jllama.constrain.Grammar` the reply must match (`Session.generate`'s
            grammar: the reply ends, stop_reason "stop", once it is complete); None: free.

        Yields:
          the reply's `Token`s as they are sampled (prompt tokens are not yielded).

        Raises:
          ContextFullError: the conversation with this message does not fit in seq_len (the
            message is not added).
          JllamaError: the chat template fails or writes nothing (ChatError).

        When the iteration ends (or is abandoned), the reply is added to `messages` and
        `cached_ids` says what the KV cache holds; `last` tells why it stopped.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.encode(messages)
        if not ids:
            # A template that writes nothing for the conversation leaves no token whose logits
            # could start the reply.
            raise ChatError("chat template: wrote no text for the conversation")
        if len(ids) >= self.seq_len:
            raise ContextFullError(
                f"the conversation is {len(ids)} tokens with this message, and the context "
                f"holds {self.seq_len} (seq_len)"
            )
        if self.session.generations != self._generation_count:
            self.cached_ids = []  # another generation overwrote the KV cache since our turn
        # At least the last prompt token is fed: its logits give the reply's first token.
        reused = min(common_prefix_length(self.cached_ids, ids), len(ids) - 1)
        room = self.seq_len - reused
        fed = len(ids) - reused
        steps = room if max_tokens < 1 else min(room, fed + max_tokens - 1)
        generation = self.session.generate(ids[reused:], sample, steps, start_pos=reused,
                                           context_ids=ids[:reused], grammar=grammar)
        self._generation_count = self.session.generations
        self.messages = messages
        self.cached_ids = ids[:reused]
        stopped = False
        try:
            for token in generation:
                if token.sampled:
                    yield token
            stopped = True
        finally:
            generated = generation.generated_ids
            self.cached_ids = (ids + generated)[: generation.end_pos]
            if generation.stop_token is not None:
                reason = "stop"
            elif generation.end_pos >= self.seq_len:
                reason = "context"
            else:
                reason = "length" if stopped else "interrupted"
            reply = self.tokenizer.decode(generated)
            self.messages = messages + [{"role": "assistant", "content": reply}]
            self.last = TurnStats(
                prompt_ids=ids, reused=reused, prefilled=fed, generated_ids=list(generated),
                stop_reason=reason, generation=generation,
            )
