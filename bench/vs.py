"""Running another program's decode for comparison (`run.py --vs "COMMAND"`).

The command is a template split like a shell line (`shlex.split`, no shell involved); in each
word `{checkpoint}` becomes the shape's llama2.c file and `{tokenizer}` a tokenizer file of
the shape's vocabulary size, e.g. for llama2.c's run:

    bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0
    env OMP_NUM_THREADS=1 bench/.cache/run {checkpoint} -z {tokenizer} -n 256 -t 0

(no shell: environment settings go through `env`, whose options such as `-i` and `-u NAME`
may come first; `env -S` is refused).

Its decode rate is read from what it prints (stdout and stderr together): run.c's
`achieved tok/s: X`, jllama's `achieved tok/s: prefill ... decode X (...)`, or the `tgN` row
of llama.cpp's `llama-bench` table (`| ... | tg256 | 88.80 ± 0.70 |`: the mean), e.g.

    bench/.cache/llama.cpp-build/bin/llama-bench -m /tmp/smollm2-F32.gguf -t 2 -p 0 -n 256 -r 3

with one `-t` and one `-n` value: a table with several tgN rows is refused, not guessed at.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import string
import subprocess
import tempfile
import time
from pathlib import Path

from cli import last_line, rate  # bench/ is not a package: by file name

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


def tg_rows(text: str) -> int:
    """How many llama-bench `tgN` rows `text` has (more than one: several -t or -n values, and
    `parse_tok_s`'s "last row" is then a guess)."""
    return len(_LLAMA_BENCH.findall(text))


_ENV_LONG = {  # GNU env's long options: whether each takes its argument as the next word
    "ignore-environment": False, "null": False, "unset": True, "chdir": True,
    "split-string": True, "block-signal": False, "default-signal": False,
    "ignore-signal": False, "list-signal-handling": False, "debug": False, "help": False,
    "version": False,
}
_ENV_SPLIT = ("env -S (--split-string) is not supported: give the command's words "
              "separately, e.g. env -i NAME=VALUE PROGRAM ARGS")


def _after_env(words: list[str]) -> tuple[list[str], list[str]]:
    """The words after `env`, split into (its NAME=VALUE settings, the command): its options
    come first (`-i`, `-0`, `-v`, `-u NAME`, `-uNAME`, `--unset NAME`, `--unset=NAME`, `-C DIR`,
    `--chdir=DIR`, grouped short ones such as `-iu NAME`, unambiguous abbreviations of long
    ones; `--` ends them; a lone `-` is `-i`), then the settings, then the command.

    Raises:
      ValueError: `-S`/`--split-string`, whose one word would be split into several.
    """
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            i += 1
            break
        if word == "-" or not word.startswith("-"):
            break
        i += 1
        if word.startswith("--"):
            name, eq, _ = word[2:].partition("=")
            matches = [o for o in _ENV_LONG if o.startswith(name)] if name else []
            option = name if name in _ENV_LONG else (matches[0] if len(matches) == 1 else None)
            if option == "split-string":
                raise ValueError(_ENV_SPLIT)
            if option is not None and _ENV_LONG[option] and not eq:
                i += 1  # --unset NAME, --chdir DIR
            continue
        for k, letter in enumerate(word[1:], 1):
            if letter == "S":
                raise ValueError(_ENV_SPLIT)
            if letter in "uC":  # the rest of the word, or else the next word, is its argument
                if k == len(word) - 1:
                    i += 1
                break
    if i < len(words) and words[i] == "-":
        i += 1
    settings = []
    while i < len(words) and "=" in words[i]:
        settings.append(words[i])
        i += 1
    return settings, words[i:]


def label(template: str) -> str:
    """A short name for a command: its program's file name, then the file name after any
    `-m` (llama-bench's model), then any `env NAME=VALUE` settings (e.g. "run
    OMP_NUM_THREADS=1", "llama-bench smollm2-F32.gguf"); env's options are left out."""
    words = shlex.split(template)
    settings: list[str] = []
    if words and words[0].rsplit("/", 1)[-1] == "env":
        try:
            settings, words = _after_env(words[1:])
        except ValueError:  # env -S: `check` refuses it; name it by env itself here
            pass
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

    Only a bare `{name}` is a placeholder; `{{` and `}}` are literal braces.

    Raises:
      ValueError: a placeholder other than those given, one with a conversion or format spec
        (`{checkpoint!r}`, `{checkpoint:>60}`), a stray brace, or unbalanced quotes.
    """
    try:
        words = shlex.split(template)
    except ValueError as e:  # shlex says "No closing quotation" / "No escaped character"
        raise ValueError(f"--vs {template!r}: cannot be split like a shell line: {e}") from None
    known = ", ".join(f"{{{k}}}" for k in values)
    try:
        for word in words:
            for _, field, spec, conversion in string.Formatter().parse(word):
                if field is None:
                    continue
                if field not in values:
                    raise ValueError(f"--vs {template!r}: unknown placeholder {{{field}}} "
                                     f"(known: {known})")
                if conversion or spec:
                    written = ("{" + field + (f"!{conversion}" if conversion else "")
                               + (f":{spec}" if spec else "") + "}")
                    raise ValueError(f"--vs {template!r}: placeholder {written} has a "
                                     f"conversion or format spec; write it bare: {{{field}}}")
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
    word after env's options and NAME=VALUE settings (None when there is none).

    Raises:
      ValueError: `env -S` (split string), which this does not follow.
    """
    words = list(argv)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        _, words = _after_env(words[1:])
    return words[0] if words else None


def check_unique(templates: list[str]) -> None:
    """Refuse the same --vs command given twice (same words once split like a shell line).

    Raises:
      ValueError: "--vs given twice: '<template>'", naming the second one as written.
    """
    seen = set()
    for template in templates:
        try:
            key: object = tuple(shlex.split(template))
        except ValueError:  # unbalanced quotes: `check` says so; compare as written
            key = template
        if key in seen:
            raise ValueError(f"--vs given twice: {template!r}")
        seen.add(key)


def check(template: str, placeholders: tuple[str, ...] = PLACEHOLDERS) -> None:
    """Refuse, before any run, a --vs template that cannot run: empty, unbalanced quotes, an
    unknown placeholder (only `placeholders`, by default `PLACEHOLDERS`), or a program that is neither an executable file
    (a path with a "/") nor a name found on PATH; `env` itself and the program after its
    options and settings are both checked (`env -S` is refused).

    Raises:
      ValueError: one line naming --vs, the template and what is wrong.
    """
    argv = expand(template, **{k: f"{{{k}}}" for k in placeholders})
    if not argv:
        raise ValueError(f"--vs {template!r}: empty, give a command")
    try:
        command = program(argv)
    except ValueError as e:
        raise ValueError(f"--vs {template!r}: {e}") from None
    for word in dict.fromkeys([argv[0], command]):
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


OUTPUT_LIMIT = 64 * 1024 * 1024
"""Bytes a --vs program may print on stdout, and again on stderr, before it is stopped (a
benchmark prints a few KiB; this keeps a runaway one from filling the disk)."""

TAIL_BYTES = 64 * 1024
"""How much of the end of each of its stdout and stderr is read back, for the rate and the
error message."""


def _tail(file) -> str:
    """The last TAIL_BYTES of a file the program wrote (from its first whole line when cut),
    decoded. Reads with pread: the file offset is shared with the program."""
    size = os.fstat(file.fileno()).st_size
    start = max(0, size - TAIL_BYTES)
    data = os.pread(file.fileno(), size - start, start)
    if start and b"\n" in data[:-1]:
        data = data[data.index(b"\n") + 1:]
    return data.decode("utf-8", "replace")


def _kill(proc: subprocess.Popen) -> None:
    """Kill the program and whatever it started (its own session), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # gone already
        pass
    proc.wait()


def run_other(argv: list[str], timeout_s: float) -> dict:
    """Run `argv` once; returns {"tok_s": float or None, "wall_s", "returncode", "tail",
    "error"}.

    Its stdout and stderr go to two temporary files, not memory; only the last 64 KiB of each
    is read back. The rate is read from both (stdout, then stderr). "tok_s" is a finite rate
    > 0 or None; when None, "error" says why in words ("could not start: [Errno 2] ...",
    "exited with status 3: <its last line>", "timed out after 5 s", "printed more than 64
    MiB on stdout; stopped it", "printed no tok/s rate: <its last line>", "printed no usable
    tok/s rate: ...", "printed 2 tg rows (one -n and one -t, please)"), else it is None; "its
    last line" is stderr's last non-empty line, or stdout's when stderr has none. "tail" is
    the last 400 characters of its output (stdout, then stderr), "text" the last 64 KiB of
    each (`TAIL_BYTES`). A timeout, too much output
    or a failed start gives returncode None; on a timeout or too much output the program and
    anything it started are killed.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_file,
                                    stderr=err_file, start_new_session=True)
        except OSError as e:
            return {"tok_s": None, "wall_s": 0.0, "returncode": None, "tail": str(e),
                    "error": f"could not start: {e}"}
        stopped = None
        try:
            deadline = start + timeout_s
            while True:
                try:
                    proc.wait(timeout=max(0.0, min(0.1, deadline - time.perf_counter())))
                    break
                except subprocess.TimeoutExpired:
                    pass
                big = [name for name, f in (("stdout", out_file), ("stderr", err_file))
                       if os.fstat(f.fileno()).st_size > OUTPUT_LIMIT]
                if big:
                    stopped = (f"printed more than {OUTPUT_LIMIT / 2**20:g} MiB on {big[0]}; "
                               "stopped it")
                elif time.perf_counter() >= deadline:
                    stopped = f"timed out after {timeout_s:g} s"
                if stopped:
                    _kill(proc)
                    break
        finally:
            if proc.returncode is None:  # Ctrl-C, SIGTERM (cli.py raises): don't leave it
                _kill(proc)
        wall_s = time.perf_counter() - start
        out_text = _tail(out_file)
        err_text = _tail(err_file)
    glue = "\n" if out_text and err_text and not out_text.endswith("\n") else ""
    text = out_text + glue + err_text
    out = {"tok_s": None, "wall_s": wall_s, "returncode": None if stopped else proc.returncode,
           "tail": text[-400:], "text": text, "error": stopped}
    if stopped:
        return out
    why = last_line(err_text) if err_text.strip() else last_line(out_text)
    if proc.returncode != 0:
        how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        out["error"] = f"{how}: {why}"
        return out
    rows = tg_rows(text)
    found = parse_tok_s(text)
    if rows > 1 and not (_RUNC.search(text) or _JLLAMA.search(text)):  # the rate is a tg row
        out["error"] = f"printed {rows} tg rows (one -n and one -t, please)"
    elif found is None:
        out["error"] = f"printed no tok/s rate: {why}"
    elif rate(found) is None:
        out["error"] = f"printed no usable tok/s rate: {found} is not a finite number > 0"
    else:
        out["tok_s"] = found
    return out
