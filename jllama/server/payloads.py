"""Pieces of OpenAI's response objects: `system_fingerprint`, `usage` and the two shapes of
`logprobs` (chat's `{"content": [...]}` and the legacy completions' parallel lists)."""

from __future__ import annotations

import codecs
import hashlib
import os

from jllama.server.engine import Done, TokenLogprob
from jllama.server.schema import ChatCompletionRequest, CompletionRequest


def system_fingerprint(model, backend) -> str:
    """OpenAI's `system_fingerprint`: "jllama-VERSION-HASH", HASH 10 hex digits of a SHA-256 of
    what, besides a request, decides its reply: the model's configuration (its context
    included), file format, checkpoint file name and size, and the backend (its `name`). It
    changes when any of them does, as OpenAI's changes with the backend's configuration (not a
    hash of the weights: reading gigabytes at every start costs too much)."""
    from jllama import __version__

    try:
        size = os.path.getsize(model.source)
    except (OSError, TypeError):
        size = None
    facts = repr((model.config, model.file_format, os.path.basename(str(model.source)), size,
                  getattr(backend, "name", type(backend).__name__)))
    return f"jllama-{__version__}-{hashlib.sha256(facts.encode()).hexdigest()[:10]}"


def usage(done: Done) -> dict:
    usage = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    if done.cached_tokens is not None:  # OpenAI's count of prompt tokens served from a cache
        usage["prompt_tokens_details"] = {"cached_tokens": done.cached_tokens}
    return usage


def chat_logprobs(items: list[TokenLogprob], body: ChatCompletionRequest) -> dict | None:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not body.logprobs:
        return None
    return {
        "content": [
            {
                "token": item.token, "logprob": item.logprob, "bytes": item.bytes,
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": b} for t, b, lp in item.top
                ],
            }
            for item in items
        ],
        "refusal": None,
    }


class TextOffsets:
    """Characters of a completion so far, decoding its tokens' bytes as they come (invalid
    bytes count as one U+FFFD each, as in the text; a character still missing bytes counts
    once it is whole)."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def add(self, data: list[int]) -> int:
        """The offset of a token with bytes `data` (where its first character starts)."""
        at = self.chars
        self.chars += len(self._decoder.decode(bytes(data)))
        return at


def completion_logprobs(items: list[TokenLogprob], body: CompletionRequest,
                         before: TextOffsets | None = None) -> dict | None:
    """OpenAI's legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (a dict per
    token), text_offset (characters from the start of the completion to the character the
    token's first byte belongs to, counted in the text as decoded, not in the U+FFFD a token
    holding part of a character shows as). `before`: the completion's bytes before `items`
    (a stream's earlier chunks), taken on here."""
    if body.logprobs is None:
        return None
    before = TextOffsets() if before is None else before
    offsets = [before.add(item.bytes) for item in items]
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{t: lp for t, _, lp in item.top} for item in items],
        "text_offset": offsets,
    }
