"""SmolLM2 Q4_1's greedy continuations from jllama (each KV cache type) beside llama.cpp's
(its default f16 + flash attention, and its f32 cache): where each pair of programs first
chooses another token, and llama.cpp's top-2 margin there. JSON lines.

    python bench/fidelity_smollm2.py [--cache_types=f16,f32,bf16,q8_0]

llama.cpp's outputs are bench/data/smollm2_llamacpp_greedy.json (its `about` says how they were
made). 8-bit activations make SmolLM2's logits move by tenths for any float difference
upstream, so two programs that are not the same arithmetic bit for bit part after a few tokens
where margins are a few hundredths; the llama.cpp-against-itself line measures how soon that
happens between two of its own settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORACLE = HERE / "data" / "smollm2_llamacpp_greedy.json"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two id lists differ (over the shorter), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache_types", default="f16,f32,bf16,q8_0")
    args = ap.parse_args(argv)
    oracle = json.loads(ORACLE.read_text())
    for want, other in zip(oracle["default"], oracle["f32"], strict=True):
        k = first_difference(want["generated_ids"], other["generated_ids"])
        print(json.dumps({"prompt": want["prompt"], "jllama": None, "vs": "llama.cpp f32 cache",
                          "parted_at": k, "margin": None if k is None else want["margins"][k]}))
    from jllama.model.loading import open_model
    from jllama.sampling import Sampler
    from jllama.generation.session import Session

    model = open_model("smollm2", seq_len=256)
    for cache in args.cache_types.split(","):
        session = Session.prepare(model, cache_type_k=cache, cache_type_v=cache)
        for case in oracle["default"]:
            generation = session.generate(case["prompt_ids"], Sampler(temperature=0.0),
                                          max_tokens=32, ignore_eos=True)
            got = [t.id for t in generation if t.sampled]
            k = first_difference(got, case["generated_ids"])
            print(json.dumps({"prompt": case["prompt"], "jllama": cache,
                              "vs": "llama.cpp default", "parted_at": k,
                              "margin": None if k is None else case["margins"][k]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
