"""The jax backend's compile planning: compiling, before a generation, the programs it will
need, so that no compile lands inside the prefill or in the middle of decoding.

What is compiled is remembered in `_compiled` (set by `prepare`), by key: ("forward", k),
("loop", kind, masked, k) and ("prefill", size, k), for k cache blocks read
(`graphs.attention_blocks`).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from jllama import graphs
from jllama.backends.jax_loop import DeviceLoopSteps, all_allowed
from jllama.backends.jax_prefill import PrefillSteps


class CompilePlan(PrefillSteps, DeviceLoopSteps):
    """`compile_for` of `JaxGraphBackend` (`jllama.backends.base.CompilePlanning`): runs the
    prefill chunks, the decode step and the device loop it plans for."""

    def compile_for(
        self, prompt_len: int, last: int, kind: str | None = None, chunked: bool = True,
        start: int = 0, masked: bool = False, verify: bool = False,
    ) -> float:
        """Compile, before a generation, the programs it will need that are not compiled yet:
        the prefill chunk programs of `prompt_len` prompt tokens fed from position `start`
        (one chunk of each size and window it will use; with chunked=False the prompt goes
        through `forward` instead) and the decode programs of every attention window that the
        positions up to `last` grow into (`forward`; with `kind`, one of
        `graphs.SAMPLING_KINDS`, `decode_loop` for the positions after the prompt). Without it
        these compile inside the first prefill and in the middle of decoding (about 1.5 s for
        SmolLM2's loop program at each new window), and the rates printed count the compiles.

        Runs each program not run by `prepare`, `compile_loop` or an earlier `compile_for` once
        on token 0 at a position >= start it will serve: it writes only positions that the
        generation writes again before anything reads them, so a conversation can call it
        before each turn with `start` at the turn's first new position (positions < start
        keep their keys and values). With `verify`, the speculative verification programs
        of the decode positions too (`warm_verify`). Returns the seconds it took (also added
        to `compile_seconds`)."""
        config = self._prepared("compile_for")
        began = time.perf_counter()
        blocks = functools.partial(graphs.attention_blocks, config.seq_len)
        end = min(start + prompt_len, config.seq_len)
        for pos, size, _ in self._prefill_plan(start, (end - start) * chunked):
            key = ("prefill", size, blocks(pos + max(size, 1) - 1))
            if size and key not in self._compiled:
                self._compiled.add(key)
                x = self._prefill_chunk([0] * size, pos, layers=self.warm_layers())
                self._programs.classifier_last(config, x, self.rms_final_weight, self.wcls,
                                               self._put(np.int32(size - 1)))
        first, final = end if chunked else start, min(last, config.seq_len - 1)
        # Where a program can first be needed: the first position, the first after the prompt
        # and each block's first (where the window can grow); not every position.
        starts = range((first // self.block_length + 1) * self.block_length, final + 1,
                       self.block_length)
        for pos in sorted({p for p in (first, end, *starts) if first <= p <= final}):
            if ("forward", blocks(pos)) not in self._compiled:
                self._compiled.add(("forward", blocks(pos)))
                self.warm_forward(pos)
            loop_key = ("loop", kind, masked, blocks(pos))
            if kind is not None and pos >= end and loop_key not in self._compiled:
                self._compiled.add(loop_key)
                bits = all_allowed(config.vocab_size) if masked else None
                self.decode_loop(0, pos, 1, kind=kind, coins=[0.0], allowed_bits=bits)
        if verify and end <= final:
            self.warm_verify(end, final)
        seconds = time.perf_counter() - began
        self.compile_seconds += seconds
        return seconds
