"""The main job: read the model, then a raw completion of --prompt (--mode=generate) or a chat
(--mode=chat, `jllama.cli.chat`), both through one `Session`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from jllama.platform import runtime
from jllama.cli import chat
from jllama.cli.common import (
    compile_programs, device_count, kv_cache_types, note_seq_len, open_session, opened_draft,
    rates, say, write_raw,
)
from jllama.cli.options import Options, RunOptions
from jllama.errors import JllamaError
from jllama.generation.generate import GenerationStats, resolve_steps
from jllama.model.loading import open_model, required_memory
from jllama.sampling import Sampler
from jllama.model.weights import tensor_stats


def main(options: Options) -> int:
    """Run the main job; returns the exit status."""
    run, text = options.run, options.text
    if run.threads:
        runtime.limit_cpu_threads(run.threads)
    several = _start_processes(run)  # before anything touches a JAX device
    speak = not several or _is_main_process()
    if several:
        _keep_stdout_for_text(speak)
    load_began = time.perf_counter()
    m = options.model
    model = open_model(m.checkpoint, m.tokenizer, seq_len=m.seq_len,
                       need_tokenizer=not text.verify_checkpoint, dtype=m.dtype)
    read_seconds = time.perf_counter() - load_began
    config, tokenizer = model.config, model.tokenizer
    if text.verify_checkpoint:
        return _verify(model.weights)
    if speak:
        note_seq_len(options, model)
    _check_mode(text, model, several)
    kv_types = kv_cache_types(run, model)  # a type this model cannot hold: before any line
    n_devices = device_count(run, config, several)
    prompt_ids = []
    if text.mode == "generate":
        prompt_ids = _prompt_ids(text, model, several, speak)
    sampler = Sampler.from_config(options.sampling.config)
    seed = sampler.config.seed
    if several:  # every process samples with process 0's seed (a clock seed differs)
        from jllama.platform.distributed import agree

        low, high = agree([seed & 0xFFFFFFFF, seed >> 32])
        seed = low | high << 32
        sampler = Sampler.from_config(dataclasses.replace(options.sampling.config, seed=seed))
    if sampler.config.temperature > 0 and options.sampling.config.seed is None and speak:
        say(f"seed {seed} (repeat with --seed={seed})")
    draft = opened_draft(run, model)  # a draft checkpoint: its weights are in the line
    if speak:
        say(required_memory(model, n_devices, kv_types, draft=draft))
    jax_began = time.perf_counter()
    programs = compile_programs(run, speak)  # the first import of JAX, in most runs
    jax_seconds = time.perf_counter() - jax_began
    session = open_session(model, run, n_devices, speak, draft=draft)
    if tokenizer.vocab_size < config.vocab_size and run.decode == "loop":
        raise JllamaError(
            f"--decode=loop: the model has {config.vocab_size} logits and its tokenizer "
            f"{tokenizer.vocab_size} tokens; the device sampler cannot skip the padding: use "
            "--decode=graph"
        )
    if text.mode == "chat":
        return chat.main(session, sampler, text)

    steps = resolve_steps(text.steps, config.seq_len)
    if len(prompt_ids) > steps and speak:
        say(f"warning: the prompt ({len(prompt_ids)} tokens) is longer than --steps={steps}; "
            "nothing will be generated")
    began = runtime.process_start()
    generation = session.generate(prompt_ids, sampler, steps, started_at=began,
                                  grammar=text.grammar)
    stats = generation.stats
    stats.startup_seconds = load_began - began
    stats.load_seconds = read_seconds + session.place_seconds
    stats.compile_seconds = session.compile_seconds
    wait = _Wait(stats, before_python=max(0.0, runtime.python_start() - began), jax=jax_seconds)

    if text.output_format == "json":
        for _ in generation:
            pass
        _note_incomplete(generation, speak)
        print(json.dumps({
            # A prompt from undecodable argv bytes holds surrogates, which JSON can't carry.
            "prompt": text.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
            "prompt_ids": generation.prompt_ids,
            "generated_ids": generation.generated_ids,
            "text": tokenizer.decode(generation.generated_ids, prev=prompt_ids[-1]),
            "backend": session.backend.name,
            "seed": seed,
            "temperature": sampler.config.temperature,
            "top_p": sampler.config.top_p,
            "steps": steps,
            "seq_len": config.seq_len,
            "prefill_tok_s": stats.prefill_tok_s,
            "decode_tok_s": stats.decode_tok_s,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "compile_seconds": session.compile_seconds,
            "startup_seconds": stats.startup_seconds,
            "load_seconds": stats.load_seconds,
            "first_token_seconds": stats.first_token_seconds,
            "before_python_seconds": wait.before_python,
            "jax_seconds": wait.jax,
            "other_seconds": wait.other,
            "programs_compiled": programs.counts.compiled,
            "programs_from_cache": programs.counts.from_cache,
        }), flush=True)
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
            write_raw(out, text.prompt)
            echo = False
        out.write(decoder.push(token.prev, token.id))
        out.flush()
    if echo:
        write_raw(out, text.prompt)
    # --steps cutting a character leaves its first bytes: they print nothing, as in a stream.
    out.write(decoder.flush(drop_incomplete=True) + "\n")
    out.flush()
    _note_incomplete(generation, speak)
    if speak:
        print(rates(generation.stats) + _startup(wait, programs), file=sys.stderr)
    return 0


def _note_incomplete(generation, speak: bool) -> None:
    """A note where --steps or the context cut a constrained output short (what was printed
    then does not match the constraint, as in llama.cpp)."""
    constraint = generation.constraint
    if speak and constraint is not None and not constraint.accepting:
        say("note: the output ended at --steps or the context before the constraint was "
            "complete: it does not match it")


def _check_mode(text, model, several: bool) -> None:
    if text.mode == "chat" and text.output_format != "text":
        raise JllamaError("--output_format=json is for --mode=generate; chat mode prints text")
    if text.mode == "chat" and not model.chat_template:
        raise JllamaError(
            f"--mode=chat needs a model with a chat template; {model.source} has none "
            "(try --checkpoint=smollm2 after `jllama fetch smollm2`)"
        )
    if several and text.mode == "chat":
        raise JllamaError(
            "--mode=chat reads stdin, which one process of several cannot share: with "
            "--num_processes > 1 use --mode=generate and --prompt"
        )


def _prompt_ids(text, model, several: bool, speak: bool) -> list[int]:
    tokenizer, config = model.tokenizer, model.config
    if speak:
        warn_invalid_utf8(text.prompt, tokenizer)
    prompt_ids = tokenizer.encode(text.prompt, parse_special=text.parse_special)
    if several:  # process 0's prompt is the one every process feeds
        from jllama.platform.distributed import agree

        prompt_ids = agree(prompt_ids)
    if not prompt_ids:
        raise JllamaError(f"--prompt is empty and {model.source} adds no BOS token: give a --prompt")
    if len(prompt_ids) > config.seq_len:
        raise JllamaError(f"--prompt is {len(prompt_ids)} tokens, longer than the context "
                          f"(seq_len={config.seq_len})")
    return prompt_ids


def warn_invalid_utf8(text: str, tokenizer) -> None:
    """Warn when the prompt holds bytes that are not UTF-8 and the tokenizer drops them."""
    if not tokenizer.drops_unknown_bytes:
        return  # llama2.c's byte fallback keeps every byte
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        say("warning: --prompt is not valid UTF-8; bytes the vocabulary has no token for are "
            "dropped, as llama.cpp does")


def _verify(weights) -> int:
    ok = True
    print(f"{'tensor':<24} {'shape':<20} {'min':>12} {'max':>12} {'mean':>12}  finite")
    for s in tensor_stats(weights):
        finite = "yes" if s.finite else f"NO ({s.n_nonfinite} values)"
        ok &= s.finite
        print(f"{s.name:<24} {str(list(s.shape)):<20} {s.min:>12.6g} {s.max:>12.6g} "
              f"{s.mean:>12.6g}  {finite}")
    return 0 if ok else 1


@dataclasses.dataclass(frozen=True)
class _Wait:
    """What the wait for the first token was made of: spans of one clock from the process's
    start, one after the other, so the parts add up to `stats.first_token_seconds`.

      startup        the process's start to the model's read: exec, the interpreter, imports,
                     flags (`before_python` of it: until Python began importing jllama, which
                     counts a shell's or a wrapper's work in the process before its exec)
      load           reading the file, placing the weights (`stats.load_seconds`)
      jax            importing JAX and setting up its compile cache (`compile_programs`)
      compile        compiling or loading the programs (`stats.compile_seconds`)
      prefill        the prompt's forward passes (`stats.prefill_seconds`)
      other          the rest: the prompt's tokenizing, the memory plan, the sampler, the
                     backend's setup beside placing and compiling
    """

    stats: GenerationStats
    before_python: float
    jax: float

    @property
    def other(self) -> float:
        s = self.stats
        if not s.first_token_seconds:  # no token sampled: nothing to split
            return 0.0
        return s.first_token_seconds - (s.startup_seconds + s.load_seconds + self.jax
                                        + s.compile_seconds + s.prefill_seconds)


def _startup(wait: _Wait, programs) -> str:
    """The stats line's second half: what the wait for the first token was made of (parts
    that add up to it, `_Wait`)."""
    stats, counts = wait.stats, programs.counts
    cached = f", {counts.from_cache} from the cache" if programs.folder is not None else ""
    return (
        f"; first token {stats.first_token_seconds:.2f} s after the process started: "
        f"startup {stats.startup_seconds:.2f} s "
        f"(exec and interpreter {wait.before_python:.2f} s), "
        f"load {stats.load_seconds:.2f} s, JAX start {wait.jax:.2f} s, "
        f"compile {stats.compile_seconds:.2f} s ({counts.requested} programs{cached}), "
        f"prefill {stats.prefill_seconds:.2f} s, other {wait.other:.2f} s"
    )


def _start_processes(run: RunOptions) -> bool:
    """Join the other processes (--coordinator, --num_processes, --process_id) through
    `jax.distributed`; True when this run has several processes."""
    if run.num_processes == 1 and not run.coordinator:
        if run.process_id:
            raise JllamaError(f"--process_id={run.process_id} needs --num_processes > 1")
        return False
    if run.backend != "jax":
        raise JllamaError("--num_processes and --coordinator need --backend=jax")
    from jllama.cli.common import as_flag
    from jllama.platform.distributed import DistributedError, start

    try:
        start(run.coordinator, run.num_processes, run.process_id)
    except DistributedError as e:
        raise JllamaError(as_flag(str(e))) from None
    return run.num_processes > 1


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
    from jllama.platform.distributed import is_main_process

    return is_main_process()
