"""The KV cache types on an accelerator (a GPU: XLA's programs, no CPU kernels), checked by
hand where one is lent (CI has none): the JAX backend's logits on each type against the NumPy
reference holding the same type (graph and fused decode), prefill chunks against decode, the
device loop's greedy ids against the graph's, and the bytes XLA writes for q8_0 / f16 / bf16
against `jllama.model.cache_types`' NumPy encoders. Prints one JSON object (the tolerances to judge
it by are tests/test_cache_types_backends.py's TOLERANCE).

Usage: PYTHONPATH=. python tests/device_cache_types_check.py
"""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jllama.model import cache_types
from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.graphs import cache_rows
from jllama.graphs.attention import write_positions
from jllama.model.weights import random_weights

out = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
KV = ModelConfig(dim=128, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                 seq_len=300, shared_weights=False)
w = random_weights(KV, seed=1, scale=0.08)
toks = [int(t) for t in np.random.default_rng(0).integers(0, 300, 48)]
rows = (np.random.default_rng(3).standard_normal((2, 5, 64)) * 3).astype(np.float32)
blk = jnp.zeros((2, 16, 68), jnp.uint8)
got = np.asarray(jax.jit(lambda b, r, p: write_positions((b,), (r,), p)[0])(blk, rows, jnp.int32(7)))
out["q8_0_bytes_equal"] = bool(np.array_equal(got[:, 7:12], cache_types.quantize_q8_0(rows)))
for t in ("f16", "bf16"):
    e = np.asarray(cache_rows.encode(jnp.asarray(rows), cache_types.cache_type(t).dtype))
    out[f"{t}_bytes_equal"] = bool(np.array_equal(e.view(np.uint16),
                                                  cache_types.encode(rows, t).view(np.uint16)))
for pair in [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "f16")]:
    t0 = time.time()
    ref = make_backend("numpy", cache_type_k=pair[0], cache_type_v=pair[1])
    ref.prepare(KV, w)
    r = np.stack([ref.forward(t, p) for p, t in enumerate(toks)])
    res = {}
    for decode in ("graph", "fused"):
        b = make_backend("jax", cache_type_k=pair[0], cache_type_v=pair[1], decode=decode)
        b.prepare(KV, w)
        res[decode + "_vs_numpy"] = float(np.abs(np.stack([b.forward(t, p) for p, t in enumerate(toks)]) - r).max())
    res["platform"], res["matvec"] = b.platform, b.matvec
    b = make_backend("jax", cache_type_k=pair[0], cache_type_v=pair[1])
    b.prepare(KV, w)
    t36 = [int(t) for t in np.random.default_rng(7).integers(0, 300, 36)]
    rows_p = b.prefill_logits(t36, 240)
    one = np.stack([b.forward(t, 240 + i) for i, t in enumerate(t36)])
    res["prefill_vs_decode"] = float(np.abs(rows_p - one).max())
    token, pos, looped = 7, 250, []
    while len(looped) < 12:
        ids, fin = b.decode_loop(token, pos, 12 - len(looped))
        looped += ids
        token, pos = ids[-1], pos + len(ids)
    token, graph = 7, []
    for pos in range(250, 262):
        token = int(np.argmax(b.forward(token, pos)))
        graph.append(token)
    res["loop_equals_graph"] = looped == graph
    res["seconds"] = round(time.time() - t0, 1)
    out["_".join(pair)] = res
print(json.dumps(out, indent=1))
