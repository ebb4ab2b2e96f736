"""Running another program's decode for comparison (`run.py --vs "COMMAND"`).

The command is a template split like a shell line (`shlex.split`, no shell involved); in each
word `{checkpoint}` becomes the shape's llama2.c file and `{tokenizer}` a tokenizer file of
the shape's vocabulary size, e.g. for llama2.c's run:

    bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0
    env OMP_NUM_THREADS=1 bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0

(no shell: environment settings go through `env`).

Its decode rate is read from what it prints (stdout and stderr together): run.c's
`achieved tok/s: X`, jllama's `achieved tok/s: prefill ... decode X (...)`, or the `tgN` row
of llama.cpp's `llama-bench` table (`| ... | tg256 | 88.80 ± 0.70 |`: the mean), e.g.

    bench/.cache/llama.cpp-build/bin/llama-bench -m /tmp/smollm2-F32.gguf -t 2 -p 0 -n 256 -r 3
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time

_RUNC = re.compile(r"achieved tok/s:\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*$", re.MULTILINE)
_JLLAMA = re.compile(r"achieved tok/s:.*\bdecode\s+([0-9]+(?:\.[0-9]*)?)")
_LLAMA_BENCH = re.compile(r"\|\s*tg[0-9]+\s*\|\s*([0-9]+(?:\.[0-9]*)?)\s*±")


def parse_tok_s(text: str) -> float | None:
    """The decode tok/s a program printed (the last such line), or None if none is found."""
    for pattern in (_RUNC, _JLLAMA, _LLAMA_BENCH):
        found = pattern.findall(text)
        if found:
            return float(found[-1])
    return None


def label(template: str) -> str:
    """A short name for a command: its program's file name, then the file name after any
    `-m` (llama-bench's model), then any `env NAME=VALUE` settings (e.g. "run
    OMP_NUM_THREADS=1", "llama-bench smollm2-F32.gguf")."""
    words = shlex.split(template)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
    settings = []
    while words and "=" in words[0] and not words[0].startswith(("-", "{")):
        settings.append(words.pop(0))
    program = words[0].rsplit("/", 1)[-1] if words else "other"
    # llama-bench's model file tells two of its commands apart (F32 against Q4_1)
    model = [words[i + 1].rsplit("/", 1)[-1] for i in range(1, len(words) - 1) if words[i] == "-m"]
    return " ".join([program] + model[:1] + settings)


def expand(template: str, **values: str) -> list[str]:
    """The argument list of `template` with `{name}` replaced by `values[name]` in each word.

    Raises:
      ValueError: a placeholder other than those given, or unbalanced quotes.
    """
    words = shlex.split(template)
    try:
        return [w.format(**values) for w in words]
    except (KeyError, IndexError) as e:
        known = ", ".join(f"{{{k}}}" for k in values)
        raise ValueError(f"--vs: unknown placeholder {e} (known: {known})") from None


def run_other(argv: list[str], timeout_s: float) -> dict:
    """Run `argv` once; returns {"tok_s": float or None, "wall_s", "returncode", "tail"}.

    "tail" is the last 400 characters of its output, kept for the error line when no rate
    could be read. A timeout gives returncode None.
    """
    start = time.perf_counter()
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired as e:
        text = (e.output or b"").decode("utf-8", "replace")
        return {"tok_s": None, "wall_s": time.perf_counter() - start, "returncode": None,
                "tail": text[-400:]}
    except OSError as e:
        return {"tok_s": None, "wall_s": 0.0, "returncode": None, "tail": str(e)}
    text = done.stdout.decode("utf-8", "replace")
    rate = parse_tok_s(text) if done.returncode == 0 else None
    return {"tok_s": rate, "wall_s": time.perf_counter() - start,
            "returncode": done.returncode, "tail": text[-400:]}
