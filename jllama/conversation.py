"""A multi-turn chat over one KV cache: the chat template, the tokenizer and the generation loop.

Each turn renders the whole conversation with the model's chat template (as Hugging Face's
`apply_chat_template(..., add_generation_prompt=True)`), encodes it with special tokens parsed
only where the template itself wrote them (`ChatTemplate.render_segments`), and feeds the model
only the tokens after the longest prefix already in the KV cache (as llama.cpp's server reuses
its prompt cache). The reply is sampled until an end-of-generation token (`tokenizer.stop_ids`,
e.g. `<|im_end|>`), a length limit, or the end of the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jllama.errors import JllamaError
from jllama.generate import Generation, Token

Forward = Callable[[int, int], np.ndarray]
Sample = Callable[[np.ndarray], int]


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
      stop_reason: "stop" (an end-of-generation token), "length" (max_tokens reached) or
        "context" (seq_len reached).
      generation: the underlying `Generation` (rates in `generation.stats`).
    """

    prompt_ids: list[int]
    reused: int
    prefilled: int
    generated_ids: list[int]
    stop_reason: str
    generation: Generation


class Conversation:
    """A chat whose turns share one KV cache.

    Args:
      forward: the model step, `forward(token, pos) -> logits f32[vocab_size]`; its KV cache
        belongs to this conversation (positions are reused from 0).
      tokenizer: with `encode_segments`, `decode`, `stop_ids`.
      template: a `jllama.chat.ChatTemplate`.
      seq_len: the context the KV cache holds, tokens.
      system_prompt: the first message's content, role "system" (None: the template's default).
      prefill: optional batched `prefill(tokens, start_pos) -> logits` (a backend's), used for
        each turn's new tokens.
      decode_loop: optional on-device decode loop for each reply (`Generation`'s argument; it
        must sample as the `sample` given to `say`, e.g. `jllama.device_loop.loop_decoder`).
      compile_for: optional `compile_for(prompt_len, last, start=...)`, called before each
        turn with the turn's new tokens, its last position and its first new position (e.g.
        `JaxGraphBackend.compile_for` with the loop's `kind`): the programs the turn needs
        compile before it starts, not in the middle of the reply. It must leave positions <
        start as they are.

    Attributes:
      messages: the conversation so far, as {"role", "content"} dicts.
      cached_ids: the tokens whose keys and values fill positions 0 .. len-1 of the KV cache.
      last: `TurnStats` of the last turn, or None.
    """

    def __init__(self, forward: Forward, tokenizer, template, seq_len: int,
                 system_prompt: str | None = None, prefill=None, decode_loop=None,
                 compile_for=None):
        self._forward = forward
        self._prefill = prefill
        self._decode_loop = decode_loop
        self._compile_for = compile_for
        self.tokenizer = tokenizer
        self.template = template
        self.seq_len = seq_len
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.cached_ids: list[int] = []
        self.last: TurnStats | None = None

    def encode(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
               ) -> list[int]:
        """Token ids of `messages` rendered by the template (no BOS added: the template writes
        it where it wants one, as with Hugging Face's add_special_tokens=False)."""
        segments = self.template.render_segments(
            list(messages), add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode_segments(segments, bos=False)

    def say(self, text: str, sample: Sample, max_tokens: int = 0) -> Iterator[Token]:
        """Add a user message and generate the assistant's reply, token by token.

        Args:
          text: the user's message.
          sample: `sample(logits) -> token id`.
          max_tokens: the most tokens the reply may have; < 1 = until the context is full.

        Yields:
          the reply's `Token`s as they are sampled (prompt tokens are not yielded).

        Raises:
          ContextFullError: the conversation with this message does not fit in seq_len (the
            message is not added).
          JllamaError: the chat template fails (ChatError).

        When the iteration ends (or is abandoned), the reply is added to `messages` and
        `cached_ids` says what the KV cache holds; `last` tells why it stopped.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.encode(messages)
        if len(ids) >= self.seq_len:
            raise ContextFullError(
                f"the conversation is {len(ids)} tokens with this message, and the context "
                f"holds {self.seq_len} (seq_len)"
            )
        # At least the last prompt token is fed: its logits give the reply's first token.
        reused = min(common_prefix_length(self.cached_ids, ids), len(ids) - 1)
        room = self.seq_len - reused
        fed = len(ids) - reused
        steps = room if max_tokens < 1 else min(room, fed + max_tokens - 1)
        if self._compile_for is not None:
            self._compile_for(fed, reused + steps - 1, start=reused)
        generation = Generation(
            self._forward, ids[reused:], sample, steps,
            stop_ids=tuple(self.tokenizer.stop_ids), start_pos=reused, prefill=self._prefill,
            decode_loop=self._decode_loop, context_ids=ids[:reused],
        )
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
