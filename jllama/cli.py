"""The `jllama` command: absl flags wired to the library.

With no flags it tells a story from the embedded stories260K model, as llama2.c's `run` does.
Presets live in `configs/` and are passed with `--flagfile`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from absl import app, flags, logging

from jllama import compile_cache, runtime
from jllama.backends import backend_names, make_backend
from jllama.conversation import ContextFullError, Conversation
from jllama.errors import BackendError, ChatError, JllamaError
from jllama.fetch import KNOWN_MODELS, fetch
from jllama.files import require_regular_file
from jllama.generate import Generation, GenerationStats, resolve_steps
from jllama.loading import open_model, required_memory
from jllama.sampling import FILTERS, Sampler, restrict_to_vocabulary
from jllama.weights import tensor_stats, weights_dtype

FLAGS = flags.FLAGS
_F32_MAX = 3.4028234663852886e38

flags.DEFINE_string(
    "checkpoint",
    None,
    "Model file: a llama2.c checkpoint (.bin, version 0) or a GGUF file (.gguf), or the name "
    "of a fetched model (smollm2). Default: the embedded stories260K.",
)
flags.DEFINE_string(
    "tokenizer",
    None,
    "llama2.c tokenizer file (llama2.c checkpoints; a GGUF file carries its own). Default: tok<vocab_size>.bin or tokenizer.bin beside the "
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
    "top_k", 0, "Keep only the k most likely tokens before sampling; 0 = off (llama.cpp's "
    "--top-k).", lower_bound=0,
)
flags.DEFINE_float(
    "min_p", 0.0, "Keep only tokens at least min_p times as likely as the most likely one, in "
    "[0, 1]; 0 = off (llama.cpp's --min-p).", lower_bound=0.0, upper_bound=1.0,
)
flags.DEFINE_float(
    "repeat_penalty", 1.0, "Divide (or, for negative logits, multiply) the logits of tokens "
    "among the last --penalty_last_n by this; 1 = off (llama.cpp's --repeat-penalty).",
    lower_bound=1e-6, upper_bound=1e6,
)
flags.DEFINE_float(
    "presence_penalty", 0.0, "Subtract this from the logit of every token among the last "
    "--penalty_last_n; 0 = off (OpenAI's presence_penalty).",
)
flags.DEFINE_float(
    "frequency_penalty", 0.0, "Subtract this times its count from the logit of every token "
    "among the last --penalty_last_n; 0 = off (OpenAI's frequency_penalty).",
)
flags.DEFINE_integer(
    "penalty_last_n", 64, "How many of the last tokens (prompt included) the penalties count; "
    "-1 = all, 0 = off (llama.cpp's --repeat-last-n).", lower_bound=-1,
)
flags.DEFINE_list(
    "samplers", "top_k,temperature,top_p,min_p", "Order of the sampler steps, each of top_k, "
    "temperature, top_p, min_p once. The default applies the temperature before top-p (run.c, "
    "transformers); llama.cpp's default is top_k,top_p,min_p,temperature.",
)
flags.DEFINE_integer(
    "steps",
    256,
    "generate: positions to run, prompt included (tokens); < 1 or > seq_len means seq_len. "
    "chat: the most tokens of one reply; < 1 = until the context is full.",
)
flags.DEFINE_string(
    "prompt", "", "generate: the text to continue. chat: the first user message (then stdin)."
)
flags.DEFINE_enum(
    "mode",
    "generate",
    ["generate", "chat"],
    "generate: raw completion of --prompt. chat: a conversation read from stdin, one message "
    "per line, rendered with the model's chat template; replies stop at the end-of-turn token.",
)
flags.DEFINE_string(
    "system_prompt", "", "chat: the system message (empty: the chat template's default)."
)
flags.DEFINE_integer(
    "seq_len",
    0,
    "Context to allocate the KV cache for (tokens), at most the model's; 0 = the model's.",
    lower_bound=0,
)
flags.DEFINE_bool(
    "parse_special",
    False,
    "Let special-token text in --prompt (e.g. <|im_start|>) become the special token, as "
    "llama.cpp's llama-tokenize does; by default it stays plain text.",
)
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "float32", "bfloat16", "int8", "q4"],
    "Type to hold the weight matrices in: auto = as stored (a GGUF's quantized blocks as they "
    "are, float32 for llama2.c files, the stored type for Hugging Face folders); bfloat16 halves "
    "f32's memory; int8 quarters it (one float32 scale per row; a GGUF's blocks become Q8_0); "
    "q4 is llama.cpp's Q4_0 blocks, about an eighth (see README for speed and accuracy).",
)
flags.DEFINE_enum(
    "decode",
    "auto",
    ["auto", "graph", "fused", "loop"],
    "jax backend: graph = three compiled programs per layer; fused = one program for all layers "
    "per token; loop = 16 tokens per program call, sampled on the device (temperature/top_p/"
    "seed sampling only); auto = loop where it can sample (run.c's sampler, a tokenizer that "
    "covers every logit), else graph. See README for the speed of each.",
)
flags.DEFINE_enum(
    "matvec",
    "auto",
    ["auto", "xla", "kernel"],
    "jax backend: how decode computes its matrix-vector products and attention, and prefill "
    "its attention. kernel = jllama's CPU kernels (built once with the system's C++ compiler "
    "into $JLLAMA_HOME/kernels; int8 and bfloat16 weights stream at f32's bytes/s instead of "
    "being widened by XLA; prefill's attention only where built with AVX-512 or AVX2); xla = jnp.dot "
    "and XLA's attention; auto = kernel on one CPU device when it builds, else xla.",
)
flags.DEFINE_enum(
    "prefill",
    "chunked",
    ["chunked", "token"],
    "How the prompt goes through the model: chunked = batched chunks of tokens through each "
    "layer (jax backend); token = one position at a time, as run.c.",
)
flags.DEFINE_bool(
    "compile_cache",
    True,
    "jax backend: keep XLA's compiled programs in $JLLAMA_HOME/xla-cache and load them in "
    "later runs instead of compiling again; --nocompile_cache compiles everything and stores "
    "nothing.",
)
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on.")
flags.DEFINE_integer(
    "port", 8080, "serve: the TCP port to listen on (0 = any free one, printed).",
    lower_bound=0, upper_bound=65535,
)
flags.DEFINE_string(
    "model_name", None, "serve: the name clients give as `model` (default: the checkpoint's "
    "name, e.g. stories260K or smollm2).",
)
flags.DEFINE_integer(
    "max_waiting", 256, "serve: the most requests queued at once; more get HTTP 503.",
    lower_bound=1,
)
flags.DEFINE_bool("pieces", False, "tokenize: print each id with its text, one per line.")
flags.DEFINE_bool(
    "force",
    False,
    "fetch: download again even if the cached file verifies. convert: write settings a "
    "llama2.c file cannot hold (norm_eps, rope_theta, rope_scaling), which run.c then ignores.",
)
flags.DEFINE_string("output", None, "convert: the llama2.c checkpoint file to write.")
flags.DEFINE_enum(
    "llama2c_version",
    "1",
    ["0", "1", "2"],
    "convert: llama2.c format version: 0 (legacy, run.c), 1 (float32, export.py), 2 (Q8_0, "
    "runq.c).",
)
flags.DEFINE_integer(
    "group_size", 64, "convert: Q8_0 group size for version 2 (halved until it fits).",
    lower_bound=1,
)
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
flags.DEFINE_integer(
    "devices",
    0,
    "jax backend: split the model over this many devices, tensor-parallel (each holds a "
    "slice of every layer and its KV heads' cache; must divide n_kv_heads). 0 = one device, "
    "or with --num_processes > 1 every device of every process. On CPU, "
    "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices.",
    lower_bound=0,
)
flags.DEFINE_string(
    "coordinator",
    None,
    "Several processes (hosts) running one model: HOST:PORT of process 0, where JAX's "
    "coordinator listens (jax.distributed). Every process runs the same command with its own "
    "--process_id.",
)
flags.DEFINE_integer(
    "num_processes", 1, "How many processes run the model together (see --coordinator).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "process_id", 0, "This process's number, 0 .. --num_processes - 1; process 0 prints.",
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
    "the rates (perplexity: the PPL, its error and the rates).",
)
flags.DEFINE_string("file", None, "perplexity: the UTF-8 text file to score.")
flags.DEFINE_integer(
    "ctx", 512, "perplexity: tokens a chunk (llama-perplexity's -c); the second half of each "
    "is scored.",
)
flags.DEFINE_integer(
    "chunks", -1, "perplexity: the most chunks to evaluate (llama-perplexity's --chunks); "
    "-1 = all.",
)

flags.register_validator(
    "temperature",
    lambda t: math.isfinite(t) and t <= _F32_MAX,
    message="must be a finite number no larger than 3.4e38 (a float32)",
)
flags.register_validator("top_p", lambda p: math.isfinite(p), message="must be a finite number")
flags.register_validator(
    "samplers",
    lambda names: sorted(names) == sorted(FILTERS),
    message=f"must list each of {', '.join(FILTERS)} once, comma-separated",
)
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
    command, args = (argv[1], argv[2:]) if len(argv) > 1 else (None, [])
    if command == "fetch":
        return _fetch(args)
    if command == "tokenize":
        _no_arguments("tokenize", args)
        return _tokenize()
    if command == "convert":
        _no_arguments("convert", args)
        return _convert()
    if command == "serve":
        _no_arguments("serve", args)
        return _serve()
    if command == "perplexity":
        _no_arguments("perplexity", args)
        return _perplexity()
    if command is not None:
        # `chat` reads like a command next to `serve`, but it is a mode of the main job.
        hint = f"; for {command}, pass --mode={command}" if command in ("chat", "generate") else ""
        raise JllamaError(
            f"unexpected argument {command!r} (commands: fetch, tokenize, convert, serve, perplexity; flags take the form "
            f"--name=value{hint})"
        )
    if FLAGS.threads:
        runtime.limit_cpu_threads(FLAGS.threads)
    several = _start_processes()  # before anything touches a JAX device
    speak = not several or _is_main_process()
    if several:
        _keep_stdout_for_text(speak)
    load_began = time.perf_counter()
    model = open_model(
        FLAGS.checkpoint, FLAGS.tokenizer, seq_len=FLAGS.seq_len or None,
        need_tokenizer=not FLAGS.verify_checkpoint,
        dtype=None if FLAGS.dtype == "auto" else FLAGS.dtype,
    )
    read_seconds = time.perf_counter() - load_began
    config, tokenizer = model.config, model.tokenizer
    if FLAGS.verify_checkpoint:
        return _verify(model.weights)
    if speak:
        _note_seq_len(config)
    if FLAGS.mode == "chat" and FLAGS.output_format != "text":
        raise JllamaError("--output_format=json is for --mode=generate; chat mode prints text")
    if FLAGS.mode == "chat" and not model.chat_template:
        raise JllamaError(
            f"--mode=chat needs a model with a chat template; {model.source} has none "
            "(try --checkpoint=smollm2 after `jllama fetch smollm2`)"
        )
    if several and FLAGS.mode == "chat":
        raise JllamaError(
            "--mode=chat reads stdin, which one process of several cannot share: with "
            "--num_processes > 1 use --mode=generate and --prompt"
        )
    n_devices = _device_count(config, several)
    prompt_ids = []
    if FLAGS.mode == "generate":
        if speak:
            _warn_invalid_utf8(FLAGS.prompt, tokenizer)
        prompt_ids = tokenizer.encode(FLAGS.prompt, parse_special=FLAGS.parse_special)
        if several:  # process 0's prompt is the one every process feeds
            from jllama.distributed import agree

            prompt_ids = agree(prompt_ids)
        if not prompt_ids:
            raise JllamaError(
                f"--prompt is empty and {model.source} adds no BOS token: give a --prompt"
            )
        if len(prompt_ids) > config.seq_len:
            raise JllamaError(
                f"--prompt is {len(prompt_ids)} tokens, longer than the context "
                f"(seq_len={config.seq_len})"
            )
    sampler = Sampler(
        temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed or None,
        **_sampler_options(),
    )
    seed = sampler.config.seed
    if several:  # every process samples with process 0's seed (a clock seed differs)
        from jllama.distributed import agree

        low, high = agree([seed & 0xFFFFFFFF, seed >> 32])
        seed = low | high << 32
        sampler = Sampler(
            temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=seed, **_sampler_options()
        )
    if tokenizer.vocab_size < config.vocab_size:
        # A padded vocabulary (more model rows than tokens): ids with no token are never drawn.
        sampler = restrict_to_vocabulary(sampler, tokenizer.vocab_size)
    if FLAGS.temperature > 0 and not FLAGS.seed and speak:
        print(f"jllama: seed {seed} (repeat with --seed={seed})", file=sys.stderr)

    if speak:
        print(f"jllama: {required_memory(model, n_devices)}", file=sys.stderr)
    decode = _decode_mode(tokenizer, config)
    programs = _compile_cache(speak)
    placing = time.perf_counter()
    backend = _make_backend(config, model.weights, n_devices, decode, speak)
    # prepare's time, less its warm-up (the compile), is placing the weights on the device.
    place_seconds = time.perf_counter() - placing - getattr(backend, "compile_seconds", 0.0)
    decode_loop = _loop_of(decode, backend, sampler, tokenizer, config)
    if FLAGS.mode == "chat":
        return _chat(model, backend, sampler, decode_loop)

    steps = resolve_steps(FLAGS.steps, config.seq_len)
    if len(prompt_ids) > steps and speak:
        print(
            f"jllama: warning: the prompt ({len(prompt_ids)} tokens) is longer than "
            f"--steps={steps}; nothing will be generated",
            file=sys.stderr,
        )
    if hasattr(backend, "compile_for"):
        # The prompt's chunk programs and the windows the decode grows into, compiled now
        # rather than inside the timed prefill and in the middle of decoding.
        backend.compile_for(len(prompt_ids), steps - 1, getattr(decode_loop, "kind", None),
                            chunked=_prefill_of(backend) is not None)
    generation = Generation(
        backend.forward, prompt_ids, sampler, steps, stop_ids=tuple(tokenizer.stop_ids),
        prefill=_prefill_of(backend), decode_loop=decode_loop, started_at=runtime.process_start(),
    )
    stats = generation.stats
    stats.startup_seconds = load_began - runtime.process_start()
    stats.load_seconds = read_seconds + place_seconds
    stats.compile_seconds = getattr(backend, "compile_seconds", 0.0)

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
            "seq_len": config.seq_len,
            "prefill_tok_s": stats.prefill_tok_s,
            "decode_tok_s": stats.decode_tok_s,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "compile_seconds": getattr(backend, "compile_seconds", 0.0),
            "startup_seconds": stats.startup_seconds,
            "load_seconds": stats.load_seconds,
            "first_token_seconds": stats.first_token_seconds,
            "programs_compiled": programs.counts.compiled,
            "programs_from_cache": programs.counts.from_cache,
        }
        print(json.dumps(result), flush=True)
        return 0

    decoder = tokenizer.stream_decoder()
    out = sys.stdout
    # A GGUF model's prompt is echoed as typed (llama.cpp does the same), its bytes exactly,
    # once the model has produced something (a broken model prints only its error); llama2.c's
    # run prints the prompt's decoded pieces, which the decoder reproduces.
    echo = model.file_format == "gguf"
    for token in generation:
        if model.file_format == "gguf" and not token.sampled:
            continue
        if echo:
            _write_raw(out, FLAGS.prompt)
            echo = False
        out.write(decoder.push(token.prev, token.id))
        out.flush()
    if echo:
        _write_raw(out, FLAGS.prompt)
    out.write(decoder.flush() + "\n")
    out.flush()
    if speak:
        print(_rates(generation.stats) + _startup(generation.stats, programs), file=sys.stderr)
    return 0


def _startup(stats: GenerationStats, programs: compile_cache.CompileCache) -> str:
    """The stats line's second half: what the wait for the first token was made of."""
    counts = programs.counts
    cached = f", {counts.from_cache} from the cache" if programs.folder is not None else ""
    return (
        f"; first token {stats.first_token_seconds:.2f} s after the process started: "
        f"startup {stats.startup_seconds:.2f} s, load {stats.load_seconds:.2f} s, "
        f"compile {stats.compile_seconds:.2f} s ({counts.requested} programs{cached}), "
        f"prefill {stats.prefill_seconds:.2f} s"
    )


def _compile_cache(speak: bool = True) -> compile_cache.CompileCache:
    """The persistent compile cache (--compile_cache) for the jax backend, set up before any
    program compiles; its counts are kept either way."""
    use = FLAGS.compile_cache and FLAGS.backend == "jax"
    return compile_cache.setup(enabled=use, warn=None if speak else (lambda line: None))


def _start_processes() -> bool:
    """Join the other processes (--coordinator, --num_processes, --process_id) through
    `jax.distributed`; True when this run has several processes."""
    if FLAGS.num_processes == 1 and not FLAGS.coordinator:
        if FLAGS.process_id:
            raise JllamaError(f"--process_id={FLAGS.process_id} needs --num_processes > 1")
        return False
    if FLAGS.backend != "jax":
        raise JllamaError("--num_processes and --coordinator need --backend=jax")
    from jllama.distributed import DistributedError, start

    try:
        start(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    except DistributedError as e:
        raise JllamaError(_as_flag(str(e))) from None
    return FLAGS.num_processes > 1


def _keep_stdout_for_text(speak: bool) -> None:
    """Keep stdout for the generated text: the libraries under JAX write to file descriptor 1
    (gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks ..." when its collectives
    connect), so descriptor 1 goes to stderr and `sys.stdout` writes to a copy of the
    original. Only process 0 prints the text; the others' goes to /dev/null."""
    sys.stdout.flush()
    own = os.dup(1) if speak else os.open(os.devnull, os.O_WRONLY)
    os.dup2(2, 1)
    sys.stdout = open(own, "w", encoding=sys.stdout.encoding, errors="replace")


def _is_main_process() -> bool:
    from jllama.distributed import is_main_process

    return is_main_process()


def _as_flag(message: str) -> str:
    """A library message that starts with a setting's name (`devices=3 must ...`) as the
    flag's (`--devices=3 must ...`)."""
    return message if message.startswith("--") else "--" + message


def _device_count(config, several: bool) -> int:
    """The devices --devices asks for (0: one, or all of them with several processes),
    checked against the model's sizes before anything is loaded onto a device."""
    if FLAGS.devices > 1 and FLAGS.backend != "jax":
        raise JllamaError(f"--devices={FLAGS.devices} needs --backend=jax")
    for name in ("decode", "matvec"):
        if FLAGS[name].present and FLAGS[name].value != "auto" and FLAGS.backend != "jax":
            raise JllamaError(f"--{name}={FLAGS[name].value} is a mode of the jax backend, "
                              f"not of --backend={FLAGS.backend}")
    n = FLAGS.devices
    if n == 0:
        if not several:
            return 1
        import jax

        n = jax.device_count()
    if n > 1 or several:
        from jllama.sharding import ShardingError, check_divisible, make_mesh

        try:
            check_divisible(config, n)
            make_mesh(n)  # enough devices, and (several processes) a part for every process
        except ShardingError as e:
            raise JllamaError(_as_flag(str(e))) from None
    return n


def _make_backend(config, weights, n_devices: int, decode: str, speak: bool = True):
    """The --backend, prepared: weights converted and placed (split over n_devices when
    more than one), programs compiled."""
    options = {"decode": decode, "matvec": FLAGS.matvec} if FLAGS.backend == "jax" else {}
    if n_devices > 1:
        options["devices"] = n_devices
    backend = make_backend(FLAGS.backend, **options)
    if getattr(getattr(backend, "device", None), "platform", "cpu") == "cpu":
        runtime.check_kv_cache_fits(config)
    if speak and n_devices == 1 and options.get("matvec", "xla") != "xla":
        from jllama.kernels.library import compiler, is_built

        if getattr(backend.device, "platform", "") == "cpu" and compiler() and not is_built():
            print("jllama: building jllama's CPU kernels (once for this machine and compiler, "
                  "a few seconds)", file=sys.stderr, flush=True)
    from jllama.sharding import ShardingError

    try:
        backend.prepare(config, weights)
    except ShardingError as e:  # e.g. fewer devices than --devices asks for
        raise JllamaError(_as_flag(str(e))) from None
    except BackendError as e:  # e.g. "matvec=kernel: no C++ compiler ..."
        raise BackendError(_as_flag(str(e)) if str(e).startswith("matvec=") else str(e)) from None
    if speak and getattr(backend, "matvec_note", ""):
        print(f"jllama: note: using XLA's products (--matvec=xla): {backend.matvec_note}",
              file=sys.stderr)
    if speak and getattr(backend, "weights_note", ""):
        print(f"jllama: note: {backend.weights_note}", file=sys.stderr)
    if speak:
        for note in getattr(backend, "sharding_notes", ()):
            print(f"jllama: note: {note}", file=sys.stderr)
    return backend


def _note_seq_len(config) -> None:
    """Says so when --seq_len asked for more context than the model has (it is capped)."""
    if FLAGS.seq_len > config.seq_len:
        print(f"jllama: note: --seq_len={FLAGS.seq_len} is more than the model's context; "
              f"using {config.seq_len}", file=sys.stderr)


def _prefill_of(backend):
    """The backend's batched prefill when --prefill=chunked and it has one, else None."""
    return getattr(backend, "prefill", None) if FLAGS.prefill == "chunked" else None


def _write_raw(out, text: str) -> None:
    """Write `text` with any undecodable argv bytes (surrogate escapes) as those bytes."""
    out.flush()
    out.buffer.write(text.encode("utf-8", "surrogateescape"))
    out.buffer.flush()


def _warn_invalid_utf8(text: str, tokenizer) -> None:
    if not hasattr(tokenizer, "merges"):
        return  # llama2.c's byte fallback keeps every byte
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        print(
            "jllama: warning: --prompt is not valid UTF-8; bytes the vocabulary has no token "
            "for are dropped, as llama.cpp does",
            file=sys.stderr,
        )


def _no_arguments(command: str, args: list[str]) -> None:
    if args:
        raise JllamaError(f"{command}: unexpected argument {args[0]!r} (flags take the form --name=value)")


def _fetch(args: list[str]) -> int:
    if len(args) != 1:
        known = "; ".join(f"{m.name}: {m.description}" for m in KNOWN_MODELS.values())
        raise JllamaError(f"usage: jllama fetch NAME, one model at a time (known models: {known})")
    path = fetch(args[0], progress=True, force=FLAGS.force)
    print(path, flush=True)
    return 0


def _convert() -> int:
    if not FLAGS.checkpoint or not FLAGS.output:
        raise JllamaError("convert needs --checkpoint=SOURCE and --output=FILE.bin")
    from jllama.convert import convert

    try:
        report = convert(
            FLAGS.checkpoint, FLAGS.output, version=int(FLAGS.llama2c_version),
            group_size=FLAGS.group_size, force=FLAGS.force,
            exact_group_size=FLAGS["group_size"].present,
        )
    except JllamaError as e:
        message = str(e).replace("force=True", "--force")
        # The writer names its file "checkpoint"; here that file is --output.
        written = f"checkpoint {FLAGS.output}:"
        if message.startswith(written):
            message = f"--output={FLAGS.output}:" + message[len(written):]
        raise type(e)(message) from None
    line = (
        f"wrote {report.destination}: llama2.c version {report.version}, "
        f"{report.nbytes} bytes, from {report.source_format} {report.source}"
    )
    if report.version == 2:
        line += (
            f"; Q8_0 group size {report.group_size}, max quantization error "
            f"{report.max_quantization_error:.3g}"
        )
    print(line, flush=True)
    return 0


def _tokenize() -> int:
    model = open_model(FLAGS.checkpoint, FLAGS.tokenizer, seq_len=FLAGS.seq_len or None)
    tokenizer = model.tokenizer
    _warn_invalid_utf8(FLAGS.prompt, tokenizer)
    ids = tokenizer.encode(FLAGS.prompt, parse_special=FLAGS.parse_special)
    if not FLAGS.pieces:
        print(ids, flush=True)
        return 0
    for token in ids:
        print(f"{token:>6} -> {tokenizer.piece(token)!r}")
    sys.stdout.flush()
    return 0


def _read_message(interactive: bool) -> str | None:
    """One user message from stdin: a line, or several joined by a trailing backslash
    (llama.cpp's convention). None at end of input."""
    lines = []
    while True:
        if interactive:
            print("> " if not lines else "  ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _decode_mode(tokenizer, config) -> str:
    """--decode with auto resolved: loop where the device loop can sample (run.c's sampler,
    a tokenizer covering every logit: loop is the fastest mode here, bench/NOTES.md), else
    graph."""
    if FLAGS.decode != "auto":
        return FLAGS.decode
    if _llama_cpp_sampler_flags() or tokenizer.vocab_size < config.vocab_size:
        return "graph"
    return "loop"


def _loop_of(decode, backend, sampler, tokenizer, config):
    """The on-device decode loop when `decode` is loop (jax backend), else None."""
    if decode != "loop" or not hasattr(backend, "decode_loop"):
        return None
    if tokenizer.vocab_size < config.vocab_size:
        _fail(
            f"--decode=loop: the model has {config.vocab_size} logits and its tokenizer "
            f"{tokenizer.vocab_size} tokens; the device sampler cannot skip the padding: use "
            "--decode=graph"
        )
    from jllama.device_loop import loop_decoder

    return loop_decoder(backend, sampler, tokenizer.stop_ids)


def _chat(model, backend, sampler, decode_loop=None) -> int:
    from jllama.chat import ChatTemplate  # jinja2: imported only for a chat

    tokenizer = model.tokenizer
    try:
        template = ChatTemplate(
            model.chat_template,
            bos_token=tokenizer.decode([tokenizer.bos_id], special=True),
            eos_token=tokenizer.decode([tokenizer.eos_id], special=True),
        )
    except ChatError as e:
        raise ChatError(f"{model.source}: {e}") from None
    compile_for = None
    if hasattr(backend, "compile_for"):
        compile_for = functools.partial(
            backend.compile_for, kind=getattr(decode_loop, "kind", None),
            chunked=_prefill_of(backend) is not None,
        )
    conversation = Conversation(
        backend.forward, tokenizer, template, model.config.seq_len,
        system_prompt=FLAGS.system_prompt or None, prefill=_prefill_of(backend),
        decode_loop=decode_loop, compile_for=compile_for,
    )
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            "jllama: chat mode: type a message and press Enter (end a line with \\ to go on "
            "to the next; Ctrl-D ends the chat, Ctrl-C stops jllama at once)",
            file=sys.stderr,
        )
    pending = FLAGS.prompt or None
    out = sys.stdout
    while True:
        text = pending if pending is not None else _read_message(interactive)
        pending = None
        if text is None:
            break
        if not text.strip():
            continue
        decoder = tokenizer.stream_decoder()
        try:
            for token in conversation.say(text, sampler, max_tokens=FLAGS.steps):
                out.write(decoder.push(token.prev, token.id))
                out.flush()
        except ChatError as e:
            raise ChatError(f"{model.source}: {e}") from None
        except ContextFullError as e:
            if conversation.last is None:  # nothing could be answered: the settings are wrong
                raise JllamaError(f"{e}: give a larger --seq_len") from None
            print(f"jllama: context full: {e}; ending the chat", file=sys.stderr)
            return 0
        out.write(decoder.flush() + "\n")
        out.flush()
        turn = conversation.last
        if interactive or FLAGS.verbosity > 0:
            print(_rates(turn.generation.stats), file=sys.stderr)
        if turn.stop_reason == "context":
            print(
                f"jllama: context full: the reply reached seq_len={model.config.seq_len} "
                "tokens; ending the chat (a larger --seq_len holds more)",
                file=sys.stderr,
            )
            return 0
    return 0


def _llama_cpp_sampler_flags() -> list[str]:
    """The llama.cpp sampler flags given on the command line (the device loop has none)."""
    changed = [f"--{name}" for name in ("top_k", "min_p", "repeat_penalty", "presence_penalty",
                                         "frequency_penalty") if FLAGS[name].present]
    if tuple(FLAGS.samplers) != FILTERS:  # another order than run.c's temperature, then top-p
        changed.append("--samplers")
    return changed


def _sampler_options() -> dict:
    """The llama.cpp sampler flags as `Sampler` keyword arguments."""
    options = {
        "top_k": FLAGS.top_k, "min_p": FLAGS.min_p, "repeat_penalty": FLAGS.repeat_penalty,
        "presence_penalty": FLAGS.presence_penalty,
        "frequency_penalty": FLAGS.frequency_penalty, "penalty_last_n": FLAGS.penalty_last_n,
        "order": tuple(FLAGS.samplers),
    }
    changed = _llama_cpp_sampler_flags()
    if changed and FLAGS.decode == "loop":
        raise JllamaError(
            f"--decode=loop samples on the device with temperature and top_p only; "
            f"{', '.join(changed)} cannot be used with it (use --decode=graph or fused)"
        )
    return options


def _model_id() -> str:
    """The name `jllama serve` answers to: --model_name, else the checkpoint's name."""
    if FLAGS.model_name:
        return FLAGS.model_name
    checkpoint = FLAGS.checkpoint
    if checkpoint is None:
        return "stories260K"
    if checkpoint in KNOWN_MODELS:
        return checkpoint
    path = Path(checkpoint)
    return path.name if path.is_dir() else path.stem


def _serve() -> int:
    from jllama.server import bind, make_server
    from jllama.server.engine import Engine

    if FLAGS.threads:
        runtime.limit_cpu_threads(FLAGS.threads)
    if FLAGS.num_processes > 1 or FLAGS.coordinator:
        raise JllamaError(
            "serve runs in one process (--devices splits the model over its devices); "
            "--num_processes and --coordinator are for generation"
        )
    sock = bind(FLAGS.host, FLAGS.port)  # before the slow load: a busy port fails at once
    model = open_model(
        FLAGS.checkpoint, FLAGS.tokenizer, seq_len=FLAGS.seq_len or None,
        dtype=None if FLAGS.dtype == "auto" else FLAGS.dtype,
    )
    n_devices = _device_count(model.config, several=False)
    _note_seq_len(model.config)
    print(f"jllama: {required_memory(model, n_devices)}", file=sys.stderr)
    # Requests are sampled on the host (every request brings its own sampler settings).
    decode = "graph" if FLAGS.decode in ("loop", "auto") else FLAGS.decode
    _compile_cache()  # programs compiled per request are kept for the next server too
    backend = _make_backend(model.config, model.weights, n_devices, decode)
    engine = Engine(
        model, backend, use_prefill=FLAGS.prefill == "chunked", max_waiting=FLAGS.max_waiting
    )
    model_id = _model_id()
    server = make_server(engine, model_id, sock)
    host, port = sock.getsockname()[:2]
    chat = "chat and completions" if model.chat_template else "completions only, no chat template"
    print(
        f"jllama: serving {model_id} ({chat}; context {model.config.seq_len} tokens) at "
        f"http://{FLAGS.host}:{port}/v1 (Ctrl-C stops)",
        file=sys.stderr, flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0


def _perplexity() -> int:
    """`jllama perplexity`: the PPL of --file in chunks of --ctx tokens (`jllama.perplexity`)."""
    from jllama import perplexity as ppl

    def flagged(e: JllamaError) -> JllamaError:  # the library's ctx and chunks= are flags here
        return type(e)(re.sub(r"(?<![-\w])(ctx\b|chunks=)", r"--\1", str(e)))

    if FLAGS.threads:
        runtime.limit_cpu_threads(FLAGS.threads)
    if FLAGS.num_processes > 1 or FLAGS.coordinator:
        raise JllamaError("perplexity runs in one process (--devices splits the model over its "
                          "devices); --num_processes and --coordinator are for generation")
    if not FLAGS.file:
        raise JllamaError("perplexity needs --file=TEXT, a UTF-8 text file")
    ctx, file_flag = FLAGS.ctx, f"--file={FLAGS.file}"
    if FLAGS.seq_len and FLAGS.seq_len != ctx:
        print(f"jllama: note: perplexity's context is --ctx={ctx}; --seq_len={FLAGS.seq_len} is "
              "not used", file=sys.stderr)
    try:
        ppl.check_chunks(FLAGS.chunks)
        ppl.check_ctx(ctx)
        text = ppl.read_text(FLAGS.file, what=file_flag)
        model = open_model(FLAGS.checkpoint, FLAGS.tokenizer, seq_len=ctx,
                           dtype=None if FLAGS.dtype == "auto" else FLAGS.dtype)
        ppl.check_ctx(ctx, model.context_length)
        tokenizer = model.tokenizer
        tokens = tokenizer.encode(text)
        ppl.chunk_count(len(tokens), ctx, FLAGS.chunks, what=file_flag)
    except ppl.PerplexityError as e:
        raise flagged(e) from None
    config = model.config
    n_devices = _device_count(config, several=False)
    print(f"jllama: {required_memory(model, n_devices)}", file=sys.stderr)
    decode = "graph" if FLAGS.decode in ("auto", "loop") else FLAGS.decode
    _compile_cache()
    backend = _make_backend(config, model.weights, n_devices, decode)
    chunked = FLAGS.prefill == "chunked" and hasattr(backend, "prefill_logits")
    if hasattr(backend, "compile_for"):
        backend.compile_for(ctx, ctx - 1, chunked=chunked)
    result = ppl.perplexity(
        backend.prefill_logits if chunked else ppl.forward_logits(backend.forward), tokens, ctx,
        bos_id=tokenizer.bos_id if tokenizer.add_bos else None, chunks=FLAGS.chunks,
        n_vocab=min(tokenizer.vocab_size, config.vocab_size), progress=True,
    )
    est = result.estimate
    if FLAGS.output_format == "json":
        print(json.dumps({
            "ppl": est.ppl, "ppl_error": est.ppl_error if math.isfinite(est.ppl_error) else None,
            "mean_nll": est.mean_nll, "chunks": result.chunks, "ctx": ctx,
            "tokens": result.tokens, "tokens_scored": est.count, "seconds": result.seconds,
            "tokens_per_second": result.tokens_per_second,
            "compile_seconds": getattr(backend, "compile_seconds", 0.0),
            "chunk_ppl": list(result.chunk_ppl), "model": _model_id(),
            "checkpoint": model.source, "file": FLAGS.file, "dtype": weights_dtype(model.weights),
            "backend": backend.name,
        }), flush=True)
        return 0
    print(",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(result.chunk_ppl)) + ",",
          file=sys.stderr)
    chunks = f"{result.chunks} chunk{'' if result.chunks == 1 else 's'}"
    print(f"jllama: {chunks} of {ctx} tokens, {est.count} scored, "
          f"{result.seconds:.2f} s ({result.tokens_per_second:.1f} tok/s)", file=sys.stderr)
    print(ppl.final_line(est), flush=True)
    return 0


def _fail(message: str, status: int = 1):
    # One line, whatever the message holds (a path with a newline, a multi-line library error).
    one_line = " ".join(str(message).split("\n"))
    print(f"jllama: error: {one_line}", file=sys.stderr)
    sys.exit(status)


_HELP = {"-h", "--help", "-help", "--helpshort", "-?"}
_USAGE = """usage: jllama [--flag=value ...]
       jllama fetch NAME                      download a known model (smollm2) into the cache
       jllama tokenize --prompt=TEXT [--pieces] [--parse_special] [--checkpoint=...]
       jllama convert --checkpoint=SOURCE --output=FILE.bin [--llama2c_version=1|2|0]
       jllama serve [--checkpoint=...] [--host=127.0.0.1] [--port=8080]   OpenAI-compatible API
       jllama perplexity --file=TEXT [--ctx=512] [--chunks=N] [--checkpoint=...]
                                              PPL of a text, as llama.cpp's llama-perplexity

Generates text with a Llama model from a llama2.c checkpoint or a GGUF file.
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
    # At exit the interpreter's last collection would walk every object the model and its
    # vocabulary made (0.15 s of SmolLM2's exit); nothing then needs collecting. Registered
    # after JAX's handlers, so it runs before them.
    atexit.register(gc.freeze)
    app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
