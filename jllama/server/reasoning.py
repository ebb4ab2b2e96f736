"""Thinking models' replies on the chat path: the think block as `reasoning_content`, and the
chat template's extra variables (`chat_template_kwargs`, e.g. `{"enable_thinking": false}`).

Sources: vLLM's and llama.cpp's OpenAI-compatible servers, which both add `reasoning_content`
to the assistant message (streamed as `delta.reasoning_content` pieces before the
`delta.content` ones) and take `chat_template_kwargs` in a chat request; the block is found by
`jllama.chat.reasoning` (llama.cpp's `deepseek` format). `response_format` and tools shape the
answer after the block, not the block (`after_thinking`), as vLLM applies structured outputs
once its reasoning parser has seen the block end.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jllama.chat.reasoning import CONTENT, ThinkSplitter, split_reasoning
from jllama.server.errors import APIError
from jllama.server.tool_reply import TextReply
from jllama.server.tools import ChatPlan, call_grammar

if TYPE_CHECKING:  # llguidance is imported only where a grammar is used
    from jllama.constrain import Grammar

_SET_BY_SERVER = ("messages", "add_generation_prompt", "tools")
"""Template variables the server sets from the request itself (a request's
chat_template_kwargs may not name them)."""


def template_kwargs(defaults: Mapping[str, Any], given: Any) -> dict[str, Any]:
    """The chat template's extra variables: the server's (`serve --enable_thinking`), then the
    request's `chat_template_kwargs` over them.

    Raises:
      APIError (400, param "chat_template_kwargs"): not an object, or a key the server sets
        itself (messages, add_generation_prompt, tools: give those as the request's fields).
    """
    if given is None:
        return dict(defaults)
    if not isinstance(given, dict):
        raise APIError(400, "chat_template_kwargs: must be an object of template variables, "
                       'e.g. {"enable_thinking": false}', param="chat_template_kwargs")
    for key in given:
        if key in _SET_BY_SERVER:
            raise APIError(400, f"chat_template_kwargs: {key!r} is set from the request "
                           "itself and cannot be given here", param="chat_template_kwargs")
    return {**defaults, **given}


_THINK_RULES = 'think[lazy]: /(.|\\n)*<\\/think>/\n'
"""llguidance Lark: the reasoning up to the first `</think>` (a lazy lexeme ends at the first
match, so the block's text is free but cannot hold the tag)."""


def after_thinking(grammar: Grammar, thinking: str) -> Grammar:
    """`grammar` for the answer after a think block: the block first, free text up to its
    `</think>`, then whitespace and what `grammar` matches.

    Args:
      grammar: what the answer must match (response_format's, a tool call's).
      thinking: where the prompt leaves the reply (`jllama.chat.reasoning.prompt_thinking`):
        "open", the reply starts inside the block; "" the model may open one (`<think>` after
        whitespace) or answer at once; "closed", thinking is off: `grammar` as it is.

    Returns:
      A `Grammar` of the same kind and source, whose llguidance text holds `grammar`'s as a
      grammar it refers to (`@reply`).
    """
    if thinking == "closed":
        return grammar
    import llguidance

    text = grammar.llguidance
    # llguidance's compiled form: a JSON list of grammars (schemas, regexes), or Lark text.
    inner = json.loads(text)["grammars"] if text.lstrip().startswith("{") else [
        {"lark_grammar": text}]
    inner = [{**inner[0], "name": "reply"}, *inner[1:]]
    start = ('start: think /\\s*/ @reply\n' if thinking == "open"
             else 'start: /\\s*/ ("<think>" think /\\s*/)? @reply\n')
    top = {"grammars": [{"name": "thinking", "lark_grammar": start + _THINK_RULES}, *inner],
           "max_tokens": None}
    composed = json.dumps(top)
    failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(composed)
    if failed:  # not expected for llguidance's own grammars; the answer's grammar as it is
        return grammar
    return dataclasses.replace(grammar, llguidance=composed)


def answer_grammar(plan: ChatPlan, thinking: str) -> Grammar | None:
    """The grammar of a reply read apart whose `response_format` or tools (`plan.grammar`)
    shape its answer: the think block first (`after_thinking`), and with tool_choice "auto"
    a free text that cannot be read as the block (`call_grammar`'s think_apart). A raw
    `grammar` or `structured_outputs` shapes the whole reply instead (the caller keeps it).

    Args:
      plan: the request's `ChatPlan`.
      thinking: where the prompt leaves the reply (`jllama.chat.reasoning.prompt_thinking`).
    """
    grammar = plan.grammar
    if grammar is None or thinking == "closed":
        return grammar
    if plan.mode == "auto":
        grammar = call_grammar(plan.tools, "auto", think_apart=True,
                               call_format=plan.call_format, parallel=plan.parallel)
    return after_thinking(grammar, thinking)


class ReasoningReply:
    """A chat reply whose think block is `reasoning_content`: the text after the block goes to
    the reply it wraps (`TextReply`, or `ToolReply` with tools offered), as if the block had
    not been written.

    Args:
      inner: the reply reader of the content.
      in_think: the prompt opened the block (`jllama.chat.reasoning.opens_thinking`).

    Attributes:
      reasoning_tokens: the generated tokens of the think block so far (`deltas`' tokens of
        each piece read inside it, the one that closes it included; 0 without a block).
    """

    def __init__(self, inner: TextReply, in_think: bool):
        self.inner = inner
        self.in_think = in_think
        self._splitter = ThinkSplitter(in_think)
        self.reasoning_tokens = 0
        self._held_tokens = 0  # of pieces read before the block is known to open

    def _as_deltas(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, text in pieces:
            if kind == CONTENT:
                out += self.inner.deltas(text)
            else:
                out.append({"reasoning_content": text})
        return out

    def deltas(self, text: str, tokens: int = 1) -> list[dict]:
        """Stream deltas for the next piece of text (of `tokens` generated tokens):
        `{"reasoning_content"}` inside the block, the inner reply's deltas after it."""
        inside = self._splitter.thinking
        deltas = self._as_deltas(self._splitter.feed(text))
        if inside:
            self._held_tokens += tokens
            if self._splitter.opened:
                self.reasoning_tokens += self._held_tokens
            if self._splitter.opened or not self._splitter.thinking:
                self._held_tokens = 0
        return deltas

    def count(self, texts: list[str], tokens: list[int]) -> None:
        """Sets `reasoning_tokens` from a whole reply's pieces and their tokens (as `deltas`
        counts them), for a reply that was not streamed."""
        counter = ReasoningReply(TextReply(), self.in_think)
        for text, n in zip(texts, tokens, strict=True):
            counter.deltas(text, n)
        self.reasoning_tokens = counter.reasoning_tokens

    def final_deltas(self) -> list[dict]:
        return self._as_deltas(self._splitter.finish()) + self.inner.final_deltas()

    def message(self, text: str) -> dict:
        """The whole reply as an assistant message: the inner reply's, with
        `reasoning_content` (null where the reply has no think block)."""
        reasoning, content = split_reasoning(text, self.in_think)
        return {**self.inner.message(content), "reasoning_content": reasoning}

    def finish_reason(self, reason: str) -> str:
        return self.inner.finish_reason(reason)
