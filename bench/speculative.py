"""Speculative decoding's speed (issue 35): greedy decode tok/s with a drafter (`--draft`:
ngram by default, self:q4, a checkpoint) against the same generation without drafts,
alternated round by round in one process; JSON lines.

Tasks (a chat model through its own template, greedy):

  edit  the model asked to repeat a ~300-token passage with one word changed: most of the reply
        is in the prompt, so drafts are accepted (the issue asks >= 2.0x)
  chat  ordinary questions whose replies do not repeat the prompt (the issue asks >= 0.95x:
        the drafter finds little and the plain device loop runs)

Each row: the task, decode tok/s of each round with and without drafts, their best and the
ratio of the best, drafted / accepted tokens, and whether the token ids were the same (they
must be: speculation changes nothing but the speed). The first line names the machine.

With --server: two `jllama serve` engines in this process (ServerThread, --parallel=8, one
with --draft=ngram), the edit task's greedy chat completion from 1 client and from 8 clients
at once, alternated; completion tokens per second of wall time, and whether the texts match.

    .venv/bin/python bench/speculative.py                        # SmolLM2 (jllama fetch smollm2)
    .venv/bin/python bench/speculative.py --checkpoint=F.gguf --rounds=5 --out=results.jsonl
    .venv/bin/python bench/speculative.py --dtype=float32 --draft=self:q4 --tasks=chat
    .venv/bin/python bench/speculative.py --server
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
    p.add_argument("--draft", default="ngram", help="ngram, self:q4, self:int8 or a checkpoint")
    p.add_argument("--dtype", default=None, help="the target's weights: float32, ... (as stored)")
    p.add_argument("--tasks", default="edit,chat")
    p.add_argument("--server", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lines = []

    def emit(row: dict) -> None:
        text = json.dumps(row)
        print(text, flush=True)
        lines.append(text)

    emit({"metric": "meta", "machine": machine(), "args": {
        k: str(v) for k, v in vars(args).items()}})
    model = open_model(args.checkpoint, dtype=args.dtype)
    if args.server:
        served(model, args, emit)
        return finish(args, lines)
    template = ChatTemplate(model.chat_template)
    sessions = {"none": Session.prepare(model, "jax"),
                "draft": Session.prepare(model, "jax", draft=args.draft,
                                         draft_tokens=args.draft_tokens)}
    for task in args.tasks.split(","):
        for i, question in enumerate(TASKS[task]):
            prompt = template.render([{"role": "user", "content": question}])
            for session in sessions.values():  # compile outside the timed rounds
                run(session, prompt, args.max_tokens)
            rates = {"none": [], "draft": []}
            same, drafted, accepted, tokens = True, 0, 0, 0
            for _ in range(args.rounds):  # alternated
                plain, stats = run(sessions["none"], prompt, args.max_tokens)
                rates["none"].append(stats.decode_tok_s)
                spec, stats = run(sessions["draft"], prompt, args.max_tokens)
                rates["draft"].append(stats.decode_tok_s)
                same &= spec == plain
                drafted, accepted = stats.drafted_tokens, stats.accepted_tokens
                tokens = stats.generated_tokens
            emit({"metric": "speculative", "task": task, "prompt": i, "draft": args.draft,
                  "dtype": args.dtype or "as stored",
                  "generated_tokens": tokens, "plain_tok_s": rates["none"],
                  "draft_tok_s": rates["draft"],
                  "speedup": max(rates["draft"]) / max(rates["none"]),
                  "drafted": drafted, "accepted": accepted, "same_ids": same})
    return finish(args, lines)


def finish(args, lines: list[str]) -> int:
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def served(model, args, emit) -> None:
    """The edit task through two in-process servers, 1 and 8 clients, alternated."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from jllama.backends import prepared_backend
    from jllama.server import ServerThread

    servers = {draft: ServerThread(model, prepared_backend(model, "jax"), "m", parallel=8,
                                   draft=draft, draft_tokens=args.draft_tokens).start()
               for draft in ("none", "ngram")}
    body = {"model": "m", "temperature": 0, "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": TASKS["edit"][0]}]}

    def one(url: str) -> tuple[str, int]:
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
        return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

    def clients(url: str, n: int) -> tuple[float, list[str]]:
        started = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(one, [url] * n))
        return sum(k for _, k in replies) / (time.perf_counter() - started), [r for r, _ in replies]

    try:
        for server in servers.values():
            clients(server.url, 1)  # compile outside the timed rounds
        for n in (1, 8):
            rates, texts = {"none": [], "ngram": []}, {}
            for _ in range(args.rounds):  # alternated
                for draft, server in servers.items():
                    rate, texts[draft] = clients(server.url, n)
                    rates[draft].append(rate)
            emit({"metric": "speculative_server", "task": "edit", "clients": n,
                  "plain_tok_s": rates["none"], "ngram_tok_s": rates["ngram"],
                  "speedup": max(rates["ngram"]) / max(rates["none"]),
                  "same_text": texts["none"] == texts["ngram"]})
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
