"""The jax backend's batched decode step: one token for each of B sequences, each on its own KV
cache (`jllama.backends.base.BatchDecode`).

With jllama's CPU kernels (matvec="kernel", one device; float32, bfloat16, int8 or GGML
weights) the step runs `graphs.batch`'s programs: per layer one `layer_batch` (the products
read each weight once for all B rows), then `classifier_batch`. Row b's logits have the bits
`forward` gives for that sequence alone (the same kernels' sums in the same order; tests/
test_batch_decode.py), whatever B is. Batches are padded up to one of `graphs.batch.
BATCH_SIZES` with rows the kernels skip, so the programs compile once per size and cache
window (the largest `graphs.attention_blocks` among the sequences) and never as requests come
and go.

With XLA's products (matvec="xla": any platform, one device or split over a mesh as the
single step is) the step is one program, `graphs.decode_batch_step` (all layers and the
classifier for the B rows: a matrix product per weight, each row's attention over its own
blocks), then `graphs.write_rows` per group of sequences (their blocks donated, written in
place; groups of powers of two, `write_groups`).
Padded and compiled as above; a row's logits equal `forward`'s up to float rounding, not bit
for bit (tests/test_batch_xla.py). Otherwise (the kernels' products with weights
`matvec_batch` does not take) the step is `forward` per sequence on its caches: the same
logits, no faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jllama import graphs
from jllama.kernels import batched
from jllama.backends.base import check_token_pos
from jllama.backends.jax_state import JaxState
from jllama.graphs.attention import windowed
from jllama.graphs.cache_rows import kernel_reads
from jllama.graphs.batch import BATCH_SIZES, classifier_batch, layer_batch
from jllama.model.ggml_matrix import embedding_rows


XLA_BLOCK_READS = 256
"""The most (row, cache block) pairs one `graphs.decode_batch_step` call reads per layer: its
program holds one attention per row over its K blocks, unrolled, so a batch at long windows
runs in parts of fewer rows (32 rows at K <= 8, 8 rows at K = 32: SmolLM2's 8192 positions)."""


def write_groups(b: int) -> list[int]:
    """The sizes, powers of two, largest first, that b sequences' cache writes run in
    (`graphs.write_rows`): 7 -> [4, 2, 1]. At most six programs, each compiled once, serve
    every b up to 63; one to six calls a step."""
    return [1 << i for i in reversed(range(b.bit_length())) if b >> i & 1]


def batch_size(b: int) -> int:
    """The compiled batch size a batch of b (1 <= b <= max(BATCH_SIZES)) runs in."""
    return next(size for size in BATCH_SIZES if size >= b)


class BatchSteps(JaxState):
    """`decode_batch` of `JaxGraphBackend`, over the state `jax_state.JaxState` names."""

    _pad_blocks: list

    def batch_kernels(self) -> bool:
        """Whether `decode_batch` runs the batched programs (else `forward` per sequence)."""
        config = self._prepared("decode_batch")
        if self.matvec != "kernel" or self.tensor_parallel is not None or config.moe:
            return False  # a MoE model: `forward` per sequence (no batched MoE programs yet)
        if windowed(config):  # the batched kernels' attention has no sliding window
            return False
        if not kernel_reads(*self._zero_blocks):  # a KV cache type the kernel does not read
            return False
        layer = self.layers[0]
        return all(batched.batch_supported(w) for w in
                   (layer.wqkv, layer.wo, layer.w1, layer.w2, layer.w3, self.wcls))

    def decode_batch(
        self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[object]
    ) -> np.ndarray:
        """Logits f32[B, vocab_size]: row b is what `forward(tokens[b], positions[b])` returns
        on `caches[b]` (from `new_caches`, or the ones `use_caches` returned), and each
        caches[b] is updated as that forward would update it. The caches in use
        (`use_caches`) stay in use.

        Raises:
          ValueError: lengths that differ, an empty batch, a token or position out of range,
            or one cache given twice.
          RuntimeError: before `prepare`.
        """
        config = self._prepared("decode_batch")
        tokens, positions, caches = list(tokens), list(positions), list(caches)
        if not len(tokens) == len(positions) == len(caches):
            raise ValueError("decode_batch: tokens, positions and caches differ in length")
        if not tokens:
            raise ValueError("decode_batch: no sequences")
        if len({id(c[0]) for c in caches}) != len(caches):
            raise ValueError("decode_batch: a sequence's caches given twice")
        pairs = [check_token_pos(config, t, p) for t, p in zip(tokens, positions, strict=True)]
        if self.batch_kernels():
            top, part = BATCH_SIZES[-1], self._decode_part
        elif self.batch_xla():
            k = max(graphs.attention_blocks(config.seq_len, p) for _, p in pairs)
            top = max([s for s in BATCH_SIZES if s * k <= XLA_BLOCK_READS] or [1])
            part = self._decode_xla_part
        else:
            return self._decode_each(pairs, caches)
        rows = [part(pairs[i:i + top], caches[i:i + top]) for i in range(0, len(pairs), top)]
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def batch_xla(self) -> bool:
        """Whether `decode_batch` runs `graphs.decode_batch_step` (XLA's products: one
        program for the batch), where `batch_kernels` is False; never for a
        Mixture-of-Experts model, nor one whose sliding window is shorter than the context
        (`forward` per sequence: its attention masks the window)."""
        config = self._prepared("decode_batch")
        return self.matvec == "xla" and not config.moe and not windowed(config)

    def batch_attention(self) -> str:
        """How `graphs.decode_batch_step` runs the rows' attention (`graphs.batch_xla.
        ATTENTION`): "rows" on a CPU, "stacked" on an accelerator; the attribute
        `xla_batch_attention`, where set, overrides it (tests)."""
        chosen = getattr(self, "xla_batch_attention", None)
        return chosen or ("rows" if self.device.platform == "cpu" else "stacked")

    def _decode_xla_part(self, pairs, caches) -> np.ndarray:
        """At most max(BATCH_SIZES) sequences through `graphs.decode_batch_step`, then their
        new keys and values written by `graphs.write_rows` (their blocks donated), a call per
        group of `write_groups`."""
        config = self.config
        live = len(pairs)
        size = batch_size(live)
        bl = self.block_length
        pos = np.zeros(size, np.int32)
        pos[:live] = [p for _, p in pairs]
        k = max(graphs.attention_blocks(config.seq_len, int(p)) for p in pos[:live])
        x = np.zeros((size, config.dim), np.float32)
        x[:live] = embedding_rows(self.token_embedding_table,
                                  np.array([t for t, _ in pairs], np.int64))
        cur = [int(p) // bl for p in pos[:live]]
        key_zero, value_zero = self._zero_blocks

        def rows(side: int, zero) -> tuple:
            """Per layer, per row, its K blocks: its own up to its current one, then zeros."""
            return tuple(
                tuple(tuple(c[side][l][j] if j <= cur[b] else zero for j in range(k))
                      for b, c in enumerate(caches))
                + ((zero,) * k,) * (size - live)
                for l in range(len(self.layers))
            )

        programs = self._programs
        logits, new_k, new_v = programs.decode_batch_step(
            config, self._put(x), self._put(pos), self.layers, rows(0, key_zero),
            rows(1, value_zero), self.inv_freq, self.rms_final_weight, self.wcls,
            shards=self._shards, attention=self.batch_attention(),
        )
        start = 0
        for group in write_groups(live):
            rows = range(start, start + group)
            start += group
            written_k, written_v = programs.write_rows(
                config, tuple(tuple(kc[cur[b]] for kc in caches[b][0]) for b in rows),
                tuple(tuple(vc[cur[b]] for vc in caches[b][1]) for b in rows),
                tuple(new_k[b] for b in rows), tuple(new_v[b] for b in rows),
                self._put(pos[rows.start:rows.stop]),
            )
            for b, keys, values in zip(rows, written_k, written_v, strict=True):
                for kc, vc, key, value in zip(caches[b][0], caches[b][1], keys, values,
                                              strict=True):
                    kc[cur[b]], vc[cur[b]] = key, value
        return np.asarray(logits)[:live]

    def _decode_each(self, pairs, caches) -> np.ndarray:
        """The step as `forward` per sequence on its caches."""
        previous = (self.key_cache, self.value_cache)
        out = []
        try:
            for (token, pos), c in zip(pairs, caches, strict=True):
                self.key_cache, self.value_cache = c
                out.append(self.forward(token, pos))
        finally:
            self.key_cache, self.value_cache = previous
        return np.stack(out)

    def _pads(self, n: int) -> list:
        """n (key, value) block pairs the padding rows hand the kernel (distinct, never
        read or written)."""
        if not hasattr(self, "_pad_blocks"):
            self._pad_blocks = []
        while len(self._pad_blocks) < n:
            key_zero, value_zero = self._zero_blocks
            self._pad_blocks.append((jax.numpy.zeros_like(key_zero),
                                     jax.numpy.zeros_like(value_zero)))
        return self._pad_blocks[:n]

    def _decode_part(self, pairs, caches) -> np.ndarray:
        """At most max(BATCH_SIZES) sequences through the batched programs."""
        config = self.config
        live = len(pairs)
        size = batch_size(live)
        bl = self.block_length
        tokens = np.array([t for t, _ in pairs], np.int64)
        pos = np.zeros(size, np.int32)
        pos[:live] = [p for _, p in pairs]
        k = max(graphs.attention_blocks(config.seq_len, int(p)) for p in pos[:live])
        x = np.zeros((size, config.dim), np.float32)
        x[:live] = embedding_rows(self.token_embedding_table, tokens)
        x = self._put(x)
        pos_arr = self._put(pos)
        count = self._put(np.int32(live))
        cur = [int(p) // bl for p in pos[:live]]
        self._pads(size - live)
        key_zero, value_zero = self._zero_blocks
        for l, layer in enumerate(self.layers):
            key_current, value_current, key_blocks, value_blocks = [], [], [], []
            for b, (keys, values) in enumerate(caches):
                kc, vc = keys[l], values[l]
                key_current.append(kc[cur[b]])
                value_current.append(vc[cur[b]])
                key_blocks.extend(kc[j] if j < cur[b] else key_zero for j in range(k))
                value_blocks.extend(vc[j] if j < cur[b] else value_zero for j in range(k))
            for kp, vp in self._pad_blocks[:size - live]:
                key_current.append(kp)
                value_current.append(vp)
                key_blocks.extend([key_zero] * k)
                value_blocks.extend([value_zero] * k)
            x, new_keys, new_values = layer_batch(
                config, x, count, pos_arr, layer, self.inv_freq, tuple(key_current),
                tuple(value_current), tuple(key_blocks), tuple(value_blocks),
            )
            for b, (keys, values) in enumerate(caches):
                keys[l][cur[b]] = new_keys[b]
                values[l][cur[b]] = new_values[b]
            for i in range(size - live):
                self._pad_blocks[i] = (new_keys[live + i], new_values[live + i])
        logits = classifier_batch(config, x, count, self.rms_final_weight, self.wcls)
        return np.asarray(logits)[:live]
