"""The batched decode step with XLA's products (matvec="xla", issue 38): one program
(`jllama.graphs.decode_batch_step`) for B sequences at their own positions on their own caches.

What is and is not bit-identical on this path (measured on stories260K and a GQA model; the
assertions below hold it):
  - a row's logits against `forward` of that sequence alone: not bit-identical (the products
    are XLA matrix products of B rows, `forward`'s are matrix-vector products whose sums run
    in another order): within 1e-4, and the greedy tokens are the same;
  - the keys and values written to the caches: not bit-identical to forward's either (from the
    same products), within 1e-5;
  - a row beside other sequences in the same compiled batch size (the same program): the same
    bits whatever the neighbours are and however many of the size's rows are real;
  - a row in another batch size (another program): `test_batch_sizes_measured` records whether
    XLA's product gives the same bits (it does not promise to).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_prefill import _compiles  # the programs compiled inside a `with` block

from jllama.backends import make_backend
from jllama.backends.jax_batch import batch_size, write_groups
from jllama.engine import Request, complete_all
from jllama.generation.session import Session
from jllama.model.config import ModelConfig
from jllama.model.loading import open_model
from jllama.model.weights import random_weights
from jllama.sampling import SamplerConfig

GQA = ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300,
                  seq_len=512, shared_weights=False)
"""kv_mul 4, two cache blocks of 256 positions. The backend tests below run at windows of two
blocks (positions 256 and on) in batch sizes 1, 2 and 4, so they share three compiled
programs, 4 the largest (the program's compile grows with the rows: one attention each)."""


@pytest.fixture(scope="module")
def gqa_xla():
    b = make_backend("jax", matvec="xla")
    b.prepare(GQA, random_weights(GQA, seed=4, scale=0.1))
    return b


def _prefilled(backend, prompts):
    """A new cache per prompt, the prompt fed into it (the caches in use kept)."""
    before = backend.use_caches(backend.new_caches())
    caches = []
    for prompt in prompts:
        c = backend.new_caches()
        if prompt:
            backend.use_caches(c)
            backend.prefill(prompt, 0)
        caches.append(c)
    backend.use_caches(before)
    return caches


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def _greedy_against_alone(b, lengths, steps):
    """Sequences of prompts of `lengths` decoded greedily `steps` steps in one batch and each
    alone: the same tokens; each row's logits within 1e-4 of forward's, the caches within
    1e-5."""
    prompts = _prompts(b.config.vocab_size, lengths, seed=1)
    alone, batched = _prefilled(b, prompts), _prefilled(b, prompts)
    in_use = b.use_caches(b.new_caches())
    b.use_caches(in_use)
    tokens = [p[-1] for p in prompts]
    pos = [n - 1 for n in lengths]
    alone_tokens, batch_tokens = [], []
    worst = 0.0
    for _ in range(steps):
        out = b.decode_batch(tokens, pos, batched)
        refs = []
        for i, c in enumerate(alone):
            b.use_caches(c)
            refs.append(b.forward(tokens[i], pos[i]))
        b.use_caches(in_use)
        worst = max(worst, max(float(np.abs(o - r).max()) for o, r in zip(out, refs)))
        alone_tokens.append([int(np.argmax(r)) for r in refs])
        batch_tokens.append([int(np.argmax(o)) for o in out])
        tokens, pos = batch_tokens[-1], [p + 1 for p in pos]
        assert alone_tokens == batch_tokens
    assert worst < 1e-4, worst
    for a, c in zip(alone, batched, strict=True):
        for la, lc in zip(a[0] + a[1], c[0] + c[1], strict=True):
            for blk in range(len(la)):
                if list.__getitem__(la, blk) is not None:
                    np.testing.assert_allclose(np.asarray(lc[blk]), np.asarray(la[blk]),
                                               atol=1e-5)


def test_greedy_tokens_equal_each_sequence_decoded_alone(gqa_xla):
    """Four sequences (two in windows of two blocks, one crossing the first block's end at
    its fourth step) decoded greedily for 4 steps in one batch, as each alone."""
    assert gqa_xla.batch_xla() and not gqa_xla.batch_kernels()
    assert gqa_xla.batch_attention() == "rows"  # on a CPU
    _greedy_against_alone(gqa_xla, [8, 254, 257, 264], steps=4)


def test_the_stacked_attention_of_an_accelerator(gqa_xla):
    """The attention an accelerator runs (the rows' blocks stacked, one batched attention per
    layer), here on the CPU: the tokens of each sequence alone too."""
    gqa_xla.xla_batch_attention = "stacked"
    try:
        _greedy_against_alone(gqa_xla, [8, 257, 264], steps=3)
    finally:
        del gqa_xla.xla_batch_attention


def test_a_narrow_kv_cache_type_and_qwen_layers():
    """f16 keys and bfloat16 values (rows rounded as written by `write_rows`, widened as
    read), in a layer with q/k/v biases (Qwen2) and per-head q/k RMSNorms (Qwen3): the greedy
    tokens and (within 1e-4) the logits of each sequence alone."""
    config = dataclasses.replace(GQA, n_layers=1, qkv_bias=True, qk_norm=True)
    b = make_backend("jax", matvec="xla", cache_type_k="f16", cache_type_v="bf16")
    b.prepare(config, random_weights(config, seed=5, scale=0.1))
    alone, batched = _prefilled(b, [[], []]), _prefilled(b, [[], []])  # from position 0
    in_use = b.use_caches(b.new_caches())
    tokens = [3, 250]
    for pos in range(3):
        out = b.decode_batch(tokens, [pos, pos], batched)
        refs = []
        for c, t in zip(alone, tokens, strict=True):
            b.use_caches(c)
            refs.append(b.forward(t, pos))
        b.use_caches(in_use)
        np.testing.assert_allclose(out, np.stack(refs), atol=1e-4)
        tokens = [int(np.argmax(r)) for r in refs]
        assert tokens == [int(np.argmax(o)) for o in out]
    assert batched[0][0][0][0].dtype == np.float16


def test_the_cache_blocks_are_written_in_place(gqa_xla):
    """Each sequence's current block is donated to `write_rows` and written where it lies
    (no copy of a block per step)."""
    b = gqa_xla
    caches = _prefilled(b, [[1] * 257, [2] * 257])
    blocks = [c[side][l][1] for c in caches for side in (0, 1) for l in range(GQA.n_layers)]
    pointers = [blk.unsafe_buffer_pointer() for blk in blocks]
    b.decode_batch([3, 4], [257, 257], caches)
    now = [c[side][l][1] for c in caches for side in (0, 1) for l in range(GQA.n_layers)]
    assert all(old.is_deleted() for old in blocks)
    assert [blk.unsafe_buffer_pointer() for blk in now] == pointers


def test_writes_run_in_groups_of_powers_of_two():
    assert [write_groups(n) for n in (1, 2, 3, 7, 8, 32)] == [
        [1], [2], [2, 1], [4, 2, 1], [8], [32]]


def test_row_does_not_depend_on_neighbours_in_a_batch_size(gqa_xla):
    """The same sequence beside 2 and then 3 other sequences (batch size 4 both times): the
    same bits."""
    b = gqa_xla
    rows = []
    for n, seed in ((3, 5), (4, 6)):
        assert batch_size(n) == 4
        prompts = [_prompts(300, [264], seed=9)[0]] + _prompts(300, [8, 257, 1][:n - 1], seed)
        caches = _prefilled(b, prompts)
        others = [int(t) for t in np.random.default_rng(seed).integers(0, 300, n - 1)]
        rows.append(b.decode_batch([5] + others, [264] + [len(p) for p in prompts[1:]],
                                   caches)[0])
    assert np.array_equal(rows[0], rows[1])


def test_batch_sizes_measured(gqa_xla):
    """Not promised: the same sequence in batch sizes 1, 2 and 4 (three programs). Prints
    what it measured: whether the rows' bits agree, and the largest difference."""
    b = gqa_xla
    prompt = _prompts(300, [264], seed=11)[0]
    rows = {}
    for n in (1, 2, 4):
        prompts = [prompt] + _prompts(300, [8] * (n - 1), seed=n)
        rows[n] = b.decode_batch([7] * n, [264] + [8] * (n - 1), _prefilled(b, prompts))[0]
    diffs = {n: float(np.abs(rows[n] - rows[1]).max()) for n in rows}
    print("batch sizes against size 1, largest difference:", diffs,
          "; sizes 2 and 4 bit-identical:", np.array_equal(rows[2], rows[4]))
    assert max(diffs.values()) < 1e-4


def test_no_recompilation_as_slots_fill_and_empty(gqa_xla):
    """Batches within a compiled size, at positions within a compiled window, compile
    nothing more."""
    b = gqa_xla
    caches = _prefilled(b, [[1] * 257] * 4)
    b.decode_batch([1] * 4, [257] * 4, caches)  # size 4, two blocks: compiled now
    b.decode_batch([1] * 3, [258] * 3, caches[:3])  # its writes in groups of 2 and 1
    b.decode_batch([1] * 2, [258] * 2, caches[:2])  # size 2
    with _compiles() as compiled:
        for n, pos in ((3, 259), (4, 260), (2, 261), (3, 262), (2, 263)):
            b.decode_batch([2] * n, [pos] * n, caches[:n])
    assert compiled == []


@pytest.fixture(scope="module")
def session_xla():
    model = open_model(seq_len=256)
    return Session.prepare(model, "jax", matvec="xla", device_sampling=False)


def test_scheduler_runs_the_batched_step_with_the_tokens_of_each_alone(session_xla):
    """Greedy requests on stories260K through the engine (2 slots: batches of 2 as requests
    come and go) give the tokens each gives alone; a second run compiles nothing."""
    s = session_xla
    prompts = ["Once upon a time", "Tom had a dog", "The sun was"]
    requests = [Request(s.tokenizer.encode(p), SamplerConfig(temperature=0.0),
                        max_tokens=12 + 4 * i) for i, p in enumerate(prompts)]
    alone = [s.text(r.prompt_ids, r.sampler, max_tokens=r.max_tokens) for r in requests]
    calls = []
    batched = s.backend.decode_batch

    def counted(tokens, positions, caches):
        calls.append(len(tokens))
        return batched(tokens, positions, caches)

    s.backend.decode_batch = counted
    try:
        streams = complete_all(s, requests, n_slots=2)
        assert [x.text for x in streams] == alone
        assert max(calls) == 2
        with _compiles() as compiled:
            streams = complete_all(s, requests[::-1], n_slots=2)
        assert [x.text for x in streams] == alone[::-1]
        assert compiled == []
    finally:
        del s.backend.decode_batch


SPLIT_CHECK = """
import json, sys
import numpy as np
from jllama.backends import make_backend
from jllama.model.config import ModelConfig
from jllama.model.weights import random_weights
config = ModelConfig(**json.loads(sys.argv[1]))
b = make_backend("jax", matvec="xla", devices=2)
b.prepare(config, random_weights(config, seed=4, scale=0.1))
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (3, 30)]
def caches():
    out = []
    for p in prompts:
        c = b.new_caches(); prev = b.use_caches(c); b.prefill(p, 0); b.use_caches(prev)
        out.append(c)
    return out
same, worst = True, 0.0
for attention in ("rows", "stacked"):
    b.xla_batch_attention = attention
    alone, batched = caches(), caches()
    tokens, pos = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    for _ in range(3 if attention == "rows" else 1):
        out = b.decode_batch(tokens, pos, batched)
        refs = []
        for c, t, p in zip(alone, tokens, pos):
            prev = b.use_caches(c); refs.append(b.forward(t, p)); b.use_caches(prev)
        worst = max(worst, max(float(np.abs(o - r).max()) for o, r in zip(out, refs)))
        same = same and [int(np.argmax(o)) for o in out] == [int(np.argmax(r)) for r in refs]
        tokens, pos = [int(np.argmax(r)) for r in refs], [p + 1 for p in pos]
print(json.dumps({"same_tokens": same, "worst": worst, "devices": b.devices,
                  "batch_xla": b.batch_xla(), "w1_sharding": str(b.layers[0].w1.sharding)}))
"""


def test_split_over_two_devices_gives_the_tokens_of_each_alone(tmp_path):
    """The batched step over a mesh of 2 forced CPU devices (weights and caches split as the
    single step's), its attention in either form: greedy tokens equal each sequence's alone
    on the same mesh."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    fields = {f: getattr(GQA, f) for f in ("dim", "hidden_dim", "n_layers", "n_heads",
                                           "n_kv_heads", "vocab_size", "seq_len")}
    run = subprocess.run([sys.executable, "-c", SPLIT_CHECK, json.dumps(fields)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2 and report["batch_xla"]
    assert "model" in report["w1_sharding"]
    assert report["same_tokens"] and report["worst"] < 1e-4, report
