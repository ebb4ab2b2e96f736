"""Speculative decoding's speed (issue 35): greedy decode tok/s with `--draft=ngram` against
the same generation without drafts, alternated round by round in one process; JSON lines.

Tasks (a chat model through its own template, greedy):

  edit  the model asked to repeat a ~300-token passage with one word changed: most of the reply
        is in the prompt, so drafts are accepted (the issue asks >= 2.0x)
  chat  ordinary questions whose replies do not repeat the prompt (the issue asks >= 0.95x:
        the drafter finds little and the plain device loop runs)

Each row: the task, decode tok/s of each round with and without drafts, their best and the
ratio of the best, drafted / accepted tokens, and whether the token ids were the same (they
must be: speculation changes nothing but the speed). The first line names the machine.

    .venv/bin/python bench/speculative.py                        # SmolLM2 (jllama fetch smollm2)
    .venv/bin/python bench/speculative.py --checkpoint=F.gguf --rounds=5 --out=results.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from memory_plan import machine  # noqa: E402  (bench/ is the script's folder)

from jllama.chat import ChatTemplate  # noqa: E402
from jllama.generation.session import Session  # noqa: E402
from jllama.model.loading import open_model  # noqa: E402
from jllama.sampling import Sampler  # noqa: E402

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and "
    "every morning he climbed them again to put it out. The ships that passed never knew his "
    "name, but they knew his light, and that was enough for him. In winter the storms came "
    "from the north, and the waves threw spray as high as the gallery rail. In summer the sea "
    "was calm and blue, and children from the village came to ask him about the ships he had "
    "seen. He told them about the tall ships with white sails, about the steamers that "
    "coughed black smoke, and about the night a fishing boat lost its way in the fog and found "
    "the harbour only because the lamp was burning. When the children went home, he sat on "
    "the bench by the door and watched the gulls circle over the rocks until the sun went "
    "down and it was time to climb the steps again."
)
TASKS = {
    "edit": [f"Repeat the following passage exactly, but change 'keeper' to 'guardian':\n\n"
             f"{PASSAGE}"],
    "chat": ["What are three good ways to stay focused while studying?",
             "Explain why the sky is blue in a short paragraph.",
             "Write a short poem about autumn leaves."],
}


def run(session: Session, prompt: str, max_tokens: int):
    ids = session.encode(prompt, parse_special=True)
    generation = session.generate(ids, Sampler(temperature=0.0), max_tokens=max_tokens)
    out = [t.id for t in generation]
    return out, generation.stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max_tokens", type=int, default=400)
    p.add_argument("--draft_tokens", type=int, default=15)
    p.add_argument("--tasks", default="edit,chat")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lines = []

    def emit(row: dict) -> None:
        text = json.dumps(row)
        print(text, flush=True)
        lines.append(text)

    emit({"metric": "meta", "machine": machine(), "args": {
        k: str(v) for k, v in vars(args).items()}})
    model = open_model(args.checkpoint)
    template = ChatTemplate(model.chat_template)
    sessions = {draft: Session.prepare(model, "jax", draft=draft, draft_tokens=args.draft_tokens)
                for draft in ("none", "ngram")}
    for task in args.tasks.split(","):
        for i, question in enumerate(TASKS[task]):
            prompt = template.render([{"role": "user", "content": question}])
            for session in sessions.values():  # compile outside the timed rounds
                run(session, prompt, args.max_tokens)
            rates = {"none": [], "ngram": []}
            same, drafted, accepted, tokens = True, 0, 0, 0
            for _ in range(args.rounds):  # alternated
                plain, stats = run(sessions["none"], prompt, args.max_tokens)
                rates["none"].append(stats.decode_tok_s)
                spec, stats = run(sessions["ngram"], prompt, args.max_tokens)
                rates["ngram"].append(stats.decode_tok_s)
                same &= spec == plain
                drafted, accepted = stats.drafted_tokens, stats.accepted_tokens
                tokens = stats.generated_tokens
            emit({"metric": "speculative", "task": task, "prompt": i,
                  "generated_tokens": tokens, "plain_tok_s": rates["none"],
                  "ngram_tok_s": rates["ngram"],
                  "speedup": max(rates["ngram"]) / max(rates["none"]),
                  "drafted": drafted, "accepted": accepted, "same_ids": same})
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
