"""Several sequences in one Session: `Slot`s of KV cache and what switches between them.

A backend with `SlotCaches` keeps a cache per sequence and runs on the one in use; a Session
hands out `Slot`s (`new_slot`) and binds each generation's backend calls to its slot, so
generations in different slots can be stepped in any order (`jllama.engine.Scheduler`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from jllama.backends.base import BatchDecode, CompilePlanning, Prefill, SlotCaches
from jllama.generation.generate import Generation


class Slot:
    """One sequence's KV cache among several of a `Session` (`Session.new_slot`).

    Attributes:
      caches: the backend's caches for it (`SlotCaches.new_caches`).
      active: the last `Generation` started in it, or None.
      generations: how many were started in it.
    """

    def __init__(self, caches):
        self.caches = caches
        self.active: Generation | None = None
        self.generations = 0
        self.ahead = None  # ((token, pos), logits) computed by `decode_batch` for its next step
        # (sampler, vocabulary) of the active generation when `decode_batch` may draw its next
        # token too (a run.c-style `Sampler`; the first `vocabulary` logits, None: all), and
        # (logits, token) so drawn, for the generation's sample call on those very logits.
        self.draw = None
        self.pick = None


def draw_batch(drawn: Sequence[tuple[Slot, np.ndarray]]) -> None:
    """Each slot's next token from its logits row, in one `sample_batch` call: slot.pick =
    (row, token), or None where the row is not finite (the generation's own check then
    raises). A coin is taken from a sampler's generator only where it draws (temperature > 0),
    as `Sampler.sample` takes it. The slots share one Session, so one vocabulary."""
    from jllama.backends.jax_batch import batch_size
    from jllama.graphs.batch import BATCH_SIZES
    from jllama.kernels.batched import sample_batch

    vocabulary = drawn[0][0].draw[1]
    width = drawn[0][1][:vocabulary].shape[0]
    # Rows padded to the batched step's sizes (more than 32: to a multiple of 32), so the
    # program is not compiled again for every number of slots drawing; padding rows are not
    # drawn (count).
    n = len(drawn)
    size = batch_size(n) if n <= BATCH_SIZES[-1] else -(-n // BATCH_SIZES[-1]) * BATCH_SIZES[-1]
    settings = np.zeros((3, size), np.float32)  # temperature, top_p, coin
    block = np.zeros((size, width), np.float32)
    for b, (slot, row) in enumerate(drawn):
        sampler = slot.draw[0]
        settings[0, b], settings[1, b] = sampler.runc_settings
        if settings[0, b] != 0:
            settings[2, b] = sampler.rng.random_f32()
        block[b] = row[:vocabulary]
    tokens, finite = sample_batch(block, settings[0], settings[1], settings[2], np.int32(n))
    for (slot, row), token, ok in zip(drawn, np.asarray(tokens), np.asarray(finite)):
        slot.pick = (row, int(token)) if ok else None


class SlotsMixin:
    """`Session`'s slot handling (its `backend`, `config`, `prefill`, `compile_ahead`, and the
    `_default_slot` / `_current` / `_slotted` it sets up)."""

    @property
    def generations(self) -> int:
        """Generations started so far on the default slot (the backend's own KV cache): each
        may overwrite it (a `Conversation` notices another generation ran since its last turn
        and feeds itself again)."""
        return self._default_slot.generations

    def new_slot(self) -> Slot:
        """A KV cache for one more sequence: `generate(..., slot=...)` runs there, beside the
        others, each generation switching to its own before every backend call (nothing is
        copied: `SlotCaches`).

        Raises:
          BackendError: a backend that keeps one sequence's cache only.
        """
        from jllama.errors import BackendError

        if not isinstance(self.backend, SlotCaches):
            raise BackendError(f"the {self.backend.name} backend keeps one sequence's KV cache; "
                               "several sequences need one with SlotCaches (jax, numpy)")
        self._slotted = True
        return Slot(self.backend.new_caches())

    def _use(self, slot: Slot) -> None:
        """Make `slot`'s caches the backend's (a no-op when they are)."""
        if slot is not self._current:
            self._current.caches = self.backend.use_caches(slot.caches)
            self._current = slot

    def _bound(self, slot: Slot, call):
        """`call` that first switches the backend to `slot`'s caches (several slots only)."""
        if not self._slotted:
            return call

        def on_slot(*args, **kwargs):
            self._use(slot)
            return call(*args, **kwargs)

        return on_slot

    def _slot_sample(self, slot: Slot, sampler, sample, vocabulary: int | None):
        """`sample` for a generation in `slot`, answering with the token `decode_batch` drew
        for the very logits it is given when there is one; sampler: the `Sampler` behind it
        when its draws are run.c's (`runc_settings`), so `decode_batch` may draw them, else
        None (then `sample` as it is)."""
        slot.pick = None
        slot.draw = None
        if not self._slotted or sampler is None or sampler.runc_settings is None:
            return sample
        slot.draw = (sampler, vocabulary)

        def slot_sample(logits, *history):
            pick, slot.pick = slot.pick, None
            if pick is not None and pick[0] is logits:
                return pick[1]
            return sample(logits, *history)

        slot_sample.uses_history = False
        return slot_sample

    def _slot_forward(self, slot: Slot):
        """The backend's `forward` bound to `slot`, answering from the logits `decode_batch`
        computed ahead for that very (token, pos) when there are some."""
        if not self._slotted:
            return self.backend.forward
        forward = self._bound(slot, self.backend.forward)

        def slot_forward(token: int, pos: int):
            ahead, slot.ahead = slot.ahead, None
            if ahead is not None and ahead[0] == (token, pos):
                return ahead[1]
            return forward(token, pos)

        return slot_forward

    def decode_batch(self, inputs: Sequence[tuple[Slot, int, int]]) -> bool:
        """Compute ahead, in one batched step, the logits each slot's generation asks for next:
        `inputs` are (slot, token, pos) with (token, pos) its `Generation.next_input`; each
        slot's next `forward(token, pos)` then returns them without a backend call. Row b is
        bit for bit what that forward returns (`BatchDecode`). The generations that sample as
        run.c does (`Sampler.runc_settings`, no log-probs asked) get their next token drawn
        too, all rows in one kernel call (`jllama.kernels.batched.sample_batch`), each with a
        coin from its own sampler's generator as its own draw would take it: the same token.
        Returns False (and computes nothing) where the backend has no batched step or fewer
        than two slots are given."""
        if len(inputs) < 2 or not isinstance(self.backend, BatchDecode):
            return False
        logits = self.backend.decode_batch([t for _, t, _ in inputs], [p for _, _, p in inputs],
                                           [slot.caches for slot, _, _ in inputs])
        rows = list(logits)
        for row, (slot, token, pos) in zip(rows, inputs):
            slot.ahead = ((token, pos), row)
        drawn = [(slot, row) for row, (slot, _, _) in zip(rows, inputs) if slot.draw is not None]
        if drawn and self.backend.batch_kernels():
            draw_batch(drawn)
        return True

    def feed(self, tokens: Sequence[int], start_pos: int, slot: Slot | None = None) -> None:
        """Put `tokens` at positions start_pos.. into the slot's KV cache and sample nothing
        (a part of a prompt fed ahead of its generation, e.g. a scheduler's prefill chunk):
        batched where the plan's prefill is, compiled first as `generate` would.

        Raises:
          ValueError: no tokens, or positions beyond seq_len.
        """
        tokens = [operator.index(t) for t in tokens]
        if not tokens or start_pos < 0 or start_pos + len(tokens) > self.config.seq_len:
            raise ValueError(f"cannot feed {len(tokens)} tokens at {start_pos} "
                             f"(seq_len={self.config.seq_len})")
        slot = self._default_slot if slot is None else slot
        self._use(slot)
        chunked = self.prefill == "chunked" and isinstance(self.backend, Prefill)
        if self.compile_ahead and isinstance(self.backend, CompilePlanning):
            end = start_pos + len(tokens) - 1
            self.backend.compile_for(len(tokens), end, chunked=chunked, start=start_pos)
        if chunked:
            self.backend.prefill(tokens, start_pos)
        else:
            for i, token in enumerate(tokens):
                self.backend.forward(token, start_pos + i)
