"""Accuracy of narrower weights against float32: max |logit difference| and greedy agreement.

Usage: .venv/bin/python bench/accuracy.py CHECKPOINT|- PROMPT_IDS
  e.g. bench/accuracy.py - 1,403,407,261,378          (stories260K, "Once upon a time")
       bench/accuracy.py smollm2 6403,1980,253,655    (SmolLM2, "Once upon a time")

For bfloat16 and int8 (per-row scales), on the jax backend with seq_len 256: the float32
model's greedy continuation of 128 tokens is the reference. Prints one JSON line per dtype:
  max_abs_logit_diff              over the 128 positions, teacher-forced on the f32 tokens
  logit_range                     max |logit| of the f32 model there (for scale)
  teacher_forced_argmax_agreement fraction of those positions where the argmax is the same
  greedy_first_divergence         index of the first differing token when the narrow model
                                  runs free (null: none in 128)
  free_running_same               tokens equal position by position, free-running
"""

import json
import sys

import numpy as np

from jllama.backends.jax_graph import JaxGraphBackend
from jllama.model.loading import open_model

N = 128


def run(model, prompt, forced=None):
    """(tokens, logits f32[N, vocab]) of a greedy run; `forced`: feed these tokens instead of
    the model's own choices after the prompt (teacher forcing)."""
    b = JaxGraphBackend()
    b.prepare(model.config, model.weights)
    toks, logits = list(prompt), []
    for p in range(len(prompt) + N - 1):
        token = toks[p] if forced is None or p < len(prompt) else forced[p]
        lg = b.forward(token, p)
        if p >= len(prompt) - 1:
            logits.append(lg)
            if p + 1 >= len(toks):
                toks.append(int(np.argmax(lg)))
    return toks, np.array(logits)


def main() -> None:
    checkpoint = None if sys.argv[1] == "-" else sys.argv[1]
    prompt = [int(t) for t in sys.argv[2].split(",")]
    base = open_model(checkpoint, None, need_tokenizer=False, dtype="float32", seq_len=256)
    ref_toks, ref_logits = run(base, prompt)
    for dtype in ("bfloat16", "int8"):
        m = open_model(checkpoint, None, need_tokenizer=False, dtype=dtype, seq_len=256)
        free, _ = run(m, prompt)
        _, tf_logits = run(m, prompt, forced=ref_toks)
        gen_ref, gen = ref_toks[len(prompt):], free[len(prompt):]
        first = next((i for i, (a, b) in enumerate(zip(gen_ref, gen)) if a != b), None)
        print(json.dumps({
            "model": checkpoint or "stories260K", "dtype": dtype, "n": N,
            "max_abs_logit_diff": float(np.abs(tf_logits - ref_logits).max()),
            "logit_range": float(np.abs(ref_logits).max()),
            "teacher_forced_argmax_agreement": float(
                np.mean(np.argmax(tf_logits, -1) == np.argmax(ref_logits, -1))),
            "greedy_first_divergence": first,
            "free_running_same": sum(a == b for a, b in zip(gen_ref, gen)),
        }))


if __name__ == "__main__":
    main()
