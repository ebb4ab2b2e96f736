"""`jllama batch --file=PROMPTS`: many prompts in, one JSON line out per prompt (in the order
given), run --parallel at a time through the `jllama.engine` scheduler, a progress bar on
stderr.

Each line of the file is a prompt: plain text, or a JSON object with "prompt" and optionally
"max_tokens", "stop" (a string or a list), "seed", "temperature" and "json_schema" (that line's
own constraint, as vLLM's per-request guided JSON). The sampler flags and the constraint
(--json_schema, --json, --regex, --grammar) apply to every prompt where its line does not say;
with --seed, prompt i (from 0) samples with --seed + i (so a line gives the same text in any
batch), else with a seed from the clock + i; each output line says its seed and its "index"
(i). Error lines name a prompt by that index and its line in the file (from 1); a key a JSON
line does not take is refused (a typo such as "temprature" would otherwise be ignored).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys

from jllama.platform import runtime
from jllama.cli.common import (
    compile_programs, device_count, kv_cache_types, one_process, open_session, opened_draft, say,
)
from jllama.cli.options import Options
from jllama.engine import Request, complete_all
from jllama.errors import JllamaError
from jllama.platform.files import parse_json, require_regular_file
from jllama.model.loading import open_model, required_memory
from jllama.platform.memory import check_memory
from jllama.sampling import SamplerSettingError, check_setting, seed_from_clock


KEYS = ("prompt", "max_tokens", "stop", "seed", "temperature", "json_schema")
"""What a JSON line may hold."""


def read_prompts(path: str) -> list[dict]:
    """The prompts of `path`: dicts with "prompt" (str), "line" (the file's line, from 1) and
    optional "max_tokens", "stop", "seed", "temperature" (checked as --temperature) and
    "grammar" (a `jllama.constrain.Grammar` from the line's "json_schema").

    Prompts are counted from 0, as the output's "index"; an error names the prompt's line and
    its index (`where`).

    Raises:
      JllamaError: a file that cannot be read or is not UTF-8, a JSON object without a string
        "prompt", a key not in `KEYS`, fields of the wrong type, or no prompt at all (naming
        the line).
    """
    from pathlib import Path

    what = f"--file={path}"
    require_regular_file(Path(path), what, JllamaError)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise JllamaError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise JllamaError(f"{what}: {e.strerror or e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = f"{what}: {where(number, len(prompts))}"
        item = {"prompt": line}
        if line.lstrip().startswith("{"):
            try:
                item = parse_json(line)
            except ValueError as e:
                raise JllamaError(f"{at}: not valid JSON ({e})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise JllamaError(f"{at}: a JSON line needs a \"prompt\" string")
            for key in item:
                if key not in KEYS:
                    close = difflib.get_close_matches(key, KEYS, n=1)
                    hint = (f"did you mean {close[0]!r}?" if close
                            else f"a line takes {', '.join(KEYS)}")
                    raise JllamaError(f"{at}: unknown key {key!r} ({hint})")
            for key, kind in (("max_tokens", int), ("seed", int)):
                if key in item and (isinstance(item[key], bool) or not isinstance(item[key], kind)
                                    or item[key] < 1):
                    raise JllamaError(f"{at}: {key} must be an integer >= 1")
            stop = item.get("stop", [])
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise JllamaError(f"{at}: stop must be a string or a list of non-empty strings")
            item["stop"] = stop
            if "temperature" in item:
                try:
                    item["temperature"] = check_setting("temperature", item["temperature"])
                except SamplerSettingError as e:
                    raise JllamaError(f"{at}: temperature {e.reason}") from None
            if "json_schema" in item:
                from jllama.constrain import Grammar, GrammarError

                try:
                    item["grammar"] = Grammar.json_schema(item.pop("json_schema"))
                except GrammarError as e:
                    raise JllamaError(f"{at}: json_schema: {e}") from None
        item["line"] = number
        prompts.append(item)
    if not prompts:
        raise JllamaError(f"{what}: no prompts (one per line)")
    return prompts


def where(line: int, index: int) -> str:
    """A prompt as the errors name it: the file's line (from 1, as editors count) and the
    prompt's index (from 0, as the output's "index" and the seed offset count)."""
    return f"line {line} (index {index})"


def main(options: Options) -> int:
    run, m = options.run, options.model
    if run.threads:
        runtime.limit_cpu_threads(run.threads)
    one_process("batch", run)
    if not options.perplexity.file:
        raise JllamaError("batch needs --file=PROMPTS, one prompt per line")
    prompts = read_prompts(options.perplexity.file)
    model = open_model(m.checkpoint, m.tokenizer, seq_len=m.seq_len, dtype=m.dtype)
    tokenizer, seq_len = model.tokenizer, model.config.seq_len
    requests = []
    base = options.sampling.config
    first_seed = base.seed if base.seed is not None else seed_from_clock()
    for i, item in enumerate(prompts):
        ids = tokenizer.encode(item["prompt"], parse_special=options.text.parse_special)
        if not ids or len(ids) > seq_len:
            raise JllamaError(f"--file={options.perplexity.file}: {where(item['line'], i)}: "
                              f"the prompt is {len(ids)} tokens; it must hold 1 .. {seq_len} "
                              "(seq_len)")
        seed = item.get("seed", (first_seed + i - 1) % (2**64 - 1) + 1)
        steps = options.text.steps
        sampler = dataclasses.replace(base, seed=seed, temperature=item.get(
            "temperature", base.temperature))
        requests.append(Request(
            ids, sampler, max_tokens=item.get("max_tokens", steps if steps > 0 else None),
            stop=item["stop"] if "stop" in item else (),
            grammar=item.get("grammar", options.text.grammar),
        ))
    n_devices = device_count(run, model.config, several=False)
    kv_types = kv_cache_types(run, model)
    draft = opened_draft(run, model)  # one drafter per slot in the line
    check_memory(model, run.backend, slots=options.serve.parallel, cache_type=kv_types[0],
                 value_type=kv_types[1], draft=draft)
    say(required_memory(model, n_devices, kv_types, slots=options.serve.parallel, draft=draft))
    compile_programs(run)
    session = open_session(model, run, n_devices, device_sampling=False, draft=draft)
    streams = complete_all(session, requests, n_slots=options.serve.parallel, progress=True)
    for i, (item, stream) in enumerate(zip(prompts, streams)):
        if stream.error is not None:
            raise JllamaError(f"--file={options.perplexity.file}: {where(item['line'], i)}: "
                              f"{stream.error}")
        print(json.dumps({
            "index": i, "prompt": item["prompt"], "text": stream.text,
            "finish_reason": stream.finish_reason,
            "prompt_tokens": len(stream.request.prompt_ids),
            "completion_tokens": len(stream.generated_ids),
            "cached_tokens": stream.cached_tokens,
            "seed": stream.request.sampler.seed,
        }), flush=True)
    sys.stdout.flush()
    return 0
