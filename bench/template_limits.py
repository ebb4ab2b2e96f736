"""What the chat-template limits (issue 33) cost a real rendering: JSON lines.

For each real template (tests/data/templates, or --templates=DIR such as llama.cpp's
models/templates) and each conversation (plain, and with one tool call and its result), the
same template compiled three times, alternated round by round in one process:

  plain    Jinja's ImmutableSandboxedEnvironment with jllama's helpers (raise_exception,
           strftime_now, tojson's encoding, {% generation %}) and no limits: what transformers
           runs (its tojson is json.dumps, the same text; jllama's keeps json's C encoder
           between calls, a saving that is not the limits' to claim, so plain has it too);
  bounded  jllama's `render_template`: the same, with the watcher registered and every step
           that could make a huge value sized before it runs;
  transformers  plain with transformers' tojson (json.dumps, which builds its encoder at each
           call): what a user of transformers' sandbox would see instead.

Each figure is the best of --rounds rounds of --number renderings (microseconds a rendering).
A template transformers' own sandbox refuses for a conversation is left out of that pair.
Also `ChatTemplate.render` (what the CLI and the server call: the message checks too), and
the limits' cost as a share of it. The last line sums the times over templates:
overhead = bounded / plain - 1 (the limits' cost), overhead_vs_transformers = bounded /
transformers - 1 (jllama's rendering against transformers' sandbox).

  .venv/bin/python bench/template_limits.py
  .venv/bin/python bench/template_limits.py --templates=path/to/llama.cpp/models/templates
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import timeit
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jllama.chat import ChatTemplate  # noqa: E402
from jllama.chat import sandbox  # noqa: E402
from jllama.chat.sandbox import compile_template, render_template  # noqa: E402
from jllama.errors import ChatError  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]
CONVERSATIONS = {
    "plain": dict(messages=[
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke."}]),
    "tools": dict(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": '{"temp": 20}'}], tools=TOOLS),
}


def _json_dumps(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson filter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# jllama's tojson without its sizing (json.dumps before jllama kept json's encoders: this
# script measures older commits too).
_JLLAMA_JSON = getattr(sandbox, "json_text", _json_dumps)


def plain_environment(tojson=_JLLAMA_JSON) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandbox jllama's is built on, with the same helpers and none of the limits (or,
    given `tojson=_json_dumps`, transformers' tojson)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, sandbox._GenerationBlock])
    env.globals["raise_exception"] = sandbox._raise_exception
    env.globals["strftime_now"] = sandbox._strftime_now
    env.filters["tojson"] = tojson
    return env


def best_us(fn, number: int, rounds: int) -> list[float]:
    return [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=rounds)]


def machine() -> dict:
    """bench/memory_plan.py's machine facts, with the Python and Jinja versions."""
    from memory_plan import machine as host  # bench/ is the script's folder

    return {**host(), "python": platform.python_version(), "jinja2": jinja2.__version__}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--templates", type=Path, default=HERE.parent / "tests" / "data" / "templates")
    p.add_argument("--number", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    print(json.dumps({"metric": "meta", "machine": machine(), "args": {
        "templates": str(args.templates), "number": args.number, "rounds": args.rounds}}))
    plain_env = plain_environment()
    hf_env = plain_environment(_json_dumps)
    totals = {"plain": 0.0, "bounded": 0.0, "chat_template": 0.0, "plain_for_chat": 0.0,
              "bounded_for_chat": 0.0, "transformers": 0.0}
    ratios = []
    for path in sorted(args.templates.glob("*.jinja")):
        source = path.read_text()
        plain, bounded = plain_env.from_string(source), compile_template(source)
        hf = hf_env.from_string(source)
        for name, conversation in CONVERSATIONS.items():
            variables = dict(conversation, add_generation_prompt=True, bos_token="<s>",
                             eos_token="</s>", date_string="26 Jul 2024")
            try:
                expected = plain.render(variables)
            except Exception:  # noqa: BLE001 - the template refuses this conversation
                continue
            if render_template(bounded, variables) != expected:
                print(json.dumps({"metric": "differs", "template": path.stem, "conversation": name}))
                continue
            plain_us, bounded_us, hf_us = [], [], []
            for _ in range(args.rounds):  # alternated round by round
                plain_us += best_us(lambda: plain.render(variables), args.number, 1)
                bounded_us += best_us(lambda: render_template(bounded, variables), args.number, 1)
                hf_us += best_us(lambda: hf.render(variables), args.number, 1)
            chat = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
            extra = {k: v for k, v in conversation.items() if k != "messages"}
            try:
                chat_us = best_us(lambda: chat.render(
                    conversation["messages"], date_string="26 Jul 2024", **extra),
                    args.number, args.rounds)
            except ChatError:  # its message checks give the template what it refuses
                chat_us = [float("nan")]
            row = {"metric": "template", "template": path.stem, "conversation": name,
                   "plain_us": min(plain_us), "bounded_us": min(bounded_us),
                   "transformers_us": min(hf_us),
                   "chat_template_render_us": min(chat_us),
                   "overhead": min(bounded_us) / min(plain_us) - 1}
            print(json.dumps(row))
            totals["plain"] += row["plain_us"]
            totals["bounded"] += row["bounded_us"]
            totals["transformers"] += row["transformers_us"]
            if chat_us[0] == chat_us[0]:  # not NaN
                totals["chat_template"] += row["chat_template_render_us"]
                totals["plain_for_chat"] += row["plain_us"]
                totals["bounded_for_chat"] += row["bounded_us"]
            ratios.append(row["overhead"])
    print(json.dumps({
        "metric": "summary", "pairs": len(ratios), "plain_us_sum": totals["plain"],
        "bounded_us_sum": totals["bounded"],
        "overhead_of_sum": totals["bounded"] / totals["plain"] - 1,
        "overhead_median": statistics.median(ratios),
        "overhead_max": max(ratios),
        "transformers_us_sum": totals["transformers"],
        "overhead_vs_transformers_of_sum": totals["bounded"] / totals["transformers"] - 1,
        "chat_template_render_us_sum": totals["chat_template"],
        "overhead_of_chat_template_render": (totals["bounded_for_chat"]
                                             - totals["plain_for_chat"]) / totals["chat_template"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
