"""The model worker: one thread that owns the backend and runs requests one at a time, in the
order they came (a fair first-in, first-out queue).

Isolation. Every request is a new sequence of the backend's KV cache, which keeps the
positions of the prompt prefix it shares with what the cache holds from the previous request
(prefix reuse, as the slots worker's: `Done.cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens`; at least the prompt's last token is fed again) and
writes over the rest: the backends' attention masks every position after the current one, so
nothing else a previous request wrote is visible, and each request has its own `Sampler` (its
own random generator).

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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jllama.errors import ConstraintError
from jllama.generation.conversation import common_prefix_length
from jllama.sampling import SamplerConfig
from jllama.server.errors import APIError
from jllama.server.metrics import Metrics
from jllama.generation.streaming import Text, TokenLogprob

if TYPE_CHECKING:  # llguidance is imported only where a grammar is used
    from jllama.constrain import Grammar

__all__ = ["Done", "Engine", "Failed", "Job", "Text", "TokenLogprob", "enqueue"]


@dataclasses.dataclass(frozen=True)
class Done:
    """The end: finish_reason "stop" (end-of-generation token or stop string) or "length"
    (max_tokens or the context); token counts for `usage`; cached_tokens: prompt tokens reused
    from the cache (a slot's, or the one-at-a-time worker's), None: not known; stop_string: the
    stop string the text ended at (Anthropic's stop_sequence), None: none did; drafted_tokens,
    accepted_tokens: speculative decoding's (`--draft`), 0 without."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    stop_string: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


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
      ignore_eos: go on past the end-of-generation ids (llama.cpp server's request field, for
        fixed-length benchmarks).
      grammar: a `jllama.constrain.Grammar` the generated text must match (response_format,
        a tool call), or None; grammar_param: the request field it came from (the `param` of
        a 400 when its matcher fails mid-generation).
      events: where the worker puts `Text`, `Done` or `Failed` (an asyncio.Queue of the loop
        that submitted the job).
      cache_prompt: reuse the prompt prefix the cache holds (llama.cpp server's field); False:
        the whole prompt is fed from position 0, so the reply is the one a fresh run gives bit
        for bit (with a prefix reused, logits can differ in their last bits, and a greedy reply
        at a near-tie).
      finish_by_reply: the finish_reason /metrics counts is the reply's, given to `count` by
        whoever reads the events (a chat reply that is a tool call ends "tool_calls" where the
        worker says "stop"); False: the worker's, counted as the job ends.
    """

    prompt_ids: list[int]
    sampler: SamplerConfig
    max_tokens: int | None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    grammar: Grammar | None = None
    grammar_param: str | None = None
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    metrics: Metrics | None = None
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    cache_prompt: bool = True
    finish_by_reply: bool = False
    _done: Done | None = None
    _counted: bool = False
    _count_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stop (or never start) this job; its events are no longer read. A no-op once the
        job has emitted `Done` or `Failed`: a stream that closes after its last event does
        not count as cancelled (/health); a `Done` not yet counted in /metrics (its reader
        went away before it) is counted with the worker's finish_reason."""
        if not self.finished.is_set():
            self.cancelled.set()
        else:
            self.count()

    def count(self, finish_reason: str | None = None) -> None:
        """Count the job's `Done` in /metrics, once (later calls, and calls before it ended,
        do nothing); finish_reason: the reply's (None: the worker's)."""
        with self._count_lock:
            done = self._done
            if done is None or self._counted or self.metrics is None:
                return
            self._counted = True
        self.metrics.observe(finish_reason or done.finish_reason, done.prompt_tokens,
                             done.completion_tokens, done.cached_tokens,
                             done.drafted_tokens, done.accepted_tokens)

    def _emit(self, event) -> None:
        if isinstance(event, Done):
            self._done = event
            if not self.finish_by_reply:
                self.count()
        if isinstance(event, (Done, Failed)):
            self.finished.set()  # before the reader can see the event and cancel
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


def enqueue(job: Job, jobs: queue.Queue, waiting: int, max_waiting: int, metrics: Metrics) -> None:
    """Put `job` on a worker's queue, its events bound to the running event loop.

    Raises:
      APIError (503): `waiting` requests already wait, the most `max_waiting` allows.
    """
    if waiting >= max_waiting:
        raise APIError(
            503, f"the server is busy: {max_waiting} requests are waiting; retry later",
            type="server_error", code="queue_full",
        )
    job.loop = asyncio.get_running_loop()
    job.events = asyncio.Queue()
    job.metrics = metrics
    jobs.put(job)


class Engine:
    """The worker thread and its queue.

    Args:
      session: the `jllama.generation.session.Session` the requests run on (its model, backend and plan:
        made with device_sampling=False, as every request brings its own sampler), used by
        the worker thread only.
      max_waiting: the most requests waiting at once; more are refused with 503.

    Attributes (counters, read by /health): running (0 or 1), waiting, completed, cancelled.
    """

    def __init__(self, session, max_waiting: int = 256):
        self.session = session
        self.model = session.model
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.max_waiting = max_waiting
        self.running = 0
        self.completed = 0
        self.cancelled = 0
        self.slots = 1
        self.metrics = Metrics(self)
        self._current: Job | None = None
        self._held: list[int] = []  # the tokens whose keys and values the cache holds
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
        enqueue(job, self._queue, self.waiting, self.max_waiting, self.metrics)

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
            except ConstraintError as e:  # the request's grammar, not the model
                job._emit(Failed(APIError(400, str(e), param=job.grammar_param)))
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
        ids = list(job.prompt_ids)
        # At least the last prompt token is fed: its logits give the first new token.
        reused = min(common_prefix_length(self._held, ids), len(ids) - 1)
        if not job.cache_prompt:
            reused = 0
        self._held = []  # what the cache holds is known again once the generation ends well
        completion = self.session.complete(
            ids, job.sampler, max_tokens=job.max_tokens, stop=job.stop,
            logprobs=job.logprobs, cancelled=job.cancelled.is_set, grammar=job.grammar,
            ignore_eos=job.ignore_eos, start_pos=reused,
        )
        for piece in completion:
            job._emit(piece)
        generation = completion.generation
        # Positions 0 .. end_pos - 1 went through the model (an error above leaves it empty).
        self._held = (ids + list(generation.generated_ids))[: generation.end_pos]
        if completion.finish_reason == "cancelled":
            return
        job._emit(Done(completion.finish_reason, len(ids), len(generation.generated_ids),
                       cached_tokens=reused, stop_string=completion.stop_string,
                       drafted_tokens=generation.stats.drafted_tokens,
                       accepted_tokens=generation.stats.accepted_tokens))
