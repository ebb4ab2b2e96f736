"""One prompt point of `bench/scale.py` in a process of its own: jllama's prefill of a prompt
of L random ids and the greedy decode after it, as the CLI runs them (a `Session` with the
CLI's defaults: decode auto, matvec auto, chunked prefill, the compile cache).

    python bench/scale_worker.py --checkpoint=F.gguf --prompt_tokens=4096 --decode_tokens=64

prints one JSON object: prefill_tok_s (L / the seconds from the first prompt token to the
first sampled token, the programs compiled before: `Session.generate` compiles ahead),
decode_tok_s (the --decode_tokens tokens after the first sampled one, greedy, end-of-text
ignored so that every one is generated), the counts they cover, load_s, seq_len and peak_rss_mb
(the process's, 10^6 bytes). --decode_tokens=0: the prefill alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt_tokens", type=int, required=True)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=0, help="0: prompt + decode tokens")
    p.add_argument("--cache_type", default="auto", help="the KV cache type (keys and values)")
    args = p.parse_args(argv)

    from worker import prompt_tokens  # BOS-like first id, then fixed random ids

    from jllama.platform import compile_cache
    from jllama.errors import JllamaError
    from jllama.model.loading import open_model
    from jllama.sampling import Sampler
    from jllama.generation.session import Session

    seq_len = args.seq_len or args.prompt_tokens + max(args.decode_tokens, 1)
    try:
        compile_cache.setup(enabled=True, warn=lambda line: None)
        start = time.perf_counter()
        model = open_model(args.checkpoint, seq_len=seq_len)
        session = Session.prepare(model, cache_type_k=args.cache_type,
                                  cache_type_v=args.cache_type)
        load_s = time.perf_counter() - start
        ids = prompt_tokens(args.prompt_tokens, model.config.vocab_size, seed=0)
        generation = session.generate(ids, Sampler(temperature=0.0),
                                      max_tokens=args.decode_tokens + 1, ignore_eos=True)
        for _ in generation:
            pass
    except JllamaError as e:
        print(f"scale_worker: {e}", file=sys.stderr)
        return 1
    stats = generation.stats
    print(json.dumps({
        "prompt_tokens": stats.prompt_tokens, "prefill_tok_s": stats.prefill_tok_s,
        "prefill_s": stats.prefill_seconds, "decode_tok_s": stats.decode_tok_s or None,
        "decode_tokens": stats.decode_steps, "decode_s": stats.decode_seconds,
        "decode_mode": session.decode_mode(Sampler(temperature=0.0)),
        "load_s": load_s, "compile_s": session.compile_seconds, "seq_len": model.config.seq_len,
        "cache_types": [t.name for t in getattr(session.backend, "cache_types", ())],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
