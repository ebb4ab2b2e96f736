"""Measurements of tensor-parallel runs, made in a process of its own with several forced host
devices (`tests/test_sharding.py` starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4 and asserts on the JSON it writes).

For each model and device count: greedy tokens and logits of the split backend against the
one-device backend (and, for stories260K, the NumPy reference), in every decode mode and with
chunked prefill; the per-device shard shapes of every array and the contents of device d's
wqkv shard; the bytes each device holds against `jllama.platform.sharding.device_memory`; and the
collectives in the compiled HLO of the per-layer programs.

Usage: python tests/sharded_check.py OUT.json [--quick]
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np

from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.formats.llama2c import read_checkpoint
from jllama.backends.base import Prefill
from jllama.generation.generate import Generation
from jllama.sampling import Sampler
from jllama.platform.sharding import device_memory, qkv_row_order
from jllama.model.weights import cast_weights, random_weights

STORIES260K = Path(__file__).parent.parent / "jllama" / "data" / "stories260K.bin"
# TinyLlama-1.1B's shape (dim 2048, hidden 5632, 32 heads, 4 KV heads, vocabulary 32000,
# an unshared classifier) at two layers instead of 22.
TINYLLAMA_2L = ModelConfig(
    dim=2048, hidden_dim=5632, n_layers=2, n_heads=32, n_kv_heads=4, vocab_size=32000,
    seq_len=64, shared_weights=False,
)
# A shape whose split columns (wo: 64 of 128, w2: 128 of 256) hold whole groups of 32, for
# int8 with group scales (GGUF's Q8_0).
GROUPED = ModelConfig(
    dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64,
    shared_weights=False,
)


def q8_0_weights(config, seed):
    """Random weights with every matrix stored as GGUF Q8_0 would hold it, as a grouped
    `Int8Matrix` (what `--dtype=int8` reads from such a file)."""
    import gguf

    from jllama.formats import ggml_quants
    from jllama.model.quant import Int8Matrix

    weights = random_weights(config, seed=seed, scale=0.1)
    changes = {}
    for name in ("token_embedding_table", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wcls"):
        w = np.ascontiguousarray(getattr(weights, name), np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        q, scale = ggml_quants.int8_groups(raw, ggml_quants.Q8_0, w.shape)
        changes[name] = Int8Matrix(q=q, scale=scale)
    return dataclasses.replace(weights, **changes)


COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def run_tokens(backend, prompt, steps, prefill: bool):
    gen = Generation(
        backend.forward, prompt, Sampler(temperature=0.0), steps,
        prefill=backend.prefill if prefill and isinstance(backend, Prefill) else None,
    )
    list(gen)
    return gen.generated_ids


def logits_along(backend, tokens):
    return np.stack([backend.forward(t, pos) for pos, t in enumerate(tokens)])


def argmax_tokens(logits, prompt_len):
    """The greedy choice at each position after the prompt, from the rows `logits_along` gave
    with the one-device tokens fed: they equal those tokens exactly when a free greedy run's
    tokens do (position by position, the same forward calls on the same inputs)."""
    return [int(np.argmax(row)) for row in logits[prompt_len - 1:]]


def loop_tokens(backend, prompt, steps):
    """Greedy tokens from the on-device loop after feeding the prompt token by token."""
    for pos, t in enumerate(prompt[:-1]):
        backend.forward(t, pos)
    out, token, pos = [], prompt[-1], len(prompt) - 1
    while pos < steps - 1:
        ids, _ = backend.decode_loop(token, pos, steps - 1 - pos)
        out += ids
        pos += len(ids)
        token = ids[-1]
    return out


def shard_facts(backend):
    """Shard shapes per device of layer 0's arrays, wcls and a cache block."""
    layer = backend.layers[0]
    arrays = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)
              if getattr(layer, f.name) is not None}  # a Llama: no bqkv, q_norm, k_norm
    arrays["wcls"] = backend.wcls
    arrays["key_block"] = backend.key_cache[0][0]
    facts = {}
    for name, a in arrays.items():
        if not isinstance(a, jax.Array):  # an Int8Matrix: its values
            a = a.q
        facts[name] = {
            "global": list(a.shape),
            "shard_shape": list(a.sharding.shard_shape(a.shape)),
            "shards": sorted({tuple(s.data.shape) for s in a.addressable_shards}),
            "devices": len({s.device for s in a.addressable_shards}),
        }
    return facts


def wqkv_shards_match(backend, config, weights):
    """Whether device d's wqkv shard holds exactly device d's heads' wq, wk, wv rows."""
    n = backend.devices
    wqkv = backend.layers[0].wqkv
    wqkv = wqkv if isinstance(wqkv, jax.Array) else wqkv.q
    qs, ks = config.q_dim // n, config.kv_dim // n
    full = lambda m: np.asarray(m.q if hasattr(m, "q") else m)
    wq, wk, wv = (full(getattr(weights, f))[0] for f in ("wq", "wk", "wv"))
    ok = []
    for shard in wqkv.addressable_shards:
        d = list(backend.tensor_parallel.mesh.devices.flat).index(shard.device)
        want = np.concatenate([
            wq[d * qs:(d + 1) * qs], wk[d * ks:(d + 1) * ks], wv[d * ks:(d + 1) * ks]
        ])
        ok.append(bool(np.array_equal(np.asarray(shard.data), want)))
    return ok


def bytes_per_device(backend):
    held = {}
    trees = [backend.layers, backend.rms_final_weight, backend.wcls]
    caches = [backend.key_cache, backend.value_cache]
    for kind, tree in (("weights", trees), ("kv_cache", caches)):
        for a in jax.tree.leaves(tree):
            for s in a.addressable_shards:
                key = (str(s.device), kind)
                held[key] = held.get(key, 0) + s.data.nbytes
    out = {}
    for (device, kind), n in held.items():
        out.setdefault(device, {})[kind] = n
    return out


def collectives(backend, config):
    """The collectives (op, result shape) in each per-layer decode program's compiled HLO."""
    tp = backend.tensor_parallel
    programs, layer, n = backend._programs, backend.layers[0], backend.devices
    x = backend._put(np.zeros(config.dim, np.float32))
    att = jax.device_put(np.zeros(config.q_dim, np.float32), tp.by_head)
    q = jax.device_put(np.zeros((config.n_heads, config.head_dim), np.float32), tp.by_head)
    pos = backend._put(np.int32(0))
    blocks = (backend.key_cache[0][0],)
    lowered = {
        "qkv": programs.qkv.lower(
            config, x, layer.rms_att_weight, layer.wqkv, backend.key_cache[0][0],
            backend.value_cache[0][0], pos, backend.inv_freq, shards=n),
        "attention": programs.attention.lower(config, q, blocks, blocks, pos),
        "block": programs.block.lower(
            config, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3),
        "classifier": programs.classifier.lower(config, x, backend.rms_final_weight,
                                                backend.wcls),
    }
    return {name: COLLECTIVE.findall(low.compile().as_text()) for name, low in lowered.items()}


def loop_collectives(backend, prompt):
    """The collectives in the compiled HLO of the loop program (`decode_loop`), lowered with
    the arguments the backend passes it."""
    programs = backend._programs  # a frozen `jllama.graphs.Programs`: swapped, not patched
    real, seen = programs.decode_loop, []

    def spy(*args, **kwargs):
        seen.append(COLLECTIVE.findall(real.lower(*args, **kwargs).compile().as_text()))
        return real(*args, **kwargs)

    backend._programs = dataclasses.replace(programs, decode_loop=spy)
    try:
        backend.decode_loop(prompt[0], 0, 1)
    finally:
        backend._programs = programs
    return seen[0]


def check_model(name, config, weights, counts, prompt, steps, modes, numpy_ref: bool,
                cache=("f32", "f32")):
    """cache: the (key, value) KV cache types of every backend (`jllama.model.cache_types`)."""
    kv = {"cache_type_k": cache[0], "cache_type_v": cache[1]}
    result = {"config": dataclasses.asdict(config), "cache": list(cache), "by_devices": {}}
    one = make_backend("jax", **kv)
    one.prepare(config, weights)
    reference = {
        "tokens": run_tokens(one, prompt, steps, prefill=False),
        "tokens_prefill": run_tokens(one, prompt, steps, prefill=True),
    }
    sequence = prompt + reference["tokens"]
    ref_logits = logits_along(one, sequence[:steps])
    reference["loop"] = loop_tokens(one, prompt, steps) if "loop" in modes else None
    result["single"] = reference
    if numpy_ref:
        ref = make_backend("numpy", **kv)
        ref.prepare(config, weights)
        result["numpy_tokens"] = run_tokens(ref, prompt, steps, prefill=False)
        np_logits = logits_along(ref, sequence[:steps])
        result["single_vs_numpy"] = float(np.max(np.abs(ref_logits - np_logits)))
    del one
    for n in counts:
        entry = {}
        for mode in modes:
            b = make_backend("jax", decode="graph" if mode == "loop" else mode, devices=n,
                             **kv)
            b.prepare(config, weights)
            if mode == "loop":
                entry["loop"] = loop_tokens(b, prompt, steps)
                entry["collectives_loop"] = loop_collectives(b, prompt)
                continue
            logits = logits_along(b, sequence[:steps])
            entry[mode] = {
                # Teacher-forced greedy tokens: equal to the one-device tokens exactly when a
                # free run's are, one pass of forward calls fewer.
                "tokens": argmax_tokens(logits, len(prompt)),
                "tokens_prefill": run_tokens(b, prompt, steps, prefill=True),
                "max_logit_diff": float(np.max(np.abs(logits - ref_logits))),
            }
            if mode == "graph":  # every position's logits from the chunk programs (perplexity)
                rows = b.prefill_logits(sequence[:steps], 0)
                entry[mode]["prefill_logits_diff"] = float(np.max(np.abs(rows - ref_logits)))
            if numpy_ref:
                entry[mode]["max_diff_vs_numpy"] = float(np.max(np.abs(logits - np_logits)))
            if mode == "graph":
                entry["shards"] = shard_facts(b)
                entry["wqkv_shards_match"] = wqkv_shards_match(b, config, weights)
                entry["held"] = bytes_per_device(b)
                predicted = device_memory(config, weights, n, cache)
                entry["predicted"] = {"weights": predicted.weights,
                                      "kv_cache": predicted.kv_cache}
                entry["collectives"] = collectives(b, config)
                entry["row_order_is_permutation"] = bool(np.array_equal(
                    np.sort(qkv_row_order(config, n)), np.arange(config.q_dim + 2 * config.kv_dim)))
            del b
        result["by_devices"][str(n)] = entry
    return result


def main(argv):
    out = Path(argv[1])
    report = {"device_count": jax.device_count()}
    config, weights = read_checkpoint(STORIES260K)
    config = dataclasses.replace(config, seq_len=512)
    # BOS and 11 tokens: chunked prefill runs one chunk of 8, then 3 single tokens.
    prompt = [1, 403, 407, 261, 378, 290, 300, 310, 320, 330, 340, 350]
    report["stories260K"] = check_model(
        "stories260K", config, weights, (2, 4), prompt, 40, ("graph", "fused", "loop"), True)
    report["stories260K_int8"] = check_model(
        "stories260K_int8", config, cast_weights(weights, "int8"), (2,), prompt, 24,
        ("graph",), False)
    report["grouped_q8_0"] = check_model(
        "grouped_q8_0", GROUPED, q8_0_weights(GROUPED, seed=6), (2,), [1, 20, 300, 7, 40], 20,
        ("graph", "fused", "loop"), True)
    # KV cache types split by head as the f32 blocks are (q8_0 keys, bf16 values).
    report["grouped_kv_q8_0_bf16"] = check_model(
        "grouped_kv_q8_0_bf16", GROUPED, random_weights(GROUPED, seed=7, scale=0.1), (2,),
        [1, 20, 300, 7, 40], 20, ("graph", "loop"), True, cache=("q8_0", "bf16"))
    big = random_weights(TINYLLAMA_2L, seed=3)
    report["tinyllama_2l"] = check_model(
        "tinyllama_2l", TINYLLAMA_2L, big, (2, 4), [1, 2000, 31, 7, 4000, 12, 9, 100, 300], 24,
        ("graph", "fused"), False)
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
