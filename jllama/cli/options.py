"""The command line's settings as frozen option dataclasses, read from `FLAGS` once.

This is the only module of the command that reads `FLAGS`: every command takes the `Options`
made here. Sampler settings are checked by `SamplerConfig` (the server's schema uses the same
checks), their errors renamed to the flags they came from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from jllama.model import cache_types
from jllama.cli.flags import FLAGS
from jllama.errors import JllamaError
from jllama.sampling import FILTERS, SamplerConfig
from jllama.sampling.config import SamplerSettingError

if TYPE_CHECKING:  # llguidance is imported only where a constraint is given
    from jllama.constrain import Grammar

CONSTRAINT_FLAGS = ("json_schema", "json", "regex", "grammar")
"""The flags that constrain the output (`jllama.constrain.Grammar`), at most one at a time."""

_LLAMA_CPP_SAMPLER_FLAGS = ("top_k", "min_p", "repeat_penalty", "presence_penalty",
                            "frequency_penalty")
_FLAG_OF_FIELD = {"order": "samplers"}


DEFAULT_CONTEXT = 4096
"""The context the KV cache holds without --seq_len when the model's is longer (tokens), as
llama.cpp's default: a model made for 1M positions would otherwise allocate gigabytes of cache
(and a minute of work) for a short prompt."""


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """What to read: --checkpoint, --tokenizer, --seq_len (the model's context up to
    DEFAULT_CONTEXT when not given), --dtype (None: as stored)."""

    checkpoint: str | None
    tokenizer: str | None
    seq_len: int | None
    dtype: str | None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run it: the backend and its modes, devices, threads, processes."""

    backend: str
    decode: str
    matvec: str
    prefill: str
    devices: int
    threads: int
    compile_cache: bool
    coordinator: str | None
    num_processes: int
    process_id: int
    jax_modes: tuple[tuple[str, str], ...]
    """(flag, value) of the jax backend's modes given on the command line (not auto)."""
    cache_type_k: str = cache_types.AUTO
    cache_type_v: str = cache_types.AUTO
    """The KV cache types asked for (`jllama.model.cache_types` names, or "auto": resolved for the
    model by `jllama.model.cache_types.resolve`), from --cache_type, --cache_type_k, --cache_type_v."""
    cache_flags: tuple[str, str] = ("cache_type", "cache_type")
    """The flag each of the two came from, for the messages."""
    draft: str = "none"
    draft_tokens: int = 15
    """Speculative decoding: the drafter and the longest draft (--draft, --draft_tokens)."""
    weights_cache: bool = True
    """--weights_cache (`jllama.model.weights_cache`)."""


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """The sampler: its checked `SamplerConfig` (seed None: from the clock) and the llama.cpp
    sampler flags given on the command line (the device loop has none of them)."""

    config: SamplerConfig
    llama_cpp_flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """The main job: --mode, --prompt, --steps, --system_prompt, --parse_special,
    --output_format, --verify_checkpoint, whether to print the rates (--verbosity > 0), the
    constraint of --json_schema, --json, --regex or --grammar (None: none), chat's --reasoning
    (show or hide a thinking model's think block) and the chat template's extra variables
    (--enable_thinking, as (name, value) pairs; serve's defaults for every request too)."""

    mode: str
    prompt: str
    steps: int
    system_prompt: str | None
    parse_special: bool
    output_format: str
    verify_checkpoint: bool
    verbose: bool
    grammar: Grammar | None = None
    reasoning: str = "show"
    template_kwargs: tuple[tuple[str, object], ...] = ()


REQUEST_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "penalty_last_n", "samplers", "seed", *CONSTRAINT_FLAGS)
"""The flags of what a server request sets for itself (its sampler and constraint)."""


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """--host, --port, --model_name, --max_waiting, --parallel, the `REQUEST_FLAGS` given
    on the command line (which the server does not take), --webui (the chat page at `/`), and
    who may use the server: --api_key, --api_key_file, --cors_origins."""

    host: str
    port: int
    model_name: str | None
    max_waiting: int
    parallel: int
    request_flags: tuple[str, ...] = ()
    webui: bool = True
    api_keys: tuple[str, ...] = ()
    """--api_key's values as given (each a key or a comma-separated list; checked by
    `jllama.server.access.parse_api_keys` with --api_key_file's keys)."""
    api_key_file: str | None = None
    cors_origins: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    """--model's NAME=CHECKPOINT values (more models than --checkpoint's)."""
    models_max_loaded: int = 0
    reasoning_format: str = "auto"
    """--reasoning_format: where chat replies' think blocks go (`jllama.chat.reasoning`)."""


@dataclasses.dataclass(frozen=True)
class PerplexityOptions:
    """--file, --ctx, --chunks, and --seq_len (-c, llama-perplexity's context flag: the
    chunk size where --ctx is not given; 0 when absent)."""

    file: str | None
    ctx: int
    chunks: int
    seq_len_flag: int
    ctx_given: bool = True


@dataclasses.dataclass(frozen=True)
class ToolOptions:
    """fetch, tokenize, convert: --pieces, --force, --output, --llama2c_version,
    --group_size (and whether it was given)."""

    pieces: bool
    force: bool
    output: str | None
    llama2c_version: int
    group_size: int
    group_size_given: bool


@dataclasses.dataclass(frozen=True)
class Options:
    """Every setting of one run of the command."""

    model: ModelOptions
    run: RunOptions
    sampling: SamplingOptions
    text: TextOptions
    serve: ServeOptions
    perplexity: PerplexityOptions
    tools: ToolOptions
    seq_len_asked: int
    """--seq_len as given (0: none), for the note when it exceeds the model's context."""


def from_flags() -> Options:
    """The parsed flags as `Options`.

    Raises:
      JllamaError: a sampler setting out of range, or a bad constraint (one line naming its
        flag).
    """
    f = FLAGS
    jax_modes = tuple((name, f[name].value) for name in ("decode", "matvec")
                      if f[name].present and f[name].value != "auto")
    kv_flags = tuple(name if f[name].value is not None else "cache_type"
                     for name in ("cache_type_k", "cache_type_v"))
    kv_names = tuple(f[flag].value for flag in kv_flags)
    for name, flag in zip(kv_names, kv_flags, strict=True):
        if name.lower() != cache_types.AUTO:
            cache_types.cache_type(name, flag)  # ConfigError: one line naming the flag
    return Options(
        model=ModelOptions(f.checkpoint, f.tokenizer, f.seq_len or DEFAULT_CONTEXT,
                           None if f.dtype == "auto" else f.dtype),
        run=RunOptions(f.backend, f.decode, f.matvec, f.prefill, f.devices, f.threads,
                       f.compile_cache, f.coordinator, f.num_processes, f.process_id,
                       jax_modes, *kv_names, kv_flags, f.draft, f.draft_tokens,
                       f.weights_cache),
        sampling=_sampling(),
        text=TextOptions(f.mode, f.prompt, f.steps, f.system_prompt or None, f.parse_special,
                         f.output_format, f.verify_checkpoint, f.verbosity > 0, constraint(),
                         f.reasoning, (() if f.enable_thinking is None
                                       else (("enable_thinking", f.enable_thinking),))),
        serve=ServeOptions(f.host, f.port, f.model_name, f.max_waiting, f.parallel,
                           tuple(name for name in REQUEST_FLAGS if f[name].present),
                           f.webui, api_keys=tuple(f.api_key or ()),
                           api_key_file=f.api_key_file, cors_origins=tuple(f.cors_origins or ()),
                           models=tuple(f.model or ()),
                           models_max_loaded=f.models_max_loaded,
                           reasoning_format=f.reasoning_format),
        perplexity=PerplexityOptions(f.file, f.ctx, f.chunks, f.seq_len, f["ctx"].present),
        tools=ToolOptions(f.pieces, f.force, f.output, int(f.llama2c_version), f.group_size,
                          f["group_size"].present),
        seq_len_asked=f.seq_len,
    )


def _sampling() -> SamplingOptions:
    f = FLAGS
    given = [f"--{name}" for name in _LLAMA_CPP_SAMPLER_FLAGS if f[name].present]
    if tuple(f.samplers) != FILTERS:  # another order than run.c's temperature, then top-p
        given.append("--samplers")
    try:
        config = SamplerConfig(
            temperature=f.temperature, top_p=f.top_p, seed=f.seed or None, top_k=f.top_k,
            min_p=f.min_p, repeat_penalty=f.repeat_penalty,
            presence_penalty=f.presence_penalty, frequency_penalty=f.frequency_penalty,
            penalty_last_n=f.penalty_last_n, order=tuple(f.samplers),
        )
    except SamplerSettingError as e:
        raise JllamaError(f"--{_FLAG_OF_FIELD.get(e.name, e.name)}: {e.reason}") from None
    if given and f.decode == "loop":
        raise JllamaError(
            f"--decode=loop samples on the device with temperature and top_p only; "
            f"{', '.join(given)} cannot be used with it (use --decode=graph or fused)"
        )
    return SamplingOptions(config, tuple(given))


def constraint() -> Grammar | None:
    """The `Grammar` of the constraint flag given (`CONSTRAINT_FLAGS`), None for none.

    --json_schema takes a file or inline JSON (an object, or any JSON value, refused unless
    true / false);
    --grammar a file, GBNF where it holds "::=", else Lark.

    Raises:
      JllamaError: more than one constraint flag, a file that cannot be read, or a schema,
        pattern or grammar llguidance refuses (one line naming the flag).
    """
    f = FLAGS
    given = [name for name in CONSTRAINT_FLAGS if f[name].value not in (None, False)]
    if len(given) > 1:
        raise JllamaError(f"{', '.join('--' + n for n in given)}: give one constraint, not "
                          "several")
    if not given:
        return None
    name = given[0]
    from jllama.constrain import Grammar, GrammarError

    value = f[name].value
    try:
        if name == "json":
            return Grammar.of("json", "")
        if name == "regex":
            return Grammar.of("regex", value)
        if name == "json_schema":
            # Inline JSON: what no schema file's name looks like (an object, an array, a
            # string, a number, true / false / null); an inline non-object is refused by
            # Grammar with the reason, not as a missing file.
            inline = value.strip()[:1] in ('{', '[', '"') or _is_json(value)
            return Grammar.json_schema(value if inline else _read(name, value))
        text = _read(name, value)
        return Grammar.of("gbnf" if "::=" in text else "lark", text)
    except GrammarError as e:
        raise JllamaError(f"--{name}: {e}") from None


def _is_json(text: str) -> bool:
    """Whether `text` is one JSON value (a number, true, null ...), not a file's name."""
    from jllama.platform.files import parse_json

    try:
        parse_json(text)
    except ValueError:
        return False
    return True


def _read(flag: str, path: str) -> str:
    """The UTF-8 text of the file a flag names (JllamaError naming the flag otherwise)."""
    from jllama.platform.files import require_regular_file

    require_regular_file(Path(path), f"--{flag}={path}", JllamaError)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise JllamaError(f"--{flag}={path}: not UTF-8 text ({e.reason} at byte {e.start})"
                          ) from None
    except OSError as e:
        raise JllamaError(f"--{flag}={path}: cannot read: {e.strerror or e}") from None
