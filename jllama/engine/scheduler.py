"""Many requests at once over one Session: slots, admission, round-robin steps, prefix reuse.

A `Scheduler` holds `n_slots` KV caches (`Session.new_slot`). Requests wait in a first-in,
first-out queue and are admitted into free slots; each `step` computes the next logits of
every decoding request in one batched step (`Session.decode_batch`), then advances each
running request by one token (`jllama.generation.streaming.Completion` with each_token: a token that
releases no text yet makes an empty piece, which is not kept) or one prefill chunk, in slot
order, so a new request's first token waits for one round of the others rather than for them
to finish.
A request that ends (a stop token or string, max_tokens, the context, cancelled) frees its
slot at once for the next one.

Prefix reuse: a slot keeps the tokens whose keys and values it holds after its request ends.
A request admitted into the free slot holding the longest common prefix with its prompt feeds
only the rest (llama.cpp's `cache_prompt`, vLLM's prefix caching); `Stream.cached_tokens` says
how many were reused (OpenAI's `usage.prompt_tokens_details.cached_tokens`).

Each request runs its own `Generation` in its own slot, with its own sampler and random
state; on jllama's CPU kernels the batched step's row for it has the bits of its forward alone
(`BatchDecode`), so its tokens are the same alone or beside others, bit for bit. With XLA's
products (`--matvec=xla`, GPUs, a mesh) the row equals its forward to float rounding (greedy
tokens the same unless two logits tie within it; a sampled draw can differ where its coin
lands within that rounding of a boundary).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from jllama.generation.conversation import common_prefix_length
from jllama.sampling import Sampler, SamplerConfig
from jllama.generation.streaming import Text

SPECULATE_ALONE = 1
"""Running requests at most for a request's speculative decoding (`Session(draft=...)`) to
draft: with more, the batched step already reads each weight once for all of them."""

if TYPE_CHECKING:  # llguidance is imported only where a grammar is used
    from jllama.constrain import Grammar


@dataclasses.dataclass
class Request:
    """One completion to run.

    Attributes:
      prompt_ids: the prompt, tokens (BOS included when wanted), 1 <= len <= seq_len.
      sampler: its settings (a None seed: from the clock when it starts) or a `Sampler`.
      max_tokens: the most tokens to generate; None: until the context is full.
      stop: stop strings.
      logprobs: top log-probs per token (0: the chosen token's only), None: none.
      ignore_eos: go on past the end-of-generation ids (fixed-length benchmarks).
      grammar: a `jllama.constrain.Grammar` the generated text must match (`Session.complete`'s
        grammar: a matcher of its own in its slot, its tokens drawn on the host), None: free.
      cache_prompt: reuse the prompt prefix a free slot holds (the scheduler's reuse_prefix
        permitting); False: the whole prompt is fed from position 0, as a run of its own feeds
        it (logits computed with a prefix reused can differ from those in their last bits).
    """

    prompt_ids: Sequence[int]
    sampler: SamplerConfig | Sampler = dataclasses.field(default_factory=SamplerConfig)
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    grammar: Grammar | None = None
    cache_prompt: bool = True


class Stream:
    """A submitted request's progress.

    Attributes:
      request: the `Request`.
      pieces: the `Text` pieces released so far, in order.
      finish_reason: None while it runs or waits; then "stop", "length", "cancelled" or
        "error" (`error` holds the exception: the model's failure, or a request it cannot run).
      cached_tokens: prompt tokens reused from the slot's cache (not fed again).
      generated_ids: the tokens generated (once started).
    """

    def __init__(self, request: Request):
        self.request = request
        self.pieces: list[Text] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.error: Exception | None = None
        self._cancelled = False
        self._completion = None
        self._iterator: Iterator[Text] | None = None
        self._slot = None
        self._fed = 0  # prompt tokens in the slot's cache so far

    @property
    def text(self) -> str:
        """The text released so far."""
        return "".join(piece.text for piece in self.pieces)

    @property
    def generated_ids(self) -> list[int]:
        if self._completion is None:
            return []
        return list(self._completion.generation.generated_ids)

    @property
    def stats(self):
        """The generation's `GenerationStats` (once started), else None."""
        return None if self._completion is None else self._completion.generation.stats

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string the text ended at, or None (`Completion.stop_string`)."""
        return None if self._completion is None else self._completion.stop_string

    def cancel(self) -> None:
        """Stop at the next step (a waiting request never starts); frees its slot then."""
        self._cancelled = True


class Scheduler:
    """Requests over the slots of one `Session`, advanced in rounds.

    Args:
      session: the `jllama.generation.session.Session` (its backend must have `SlotCaches`).
      n_slots: KV caches, i.e. requests running at once (>= 1).
      reuse_prefix: admit a request into the free slot sharing the longest prefix with its
        prompt and feed only the rest.
      prefill_chunk: the most prompt tokens one request feeds in one step (a longer prompt
        takes a step per chunk, so the others' streams pause for one chunk at a time, not for
        the whole prompt); None: a whole prompt in one step. 256, the backend's largest
        prefill chunk, cuts a prompt from position 0 exactly as one batched prefill does.
      on_piece: called with (stream, piece) for each `Text` as it is released, and with
        (stream, None) when the stream ends.

    Raises:
      BackendError: a backend without `SlotCaches`.
      ValueError: n_slots < 1.
    """

    def __init__(self, session, n_slots: int = 4, reuse_prefix: bool = True,
                 on_piece: Callable[[Stream, Text | None], None] | None = None,
                 prefill_chunk: int | None = 256):
        if n_slots < 1:
            raise ValueError(f"n_slots={n_slots} must be at least 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be at least 1 (or None)")
        self._chunk = prefill_chunk
        self.session = session
        self._free = [(session.new_slot(), []) for _ in range(n_slots)]
        self._running: list[Stream] = []
        self._waiting: collections.deque[Stream] = collections.deque()
        self._reuse = reuse_prefix
        self._on_piece = on_piece

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def streams(self) -> list[Stream]:
        """The streams running, then those waiting, in order."""
        return self._running + list(self._waiting)

    def submit(self, request: Request) -> Stream:
        """Queue `request`; it starts at a step with a free slot.

        Raises:
          ValueError: an empty prompt, or one longer than the context.
        """
        seq_len = self.session.config.seq_len
        if not 1 <= len(request.prompt_ids) <= seq_len:
            raise ValueError(f"the prompt is {len(request.prompt_ids)} tokens; it must hold "
                             f"1 .. {seq_len} (seq_len)")
        stream = Stream(request)
        self._waiting.append(stream)
        return stream

    def step(self) -> int:
        """Admit waiting requests into free slots, then advance each running one by a piece
        (or end it). Returns how many are still running or waiting."""
        self._admit()
        # The next token of every stream that is decoding, in one batched step where the
        # backend has one (each stream then reads its row instead of calling forward).
        self.session.decode_batch([
            (s._slot, *s._completion.generation.next_input) for s in self._running
            if s._completion is not None and s._completion.generation.next_input is not None
            and not s._cancelled
        ])
        for stream in list(self._running):
            if stream._cancelled:
                self._finish(stream, "cancelled")
                continue
            try:
                if stream._completion is None and self._feed(stream):
                    continue  # a chunk of its prompt was this step's work
                piece = next(stream._iterator)
            except StopIteration:
                self._finish(stream, stream._completion.finish_reason)
                continue
            except Exception as e:  # this request's failure (e.g. NaN logits): the rest go on
                stream.error = e
                self._finish(stream, "error")
                continue
            if not piece.text and not piece.logprobs:
                continue  # a token that released no text yet
            stream.pieces.append(piece)
            if self._on_piece is not None:
                self._on_piece(stream, piece)
        return len(self._running) + len(self._waiting)

    def run(self) -> None:
        """Step until nothing runs or waits."""
        while self.step():
            pass

    def _admit(self) -> None:
        while self._waiting and self._free:
            stream = self._waiting.popleft()
            if stream._cancelled:
                stream.finish_reason = "cancelled"
                if self._on_piece is not None:
                    self._on_piece(stream, None)
                continue
            ids = list(stream.request.prompt_ids)
            reuse = self._reuse and stream.request.cache_prompt
            best = max(range(len(self._free)),
                       key=lambda i: common_prefix_length(self._free[i][1], ids)) if reuse else 0
            slot, held = self._free.pop(best)
            # At least the last prompt token is fed: its logits give the first new token.
            reused = min(common_prefix_length(held, ids), len(ids) - 1) if reuse else 0
            stream._slot, stream._fed, stream.cached_tokens = slot, reused, reused
            self._running.append(stream)

    def _feed(self, stream: Stream) -> bool:
        """Feed the next chunk of a prompt longer than a chunk and return True; or start the
        request's completion (its first piece prefills the rest) and return False."""
        ids = stream.request.prompt_ids
        if self._chunk is not None and len(ids) - stream._fed > self._chunk:
            self.session.feed(ids[stream._fed:stream._fed + self._chunk], stream._fed,
                              slot=stream._slot)
            stream._fed += self._chunk
            return True
        r = stream.request
        stream._completion = self.session.complete(
            ids, r.sampler, max_tokens=r.max_tokens, stop=r.stop, logprobs=r.logprobs,
            slot=stream._slot, start_pos=stream._fed, ignore_eos=r.ignore_eos, each_token=True,
            grammar=r.grammar,
        )
        decoder = stream._completion.generation.speculation
        if decoder is not None:
            # Drafts only while the request decodes alone: beside others, its tokens come
            # from the batched step's row (one weight read for every sequence).
            decoder.enabled = lambda: len(self._running) <= SPECULATE_ALONE
        stream._iterator = iter(stream._completion)
        return False

    def _finish(self, stream: Stream, reason: str | None) -> None:
        stream.finish_reason = reason or "cancelled"
        self._running.remove(stream)
        ids = list(stream.request.prompt_ids)
        if stream._completion is None:  # ended while its prompt was being fed
            held = ids[: stream._fed]
        else:
            generation = stream._completion.generation
            ids += generation.generated_ids
            # What the slot's cache holds: positions 0 .. end_pos - 1.
            held = ids[: generation.end_pos]
        if reason == "error":
            held = []  # an error may have come between a cache write and its count
        self._free.append((stream._slot, held))
        if self._on_piece is not None:
            self._on_piece(stream, None)


def complete_all(session, requests: Sequence[Request], n_slots: int = 4,
                 progress: bool = False) -> list[Stream]:
    """Run `requests` through a `Scheduler` of n_slots and return their finished streams, in
    the order given (vLLM's `LLM.generate(prompts)` shape); `progress`: a tqdm bar on stderr
    counting finished requests."""
    finished = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", leave=False)

    def on_piece(stream, piece):
        if piece is None:
            finished.append(stream)
            if bar is not None:
                bar.update(1)

    scheduler = Scheduler(session, n_slots=n_slots, on_piece=on_piece)
    streams = [scheduler.submit(r) for r in requests]
    try:
        scheduler.run()
    finally:
        if bar is not None:
            bar.close()
    return streams
