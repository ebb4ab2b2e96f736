"""`jllama serve`: the OpenAI-compatible HTTP API over one `Session` (`jllama.server`), or
one per model with --model NAME=CHECKPOINT (`jllama.server.models`)."""

from __future__ import annotations

import sys
from pathlib import Path

from jllama.platform import runtime
from jllama.cli.common import (
    compile_programs, device_count, kv_cache_types, note_seq_len, one_process, open_session,
    opened_draft, say,
)
from jllama.cli.options import Options
from jllama.errors import JllamaError
from jllama.platform.fetch import KNOWN_MODELS
from jllama.model.loading import open_model, required_memory
from jllama.platform.memory import check_memory


def model_id(options: Options) -> str:
    """The name `jllama serve` answers to: --model_name, else the checkpoint's name."""
    if options.serve.model_name:
        return options.serve.model_name
    checkpoint = options.model.checkpoint
    if checkpoint is None:
        return "stories260K"
    if checkpoint in KNOWN_MODELS:
        return checkpoint
    path = Path(checkpoint)
    return path.name if path.is_dir() else path.stem


def more_models(options: Options, default: str) -> dict[str, str]:
    """--model's NAME=CHECKPOINT values as {name: checkpoint}, none named as another or as
    the default model."""
    from jllama.server.models import parse_model_flag

    models: dict[str, str] = {}
    for value in options.serve.models:
        try:
            name, checkpoint = parse_model_flag(value)
        except ValueError as e:
            raise JllamaError(f"serve: {e}") from None
        if name == default or name in models:
            raise JllamaError(f"serve: --model={value}: the name {name!r} is taken "
                              f"(models: {', '.join([default, *models])})")
        models[name] = checkpoint
    return models


def main(options: Options) -> int:
    from jllama.server import bind, make_server, make_worker
    from jllama.server.access import parse_api_keys

    run, serve, m = options.run, options.serve, options.model
    if serve.request_flags:
        # A request without a setting gets OpenAI's default, whatever the command line said.
        raise JllamaError(
            f"serve: {', '.join('--' + name for name in serve.request_flags)}: a request's "
            "sampler setting, not the server's (a request without one gets OpenAI's default); "
            "leave it out"
        )
    if run.threads:
        runtime.limit_cpu_threads(run.threads)
    one_process("serve", run)
    api_keys = parse_api_keys(serve.api_keys, serve.api_key_file)  # a bad file fails at once
    name = model_id(options)
    others = more_models(options, name)  # a bad --model fails before the slow load
    sock = bind(serve.host, serve.port)  # before the slow load: a busy port fails at once

    def load(checkpoint: str | None, tokenizer: str | None):
        model = open_model(checkpoint, tokenizer, seq_len=m.seq_len, dtype=m.dtype)
        n_devices = device_count(run, model.config, several=False)
        note_seq_len(options, model)
        kv_types = kv_cache_types(run, model)
        draft = opened_draft(run, model)  # one drafter per slot in the line
        check_memory(model, run.backend, slots=serve.parallel, cache_type=kv_types[0],
                     value_type=kv_types[1], draft=draft)
        say(required_memory(model, n_devices, kv_types, slots=serve.parallel, draft=draft))
        # Every request brings its own sampler, sampled on the host: never the device loop.
        session = open_session(model, run, n_devices, device_sampling=False, draft=draft)
        return make_worker(session, serve.parallel, serve.max_waiting)

    compile_programs(run)  # programs compiled per request are kept for the next server too
    app_options = {"webui": serve.webui, "api_keys": api_keys,
                   "cors_origins": serve.cors_origins,
                   "reasoning_format": serve.reasoning_format,
                   "chat_template_kwargs": dict(options.text.template_kwargs)}
    if others:
        from jllama.server.models import ModelRouter

        loaders = {name: lambda: load(m.checkpoint, m.tokenizer)}
        loaders.update({other: (lambda c=checkpoint: load(c, None))
                        for other, checkpoint in others.items()})
        engine = ModelRouter(loaders, name, serve.models_max_loaded, **app_options).start()
        model = engine.worker(name).model  # for the line below; not kept
        server = make_server(None, name, sock, app=engine)
        limit = (f", at most {serve.models_max_loaded} loaded at once"
                 if serve.models_max_loaded else "")
        print(f"jllama: models {', '.join(loaders)} (default {name}; the others load on first "
              f"use{limit})", file=sys.stderr, flush=True)
    else:
        engine = load(m.checkpoint, m.tokenizer)
        model = engine.model
        server = make_server(engine, name, sock, **app_options)
    port = sock.getsockname()[1]
    chat = "chat and completions" if model.chat_template else "completions only, no chat template"
    context = model.config.seq_len
    del model  # an unloaded default model must not stay referenced here
    slots = f"{serve.parallel} slots" if serve.parallel > 1 else "1 slot, first in first out"
    print(f"jllama: serving {name} ({chat}; context {context} tokens, {slots}) at "
          f"http://{serve.host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    if serve.webui:
        print(f"jllama: chat page: http://{serve.host}:{port}/", file=sys.stderr, flush=True)
    if api_keys or serve.cors_origins:
        keys = (f"{len(api_keys)} API key{'s' * (len(api_keys) > 1)} (every route but /health "
                "and the chat page needs one)" if api_keys else "no API key")
        origins = ", ".join(serve.cors_origins) if serve.cors_origins else "none"
        print(f"jllama: {keys}; CORS origins: {origins}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0
