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

import math
import os
import re
import shlex
import shutil
import string
import subprocess
import time
from pathlib import Path

from cli import last_line  # bench/ is not a package: by file name

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


def labels(templates: list[str]) -> dict[str, str]:
    """Names for several commands, distinct from each other: each one's `label`, and where two
    or more share it, that label followed by the words of the command that differ among
    them, with the flag before a differing value (e.g. "run {checkpoint} -t 1" and "run
    {checkpoint} -t 2" -> "run -t 1", "run -t 2")."""
    out: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for t in dict.fromkeys(templates):
        groups.setdefault(label(t), []).append(t)
    for name, group in groups.items():
        if len(group) == 1:
            out[group[0]] = name
            continue
        split = [shlex.split(t) for t in group]
        common = set.intersection(*(set(words) for words in split))
        for t, words in zip(group, split):
            differ = [j for j in range(1, len(words)) if words[j] not in common]
            # a differing value keeps its flag: "-t 2", not "2"
            keep = sorted({j - 1 for j in differ if words[j - 1].startswith("-")} | set(differ))
            extra = " ".join(words[j] for j in keep if j >= 1)
            out[t] = f"{name} {extra}" if extra else name
    taken: dict[str, int] = {}
    for n in out.values():
        taken[n] = taken.get(n, 0) + 1
    # still alike (they differ in the program's folder, say): the whole command says which
    return {t: (t if taken[n] > 1 else n) for t, n in out.items()}


def expand(template: str, **values: str) -> list[str]:
    """The argument list of `template` with `{name}` replaced by `values[name]` in each word.

    Raises:
      ValueError: a placeholder other than those given, a stray brace, or unbalanced quotes.
    """
    try:
        words = shlex.split(template)
    except ValueError as e:  # shlex says "No closing quotation" / "No escaped character"
        raise ValueError(f"--vs {template!r}: cannot be split like a shell line: {e}") from None
    known = ", ".join(f"{{{k}}}" for k in values)
    try:
        for word in words:
            for _, field, _, _ in string.Formatter().parse(word):
                if field is not None and field not in values:
                    raise ValueError(f"--vs {template!r}: unknown placeholder {{{field}}} "
                                     f"(known: {known})")
        return [w.format(**values) for w in words]
    except ValueError as e:
        if str(e).startswith("--vs"):
            raise
        # a lone "{" or "}", a bad format spec
        raise ValueError(f"--vs {template!r}: {e} (placeholders: {known}; "
                         "write {{ and }} for a brace)") from None


PLACEHOLDERS = ("checkpoint", "tokenizer")
"""What a --vs template may name: the shape's llama2.c file and a tokenizer file."""


def program(argv: list[str]) -> str | None:
    """The program an argument list runs: its first word, or after a leading `env` the first
    word that is not a NAME=VALUE setting (None when there is none)."""
    words = list(argv)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
        while words and "=" in words[0] and not words[0].startswith("-"):
            words.pop(0)
    return words[0] if words else None


def check(template: str, placeholders: tuple[str, ...] = PLACEHOLDERS) -> None:
    """Refuse, before any run, a --vs template that cannot run: empty, unbalanced quotes, an
    unknown placeholder (only `placeholders`, by default `PLACEHOLDERS`), or a program that is neither an executable file
    (a path with a "/") nor a name found on PATH; `env` itself and the program after its
    settings are both checked.

    Raises:
      ValueError: one line naming --vs, the template and what is wrong.
    """
    argv = expand(template, **{k: f"{{{k}}}" for k in placeholders})
    if not argv:
        raise ValueError(f"--vs {template!r}: empty, give a command")
    for word in dict.fromkeys([argv[0], program(argv)]):
        if word is None:
            raise ValueError(f"--vs {template!r}: names no program after its settings")
        if "/" in word:
            path = Path(word)
            if not path.is_file():
                raise ValueError(f"--vs {template!r}: program {word} does not exist"
                                 + (" (it is a folder)" if path.is_dir() else ""))
            if not os.access(path, os.X_OK):
                raise ValueError(f"--vs {template!r}: program {word} is not executable")
        elif shutil.which(word) is None:
            hint = " (environment settings go through `env NAME=VALUE`)" if "=" in word else ""
            raise ValueError(f"--vs {template!r}: program {word!r} is not found on PATH{hint}")


def run_other(argv: list[str], timeout_s: float) -> dict:
    """Run `argv` once; returns {"tok_s": float or None, "wall_s", "returncode", "tail",
    "error"}.

    "tok_s" is a finite rate > 0 or None; when None, "error" says why in words ("could not
    start: [Errno 2] ...", "exited with status 3: <its last line>", "timed out after 5 s",
    "printed no tok/s rate: <its last line>", "printed no usable tok/s rate: ..."), else it
    is None. "tail" is the last 400 characters of its output. A timeout or a failed start
    gives returncode None.
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
                "tail": text[-400:], "error": f"timed out after {timeout_s:g} s"}
    except OSError as e:
        return {"tok_s": None, "wall_s": 0.0, "returncode": None, "tail": str(e),
                "error": f"could not start: {e}"}
    text = done.stdout.decode("utf-8", "replace")
    out = {"tok_s": None, "wall_s": time.perf_counter() - start,
           "returncode": done.returncode, "tail": text[-400:], "error": None}
    if done.returncode != 0:
        how = (f"was killed by signal {-done.returncode}" if done.returncode < 0
               else f"exited with status {done.returncode}")
        out["error"] = f"{how}: {last_line(text)}"
        return out
    found = parse_tok_s(text)
    if found is None:
        out["error"] = f"printed no tok/s rate: {last_line(text)}"
    elif not (math.isfinite(found) and found > 0):
        out["error"] = f"printed no usable tok/s rate: {found} is not a finite number > 0"
    else:
        out["tok_s"] = found
    return out
