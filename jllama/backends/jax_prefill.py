"""The jax backend's batched prefill: a prompt cut into chunks that go through each layer as
matrix-matrix products (`jllama.graphs.prefill`), the tokens left over through `forward`."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.backends.jax_step import DecodeStep
from jllama.backends.numpy_ref import route
from jllama.graphs import moe
from jllama.model.ggml_matrix import embedding_rows
from jllama.model.rope import rope_cos_sin

PREFILL_CHUNKS = (256, 64, 8)
"""Token counts a prefill chunk may have (compiled shapes); a prompt is cut greedily into
chunks of these sizes (none crossing a 256-position cache block). 256-token chunks: SmolLM2's
512-token prefill ran at 957 tok/s against 730 with chunks of at most 64 (XLA's
matrix-matrix products are more efficient on more rows; bench/NOTES.md). The 2 to 7 tokens
left after them go as one chunk of 8 padded at its end (see `PAD_TOKEN`) where its 8
positions fit in the block and the context; a single token, or a tail that does not fit, goes
through the decode programs."""

PAD_TOKEN = 0
"""The token a padded chunk's rows after the prompt hold. Their keys and values land at
positions after the prompt's, which nothing reads before the tokens of those positions write
them again (attention at p reads positions <= p only), and their logits are not taken: one
pass over the weights for up to 7 tokens where each would take one (an 8B model's ~0.4 s a
pass)."""


class PrefillSteps(DecodeStep):
    """`prefill` and `prefill_logits` of `JaxGraphBackend` (`jllama.backends.base.Prefill`,
    `PrefillLogits`), over the state `jax_state.JaxState` names; the tokens a chunk cannot
    take go through the decode step (`jax_step.DecodeStep.forward`)."""

    def prefill(self, tokens, start_pos: int) -> np.ndarray:
        """Feed `tokens` at positions start_pos, start_pos+1, ... and return the logits
        f32[vocab_size] after the last one (what `forward` of the last token returns, up to
        float rounding: the sums run in another order).

        Chunks of `PREFILL_CHUNKS` tokens go through each layer as matrix-matrix products
        (`jllama.graphs.prefill`), reading each weight once per chunk instead of once per token;
        the remaining tokens go through `forward`.

        Raises:
          ValueError: no tokens, or positions beyond seq_len (as `forward`).
        """
        config = self._prepared("prefill")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("prefill needs at least one token")
        check_token_pos(config, tokens[-1], start_pos + len(tokens) - 1)  # the last position
        for t in tokens:
            check_token_pos(config, t, start_pos)
        logits, x, last = None, None, 0
        for pos, size, real in self._prefill_plan(start_pos, len(tokens)):
            if size:
                x = self._prefill_chunk(self._padded(tokens, pos - start_pos, size, real), pos)
                logits, last = None, real - 1
            else:
                logits = self.forward(tokens[pos - start_pos], pos)
                x = None
        if logits is None:
            logits = np.asarray(self._programs.classifier_last(
                config, x, self.rms_final_weight, self.wcls, self._put(np.int32(last))))
        return logits

    @staticmethod
    def _padded(tokens: list[int], i: int, size: int, real: int) -> list[int]:
        """tokens[i:i + real], then `PAD_TOKEN` up to `size`."""
        return tokens[i:i + real] + [PAD_TOKEN] * (size - real)

    def prefill_logits(self, tokens, start_pos: int, first: int = 0) -> np.ndarray:
        """Feed `tokens` at positions start_pos, start_pos+1, ... as `prefill` does and return
        the logits after each of tokens[first:]: f32[len(tokens) - first, vocab_size], row i
        the prediction that follows tokens[first + i] (what `forward` of that token returns,
        up to float rounding).

        Chunks run `prefill`'s programs and `jllama.graphs.classifier_rows` over their rows
        (chunks wholly before `first` skip the classifier); the tokens left over go through
        `forward`. A sequence started again at start_pos 0 sees only what it writes: attention
        at position p reads cache positions <= p, all written by this call.

        Raises:
          ValueError: no tokens, first outside [0, len(tokens)), or positions beyond seq_len.
        """
        config = self._prepared("prefill_logits")
        tokens = [int(t) for t in tokens]
        if not 0 <= first < len(tokens):
            raise ValueError(f"first={first} must index one of the {len(tokens)} tokens")
        check_token_pos(config, tokens[-1], start_pos + len(tokens) - 1)
        for t in tokens:
            check_token_pos(config, t, start_pos)
        rows = []
        for pos, size, real in self._prefill_plan(start_pos, len(tokens)):
            i = pos - start_pos  # index of the step's first token
            if not size:
                logits = self.forward(tokens[i], pos)
                if i >= first:
                    rows.append(logits[None])
                continue
            x = self._prefill_chunk(self._padded(tokens, i, size, real), pos)
            if i + real > first:
                logits = self._programs.classifier_rows(config, x, self.rms_final_weight,
                                                        self.wcls)
                rows.append(np.asarray(logits)[max(first - i, 0):real])
        return np.concatenate(rows)

    def _prefill_plan(self, start_pos: int, n: int) -> Iterator[tuple[int, int, int]]:
        """(pos, size, real) of each step of a prefill of n tokens from start_pos: a chunk of
        `size` tokens whose first `real` are the prompt's (the rest `PAD_TOKEN`), or one token
        through `forward` when size is 0 (real 1). A chunk never crosses a cache block boundary
        (it writes into one block) nor the context's end."""
        pos, end = start_pos, start_pos + n
        smallest = PREFILL_CHUNKS[-1]
        while pos < end:
            room = min(end - pos, self.block_length - pos % self.block_length)
            size = next((s for s in PREFILL_CHUNKS if s <= room), 0)
            if size:
                yield pos, size, size
                pos += size
                continue
            left = min(end - pos, room)
            fits = (pos % self.block_length + smallest <= self.block_length
                    and pos + smallest <= self.config.seq_len)
            if left >= 2 and fits:  # the tail as one padded chunk
                yield pos, smallest, left
                pos += left
            else:
                yield pos, 0, 1
                pos += 1

    def _prefill_chunk(self, chunk: list[int], pos: int, layers=None) -> jax.Array:
        """The chunk's tokens at positions pos .. pos+len-1 through every layer (or the
        layers of index `layers` only: a warm-up that compiles the programs, `warm_layers`),
        their keys and values written to the caches; returns the residual streams
        f32[len, dim]."""
        config = self.config
        rows = embedding_rows(self.token_embedding_table, np.asarray(chunk))
        x = self._put(rows)
        pos_arr = self._put(np.int32(pos))
        cos, sin = map(self._put, rope_cos_sin(np.arange(pos, pos + len(chunk)), self._inv_freq))
        k = graphs.attention_blocks(config.seq_len, pos + len(chunk) - 1)
        b = pos // self.block_length
        programs = self._programs
        for l in range(len(self.layers)) if layers is None else layers:
            layer, keys, values = self.layers[l], self.key_cache[l], self.value_cache[l]
            q, keys[b], values[b] = programs.qkv_chunk(
                config, x, layer.rms_att_weight, layer.wqkv, keys[b], values[b], pos_arr,
                cos, sin, bqkv=layer.bqkv, q_norm=layer.q_norm, k_norm=layer.k_norm,
                shards=self._shards,
            )
            att = programs.attention_chunk(
                config, q, tuple(keys[:k]), tuple(values[:k]), pos_arr, matvec=self.matvec
            )
            if layer.gate_inp is not None:  # a Mixture-of-Experts FFN
                x = self._moe_chunk(x, att, layer)
                continue
            x = programs.block_chunk(
                config, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3
            )
        return x

    def _moe_chunk(self, x: jax.Array, att: jax.Array, layer) -> jax.Array:
        """A Mixture-of-Experts layer's rest for a chunk, tokens grouped by expert
        (`jllama.graphs.moe`): the router's logits of every row to the host, each row's
        top-k (`numpy_ref.route`, as a decode step), then each routed expert once over the
        rows routed to it, in expert order (so each token's experts add up in the order a
        decode step adds them). x: f32[T, dim], att: f32[T, q_dim] -> f32[T, dim]."""
        config = self.config
        x, h, logits = moe.moe_router_chunk(config, x, att, layer.wo, layer.rms_ffn_weight,
                                            layer.gate_inp)
        logits = np.asarray(logits)
        chunk = logits.shape[0]
        routed: dict[int, list[tuple[int, np.float32]]] = {}
        for t in range(chunk):
            experts, weights = route(logits[t], config.n_experts_per_tok,
                                     config.norm_topk_prob)
            for e, w in zip(experts.tolist(), weights, strict=True):
                routed.setdefault(e, []).append((t, w))
        for e in sorted(routed):
            size = moe.row_bucket(len(routed[e]), chunk)
            rows, weights = np.zeros(size, np.int32), np.zeros(size, np.float32)
            rows[: len(routed[e])] = [t for t, _ in routed[e]]
            weights[: len(routed[e])] = [w for _, w in routed[e]]
            x = moe.moe_expert_rows(config, x, h, self._arg(rows), self._arg(weights),
                                    layer.w1[e], layer.w2[e], layer.w3[e])
        return x
