"""The model worker with several slots (`jllama serve --parallel=N`, N > 1): one thread that owns
the backend and advances up to N requests in rounds (`jllama.engine.Scheduler`), so a request
that arrives while others run gets its first token after a round of theirs, not after all of
them; a new request reuses the prompt prefix a free slot holds (`cached_tokens`).

It takes the same `Job`s and emits the same events as the one-at-a-time `Engine`
(`jllama.server.engine`): `Text` pieces, then `Done` (with `cached_tokens`) or `Failed`.
"""

from __future__ import annotations

import queue
import threading

from jllama.engine import Request, Scheduler
from jllama.errors import ConstraintError, SamplerError
from jllama.server.engine import Done, Failed, Job, enqueue
from jllama.server.errors import APIError
from jllama.server.metrics import Metrics


class SlotEngine:
    """The worker thread, its queue and its scheduler.

    Args:
      session: the `jllama.generation.session.Session` (device_sampling=False; its backend with
        `SlotCaches`), used by the worker thread only.
      parallel: slots, i.e. requests generated at once (>= 1).
      max_waiting: the most requests waiting at once (queued or not yet in a slot); more are
        refused with 503.

    Attributes (read by /health and /metrics): running, waiting, completed, cancelled,
    slots, metrics.
    """

    def __init__(self, session, parallel: int = 4, max_waiting: int = 256):
        self.session = session
        self.model = session.model
        self.slots = parallel
        self.max_waiting = max_waiting
        self.completed = 0
        self.cancelled = 0
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._scheduler = Scheduler(session, n_slots=parallel, on_piece=self._on_piece)
        self._jobs: dict[int, Job] = {}
        self.metrics = Metrics(self)
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="jllama-model", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return self._scheduler.running

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + self._scheduler.waiting

    def submit(self, job: Job) -> None:
        """Queue `job`, its events to go to `job.events` on the running event loop.

        Raises:
          APIError (503): the queue is full.
        """
        enqueue(job, self._queue, self.waiting, self.max_waiting, self.metrics)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: running and queued jobs are cancelled."""
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            idle = self._scheduler.running == 0 and self._scheduler.waiting == 0
            try:
                job = self._queue.get(block=idle)
            except queue.Empty:
                job = False
            if job is None or self._closing:
                for stream_job in self._jobs.values():
                    stream_job.cancel()
                return
            if job:
                if job.cancelled.is_set():
                    self.cancelled += 1
                else:
                    stream = self._scheduler.submit(Request(
                        job.prompt_ids, job.sampler, max_tokens=job.max_tokens, stop=job.stop,
                        logprobs=job.logprobs, ignore_eos=job.ignore_eos, grammar=job.grammar,
                        cache_prompt=job.cache_prompt,
                    ))
                    self._jobs[id(stream)] = job
                continue  # take every job that is there before the next round
            for stream in self._scheduler.streams():
                if self._jobs[id(stream)].cancelled.is_set():
                    stream.cancel()
            self._scheduler.step()

    def _on_piece(self, stream, piece) -> None:
        job = self._jobs[id(stream)]
        if piece is not None:
            job._emit(piece)
            return
        del self._jobs[id(stream)]
        if stream.finish_reason == "cancelled":
            self.cancelled += 1
            return
        self.completed += 1
        if stream.error is not None:
            e = stream.error
            if isinstance(e, SamplerError):
                error = APIError(400, str(e), param="sampler")
            elif isinstance(e, ConstraintError):  # the request's grammar, not the model
                error = APIError(400, str(e), param=job.grammar_param)
            else:
                error = APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                 type="server_error")
            job._emit(Failed(error))
            return
        stats = stream.stats
        job._emit(Done(stream.finish_reason, len(job.prompt_ids), len(stream.generated_ids),
                       cached_tokens=stream.cached_tokens, stop_string=stream.stop_string,
                       drafted_tokens=stats.drafted_tokens if stats else 0,
                       accepted_tokens=stats.accepted_tokens if stats else 0))
