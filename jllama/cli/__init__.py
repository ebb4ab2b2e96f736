"""The `jllama` command: absl flags (`jllama.cli.flags`) read once into options
(`jllama.cli.options`) and handed to one module per command.

With no flags it tells a story from the embedded stories260K model, as llama2.c's `run` does.
Presets live in `configs/` and are passed with `--flagfile`.

  generate.py    the main job: --mode=generate (and --verify_checkpoint)
  chat.py        --mode=chat
  serve.py       jllama serve
  perplexity.py  jllama perplexity
  tools.py       jllama fetch / tokenize / convert
  batch.py       jllama batch
"""

from __future__ import annotations

import atexit
import gc
import os
import re
import sys
from pathlib import Path

from absl import app, logging
from absl import flags as absl_flags

from jllama.cli import options as cli_options
from jllama.cli.common import fail, no_arguments, silence_stdout
from jllama.cli.flags import FLAGS
from jllama.errors import JllamaError
from jllama.platform.files import require_regular_file

PRESETS = Path(__file__).resolve().parents[2] / "configs"
"""The repository's presets (`configs/*.flags`), found from any folder."""


def main(argv: list[str]) -> int:
    """Run the command in `argv` (flags already parsed); returns the exit status."""
    if not FLAGS["verbosity"].present:
        # absl logs at INFO by default, which prints JAX's platform probing on every run.
        logging.set_verbosity(logging.WARNING)
    command, args = (argv[1], argv[2:]) if len(argv) > 1 else (None, [])
    options = cli_options.from_flags()
    if command == "fetch":
        from jllama.cli.tools import fetch

        return fetch(options, args)
    if command in ("tokenize", "convert", "serve", "perplexity", "batch"):
        no_arguments(command, args)
        if command == "batch":
            from jllama.cli import batch

            return batch.main(options)
        if command == "serve":
            from jllama.cli import serve

            return serve.main(options)
        if command == "perplexity":
            from jllama.cli import perplexity

            return perplexity.main(options)
        from jllama.cli import tools

        return tools.tokenize(options) if command == "tokenize" else tools.convert(options)
    if command is not None:
        # `chat` reads like a command next to `serve`, but it is a mode of the main job.
        hint = f"; for {command}, pass --mode={command}" if command in ("chat", "generate") else ""
        raise JllamaError(
            f"unexpected argument {command!r} (commands: fetch, tokenize, convert, serve, "
            f"perplexity, batch; flags take the form --name=value{hint})"
        )
    from jllama.cli import generate

    return generate.main(options)


_HELP = {"-h", "--help", "-help", "--helpshort", "-?"}
_USAGE = """usage: jllama [--flag=value ...]
       jllama fetch NAME                      download a known model (smollm2) into the cache
       jllama tokenize --prompt=TEXT [--pieces] [--parse_special] [--checkpoint=...|--tokenizer=FILE]
       jllama convert --checkpoint=SOURCE --output=FILE.bin [--llama2c_version=1|2|0]
       jllama serve [--checkpoint=...] [--host=127.0.0.1] [--port=8080]   OpenAI-compatible API
       jllama batch --file=PROMPTS [--parallel=4] [--steps=N]   one JSON line per prompt
       jllama perplexity --file=TEXT [--ctx=512] [--chunks=N] [--checkpoint=...]
                                              PPL of a text, as llama.cpp's llama-perplexity
       jllama --version

llama.cpp's short flags work too: -m (--checkpoint), -p (--prompt), -n (--steps), -c
(--seq_len), -t (--threads), --temp (--temperature).

Generates text with a Llama model from a llama2.c checkpoint, a GGUF file or a Hugging Face
folder.
With no flags it tells a story from the embedded stories260K model, as llama2.c's run does.

  jllama --temperature=0 --steps=200         greedy: the same story every time
  jllama --prompt="Lily and Tom" --seed=42   a sampled story you can repeat
  jllama --flagfile=configs/greedy.flags     a preset
  jllama fetch smollm2 && jllama --checkpoint=smollm2 --mode=chat
                                             chat with SmolLM2-135M-Instruct"""


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with one-line errors and a --help that lists jllama's flags and exits 0."""
    if any(arg in _HELP for arg in argv[1:]):
        _print_and_exit(
            _USAGE + "\n\n" + FLAGS.module_help(sys.modules["jllama.cli.flags"])
            + "\n\n--helpfull lists absl's own flags too."
        )
    if "--helpfull" in argv[1:]:
        _print_and_exit(FLAGS.get_help())
    if any(arg in ("--version", "-version") for arg in argv[1:]):
        from jllama import __version__

        _print_and_exit(f"jllama {__version__}")
    argv = [argv[0]] + [_no_underscore(_preset(arg)) for arg in argv[1:]]
    for i in range(1, len(argv) - 1):  # `--flagfile PATH`, as absl also takes it
        if argv[i] in ("--flagfile", "-flagfile"):
            argv[i:i + 2] = _preset(f"{argv[i]}={argv[i + 1]}").split("=", 1)
    for arg in argv[1:]:
        # A FIFO given as a flagfile would block absl's read forever: refuse it up front.
        if arg.startswith(("--flagfile=", "-flagfile=")):
            path = arg.split("=", 1)[1]
            if path:
                try:
                    require_regular_file(Path(path), f"--flagfile={path}", JllamaError)
                except JllamaError as e:
                    fail(str(e))
    try:
        return FLAGS(argv)
    except absl_flags.Error as e:
        fail(_flag_error(e))
    except UnicodeDecodeError as e:
        fail(f"a --flagfile is not UTF-8 text ({e.reason} at byte {e.start})")
    except ValueError as e:  # absl's own: "--noparse_special=1 does not take an argument"
        found = re.fullmatch(r"(--?no(\w+)=.*) does not take an argument", str(e))
        fail(f"{found[1]}: a --no flag takes no value (--{found[2]}=false)" if found else str(e))


def _flag_error(e: absl_flags.Error) -> str:
    """absl's parse error as one line naming the flag and what is wrong with its value.

    absl words a value its parser refused as `flag --NAME=VALUE: <the parser's exception>`,
    which for a boolean is a tuple and for a number Python's `int()`/`float()` message; those
    are said here by the flag's type. Range and validator messages keep absl's words."""
    message = str(e).removeprefix("ERROR:: ")  # absl's prefix for flagfile errors
    if isinstance(e, absl_flags.UnrecognizedFlagError):
        suggestions = message.partition("Did you mean: ")[2].rstrip(" ?").split(", ")
        known = [s for s in suggestions if s and s in FLAGS]
        hint = f" (did you mean {' or '.join('--' + s for s in known)}?)" if known else ""
        return f"unknown flag --{e.flagname}{hint}"
    missing = re.fullmatch(r"Missing value for flag (-+)(\w+)", message)
    if missing:
        return f"--{missing[2]} needs a value (--{missing[2]}=VALUE)"
    found = re.match(r"flag --(\w+)=", message)
    cause = e.__context__
    if found is None or found[1] not in FLAGS:
        return message.removeprefix("flag ")
    name = found[1]
    if not isinstance(cause, (ValueError, TypeError, OverflowError)):
        return message.removeprefix("flag ")  # a validator's, e.g. "--threads=9: exceeds ..."
    value = message[len(found[0]):].removesuffix(f": {cause}")
    parser = FLAGS[name].parser
    if isinstance(parser, absl_flags.BooleanParser):
        return f"--{name}: {value!r} is not a boolean (true/false)"
    if isinstance(parser, absl_flags.EnumParser):
        return f"--{name}: {value!r} is not one of {', '.join(parser.enum_values)}"
    if isinstance(parser, (absl_flags.IntegerParser, absl_flags.FloatParser)):
        try:
            parser.convert(value)
        except (ValueError, TypeError, OverflowError):
            kind = "an integer" if isinstance(parser, absl_flags.IntegerParser) else "a number"
            return f"--{name}: {value!r} is not {kind}"
    return f"--{name}: {cause}"  # e.g. "-1 is not a non-negative integer"


def _no_underscore(arg: str) -> str:
    """`--no_NAME` for a boolean flag NAME is absl's `--noNAME` (`serve --no_webui`)."""
    found = re.fullmatch(r"(--?)no_(\w+)", arg)
    if (found and found[2] in FLAGS and f"no_{found[2]}" not in FLAGS
            and isinstance(FLAGS[found[2]].parser, absl_flags.BooleanParser)):
        return f"{found[1]}no{found[2]}"
    return arg


def _preset(arg: str) -> str:
    """`--flagfile=configs/NAME.flags` from any folder: a path that does not exist from here
    but names one of the presets in the repository's `configs/` (beside the package of an
    install from a clone) is that preset."""
    flag, _, path = arg.partition("=")
    if flag not in ("--flagfile", "-flagfile") or not path or Path(path).exists():
        return arg
    preset = PRESETS / Path(path).name
    if Path(path).parent.name == "configs" and preset.is_file():
        return f"{flag}={preset}"
    return arg


def _print_and_exit(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `jllama --help | head`
        silence_stdout()
    sys.exit(0)


def _main(argv: list[str]) -> None:
    try:
        sys.exit(main(argv))
    except JllamaError as e:
        fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (e.g. `jllama | head`): stop quietly, as a filter should.
        silence_stdout()
        sys.exit(0)
    except OSError as e:
        silence_stdout()
        fail(f"cannot write the output: {e.strerror or e}")
    except Exception as e:
        if os.environ.get("JLLAMA_DEBUG"):
            raise
        fail(f"internal error: {type(e).__name__}: {e} (JLLAMA_DEBUG=1 shows the traceback)", 2)


def run() -> None:
    """Run the command (the console script goes through `jllama.__main__.run`)."""
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:  # started with that stream closed
            setattr(sys, name, open(os.devnull, "r" if name == "stdin" else "w"))
    # A terminal that cannot show a character gets a replacement mark, not a crash.
    sys.stdout.reconfigure(errors="replace")
    # At exit the interpreter's last collection would walk every object the model and its
    # vocabulary made (0.15 s of SmolLM2's exit); nothing then needs collecting. Registered
    # after JAX's handlers, so it runs before them.
    atexit.register(gc.freeze)
    app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
