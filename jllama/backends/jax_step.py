"""The jax backend's decode step: one token through the model, logits back to the host.

`graph` mode: for each layer the `qkv`, `attention` and `block` programs with that layer's
arrays (a Mixture-of-Experts layer: `qkv`, `attention`, then `jllama.graphs.moe`'s router
and its routed experts), then `classifier`; `fused` mode: `decode_step` (all layers and the classifier) then
`write_caches` (`jllama.graphs.fused`). The `loop` mode's `forward` is the graph mode's.
"""

from __future__ import annotations

import jax
import numpy as np

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.backends.numpy_ref import route
from jllama.graphs import moe
from jllama.backends.jax_state import JaxState
from jllama.model.ggml_matrix import embedding_rows


class DecodeStep(JaxState):
    """`forward` of `JaxGraphBackend` (`jllama.backends.base.Backend`), over the state
    `jax_state.JaxState` names."""

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits f32[vocab_size] for `token` at `pos` (see `jllama.backends.base.Backend`)."""
        return np.asarray(self._step(token, pos))

    def warm_layers(self) -> tuple[int, ...]:
        """One layer of each kind: the first of every distinct set of program arguments (a
        Q4_K_M file holds ffn_down as Q4_K in some layers and Q6_K in others, and each set
        is a program of its own). Running these layers compiles (or loads) every per-layer
        program a step runs, at 2-3 layers' cost instead of n_layers' (an 8B model's full
        warm-up step is ~0.4 s)."""
        if getattr(self, "_warm_layers", None) is None:
            seen, picks = set(), []
            for l, layer in enumerate(self.layers):
                leaves, tree = jax.tree_util.tree_flatten(layer)
                kind = (tree, tuple((a.shape, str(a.dtype)) for a in leaves))
                if kind not in seen:
                    seen.add(kind)
                    picks.append(l)
            self._warm_layers = tuple(picks)
        return self._warm_layers

    def warm_forward(self, pos: int) -> None:
        """Compile (or load) the decode step's programs for `pos`'s window by running token 0
        at `pos` through `warm_layers` and the classifier (the fused mode's one program runs
        whole). It writes position pos of those layers' caches, which the token of that
        position writes again before anything reads it."""
        config = self._prepared("warm_forward")
        if self.decode == "fused":
            self.forward(0, pos)
            return
        jax.block_until_ready(self._step(0, pos, self.warm_layers()))

    def _step(self, token: int, pos: int, layers=None):
        """`forward`'s logits on the device, through every layer or the layers of index
        `layers` only (`warm_forward`)."""
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
            return logits
        for l in range(len(self.layers)) if layers is None else layers:
            layer, keys, values = self.layers[l], self.key_cache[l], self.value_cache[l]
            q, keys[b], values[b] = programs.qkv(
                config, x, layer.rms_att_weight, layer.wqkv, keys[b], values[b], pos_arr,
                self.inv_freq, bqkv=layer.bqkv, q_norm=layer.q_norm, k_norm=layer.k_norm,
                shards=self._shards, matvec=self.matvec,
            )
            att = programs.attention(
                config, q, tuple(keys[:k]), tuple(values[:k]), pos_arr, matvec=self.matvec
            )
            if layer.gate_inp is not None:  # a Mixture-of-Experts FFN
                x = self._moe_block(x, att, layer)
                continue
            x = programs.block(
                config, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3,
                matvec=self.matvec,
            )
        return programs.classifier(config, x, self.rms_final_weight, self.wcls,
                                   matvec=self.matvec)

    def _moe_block(self, x, att, layer):
        """The rest of a Mixture-of-Experts layer after attention (`jllama.graphs.moe`): the
        router's logits to the host, `numpy_ref.route`'s top-k there, then the routed experts
        in one program call on the device, each with its own matrices only. x: f32[dim] on the device
        -> f32[dim] on the device."""
        config = self.config
        x, h, logits = moe.moe_router(config, x, att, layer.wo, layer.rms_ffn_weight,
                                      layer.gate_inp, matvec=self.matvec)
        experts, weights = route(np.asarray(logits), config.n_experts_per_tok,
                                 config.norm_topk_prob)
        order = np.argsort(experts, kind="stable")  # summed in expert order, as transformers
        chosen = experts[order].tolist()
        return moe.moe_experts(config, x, h, weights[order],
                               tuple(layer.w1[e] for e in chosen),
                               tuple(layer.w2[e] for e in chosen),
                               tuple(layer.w3[e] for e in chosen), matvec=self.matvec)
