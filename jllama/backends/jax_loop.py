"""The jax backend's device loop (the `loop` decode mode): a chunk of tokens sampled on the
device per call of one compiled program (`jllama.graphs.loop`)."""

from __future__ import annotations

import time

import jax
import numpy as np

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.backends.jax_state import JaxState

LOOP_CHUNK = 16
LOOP_STOP_IDS = 8
"""Tokens one `decode_loop` call samples at most (the compiled loop's capacity): the host sees
tokens in chunks of this many. LOOP_STOP_IDS: the most stop tokens it takes."""


def all_allowed(vocab_size: int) -> np.ndarray:
    """A mask that allows every id (for compiling the masked program)."""
    return np.full((vocab_size + 31) // 32, -1, np.int32)


class DeviceLoopSteps(JaxState):
    """`decode_loop` and `compile_loop` of `JaxGraphBackend` (`jllama.backends.base.DeviceLoop`),
    over the state `jax_state.JaxState` names, plus the device's embedding table the loop looks
    rows up in (`_loop_embedding`: None after `prepare`, placed at the first call)."""

    loop_chunk = LOOP_CHUNK
    _loop_embedding: object

    @property
    def loop_masks(self) -> bool:
        """Whether `decode_loop` takes `allowed_bits`: on one device (not tried over a
        mesh)."""
        return self.tensor_parallel is None

    def decode_loop(
        self,
        token: int,
        pos: int,
        n: int,
        kind: str = "greedy",
        temperature: float = 1.0,
        top_p: float = 1.0,
        coins=None,
        stop_ids=(),
        allowed_bits=None,
    ) -> tuple[list[int], bool]:
        """Feed `token` at `pos` and sample up to min(n, LOOP_CHUNK) tokens after it on the
        device, each fed in turn (`jllama.graphs.decode_loop`).

        Args:
          token, pos: the last chosen token and its position (not yet in the cache).
          n: tokens wanted, >= 1; positions beyond seq_len are never reached (n is capped).
          kind: "greedy", "mult" or "topp" (`jllama.graphs.sample_on_device`);
          temperature, top_p: as `jllama.sampling.Sampler`.
          coins: the random draw (float in [0, 1)) for each sampled token in order, at least
            min(n, LOOP_CHUNK) of them unless greedy.
          stop_ids: tokens that end the chunk when sampled (returned last).
          allowed_bits: None, or a grammar's mask, int32[ceil(vocab_size / 32)] as llguidance
            writes it (`jllama.graphs.decode_loop`): with it, n must be 1.

        Returns:
          (ids, finite): the sampled tokens (ending early after a stop token), and False if
          the loop stopped at logits that are not finite (positions pos .. pos + len(ids) are
          then in the cache).

        Raises:
          ValueError: token or pos out of range, n < 1, too few coins, an unknown kind.
        """
        config = self._prepared("decode_loop")
        token, pos = check_token_pos(config, token, pos)
        if n < 1:
            raise ValueError(f"decode_loop needs n >= 1, got {n}")
        if kind not in graphs.SAMPLING_KINDS:
            raise ValueError(f"kind={kind!r}; known: {', '.join(graphs.SAMPLING_KINDS)}")
        if allowed_bits is not None:
            words = (config.vocab_size + 31) // 32
            allowed_bits = np.asarray(allowed_bits, np.int32)
            if n != 1 or allowed_bits.shape != (words,) or not self.loop_masks:
                raise ValueError(f"decode_loop with a mask samples n=1 token (got {n}) on one "
                                 f"device and takes int32[{words}] bits (got "
                                 f"{allowed_bits.shape})")
            allowed_bits = self._arg(allowed_bits)
        # All positions of one call in one cache block (see `jllama.graphs.loop`).
        n = min(n, LOOP_CHUNK, config.seq_len - pos, self.block_length - pos % self.block_length)
        draws = np.zeros(LOOP_CHUNK, np.float32)
        if kind != "greedy":
            if coins is None or len(coins) < n:
                raise ValueError(f"decode_loop with kind={kind!r} needs {n} coins")
            draws[:n] = np.asarray(coins[:n], np.float32)
        stop_ids = [int(t) for t in stop_ids]
        if len(stop_ids) > LOOP_STOP_IDS:
            raise ValueError(f"decode_loop takes at most {LOOP_STOP_IDS} stop ids")
        # A fixed-size array (padded with -1, never sampled): one compiled shape.
        stops = np.full(LOOP_STOP_IDS, -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        k = graphs.attention_blocks(config.seq_len, pos + n - 1)
        cur = pos // self.block_length
        if self._loop_embedding is None:
            self._loop_embedding = self._place_loop_embedding()

        def others(blocks, zero):  # the first k blocks, zeros in the current one's slot
            return tuple(zero if i == cur else blocks[i] for i in range(k))

        key_zero, value_zero = self._zero_blocks

        arg = self._arg
        out, count, finite, keys, values = self._programs.decode_loop(
            config, arg(np.int32(token)), arg(np.int32(pos)), arg(np.int32(n)),
            self._loop_embedding, self.layers, tuple(kc[cur] for kc in self.key_cache),
            tuple(vc[cur] for vc in self.value_cache),
            tuple(others(kc, key_zero) for kc in self.key_cache),
            tuple(others(vc, value_zero) for vc in self.value_cache), arg(np.int32(cur)), self.inv_freq,
            self.rms_final_weight, self.wcls, arg(np.float32(temperature)), arg(np.float32(top_p)),
            arg(draws), arg(stops), allowed_bits, n_steps=LOOP_CHUNK, kind=kind,
            shards=self._shards, matvec=self.matvec,
        )
        for kc, vc, key, value in zip(self.key_cache, self.value_cache, keys, values,
                                      strict=True):
            kc[cur], vc[cur] = key, value
        count = int(count)
        return [int(t) for t in np.asarray(out)[:count]], bool(finite)

    def _place_loop_embedding(self):
        """The embedding table on the device(s), for the loop's row lookups: the classifier's
        array when the two are shared, else split by vocabulary rows as the classifier is
        over a mesh."""
        if self._shared_embedding:
            return self.wcls
        if self.tensor_parallel is None:
            table = self.token_embedding_table
            if self.matvec == "kernel":  # device_put aliases it, not copies (`packing`)
                from jllama.model.packing import aliasable
                from jllama.platform.runtime import available_cpus

                table = aliasable(table, available_cpus())
            return jax.device_put(table, self.device)
        tp = self.tensor_parallel
        table = self.token_embedding_table
        return tp.put(table, tp.classifier_spec(table))

    def compile_loop(self, kind: str = "greedy", masked: bool = False) -> float:
        """Compile `decode_loop` for `kind` (with a grammar's mask if `masked`) and the first
        cache block, by running it once
        at position 0 (harmless before a sequence starts: position 0 is rewritten by the first
        real step; do not call it in the middle of one). Returns the seconds it took (also
        added to `compile_seconds`). Longer windows compile when the context reaches them."""
        start = time.perf_counter()
        self.decode_loop(0, 0, 1, kind=kind, coins=[0.0],
                         allowed_bits=all_allowed(self.config.vocab_size) if masked else None)
        self._compiled.add(("loop", kind, masked,
                            graphs.attention_blocks(self.config.seq_len, 0)))
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        return seconds
