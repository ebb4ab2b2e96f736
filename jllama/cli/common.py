"""What the commands share: one-line errors and output, the run's processes and devices, and
the `Session` they drive (model read, backend prepared, its notes said)."""

from __future__ import annotations

import os
import sys

from jllama.platform import compile_cache
from jllama.cli.options import ModelOptions, Options, RunOptions
from jllama.errors import BackendError, JllamaError
from jllama.generation.generate import GenerationStats
from jllama.generation.session import Session


def say(line: str) -> None:
    """One line for the user, on stderr."""
    print(f"jllama: {line}", file=sys.stderr, flush=True)


def fail(message: str, status: int = 1):
    """Exit with one error line, whatever the message holds (a path with a newline, a
    multi-line library error)."""
    one_line = " ".join(str(message).split("\n"))
    print(f"jllama: error: {one_line}", file=sys.stderr)
    sys.exit(status)


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def write_raw(out, text: str) -> None:
    """Write `text` with any undecodable argv bytes (surrogate escapes) as those bytes."""
    out.flush()
    out.buffer.write(text.encode("utf-8", "surrogateescape"))
    out.buffer.flush()


def rates(stats: GenerationStats) -> str:
    """The stats line's first half: prefill and decode rates."""
    return (
        f"achieved tok/s: prefill {stats.prefill_tok_s:.1f} "
        f"({stats.prompt_tokens} tokens, {stats.prefill_seconds:.3f} s), "
        f"decode {stats.decode_tok_s:.1f} "
        f"({stats.decode_steps} tokens, {stats.decode_seconds:.3f} s)"
        + (f", drafts {stats.accepted_tokens} of {stats.drafted_tokens} accepted "
           f"({100 * stats.acceptance:.0f}%)" if stats.drafted_tokens else "")
    )


def as_flag(message: str) -> str:
    """A library message that starts with a setting's name (`devices=3 must ...`) as the
    flag's (`--devices=3 must ...`)."""
    return message if message.startswith("--") else "--" + message


def no_arguments(command: str, args: list[str]) -> None:
    if args:
        raise JllamaError(f"{command}: unexpected argument {args[0]!r} (flags take the form "
                          "--name=value)")


def one_process(command: str, run: RunOptions) -> None:
    """Refuse the multi-process flags for a command that runs in one process."""
    if run.num_processes > 1 or run.coordinator:
        raise JllamaError(
            f"{command} runs in one process (--devices splits the model over its devices); "
            "--num_processes and --coordinator are for generation"
        )


def compile_programs(run: RunOptions, speak: bool = True) -> compile_cache.CompileCache:
    """The persistent compile cache (--compile_cache) for the jax backend, set up before any
    program compiles; its counts are kept either way."""
    use = run.compile_cache and run.backend == "jax"
    return compile_cache.setup(enabled=use, warn=None if speak else (lambda line: None))


def note_seq_len(options: Options, model) -> None:
    """Says so when --seq_len asked for more context than the model has (it is capped), or
    when, without --seq_len, the model's context was capped at DEFAULT_CONTEXT (and how to
    have it all). model: a `jllama.model.loading.Model`."""
    config = model.config
    if options.seq_len_asked > config.seq_len:
        say(f"note: --seq_len={options.seq_len_asked} is more than the model's context; "
            f"using {config.seq_len}")
    elif not options.seq_len_asked and model.context_length > config.seq_len:
        say(f"note: the context is {config.seq_len} tokens of the model's "
            f"{model.context_length}; --seq_len={model.context_length} allocates all of it")


def device_count(run: RunOptions, config, several: bool) -> int:
    """The devices --devices asks for (0: one, or all of them with several processes),
    checked against the model's sizes before anything is loaded onto a device."""
    if run.devices > 1 and run.backend != "jax":
        raise JllamaError(f"--devices={run.devices} needs --backend=jax")
    if run.backend != "jax" and run.jax_modes:
        name, value = run.jax_modes[0]
        raise JllamaError(f"--{name}={value} is a mode of the jax backend, not of "
                          f"--backend={run.backend}")
    n = run.devices
    if n == 0:
        if not several:
            return 1
        import jax

        n = jax.device_count()
    if n > 1 or several:
        from jllama.platform.sharding import ShardingError, check_divisible, make_mesh

        try:
            check_divisible(config, n)
            make_mesh(n)  # enough devices, and (several processes) a part for every process
        except ShardingError as e:
            raise JllamaError(as_flag(str(e))) from None
    return n


def kv_cache_types(run: RunOptions, model) -> tuple:
    """The (key, value) `jllama.model.cache_types.CacheType`s of --cache_type, --cache_type_k and
    --cache_type_v for `model` (a `jllama.model.loading.Model`; "auto" by its file format).

    Raises:
      ConfigError: q8_0 for a model whose head_dim is not a multiple of 32 (one line naming
        the flag).
    """
    from jllama.model import cache_types

    return cache_types.resolve(run.cache_type_k, run.cache_type_v, model.file_format,
                               model.config.head_dim, flags=run.cache_flags)


def opened_draft(run: RunOptions, model):
    """--draft for `model` as the required-memory line and `open_session` take it: "none",
    "ngram" and the self: types as they are, a checkpoint opened (`load_draft`: once, before
    the line that counts its weights).

    Raises:
      JllamaError: a draft checkpoint that cannot be read or does not share the tokenizer.
    """
    from jllama.generation.draft_model import SELF_TYPES, load_draft
    from jllama.generation.speculative import DRAFTERS

    if run.draft in DRAFTERS or run.draft in SELF_TYPES:
        return run.draft
    return load_draft(run.draft, model)


def open_session(model, run: RunOptions, n_devices: int, speak: bool = True,
                 **options) -> Session:
    """`Session.prepare` with the --backend, --decode, --matvec, --prefill, --cache_type,
    --draft settings (`options`' draft, from `opened_draft`, in place of --draft's name), the
    library's errors renamed to the flags, its lines said when `speak`."""
    from jllama.platform.sharding import ShardingError

    def say_flags(line: str) -> None:  # the backend's settings are flags here
        say(line.replace("(matvec=", "(--matvec="))

    key, value = kv_cache_types(run, model)
    try:
        return Session.prepare(
            model, run.backend, decode=run.decode, matvec=run.matvec, devices=n_devices,
            cache_type_k=key, cache_type_v=value, prefill=run.prefill,
            say=say_flags if speak else None, draft=options.pop("draft", run.draft),
            draft_tokens=run.draft_tokens, weights_cache=run.weights_cache, **options,
        )
    except ShardingError as e:  # e.g. fewer devices than --devices asks for
        raise JllamaError(as_flag(str(e))) from None
    except BackendError as e:  # e.g. "matvec=kernel: no C++ compiler ..."
        raise BackendError(as_flag(str(e)) if str(e).startswith("matvec=") else str(e)) from None
