"""The `jllama` command: absl flags wired to the library.

With no flags it tells a story from the embedded stories260K model, as llama2.c's `run` does.
Presets live in `configs/` and are passed with `--flagfile`.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags, logging

from jllama import runtime
from jllama.backends import backend_names, make_backend
from jllama.errors import JllamaError
from jllama.generate import Generation, GenerationStats, resolve_steps
from jllama.loading import load_model
from jllama.sampling import Sampler, seed_from_clock
from jllama.weights import tensor_stats

FLAGS = flags.FLAGS

flags.DEFINE_string(
    "checkpoint", None, "llama2.c checkpoint (.bin, version 0). Default: the embedded stories260K."
)
flags.DEFINE_string(
    "tokenizer",
    None,
    "llama2.c tokenizer file. Default: tokenizer.bin or tok<vocab_size>.bin beside the "
    "checkpoint, else the embedded tok512.bin.",
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
    "temperature", lambda t: math.isfinite(t), message="must be a finite number"
)
flags.register_validator("top_p", lambda p: math.isfinite(p), message="must be a finite number")
flags.register_validator(
    "threads",
    lambda n: n <= runtime.available_cpus(),
    message=f"exceeds the {runtime.available_cpus()} CPUs available",
)


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
    config, weights, tokenizer = load_model(FLAGS.checkpoint, FLAGS.tokenizer)
    if FLAGS.verify_checkpoint:
        return _verify(weights)

    prompt_ids = tokenizer.encode(FLAGS.prompt, bos=True, eos=False)
    if len(prompt_ids) > config.seq_len:
        raise JllamaError(
            f"--prompt is {len(prompt_ids)} tokens, longer than the model's context "
            f"(seq_len={config.seq_len})"
        )
    steps = resolve_steps(FLAGS.steps, config.seq_len)
    if len(prompt_ids) >= steps:
        print(
            f"jllama: warning: the prompt ({len(prompt_ids)} tokens) fills --steps={steps}; "
            "nothing will be generated",
            file=sys.stderr,
        )
    seed = FLAGS.seed or seed_from_clock()
    if FLAGS.temperature > 0 and not FLAGS.seed:
        print(f"jllama: seed {seed} (repeat with --seed={seed})", file=sys.stderr)
    sampler = Sampler(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=seed)

    backend = make_backend(FLAGS.backend)
    backend.prepare(config, weights)
    generation = Generation(backend.forward, prompt_ids, sampler, steps)

    if FLAGS.output_format == "json":
        for _ in generation:
            pass
        stats = generation.stats
        result = {
            "prompt": FLAGS.prompt,
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
        print(json.dumps(result))
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


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser with a one-line error instead of a usage dump."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = str(e).removeprefix("ERROR:: ")  # absl's prefix for flagfile errors
        print(f"jllama: error: {message}", file=sys.stderr)
        sys.exit(1)


def _main(argv: list[str]) -> None:
    try:
        sys.exit(main(argv))
    except JllamaError as e:
        print(f"jllama: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (e.g. `jllama | head`): stop quietly, as a filter should.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


def run() -> None:
    """Console-script entry point."""
    app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
