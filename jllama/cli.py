"""The `jllama` command: absl flags wired to the library.

With no flags it tells a story from the embedded stories260K model, as llama2.c's `run` does.
Presets live in `configs/` and are passed with `--flagfile`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from absl import app, flags, logging

from jllama import runtime
from jllama.backends import backend_names, make_backend
from jllama.errors import JllamaError
from jllama.files import require_regular_file
from jllama.formats.llama2c import read_checkpoint
from jllama.generate import Generation, GenerationStats, resolve_steps
from jllama.loading import embedded_checkpoint, load_tokenizer
from jllama.sampling import Sampler
from jllama.weights import tensor_stats

FLAGS = flags.FLAGS
_F32_MAX = 3.4028234663852886e38

flags.DEFINE_string(
    "checkpoint", None, "llama2.c checkpoint (.bin, version 0). Default: the embedded stories260K."
)
flags.DEFINE_string(
    "tokenizer",
    None,
    "llama2.c tokenizer file. Default: tok<vocab_size>.bin or tokenizer.bin beside the "
    "checkpoint, else (for vocab_size 512) the embedded tok512.bin.",
)
flags.DEFINE_float(
    "temperature", 1.0, "Sampling temperature; 0 = greedy (argmax).", lower_bound=0.0
)
flags.DEFINE_float(
    "top_p",
    0.9,
    "Nucleus sampling threshold in [0, 1]; 0 or 1 = sample from the whole distribution.",
    lower_bound=0.0,
    upper_bound=1.0,
)
flags.DEFINE_integer(
    "steps", 256, "Positions to run, prompt included (tokens); < 1 or > seq_len means seq_len."
)
flags.DEFINE_string("prompt", "", "Text the story starts from.")
flags.DEFINE_integer(
    "seed",
    None,
    "Seed of run.c's xorshift sampler; absent or 0 = from the clock (printed to stderr).",
    lower_bound=0,
    upper_bound=2**64 - 1,
)
flags.DEFINE_enum("backend", "jax", list(backend_names()), "Model implementation.")
flags.DEFINE_integer(
    "threads",
    0,
    "CPU threads for XLA (the process is pinned to that many cores); 0 = all.",
    lower_bound=0,
)
flags.DEFINE_bool(
    "verify_checkpoint",
    False,
    "Print shape, min, max, mean and finiteness of every tensor and exit (1 if any value "
    "is not finite).",
)
flags.DEFINE_enum(
    "output_format",
    "text",
    ["text", "json"],
    "text: stream the story as run.c prints it; json: one object with the ids, the text and "
    "the rates.",
)

flags.register_validator(
    "temperature",
    lambda t: math.isfinite(t) and t <= _F32_MAX,
    message="must be a finite number no larger than 3.4e38 (a float32)",
)
flags.register_validator("top_p", lambda p: math.isfinite(p), message="must be a finite number")
flags.register_validator(
    "threads",
    lambda n: n <= runtime.available_cpus(),
    message=f"exceeds the {runtime.available_cpus()} CPUs available",
)
for _name in ("checkpoint", "tokenizer"):
    flags.register_validator(_name, lambda v: v is None or v != "", message="is empty")


def _verify(weights) -> int:
    ok = True
    print(f"{'tensor':<24} {'shape':<20} {'min':>12} {'max':>12} {'mean':>12}  finite")
    for s in tensor_stats(weights):
        finite = "yes" if s.finite else f"NO ({s.n_nonfinite} values)"
        ok &= s.finite
        print(
            f"{s.name:<24} {str(list(s.shape)):<20} {s.min:>12.6g} {s.max:>12.6g} "
            f"{s.mean:>12.6g}  {finite}"
        )
    return 0 if ok else 1


def _rates(stats: GenerationStats) -> str:
    return (
        f"achieved tok/s: prefill {stats.prefill_tok_s:.1f} "
        f"({stats.prompt_tokens} tokens, {stats.prefill_seconds:.3f} s), "
        f"decode {stats.decode_tok_s:.1f} "
        f"({stats.decode_steps} tokens, {stats.decode_seconds:.3f} s)"
    )


def main(argv: list[str]) -> int:
    if not FLAGS["verbosity"].present:
        # absl logs at INFO by default, which prints JAX's platform probing on every run.
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise JllamaError(f"unexpected argument {argv[1]!r} (flags take the form --name=value)")
    if FLAGS.threads:
        runtime.limit_cpu_threads(FLAGS.threads)
    checkpoint = Path(FLAGS.checkpoint) if FLAGS.checkpoint else embedded_checkpoint()
    config, weights = read_checkpoint(checkpoint)
    if FLAGS.verify_checkpoint:
        return _verify(weights)
    tokenizer = load_tokenizer(checkpoint, config.vocab_size, FLAGS.tokenizer)

    prompt_ids = tokenizer.encode(FLAGS.prompt, bos=True, eos=False)
    if len(prompt_ids) > config.seq_len:
        raise JllamaError(
            f"--prompt is {len(prompt_ids)} tokens, longer than the model's context "
            f"(seq_len={config.seq_len})"
        )
    steps = resolve_steps(FLAGS.steps, config.seq_len)
    if len(prompt_ids) > steps:
        print(
            f"jllama: warning: the prompt ({len(prompt_ids)} tokens) is longer than "
            f"--steps={steps}; nothing will be generated",
            file=sys.stderr,
        )
    sampler = Sampler(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed or None)
    seed = sampler.config.seed
    if FLAGS.temperature > 0 and not FLAGS.seed:
        print(f"jllama: seed {seed} (repeat with --seed={seed})", file=sys.stderr)

    backend = make_backend(FLAGS.backend)
    if getattr(getattr(backend, "device", None), "platform", "cpu") == "cpu":
        runtime.check_kv_cache_fits(config)
    backend.prepare(config, weights)
    generation = Generation(backend.forward, prompt_ids, sampler, steps)

    if FLAGS.output_format == "json":
        for _ in generation:
            pass
        stats = generation.stats
        result = {
            # A prompt from undecodable argv bytes holds surrogates, which JSON can't carry.
            "prompt": FLAGS.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
            "prompt_ids": generation.prompt_ids,
            "generated_ids": generation.generated_ids,
            "text": tokenizer.decode(generation.generated_ids, prev=prompt_ids[-1]),
            "backend": backend.name,
            "seed": seed,
            "temperature": FLAGS.temperature,
            "top_p": FLAGS.top_p,
            "steps": steps,
            "prefill_tok_s": stats.prefill_tok_s,
            "decode_tok_s": stats.decode_tok_s,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "compile_seconds": getattr(backend, "compile_seconds", 0.0),
        }
        print(json.dumps(result), flush=True)
        return 0

    decoder = tokenizer.stream_decoder()
    out = sys.stdout
    for token in generation:
        out.write(decoder.push(token.prev, token.id))
        out.flush()
    out.write(decoder.flush() + "\n")
    out.flush()
    print(_rates(generation.stats), file=sys.stderr)
    return 0


def _fail(message: str, status: int = 1):
    # One line, whatever the message holds (a path with a newline, a multi-line library error).
    one_line = " ".join(str(message).split("\n"))
    print(f"jllama: error: {one_line}", file=sys.stderr)
    sys.exit(status)


_HELP = {"-h", "--help", "-help", "--helpshort", "-?"}
_USAGE = """usage: jllama [--flag=value ...]

Generates text with a Llama model from a llama2.c checkpoint, as llama2.c's run does.
With no flags it tells a story from the embedded stories260K model.

  jllama --temperature=0 --steps=200         greedy: the same story every time
  jllama --prompt="Lily and Tom" --seed=42   a sampled story you can repeat
  jllama --flagfile=configs/greedy.flags     a preset"""


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with one-line errors and a --help that lists jllama's flags and exits 0."""
    if any(arg in _HELP for arg in argv[1:]):
        _print_and_exit(
            _USAGE + "\n\n" + FLAGS.module_help(sys.modules[__name__])
            + "\n\n--helpfull lists absl's own flags too."
        )
    if "--helpfull" in argv[1:]:
        _print_and_exit(FLAGS.get_help())
    for arg in argv[1:]:
        # A FIFO given as a flagfile would block absl's read forever: refuse it up front.
        if arg.startswith(("--flagfile=", "-flagfile=")):
            path = arg.split("=", 1)[1]
            if path:
                try:
                    require_regular_file(Path(path), f"--flagfile={path}", JllamaError)
                except JllamaError as e:
                    _fail(str(e))
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _fail(str(e).removeprefix("ERROR:: "))  # absl's prefix for flagfile errors
    except UnicodeDecodeError as e:
        _fail(f"a --flagfile is not UTF-8 text ({e.reason} at byte {e.start})")


def _print_and_exit(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `jllama --help | head`
        _silence_stdout()
    sys.exit(0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _main(argv: list[str]) -> None:
    try:
        sys.exit(main(argv))
    except JllamaError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (e.g. `jllama | head`): stop quietly, as a filter should.
        _silence_stdout()
        sys.exit(0)
    except OSError as e:
        _silence_stdout()
        _fail(f"cannot write the output: {e.strerror or e}")
    except Exception as e:
        if os.environ.get("JLLAMA_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (JLLAMA_DEBUG=1 shows the traceback)", 2)


def run() -> None:
    """Run the command (the console script goes through `jllama.__main__.run`)."""
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:  # started with that stream closed
            setattr(sys, name, open(os.devnull, "r" if name == "stdin" else "w"))
    # A terminal that cannot show a character gets a replacement mark, not a crash.
    sys.stdout.reconfigure(errors="replace")
    app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
