"""The jax backend's decode step: one token through the model, logits back to the host.

`graph` mode: for each layer the `qkv`, `attention` and `block` programs with that layer's
arrays, then `classifier`; `fused` mode: `decode_step` (all layers and the classifier) then
`write_caches` (`jllama.graphs.fused`). The `loop` mode's `forward` is the graph mode's.
"""

from __future__ import annotations

import numpy as np

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.backends.jax_state import JaxState
from jllama.quant import embedding_rows


class DecodeStep(JaxState):
    """`forward` of `JaxGraphBackend` (`jllama.backends.base.Backend`), over the state
    `jax_state.JaxState` names."""

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits f32[vocab_size] for `token` at `pos` (see `jllama.backends.base.Backend`)."""
        config = self._prepared("forward")
        token, pos = check_token_pos(config, token, pos)
        x = self._put(embedding_rows(self.token_embedding_table, token))
        pos_arr = self._put(np.int32(pos))
        k = graphs.attention_blocks(config.seq_len, pos)
        b = pos // self.block_length
        programs = self._programs
        if self.decode == "fused":
            logits, new_k, new_v = programs.decode_step(
                config, x, self.layers, tuple(tuple(kc[:k]) for kc in self.key_cache),
                tuple(tuple(vc[:k]) for vc in self.value_cache), pos_arr, self.inv_freq,
                self.rms_final_weight, self.wcls, shards=self._shards, matvec=self.matvec,
            )
            keys, values = programs.write_caches(
                config, tuple(kc[b] for kc in self.key_cache),
                tuple(vc[b] for vc in self.value_cache), new_k, new_v, pos_arr,
            )
            for kc, vc, key, value in zip(self.key_cache, self.value_cache, keys, values,
                                          strict=True):
                kc[b], vc[b] = key, value
            return np.asarray(logits)
        for l, layer in enumerate(self.layers):
            keys, values = self.key_cache[l], self.value_cache[l]
            q, keys[b], values[b] = programs.qkv(
                config, x, layer.rms_att_weight, layer.wqkv, keys[b], values[b], pos_arr,
                self.inv_freq, shards=self._shards, matvec=self.matvec,
            )
            att = programs.attention(
                config, q, tuple(keys[:k]), tuple(values[:k]), pos_arr, matvec=self.matvec
            )
            x = programs.block(
                config, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3,
                matvec=self.matvec,
            )
        logits = programs.classifier(config, x, self.rms_final_weight, self.wcls,
                                     matvec=self.matvec)
        return np.asarray(logits)
