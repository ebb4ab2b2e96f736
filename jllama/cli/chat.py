"""--mode=chat: a conversation read from stdin, one message per line, through the session's
`Conversation`.

At a terminal, lines are read with `readline` (line editing, and the session's messages as
history under the up arrow), and Ctrl-C stops the reply being written, as llama.cpp's
llama-cli does; at the prompt it ends the program.

A thinking model's reply (`<think>...</think>` and the answer, `jllama.chat.reasoning`) is
printed whole with --reasoning=show, `<think>` included where the template opened the block at
the end of the prompt (so the block reads whole); --reasoning=hide prints the answer alone.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from jllama.chat.reasoning import CONTENT, THINK_OPEN, ThinkSplitter, opens_thinking
from jllama.cli.common import rates, say
from jllama.cli.options import TextOptions
from jllama.generation.conversation import ContextFullError
from jllama.errors import ChatError, JllamaError


def main(session, sampler, text: TextOptions) -> int:
    """Chat until stdin ends (or the context is full); returns the exit status."""
    model = session.model
    try:
        conversation = session.chat(system_prompt=text.system_prompt,
                                    template_kwargs=dict(text.template_kwargs))
    except ChatError as e:
        # A template that does not compile is named by `ChatTemplate.for_tokenizer` already.
        prefix = f"{model.source}: "
        raise ChatError(str(e) if str(e).startswith(prefix) else prefix + str(e)) from None
    interactive = sys.stdin.isatty()
    editing = interactive and sys.stdout.isatty()
    if editing:
        import readline  # input() then edits lines and keeps a history

        if text.prompt:
            readline.add_history(text.prompt)  # the first message, under the up arrow too
    if interactive:
        say("chat mode: type a message and press Enter (end a line with \\ to go on to the "
            "next; Ctrl-C stops a reply, Ctrl-D ends the chat)")
    stop = _ReplyInterrupt() if interactive else None
    pending = text.prompt or None
    out = sys.stdout
    while True:
        message = pending if pending is not None else read_message(interactive, editing)
        pending = None
        if message is None:
            break
        if not message.strip():
            continue
        decoder = session.tokenizer.stream_decoder()
        shown = _Shown(text.reasoning == "hide")
        try:
            with stop or contextlib.nullcontext():
                reply = conversation.say(message, sampler, max_tokens=text.steps,
                                         grammar=text.grammar)
                try:
                    for token in reply:  # the prompt is rendered by the first token
                        out.write(shown.push(decoder.push(token.prev, token.id),
                                             conversation.prompt_text))
                        out.flush()
                        if stop is not None and stop.requested:
                            break
                finally:
                    reply.close()  # the turn is recorded now, cut where it was
        except ChatError as e:
            raise ChatError(f"{model.source}: {e}") from None
        except ContextFullError as e:
            if conversation.last is None:  # nothing could be answered: the settings are wrong
                raise JllamaError(f"{e}: give a larger --seq_len") from None
            say(f"context full: {e}; ending the chat")
            return 0
        out.write(shown.push(decoder.flush(), conversation.prompt_text) + shown.finish()
                  + "\n")
        out.flush()
        turn = conversation.last
        if interactive or text.verbose:
            print(rates(turn.generation.stats), file=sys.stderr)
        if turn.stop_reason == "context":
            say(f"context full: the reply reached seq_len={session.config.seq_len} tokens; "
                "ending the chat (a larger --seq_len holds more)")
            return 0
    return 0


class _Shown:
    """What of a reply's text is printed: all of it (`<think>` first where the prompt opened
    the block), or with `hide` only the answer after the think block (`ThinkSplitter`)."""

    def __init__(self, hide: bool):
        self.hide = hide
        self._splitter: ThinkSplitter | None = None

    def push(self, text: str, prompt: str) -> str:
        if self._splitter is None:  # the reply's first text: the prompt is known now
            if not text:
                return ""
            in_think = opens_thinking(prompt)
            self._splitter = ThinkSplitter(in_think)
            if in_think and not self.hide:  # the template's own `<think>\n`, then the reply
                text = prompt[prompt.rindex(THINK_OPEN):] + text
        if not self.hide:
            return text
        return "".join(piece for kind, piece in self._splitter.feed(text) if kind == CONTENT)

    def finish(self) -> str:
        if not self.hide or self._splitter is None:
            return ""
        return "".join(piece for kind, piece in self._splitter.finish() if kind == CONTENT)


def read_message(interactive: bool, editing: bool = False) -> str | None:
    """One user message from stdin: a line, or several joined by a trailing backslash
    (llama.cpp's convention). None at end of input."""
    lines = []
    while True:
        prompt = "> " if not lines else "  "
        if editing:
            try:
                line = input(prompt) + "\n"
            except EOFError:  # Ctrl-D: end the prompt's line before the program goes on
                print(file=sys.stderr)
                line = ""
        else:
            if interactive:
                print(prompt, end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


class _ReplyInterrupt:
    """While a reply is written, Ctrl-C asks it to stop at the next token (a second Ctrl-C
    ends the program); outside replies the program's own handler (exit at once) is back."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        else:
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self.requested:
            print(file=sys.stderr)
        return False

    def _interrupt(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
