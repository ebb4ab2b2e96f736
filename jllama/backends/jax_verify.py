"""The jax backend's verification step for speculative decoding (`jllama.backends.base.Verify`):
R consecutive positions of the sequence in use, every row's logits bit-identical to `forward`
of that position alone.

With jllama's CPU kernels (the batched step's conditions, `BatchSteps.batch_kernels`) the step
runs `graphs.verify.layer_verify` per layer and `graphs.batch.classifier_batch`; a run of
positions crossing a cache block boundary is split there (each part one call). Otherwise it is
`forward` per position: the same logits, no faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.backends.jax_batch import BatchSteps
from jllama.graphs.batch import classifier_batch
from jllama.graphs.verify import VERIFY_SIZES, layer_verify
from jllama.model.ggml_matrix import embedding_rows


def verify_size(r: int) -> int:
    """The compiled row count a run of r (2 <= r <= max(VERIFY_SIZES)) positions runs in."""
    return next(size for size in VERIFY_SIZES if size >= r)


class VerifySteps(BatchSteps):
    """`verify` of `JaxGraphBackend`, over the state `jax_state.JaxState` names."""

    def verify(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Logits f32[R, vocab_size] of `tokens` fed at start_pos, start_pos + 1, ... on the
        caches in use: row r has the bits `forward(tokens[r], start_pos + r)` gives after the
        rows before it, and the cache holds what those R forwards would write.

        Raises:
          ValueError: no tokens, a token or position out of range.
          RuntimeError: before `prepare`.
        """
        config = self._prepared("verify")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("verify: no tokens")
        pairs = [check_token_pos(config, t, start_pos + r) for r, t in enumerate(tokens)]
        if len(pairs) == 1 or not self.batch_kernels():
            return np.stack([self.forward(t, p) for t, p in pairs])
        parts, i, bl, top = [], 0, self.block_length, VERIFY_SIZES[-1]
        while i < len(pairs):
            # A part: positions in one cache block, at most `top` of them.
            pos = pairs[i][1]
            n = min(len(pairs) - i, top, bl - pos % bl)
            part = pairs[i:i + n]
            parts.append(self._verify_part(part) if n > 1
                         else self.forward(*part[0])[None])
            i += n
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _verify_part(self, pairs, layers=None) -> np.ndarray:
        """2 .. max(VERIFY_SIZES) positions in one cache block through `layer_verify`, over
        every layer or the layers of index `layers` only (compiling: `warm_layers`)."""
        config = self.config
        live = len(pairs)
        size = verify_size(live)
        tokens = np.array([t for t, _ in pairs], np.int64)
        pos = np.zeros(size, np.int32)
        pos[:live] = [p for _, p in pairs]
        pos[live:] = pos[live - 1]  # padding rows: not computed, any position in the block
        last = int(pos[live - 1])
        k = graphs.attention_blocks(config.seq_len, last)
        cur = last // self.block_length
        x = np.zeros((size, config.dim), np.float32)
        x[:live] = embedding_rows(self.token_embedding_table, tokens)
        x = self._put(x)
        pos_arr = self._put(pos)
        count = self._put(np.int32(live))
        key_zero, value_zero = self._zero_blocks
        for l in range(len(self.layers)) if layers is None else layers:
            layer, keys, values = self.layers[l], self.key_cache[l], self.value_cache[l]
            x, keys[cur], values[cur] = layer_verify(
                config, x, count, pos_arr, layer, self.inv_freq, keys[cur], values[cur],
                tuple(keys[j] if j < cur else key_zero for j in range(k)),
                tuple(values[j] if j < cur else value_zero for j in range(k)),
            )
        logits = classifier_batch(config, x, count, self.rms_final_weight, self.wcls)
        return np.asarray(logits)[:live]

    def warm_verify(self, first: int, final: int) -> None:
        """Compile (or load) the verification programs a generation decoding positions
        first .. final may call: each row count of `VERIFY_SIZES` in each attention window,
        run on token 0 through `warm_layers` at positions it writes again before anything
        reads them. Nothing where `verify` is `forward` per position."""
        config = self._prepared("warm_verify")
        if not self.batch_kernels():
            return
        bl = self.block_length
        starts = {first, *range((first // bl + 1) * bl, final + 1, bl)}
        for pos in sorted(starts):
            for size in VERIFY_SIZES:
                last = pos + size - 1
                key = ("verify", size, graphs.attention_blocks(config.seq_len, last))
                if pos % bl + size > bl or last > final or key in self._compiled:
                    continue
                self._compiled.add(key)
                self._verify_part([(0, pos + r) for r in range(size)], self.warm_layers())
