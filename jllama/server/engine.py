"""The model worker: one thread that owns the backend and runs requests one at a time, in the
order they came (a fair first-in, first-out queue).

Isolation. Every request is a new sequence from position 0 of the backend's KV cache: the
backends' attention masks every position after the current one, so nothing a previous request
wrote is visible, and each request has its own `Sampler` (its own random generator). Two
requests with the same settings therefore give the same tokens whatever ran before or beside
them.

Events go from the worker thread to the request's asyncio queue through
`loop.call_soon_threadsafe`: `Text(text, logprobs)` pieces as the tokens come, then one `Done`
(or one `Failed`). A request that is cancelled (its client went away) is skipped if it has not
started, and stops at the next token if it has, so its place goes to the next one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from jllama.generate import Generation
from jllama.sampling import Sampler, SamplerConfig, log_softmax, restrict_to_vocabulary
from jllama.server.errors import APIError
from jllama.stop import StopMatcher


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (`log_softmax` of its logits,
    before any sampler step, as llama.cpp's server reports by default).

    Attributes:
      token: the token's text (its bytes decoded as UTF-8, U+FFFD for a partial character).
      bytes: the token's bytes, as ints.
      logprob: natural log of its probability.
      top: the `top` most likely tokens at that position, as (text, bytes, logprob), most
        likely first.
    """

    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


@dataclasses.dataclass(frozen=True)
class Text:
    """Text released to the client (never any part of a stop string), and the log-probs of the
    tokens it came from (when asked for)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclasses.dataclass(frozen=True)
class Done:
    """The end: finish_reason "stop" (end-of-generation token or stop string) or "length"
    (max_tokens or the context); token counts for `usage`."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request failed in the worker (the model's fault, not the client's)."""

    error: APIError


@dataclasses.dataclass
class Job:
    """One request for the worker.

    Attributes:
      prompt_ids: the whole prompt, tokens (1 <= len <= seq_len).
      sampler: the sampler's settings (the seed already chosen).
      max_tokens: the most tokens to generate (None: until the context is full).
      stop: stop strings.
      logprobs: how many top log-probs per token (0: only the chosen token's), or None: none.
      events: where the worker puts `Text`, `Done` or `Failed` (an asyncio.Queue of the loop
        that submitted the job).
    """

    prompt_ids: list[int]
    sampler: SamplerConfig
    max_tokens: int | None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop (or never start) this job; its events are no longer read. A no-op once the
        job has emitted `Done` or `Failed`: a stream that closes after its last event does
        not count as cancelled (/health)."""
        if not self.finished.is_set():
            self.cancelled.set()

    def _emit(self, event) -> None:
        if isinstance(event, (Done, Failed)):
            self.finished.set()  # before the reader can see the event and cancel
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


class _Recorder:
    """Wraps a sampler to keep the logits of the last draw (for log-probs)."""

    def __init__(self, sample: Callable[..., int]):
        self._sample = sample
        self.uses_history = getattr(sample, "uses_history", False)
        self.logits: np.ndarray | None = None

    def __call__(self, logits, *history) -> int:
        self.logits = logits
        return self._sample(logits, *history)


class Engine:
    """The worker thread and its queue.

    Args:
      model: a `jllama.loading.Model` (config, tokenizer).
      backend: a prepared backend (`forward`, optionally `prefill`), used by the worker thread
        only.
      use_prefill: feed prompts through the backend's batched `prefill` when it has one (as the
        CLI's --prefill=chunked).
      max_waiting: the most requests waiting at once; more are refused with 503.

    Attributes (counters, read by /health): running (0 or 1), waiting, completed, cancelled.
    """

    def __init__(self, model, backend, use_prefill: bool = True, max_waiting: int = 256):
        self.model = model
        self.backend = backend
        self._prefill = getattr(backend, "prefill", None) if use_prefill else None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.max_waiting = max_waiting
        self.running = 0
        self.completed = 0
        self.cancelled = 0
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._work, name="jllama-model", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued and not started."""
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Queue `job`, its events to go to `job.events` on the running event loop.

        Raises:
          APIError (503): the queue is full.
        """
        if self._queue.qsize() >= self.max_waiting:
            raise APIError(
                503, f"the server is busy: {self.max_waiting} requests are waiting; retry later",
                type="server_error", code="queue_full",
            )
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        self._queue.put(job)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: the running job stops at its next token, queued ones are dropped."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        current = self._current
        if current is not None:
            current.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self.cancelled += 1
                continue
            self.running = 1
            self._current = job
            try:
                self._generate(job)
            except APIError as e:
                job._emit(Failed(e))
            except Exception as e:  # the model's failure: report it, keep serving
                job._emit(Failed(APIError(
                    500, f"generation failed: {type(e).__name__}: {e}", type="server_error"
                )))
            finally:
                self.running = 0
                self._current = None
                if job.cancelled.is_set():
                    self.cancelled += 1
                else:
                    self.completed += 1

    def _generate(self, job: Job) -> None:
        model, tokenizer = self.model, self.model.tokenizer
        seq_len = model.config.seq_len
        prompt = job.prompt_ids
        sampler = Sampler.from_config(job.sampler)
        sample = sampler
        if tokenizer.vocab_size < model.config.vocab_size:
            sample = restrict_to_vocabulary(sampler, tokenizer.vocab_size)
        recorder = _Recorder(sample)
        # steps counts positions from 0; the last sampled token is never fed back, hence - 1.
        room = seq_len
        steps = room if job.max_tokens is None else min(room, len(prompt) + job.max_tokens - 1)
        if hasattr(self.backend, "compile_for"):
            # Each program this request needs and no earlier one compiled, now rather than in
            # the middle of its stream (a no-op once they all are).
            self.backend.compile_for(len(prompt), steps - 1, chunked=self._prefill is not None)
        generation = Generation(
            self.backend.forward, prompt, recorder, steps,
            stop_ids=tuple(tokenizer.stop_ids), prefill=self._prefill,
        )
        decoder = tokenizer.stream_decoder()
        matcher = StopMatcher(job.stop)
        pending: list[TokenLogprob] = []
        reason = None
        for token in generation:
            if job.cancelled.is_set():
                return
            if not token.sampled:
                continue
            if job.logprobs is not None:
                pending.append(self._logprob(recorder.logits, token.prev, token.id, job.logprobs))
            text = matcher.push(decoder.push(token.prev, token.id))
            if text or (matcher.stopped and pending):
                job._emit(Text(text, pending))
                pending = []
            if matcher.stopped:
                reason = "stop"
                break
        if reason is None:
            tail = matcher.push(decoder.flush())
            if not matcher.stopped:
                tail += matcher.flush()
            if tail or pending:
                job._emit(Text(tail, pending))
            reason = "stop" if generation.stop_token is not None or matcher.stopped else "length"
        job._emit(Done(reason, len(prompt), len(generation.generated_ids)))

    def _logprob(self, logits, prev: int, token: int, top: int) -> TokenLogprob:
        n = self.model.tokenizer.vocab_size
        lp = log_softmax(np.asarray(logits)[:n])
        best = np.argsort(-lp, kind="stable")[:top] if top else []
        text_of = self._token_text
        return TokenLogprob(
            *text_of(prev, token), float(lp[token]),
            [(*text_of(prev, int(t)), float(lp[t])) for t in best],
        )

    def _token_text(self, prev: int, token: int) -> tuple[str, list[int]]:
        tokenizer = self.model.tokenizer
        if hasattr(tokenizer, "decode_piece"):
            data = tokenizer.decode_piece(prev, token)
        else:
            data = tokenizer.token_bytes(token)
        if token in getattr(tokenizer, "control_ids", ()):
            data = b""  # a control token prints nothing (as the stream decoder)
        return data.decode("utf-8", "replace"), list(data)
