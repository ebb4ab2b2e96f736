"""Thinking models' replies (Qwen3, QwQ, DeepSeek-R1): the reasoning between `<think>` and
`</think>` told apart from the answer after it, as text arrives.

Models: llama.cpp's `--reasoning-format` (`none`: the tags stay in the content; `deepseek`:
the block goes to `reasoning_content`; `auto`: deepseek for templates that think) and vLLM's
`qwen3` / `deepseek_r1` reasoning parsers. As theirs:

- A reply is parsed only where it *starts* with `<think>` (whitespace before it allowed), or
  where the template already opened the block at the end of the prompt (Qwen3-Thinking-2507,
  DeepSeek-R1: `...<|im_start|>assistant\\n<think>\\n`), so generation begins inside it. A
  `<think>` later in an answer is the answer's text.
- Everything up to `</think>` is reasoning; a block never closed (the tokens ran out) is all
  reasoning and the content is empty.
- The reasoning is stripped of the whitespace around it and the content of the whitespace that
  starts it (Qwen3 writes `<think>\\n...\\n</think>\\n\\n`), as llama.cpp's parser trims them.

`ThinkSplitter` does it piece by piece for streams: a tag cut across tokens (`</th` + `ink>`) is
held back until it is known, and so is whitespace that may turn out to end the reasoning, so the
pieces of a stream join to what `split_reasoning` gives for the whole text.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

REASONING_FORMATS = ("auto", "deepseek", "none")
"""How replies are read (llama.cpp's names): deepseek = the think block apart, as reasoning;
none = all of it content, tags included; auto = deepseek where the chat template mentions
`<think>` (a model that thinks), else none."""

REASONING = "reasoning"
CONTENT = "content"


def parses_reasoning(reasoning_format: str, template_source: str | None) -> bool:
    """Whether replies under `reasoning_format` are split for a model with this chat template
    (`auto`: its template writes or reads `<think>`).

    Raises:
      ValueError: a format not in `REASONING_FORMATS`.
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)}, "
                         f"got {reasoning_format!r}")
    if reasoning_format == "auto":
        return bool(template_source) and THINK_OPEN in template_source
    return reasoning_format == "deepseek"


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (`<think>` and whitespace at
    its end), so the reply starts as reasoning. Qwen3's template with enable_thinking false
    ends with an empty closed block (`<think>\\n\\n</think>\\n\\n`): not open."""
    return prompt.rstrip().endswith(THINK_OPEN)


def prompt_thinking(prompt: str) -> str:
    """Where a rendered prompt leaves the reply: "open" (`opens_thinking`: it starts as
    reasoning), "closed" (the prompt ends with a closed block, `</think>` and whitespace:
    the template turned thinking off, Qwen3's enable_thinking false), or "" (neither: the model
    may open a block itself)."""
    tail = prompt.rstrip()
    return "open" if tail.endswith(THINK_OPEN) else "closed" if tail.endswith(THINK_CLOSE) else ""


def _held_tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none):
    characters that may be the first of the tag, not yet known to be text."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    """Splits a reply's text into reasoning and content as pieces of it arrive.

    Args:
      in_think: the prompt opened the think block (`opens_thinking`): the reply starts as
        reasoning. False: it is reasoning only if it starts with `<think>`.

    `feed(text)` returns the `(kind, text)` pieces the new text settles, kind `REASONING` or
    `CONTENT`, none empty; `finish()` those of what was held back once the reply has ended.
    """

    def __init__(self, in_think: bool = False):
        self._state = "think" if in_think else "start"
        self._opened = in_think
        self._held = ""
        self._reasoned = False  # some reasoning was given out (its leading whitespace gone)
        self.reasoning = ""
        """The reasoning given out so far."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        while True:
            state = self._state
            if state == "start":
                head = self._held.lstrip()
                if head.startswith(THINK_OPEN):
                    self._held = head[len(THINK_OPEN):]
                    self._state = "think"
                    self._opened = True
                    continue
                if not head or THINK_OPEN.startswith(head):
                    return out  # whitespace or part of the tag: not known yet
                self._state = "content"
                continue
            if state == "think":
                end = self._held.find(THINK_CLOSE)
                if end < 0:
                    cut = len(self._held) - _held_tag_prefix(self._held, THINK_CLOSE)
                    settled = self._held[:cut].rstrip()  # whitespace may end the reasoning
                    self._emit_reasoning(settled, out)
                    self._held = self._held[len(settled):]
                    return out
                self._emit_reasoning(self._held[:end].rstrip(), out)
                self._held = self._held[end + len(THINK_CLOSE):]
                self._state = "after"
                continue
            if state == "after":
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._state = "content"
                continue
            if self._held:  # content
                out.append((CONTENT, self._held))
                self._held = ""
            return out

    def _emit_reasoning(self, text: str, out: list[tuple[str, str]]) -> None:
        if not self._reasoned:
            text = text.lstrip()
        if text:
            self._reasoned = True
            self.reasoning += text
            out.append((REASONING, text))

    def finish(self) -> list[tuple[str, str]]:
        """The pieces of what is still held at the end of the reply: a start that never became
        `<think>` is content; in an unclosed block, the rest is reasoning (trailing whitespace
        dropped)."""
        out: list[tuple[str, str]] = []
        held, self._held = self._held, ""
        if self._state == "start" and held:
            out.append((CONTENT, held))
        elif self._state == "think":
            self._emit_reasoning(held.rstrip(), out)
        return out

    @property
    def opened(self) -> bool:
        """Whether the reply has a think block (opened by the prompt or by `<think>`)."""
        return self._opened

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside (or may still open) its think block."""
        return self._state in ("start", "think")


def split_reasoning(text: str, in_think: bool = False) -> tuple[str | None, str]:
    """A whole reply as (reasoning, content): reasoning None where the reply has no think
    block (`ThinkSplitter`'s rules)."""
    splitter = ThinkSplitter(in_think)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(piece for kind, piece in pieces if kind == CONTENT)
    has_block = in_think or text.lstrip().startswith(THINK_OPEN)
    return (splitter.reasoning if has_block else None), content
