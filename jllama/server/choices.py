"""The `n` choices of one request: the samplers of their sequences, and the events of the jobs
that generate them, merged.

Each choice is a sequence of its own after the request's prompt. Choice i samples with the
request's seed + i (the `sampler_config` of `jllama.server.schema`'s requests), so its tokens
are those of a request with n=1 and seed + i; a request with n > 1 and no seed draws a random base seed, so
its choices differ. A greedy request (temperature 0) generates one sequence whose events go to
every choice: its n choices are equal by construction, for the work of one.

The prompt's keys and values: the one-at-a-time worker runs the choices one after another, each
reusing the prompt the previous one left in its cache (all but its last token: prefix reuse);
the slots worker runs them side by side, each in a free slot, feeding the prompt there (reused
where that slot holds it).

Usage as OpenAI's API counts n choices: the prompt once, the completion tokens of every choice
summed (`usage`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

from fastapi import Request

from jllama.sampling import SamplerConfig
from jllama.server.engine import Done, Failed, Job, Text, TokenLogprob
from jllama.server.errors import APIError
from jllama.server.schema import ChatCompletionRequest, CompletionRequest
from jllama.server.transport import disconnected


def choice_samplers(body: CompletionRequest | ChatCompletionRequest,
                    vocab_size: int) -> list[SamplerConfig]:
    """The samplers of the sequences a request generates: one when n is 1 or the request is
    greedy (its choices share that sequence), else n, choice i's with seed + i.

    Raises:
      APIError (400): a logit_bias token id outside the vocabulary (`sampler_config`).
    """
    first = body.sampler_config(vocab_size)
    n = body.choices
    if n == 1 or first.temperature == 0:
        return [first]
    base = None if body.seed is not None else secrets.randbits(64)
    return [body.sampler_config(vocab_size, i, base) for i in range(n)]


def usage(dones: list[Done], reasoning: list[int | None] | None = None) -> dict:
    """OpenAI's `usage` of a request whose choices ended with `dones` (one per choice): the
    prompt's tokens once, the completion tokens summed, the prompt tokens served from a
    cache (the least over the choices, where known), and where the replies' think blocks are
    read apart (`reasoning`, each choice's count, None: not read) the completion tokens spent
    in them (`completion_tokens_details.reasoning_tokens`, summed)."""
    prompt = dones[0].prompt_tokens
    completion = sum(done.completion_tokens for done in dones)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    if reasoning and None not in reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    cached = [done.cached_tokens for done in dones]
    if None not in cached:  # OpenAI's count of prompt tokens served from a cache
        out["prompt_tokens_details"] = {"cached_tokens": min(cached)}
    return out


class Choices:
    """The jobs of a request's n choices: len(jobs) == n (choice i is jobs[i]), or one job
    shared by all n (a greedy request).

    Args:
      jobs: the submitted jobs.
      n: how many choices.
    """

    def __init__(self, jobs: list[Job], n: int):
        if len(jobs) not in (1, n):
            raise ValueError(f"{len(jobs)} jobs for {n} choices")
        self.jobs = jobs
        self.n = n

    def cancel(self) -> None:
        """Cancel every job (`Job.cancel`: a no-op for one that has finished)."""
        for job in self.jobs:
            job.cancel()

    def job_of(self, index: int) -> Job:
        """The job generating choice `index`."""
        return self.jobs[index if len(self.jobs) == self.n else 0]

    def _indices(self, k: int) -> range:
        """The choices job k generates."""
        return range(self.n) if len(self.jobs) < self.n else range(k, k + 1)

    def _merged(self) -> tuple[asyncio.Queue, list[asyncio.Task]]:
        """A queue of (job index, event) fed from every job's events by one task per job (the
        tasks end at their job's `Done` or `Failed`; cancel them once done reading)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, job: Job) -> None:
            while True:
                event = await job.events.get()
                merged.put_nowait((k, event))
                if isinstance(event, (Done, Failed)):
                    return

        return merged, [asyncio.ensure_future(pump(k, job)) for k, job in enumerate(self.jobs)]

    async def events(self) -> AsyncIterator[tuple[int, Text | Done]]:
        """(choice index, event) as the jobs emit them, up to every choice's `Done`; a
        `Failed` is raised as its APIError. A shared job's event comes once per choice."""
        merged, tasks = self._merged()
        try:
            left = len(self.jobs)
            while left:
                k, event = await merged.get()
                if isinstance(event, Failed):
                    raise event.error
                left -= isinstance(event, Done)
                for index in self._indices(k):
                    yield index, event
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, request: Request
                      ) -> list[tuple[list[str], list[TokenLogprob], Done, list[int]]]:
        """Each choice's (text pieces, log-probs, Done, each piece's tokens: `Text.tokens`)
        once all have ended, in choice order;
        every job is cancelled as soon as the client disconnects (the worker stops before its
        next token), and when a job fails (its APIError is raised)."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        tokens: list[list[int]] = [[] for _ in range(self.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.n)]
        dones: list[Done | None] = [None] * self.n
        merged, tasks = self._merged()
        gone = asyncio.ensure_future(disconnected(request))
        try:
            left = len(self.jobs)
            while left:
                step = asyncio.ensure_future(merged.get())
                await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    raise APIError(499, "the client closed the request")
                k, event = step.result()
                if isinstance(event, Failed):
                    raise event.error
                left -= isinstance(event, Done)
                for index in self._indices(k):
                    if isinstance(event, Done):
                        dones[index] = event
                    else:
                        texts[index].append(event.text)
                        tokens[index].append(event.tokens)
                        logprobs[index].extend(event.logprobs)
            return list(zip(texts, logprobs, dones, tokens, strict=True))
        except BaseException:  # a vanished client, a failure, a shutdown: free the worker
            self.cancel()
            raise
        finally:
            gone.cancel()
            for task in tasks:
                task.cancel()
