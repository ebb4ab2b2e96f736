"""Perplexity of a text under a model, computed as llama.cpp's `llama-perplexity` does.

The rules of llama.cpp's tools/perplexity/perplexity.cpp (`perplexity`, without --ppl-stride):

  1. The file is read whole, one trailing newline dropped (`-f`), and tokenized once, BOS
     first when the vocabulary adds one; special-token text stays text.
  2. It needs at least 2 * ctx tokens. They are cut into len(tokens) // ctx chunks of ctx
     tokens (the rest is dropped); --chunks takes the first few only.
  3. Each chunk is evaluated alone from position 0 (the KV cache cleared), its first token
     replaced by BOS when the vocabulary adds one.
  4. Only the second half of a chunk is scored, so every prediction has some context:
     first = ctx // 2, and the logits at positions first .. ctx - 2 predict the chunk's
     tokens first + 1 .. ctx - 1: ctx - 1 - first tokens a chunk.
  5. A token's negative log-likelihood is `max + log(sum(exp(logits - max))) - logits[token]`
     over the vocabulary's tokens (the max and each exp in float32, the sum in float64).
  6. PPL = exp(mean NLL), and its error `sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1)) * PPL`:
     the standard error of the mean NLL carried through exp (d PPL = PPL d NLL).

`perplexity` drives a model through the chunks: any `prefill_logits(tokens, start_pos,
first)` (the backends' method, or `forward_logits` over a plain `forward`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jllama.errors import JllamaError
from jllama.platform.files import require_regular_file

MIN_CTX = 3
"""The shortest chunk that scores a token: ctx - 1 - ctx // 2 >= 1 (ctx = 2 scores none, and
llama.cpp's mean over no tokens is 0 / 0)."""

LogitsFn = Callable[[Sequence[int], int, int], np.ndarray]
"""prefill_logits(tokens, start_pos, first) -> f32[len(tokens) - first, vocab_size]: the
logits after each of tokens[first:], the tokens fed from start_pos."""


class PerplexityError(JllamaError, ValueError):
    """Settings or a text a perplexity cannot be computed with (one line naming which)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """PPL and its error from `count` token NLLs (nats).

    Attributes:
      ppl: exp(mean_nll).
      ppl_error: the standard error of ppl (rule 6 of the module); NaN when count < 2 or the
        NLLs' variance is not positive (llama.cpp prints no estimate then).
      mean_nll: mean negative log-likelihood, nats a token.
      count: tokens scored.
    """

    ppl: float
    ppl_error: float
    mean_nll: float
    count: int


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """What `perplexity` measured.

    Attributes:
      estimate: the final `Estimate` over every scored token.
      chunk_ppl: PPL over the chunks so far, after each chunk (llama.cpp's `[1]x,[2]y,...`).
      ctx: tokens a chunk; chunks: chunks evaluated; tokens: tokens in the whole text.
      seconds: wall time of the chunks' evaluation and scoring, seconds (a program a backend
        compiles at its first use, such as the classifier over a chunk's rows, counts in it).
    """

    estimate: Estimate
    chunk_ppl: tuple[float, ...]
    ctx: int
    chunks: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokens evaluated (chunks * ctx, scored or not) per second of `seconds`."""
        return self.chunks * self.ctx / self.seconds if self.seconds > 0 else math.inf


def read_text(path: str | Path, what: str | None = None) -> str:
    """The text of a UTF-8 file with one trailing newline dropped, as llama-perplexity's `-f`.

    what: how error messages name the file (default "text file PATH").

    Raises:
      PerplexityError: a missing, unreadable or non-regular file, bytes that are not UTF-8,
        or an empty text.
    """
    what = what or f"text file {path}"
    require_regular_file(Path(path), what, PerplexityError)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PerplexityError(f"{what}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PerplexityError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    text = text.removesuffix("\n")
    if not text:
        raise PerplexityError(f"{what}: the text is empty")
    return text


def check_ctx(ctx: int, context_length: int | None = None) -> int:
    """ctx, if a chunk of that many tokens scores one (>= MIN_CTX) and fits the model's
    context of context_length tokens (None: not checked); else PerplexityError naming ctx."""
    if ctx < MIN_CTX:
        raise PerplexityError(
            f"ctx={ctx} must be at least {MIN_CTX}: only the second half of a chunk is scored"
        )
    if context_length is not None and ctx > context_length:
        raise PerplexityError(f"ctx={ctx} is more than the model's context ({context_length} "
                              "tokens)")
    return ctx


def check_chunks(chunks: int) -> int:
    """chunks, if -1 (all) or >= 1; else PerplexityError naming chunks."""
    if chunks == 0 or chunks < -1:
        raise PerplexityError(f"chunks={chunks} must be at least 1, or -1 for all")
    return chunks


def chunk_count(n_tokens: int, ctx: int, chunks: int = -1, what: str = "the text") -> int:
    """Chunks of ctx tokens to evaluate in a text of n_tokens tokens: n_tokens // ctx, at most
    `chunks` (-1: all). what: how the error message names the text.

    Raises:
      PerplexityError: fewer than 2 * ctx tokens (llama.cpp's minimum), or chunks not -1 or
        >= 1.
    """
    check_chunks(chunks)
    if n_tokens < 2 * ctx:
        raise PerplexityError(
            f"{what} is {n_tokens} token{'' if n_tokens == 1 else 's'}, fewer than the "
            f"{2 * ctx} that ctx={ctx} needs "
            "(2 * ctx, as llama-perplexity): give a longer text or a smaller ctx"
        )
    available = n_tokens // ctx
    return available if chunks == -1 else min(chunks, available)


def first_scored(ctx: int) -> int:
    """The position of a chunk whose logits are scored first: ctx // 2 (its prediction is of
    the token at ctx // 2 + 1). Positions first .. ctx - 2 are scored."""
    return ctx // 2


def chunk_inputs(tokens: Sequence[int], ctx: int, index: int, bos_id: int | None) -> list[int]:
    """The ctx tokens chunk `index` feeds: tokens[index * ctx:(index + 1) * ctx], the first
    replaced by bos_id unless it is None (a vocabulary that adds no BOS)."""
    chunk = [int(t) for t in tokens[index * ctx:(index + 1) * ctx]]
    if len(chunk) != ctx:
        raise ValueError(f"chunk {index} of ctx={ctx} is past the {len(tokens)} tokens")
    if bos_id is not None:
        chunk[0] = int(bos_id)
    return chunk


def chunk_targets(tokens: Sequence[int], ctx: int, index: int) -> list[int]:
    """The tokens chunk `index` is scored on: those at chunk positions first + 1 .. ctx - 1
    (the text's own tokens, never the BOS put in place of the first)."""
    start = index * ctx
    return [int(t) for t in tokens[start + first_scored(ctx) + 1:start + ctx]]


def token_nlls(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of each target under its row of logits, as llama.cpp's
    `log_softmax`: logits f32[n, vocab], targets int[n] -> f64[n] (nats). The max and each
    exp in float32, their sum in float64, then `log(sum) - (logit - max)` in float64."""
    logits = np.asarray(logits, np.float32)
    targets = np.asarray(targets, np.int64)
    if logits.ndim != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} do not pair up")
    top = logits.max(axis=-1, keepdims=True)
    total = np.exp(logits - top).sum(axis=-1, dtype=np.float64)
    picked = np.take_along_axis(logits - top, targets[:, None], axis=-1)[:, 0]
    return np.log(total) - picked.astype(np.float64)


def estimate(nlls: Sequence[float]) -> Estimate:
    """PPL and its error from token NLLs f64[count], as llama.cpp's final estimate (module
    rule 6): means of the NLLs and of their squares, PPL = exp(mean), error
    `sqrt((mean(NLL^2) - mean^2) / (count - 1)) * PPL`.

    Raises:
      ValueError: no NLLs.
    """
    values = np.asarray(nlls, np.float64)
    count = int(values.size)
    if count == 0:
        raise ValueError("no token was scored")
    mean = float(values.sum()) / count
    mean2 = float((values * values).sum()) / count
    ppl = math.exp(mean)
    variance = mean2 - mean * mean
    error = math.sqrt(variance / (count - 1)) * ppl if count > 1 and variance > 0 else math.nan
    return Estimate(ppl=ppl, ppl_error=error, mean_nll=mean, count=count)


def forward_logits(forward: Callable[[int, int], np.ndarray]) -> LogitsFn:
    """A `LogitsFn` over a backend's plain `forward(token, pos)`, one token at a time."""

    def logits(tokens: Sequence[int], start_pos: int, first: int) -> np.ndarray:
        rows = [forward(int(t), start_pos + i) for i, t in enumerate(tokens)]
        return np.stack(rows[first:])

    return logits


def perplexity(
    logits_fn: LogitsFn,
    tokens: Sequence[int],
    ctx: int,
    bos_id: int | None = None,
    chunks: int = -1,
    n_vocab: int | None = None,
    progress: bool = False,
    on_chunk: Callable[[int, int, float, float], None] | None = None,
) -> PerplexityResult:
    """The perplexity of `tokens` (the whole text, tokenized) in chunks of ctx, as llama.cpp.

    Args:
      logits_fn: evaluates one chunk from position 0 (see `LogitsFn`); each call starts a
        new sequence.
      tokens: int ids of the text, BOS first when the vocabulary adds one.
      ctx: tokens a chunk (>= MIN_CTX).
      bos_id: the BOS put first in every chunk, or None when the vocabulary adds none.
      chunks: the most chunks to evaluate; -1 = all.
      n_vocab: the softmax runs over the first n_vocab logits (the tokenizer's tokens, when
        the model has padding rows beyond them); None = all.
      progress: a tqdm bar on stderr (tokens evaluated, the PPL so far), when it is a terminal.
      on_chunk: called after each chunk as `on_chunk(done, n_chunks, ppl_so_far, seconds)`
        (chunks done, from 1; seconds since the first chunk began), e.g. to print a line
        where stderr is not a terminal and the bar stays off.

    Raises:
      PerplexityError: ctx < MIN_CTX, fewer than 2 * ctx tokens, a bad `chunks`.
    """
    check_ctx(ctx)
    n_chunks = chunk_count(len(tokens), ctx, chunks)
    first = first_scored(ctx)
    from tqdm import tqdm

    nlls, running, total = [], [], 0.0
    bar = tqdm(total=n_chunks * ctx, desc="perplexity", unit="tok", unit_scale=True,
               file=sys.stderr, disable=None if progress else True, leave=False)
    start = time.perf_counter()
    with bar:
        for index in range(n_chunks):
            rows = logits_fn(chunk_inputs(tokens, ctx, index, bos_id), 0, first)
            rows = np.asarray(rows)[:-1]  # the last position predicts past the chunk
            if n_vocab is not None:
                rows = rows[:, :n_vocab]
            nlls.append(token_nlls(rows, chunk_targets(tokens, ctx, index)))
            total += float(nlls[-1].sum())
            running.append(math.exp(total / ((index + 1) * (ctx - 1 - first))))
            bar.update(ctx)
            bar.set_postfix(ppl=f"{running[-1]:.4f}", refresh=False)
            if on_chunk is not None:
                on_chunk(index + 1, n_chunks, running[-1], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    return PerplexityResult(
        estimate=estimate(np.concatenate(nlls)), chunk_ppl=tuple(running), ctx=ctx,
        chunks=n_chunks, tokens=len(tokens), seconds=seconds,
    )


def final_line(result: Estimate) -> str:
    """llama-perplexity's last line: `Final estimate: PPL = 12.3456 +/- 0.12345`."""
    return f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}"
