"""The cost of a JSON-schema constraint: SmolLM2 decode under a schema against free decode of
the same number of tokens, alternated in one run (issue 22's target: >= 0.85x).

    .venv/bin/python bench/constrained.py --checkpoint=smollm2 --dtype=float32 --rounds=5

Arms, one after another in every round (each compiled and run once untimed first):
  free       greedy, the decode mode jllama picks for it (`Session.decode_mode`), to exactly
             the schema arm's token count (end-of-generation ignored);
  free_host  the same with the logits brought to the host for the draw (graph mode, the mode
             a constraint needs), so `schema / free_host` is the mask's own cost;
  schema     greedy under `SCHEMA` (an array of six people: names, ages, cities), which
             ends when the grammar is complete, in the decode mode jllama picks for it (the
             loop mode's masked program, one token per call, where free decode is loop).
`decode_tokens_per_s` is `GenerationStats.decode_steps / decode_seconds` (after the first
token); `mask_ms_per_token` is `ConstrainedSampler.mask_seconds / masks` (computing the mask,
applying it, consuming the token). One JSON line per measurement, then the medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from run import machine_facts  # bench/ is the script's folder

HERE = Path(__file__).resolve().parent

SCHEMA = {
    "type": "array", "minItems": 6, "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Paris", "Rome", "Oslo", "Lima", "Cairo"]}},
        "required": ["name", "age", "city"], "additionalProperties": False,
    },
}
PROMPT = "<|im_start|>user\nList six people as JSON.<|im_end|>\n<|im_start|>assistant\n"


def run_arm(session, arm: str, ids: list[int], tokens: int | None, grammar) -> dict:
    from jllama.sampling import Sampler

    sampler = Sampler(temperature=0.0)
    if arm == "schema":
        gen = session.generate(ids, sampler, max_tokens=400, grammar=grammar)
    else:
        gen = session.generate(ids, sampler, max_tokens=tokens, ignore_eos=True,
                               host_logits=arm == "free_host")
    for _ in gen:
        pass
    stats = gen.stats
    out = {"arm": arm, "generated": stats.generated_tokens,
           "decode_tokens_per_s": round(stats.decode_steps / stats.decode_seconds, 2)}
    if gen.constraint is not None:
        c = gen.constraint
        out["mask_ms_per_token"] = round(1000 * c.mask_seconds / max(c.masks, 1), 4)
        out["text"] = session.tokenizer.decode(gen.generated_ids)
        out["decoder"] = type(gen._decode_loop).__name__ if gen._decode_loop else "graph"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from jllama.constrain import Grammar
    from jllama.sampling import Sampler
    from jllama.generation.session import Session

    session = Session.open(args.checkpoint, seq_len=args.seq_len,
                           dtype=None if args.dtype == "auto" else args.dtype)
    ids = session.tokenizer.encode(PROMPT, parse_special=True)
    grammar = Grammar.json_schema(SCHEMA)
    first = run_arm(session, "schema", ids, None, grammar)  # compiles; sets the length
    tokens = first["generated"]
    print(json.dumps({
        "meta": True, "bench": "constrained", "checkpoint": args.checkpoint,
        "dtype": args.dtype, "tokens": tokens, "cpus": os.cpu_count(),
        "free_decode_mode": session.decode_mode(Sampler(temperature=0.0)),
        "schema_decoder": first["decoder"],
        "schema_text": first["text"], **machine_facts(HERE / ".cache")}), flush=True)
    arms = ("free", "free_host", "schema")
    for arm in arms[:2]:
        run_arm(session, arm, ids, tokens, grammar)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    masks: list[float] = []
    for r in range(args.rounds):
        for arm in arms:
            out = run_arm(session, arm, ids, tokens, grammar)
            out.pop("text", None)
            out.pop("decoder", None)
            rates[arm].append(out["decode_tokens_per_s"])
            if "mask_ms_per_token" in out:
                masks.append(out["mask_ms_per_token"])
            print(json.dumps({"round": r, **out}), flush=True)
    median = {arm: statistics.median(v) for arm, v in rates.items()}
    print(json.dumps({
        "summary": True, "median_decode_tokens_per_s": median,
        "schema_vs_free": round(median["schema"] / median["free"], 3),
        "schema_vs_free_host": round(median["schema"] / median["free_host"], 3),
        "median_mask_ms_per_token": statistics.median(masks)}), flush=True)


if __name__ == "__main__":
    main()
