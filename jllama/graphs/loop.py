"""The `loop` decode mode: up to `n_steps` tokens in one compiled program, sampled on device.

A `lax.while_loop` carries the token, its position and the caches; each iteration looks the
token's embedding row up on the device, runs every layer with the graph mode's traced bodies
(`qkv` with its cache write, `attend_current`, `block`; the graph mode's sums up to order),
the classifier, then samples the next token with `sample_on_device` and records it. The loop
ends after `n` tokens, or after a stop token, or at logits that are not finite; the host
gets a chunk of tokens back per call and no logits at all.

All positions of one call lie in one cache block per layer (the caller cuts chunks at block
boundaries): those blocks are loop-carried buffers that XLA updates in place (the write of a
position happens before that iteration's attention reads it); the layer's earlier blocks are
passed read only, with zeros in the current block's slot (`attend_current`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jllama import kernels
from jllama.model.config import ModelConfig
from jllama.graphs.attention import attend_current
from jllama.graphs.block import block
from jllama.graphs.classifier import classifier
from jllama.graphs.qkv import qkv
from jllama.model.ggml_matrix import GGMLMatrix
from jllama.model.quant import Int8Matrix

SAMPLING_KINDS = ("greedy", "mult", "topp")
"""How `sample_on_device` picks: argmax; one draw from the softmax; one draw from the nucleus."""


def first_true(mask: jax.Array) -> jax.Array:
    """The index of the first True of a bool vector, or its length when there is none.
    A min over indices: XLA CPU runs `jnp.argmax` (a variadic reduce) about 7x slower
    (217 vs 29 us over 49152 logits, measured)."""
    n = mask.shape[0]
    return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), jnp.int32(n)))


def first_max(x: jax.Array) -> jax.Array:
    """The first index of the maximum of a float vector without NaNs (`jnp.argmax`'s answer,
    ties to the lowest index as run.c's strict `>` scan); never beyond the last index."""
    return jnp.minimum(first_true(x == jnp.max(x)), x.shape[0] - 1)


def sample_on_device(
    logits: jax.Array, kind: str, temperature: jax.Array, top_p: jax.Array, coin: jax.Array,
    matvec: str = "xla",
) -> jax.Array:
    """The next token from `logits: f32[vocab_size]`, as `jllama.sampling.Sampler` (run.c's
    `sample`), traced.

    kind (static): "greedy" -> argmax, the first index of the maximum; "mult" ->
    softmax(logits / temperature) and the first token whose cumulative probability exceeds
    `coin`; "topp" -> run.c's `sample_topp`: candidates with probability >= (1 - top_p) /
    (vocab_size - 1), sorted by probability descending (ties by id), kept up to the first
    whose cumulative sum exceeds top_p, then the first kept one whose cumulative sum exceeds
    `coin * kept mass`. temperature, top_p, coin: f32 scalars.

    Returns an int32 scalar. With matvec="kernel" (static) "mult" and "topp" run in jllama's
    CPU kernel (`jllama.kernels.sample`), which does the host sampler's arithmetic in its
    order: the same token for the same logits and coin. Otherwise the sums run in XLA's order
    (its cumulative sums are trees, not run.c's left-to-right loop: over SmolLM2's 49152
    tokens they were off by up to 1e-4) and `exp` is XLA's, so a draw can differ from the
    host sampler's where the coin lands near a probability boundary (measured: one SmolLM2
    draw in ~40). argmax is exact either way.
    """
    if kind == "greedy":
        return first_max(logits)
    if matvec == "kernel" and kind in ("mult", "topp"):
        return kernels.sample(logits, temperature, 1.0 if kind == "mult" else top_p, coin)
    scaled = logits / temperature
    # As `Sampler.sample`: a temperature so small that the division overflows is the limit of
    # a vanishing temperature (the most likely tokens share the mass). XLA CPU flushes a
    # subnormal temperature to 0, so the maxima are set to 0 explicitly (0 / 0 would be NaN).
    top = jnp.max(logits)
    vanishing = jnp.where(logits == top, jnp.float32(0), (logits - top) / temperature)
    scaled = jnp.where(jnp.isfinite(jnp.max(scaled)), scaled, vanishing)
    probs = jax.nn.softmax(scaled)
    n = probs.shape[0]
    if kind == "mult":
        return jnp.minimum(first_true(jnp.cumsum(probs) > coin), n - 1)
    if kind != "topp":
        raise ValueError(f"unknown sampling kind {kind!r}; known: {SAMPLING_KINDS}")
    cutoff = (jnp.float32(1) - top_p) / jnp.float32(n - 1)
    order = jnp.argsort(-probs, stable=True)  # descending, ties by id
    sorted_probs = probs[order]
    n_candidates = jnp.sum(sorted_probs >= cutoff)  # a prefix of the sorted order
    index = jnp.arange(n)
    is_candidate = index < n_candidates
    cdf = jnp.cumsum(jnp.where(is_candidate, sorted_probs, 0))
    over = (cdf > top_p) & is_candidate
    last = jnp.minimum(first_true(over), n_candidates - 1)
    r = coin * cdf[last]
    hit = (cdf > r) & (index <= last)
    i = jnp.minimum(first_true(hit), last)
    picked = order[i]
    # No candidate at all (top_p < 1 / vocab_size): the most likely token, as `sample_topp`.
    return jnp.where(n_candidates > 0, picked, first_max(probs)).astype(jnp.int32)


def _embedding_row(table, token: jax.Array) -> jax.Array:
    # jnp.take with mode="clip" (token is always in range): with the table split by rows over
    # devices (`jllama.platform.sharding`), XLA's partitioner turns this gather into a local lookup
    # plus an all-reduce of one row; `table[token]` made it all-gather the whole table each
    # step (HLO of JAX 0.10.2 read).
    def row(a):
        return jnp.take(a, token, axis=0, mode="clip")

    if isinstance(table, GGMLMatrix):  # only where the kernels are
        return kernels.embedding_rows(table, token[None])[0]
    if isinstance(table, Int8Matrix) and table.grouped:
        return row(table.q).astype(jnp.float32) * jnp.repeat(row(table.scale), table.group_size)
    if isinstance(table, Int8Matrix):
        return row(table.q).astype(jnp.float32) * row(table.scale)
    return row(table).astype(jnp.float32)


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("n_steps", "kind", "shards", "matvec"),
    donate_argnames=("key_cur", "value_cur"),
)
def decode_loop(
    config: ModelConfig,
    token: jax.Array,
    pos: jax.Array,
    n: jax.Array,
    embedding,
    layers: tuple,
    key_cur: tuple,
    value_cur: tuple,
    key_blocks: tuple,
    value_blocks: tuple,
    cur: jax.Array,
    inv_freq: jax.Array,
    rms_final_weight: jax.Array,
    wcls,
    temperature: jax.Array,
    top_p: jax.Array,
    coins: jax.Array,
    stop_ids: jax.Array,
    allowed_bits: jax.Array | None = None,
    *,
    n_steps: int,
    kind: str,
    shards: int = 1,
    matvec: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array, tuple, tuple]:
    """Feed `token` at `pos`, sample the next token, feed it, ... for up to `n` tokens.

    Args:
      config: static.
      token: int32 scalar, the last token already chosen (not yet in the caches).
      pos: int32 scalar, its position.
      n: int32 scalar, 1 <= n <= n_steps: how many tokens to sample; positions pos ..
        pos + n - 1 all lie in cache block `cur`.
      embedding: [vocab_size, dim] float32 / bfloat16 / `Int8Matrix` token embedding table.
      layers, inv_freq, rms_final_weight, wcls: as `jllama.graphs.decode_step`.
      key_cur, value_cur: n_layers arrays, each layer's cache block `cur`; donated, returned
        updated at positions pos .. pos + count - 1.
      key_blocks, value_blocks: n_layers tuples of each layer's first k blocks (k =
        `attention_blocks` of the last position), read only, zeros in slot `cur`.
      cur: int32 scalar, the block index, < k.
      temperature, top_p: f32 scalars (see `sample_on_device`).
      coins: f32[n_steps], the random draw for each sampled token, in order (unused when
        greedy).
      stop_ids: int32[k], tokens that end the loop once sampled (they are recorded).
      allowed_bits: None, or a grammar's mask as llguidance writes it, int32[ceil(vocab_size /
        32)] (bit i % 32 of word i // 32 set where id i may be sampled): the other logits are
        set to -inf before sampling. It holds for every token of the call, so a constrained
        generation calls with n = 1 (a new mask per token).
      n_steps: static, the capacity of one call (the chunk size).
      kind: static, one of `SAMPLING_KINDS`.
      shards: static; wqkv's row groups (as `jllama.graphs.qkv`).
      matvec: static; "xla" or "kernel" (`jllama.graphs.ops.matmul`).

    Returns:
      (tokens int32[n_steps]: the sampled tokens in their first `count` entries,
       count int32: tokens sampled (< n only after a stop token or non-finite logits),
       finite bool: False when the loop stopped at non-finite logits (nothing sampled there),
       key_cur, value_cur).
    """
    c = config

    def layer_pass(x, p, kcs, vcs):
        kcs, vcs = list(kcs), list(vcs)
        for l, layer in enumerate(layers):
            q, kcs[l], vcs[l] = qkv.__wrapped__(
                c, x, layer.rms_att_weight, layer.wqkv, kcs[l], vcs[l], p, inv_freq,
                bqkv=layer.bqkv, q_norm=layer.q_norm, k_norm=layer.k_norm,
                shards=shards, matvec=matvec,
            )
            att = attend_current(
                c, q, key_blocks[l], value_blocks[l], cur, kcs[l], vcs[l], p, matvec
            )
            x = block.__wrapped__(
                c, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3,
                matvec=matvec,
            )
        return x, tuple(kcs), tuple(vcs)

    def cond(carry):
        i, _, _, _, _, stopped, _ = carry
        return (i < n) & ~stopped

    allowed = None
    if allowed_bits is not None:
        # Bit b of word w is id 32 w + b: a broadcast shift, no gather (slow on XLA CPU).
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (allowed_bits[:, None] >> shifts[None, :]) & 1
        allowed = bits.reshape(-1)[: c.vocab_size] != 0

    def body(carry):
        i, tok, p, kcs, vcs, _, out = carry
        x, kcs, vcs = layer_pass(_embedding_row(embedding, tok), p, kcs, vcs)
        logits = classifier.__wrapped__(c, x, rms_final_weight, wcls, matvec=matvec)
        if allowed is not None:
            finite = jnp.all(jnp.isfinite(logits))  # the model's logits, before the mask
            if kind == "greedy" and matvec == "kernel":
                # The kernel reads an inf as a fault: masked ids get the lowest finite value.
                nxt, _ = kernels.argmax(jnp.where(allowed, logits, jnp.finfo(jnp.float32).min))
            else:
                nxt = sample_on_device(jnp.where(allowed, logits, -jnp.inf), kind, temperature,
                                       top_p, coins[i], matvec)
        elif kind == "greedy" and matvec == "kernel":  # both in one kernel call
            nxt, finite = kernels.argmax(logits)
        else:
            finite = jnp.all(jnp.isfinite(logits))
            nxt = sample_on_device(logits, kind, temperature, top_p, coins[i], matvec)
        # Non-finite logits record nothing and stop: the host reports them.
        out = jnp.where(finite, out.at[i].set(nxt), out)
        stopped = ~finite | jnp.any(nxt == stop_ids)
        return i + finite.astype(jnp.int32), nxt, p + 1, kcs, vcs, stopped, out

    init = (
        jnp.int32(0), token.astype(jnp.int32), pos.astype(jnp.int32), tuple(key_cur),
        tuple(value_cur), jnp.bool_(False), jnp.full((n_steps,), -1, jnp.int32),
    )
    count, _, _, key_cur, value_cur, _, out = jax.lax.while_loop(cond, body, init)
    last = out[jnp.maximum(count - 1, 0)]
    finite = (count == n) | ((count > 0) & jnp.any(last == stop_ids))
    return out, count, finite, key_cur, value_cur
