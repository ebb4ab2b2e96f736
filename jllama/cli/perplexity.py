"""`jllama perplexity`: the PPL of --file in chunks of --ctx tokens (`jllama.generation.perplexity`), as
llama.cpp's llama-perplexity."""

from __future__ import annotations

import json
import math
import re
import sys

from jllama.platform import runtime
from jllama.cli.common import (
    compile_programs, device_count, kv_cache_types, one_process, open_session, say,
)
from jllama.cli.options import Options
from jllama.cli.serve import model_id
from jllama.errors import JllamaError
from jllama.model.loading import open_model, required_memory
from jllama.model.weights import weights_dtype


def main(options: Options) -> int:
    from jllama.generation import perplexity as ppl

    def flagged(e: JllamaError) -> JllamaError:  # the library's ctx and chunks= are flags here
        text = re.sub(r"(?<![-\w])chunks=", "--chunks=", str(e))
        return type(e)(re.sub(r"(?<![-\w])ctx\b", f"--{ctx_flag}", text))

    run, p, m = options.run, options.perplexity, options.model
    ctx_flag = "ctx"
    if run.threads:
        runtime.limit_cpu_threads(run.threads)
    one_process("perplexity", run)
    if not p.file:
        raise JllamaError("perplexity needs --file=TEXT, a UTF-8 text file")
    ctx, file_flag = p.ctx, f"--file={p.file}"
    if p.seq_len_flag and not p.ctx_given:  # -c as llama-perplexity's
        ctx, ctx_flag = p.seq_len_flag, "seq_len"
    elif p.seq_len_flag and p.seq_len_flag != ctx:
        say(f"note: perplexity's context is --ctx={ctx}; --seq_len={p.seq_len_flag} is not used")
    try:
        ppl.check_chunks(p.chunks)
        ppl.check_ctx(ctx)
        text = ppl.read_text(p.file, what=file_flag)
        model = open_model(m.checkpoint, m.tokenizer, seq_len=ctx, dtype=m.dtype)
        ppl.check_ctx(ctx, model.context_length)
        tokenizer = model.tokenizer
        tokens = tokenizer.encode(text)
        ppl.chunk_count(len(tokens), ctx, p.chunks, what=file_flag)
    except ppl.PerplexityError as e:
        raise flagged(e) from None
    config = model.config
    n_devices = device_count(run, config, several=False)
    say(required_memory(model, n_devices, kv_cache_types(run, model)))
    compile_programs(run)
    session = open_session(model, run, n_devices, device_sampling=False)
    result = ppl.perplexity(
        session.logits_fn(ctx), tokens, ctx,
        bos_id=tokenizer.bos_id if tokenizer.add_bos else None, chunks=p.chunks,
        n_vocab=min(tokenizer.vocab_size, config.vocab_size), progress=True,
        on_chunk=None if sys.stderr.isatty() else _chunk_line,
    )
    est = result.estimate
    if options.text.output_format == "json":
        print(json.dumps({
            "ppl": est.ppl, "ppl_error": est.ppl_error if math.isfinite(est.ppl_error) else None,
            "mean_nll": est.mean_nll, "chunks": result.chunks, "ctx": ctx,
            "tokens": result.tokens, "tokens_scored": est.count, "seconds": result.seconds,
            "tokens_per_second": result.tokens_per_second,
            "compile_seconds": session.compile_seconds,
            "chunk_ppl": list(result.chunk_ppl), "model": model_id(options),
            "checkpoint": model.source, "file": p.file, "dtype": weights_dtype(model.weights),
            "backend": session.backend.name,
        }), flush=True)
        return 0
    print(",".join(f"[{i + 1}]{x:.4f}" for i, x in enumerate(result.chunk_ppl)) + ",",
          file=sys.stderr)
    chunks = f"{result.chunks} chunk{'' if result.chunks == 1 else 's'}"
    print(f"jllama: {chunks} of {ctx} tokens, {est.count} scored, "
          f"{result.seconds:.2f} s ({result.tokens_per_second:.1f} tok/s)", file=sys.stderr)
    print(ppl.final_line(est), flush=True)
    return 0


def _chunk_line(done: int, total: int, ppl_so_far: float, seconds: float) -> None:
    """A line a chunk where stderr is not a terminal (a log, a pipe), which the terminal's
    progress bar leaves empty: llama-perplexity's running value, with the time so far."""
    say(f"chunk {done}/{total}: PPL so far {ppl_so_far:.4f} ({seconds:.1f} s)")
