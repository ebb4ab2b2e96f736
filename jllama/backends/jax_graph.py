"""The JAX backend: the compiled programs of `jllama.graphs` assembled into a decode step.

Per token: the embedding row goes to the device, then for each layer the `qkv`, `attention` and
`block` programs run with that layer's arrays, then `classifier`. The four programs are traced
and compiled once (in `prepare`, by a warm-up step) and replayed for every layer and token;
`attention` is compiled once more for each longer window the context grows into
(`graphs.attention_window`: 256, 512, 1024, ... positions). Each layer's KV cache is a list of
blocks of 256 positions (`graphs.attention`), passed whole to the programs.

With `devices=N` (or a `mesh`) the same programs run split over N devices, tensor-parallel
(`jllama.sharding`: every device holds its heads' and hidden units' slice of every layer and
its KV heads' caches; `jllama.graphs.sharded`: the programs with their output layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jllama import graphs
from jllama.backends.base import check_token_pos
from jllama.config import ModelConfig
from jllama import kernels
from jllama.errors import BackendError
from jllama.ggml_matrix import for_xla, is_ggml, repacked
from jllama.quant import embedding_rows
from jllama.packing import pack_in_decode_order
from jllama.rope import rope_cos_sin, rope_frequencies
from jllama.sharding import TensorParallel
from jllama.weights import (
    TransformerWeights,
    check_shapes,
    to_graph_weights,
)

DECODE_MODES = ("graph", "fused", "loop")
"""graph: three compiled programs per layer plus the classifier (the design's per-block
programs); fused: one program for all layers and the classifier, plus one that writes the
caches (`jllama.graphs.fused`); loop: `LOOP_CHUNK` tokens per call of one program that also
samples (`jllama.graphs.loop`, through `decode_loop`; `forward` runs the graph programs). All
give the same greedy tokens."""

LOOP_CHUNK = 16
LOOP_STOP_IDS = 8
"""Tokens one `decode_loop` call samples at most (the compiled loop's capacity): the host sees
tokens in chunks of this many. LOOP_STOP_IDS: the most stop tokens it takes."""

MATVEC = ("auto", "xla", "kernel")
"""How the decode programs compute their matrix-vector products (`jllama.graphs.ops.matmul`):
"kernel": jllama's CPU kernels (`jllama.kernels`); "xla": `jnp.dot`; "auto": the kernels on one
CPU device when they build here, else XLA."""

PREFILL_CHUNKS = (256, 64, 8)
"""Token counts a prefill chunk may have (compiled shapes); a prompt is cut greedily into
chunks of these sizes (none crossing a 256-position cache block) and the fewer-than-8 tokens
left go through the decode programs. 256-token chunks: SmolLM2's 512-token prefill ran at 957
tok/s against 730 with chunks of at most 64 (XLA's matrix-matrix products are more efficient
on more rows; bench/NOTES.md)."""


class LazyBlocks(list):
    """One layer's KV-cache blocks (a list of `count` arrays), each made by `make` the first
    time it is read: a short run of a long-context model allocates only the blocks it reaches
    (SmolLM2's 8192 positions are 377 MB of zeros, about 0.5-1 s to write at start-up)."""

    def __init__(self, count: int, make):
        super().__init__([None] * count)
        self._make = make

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        block = super().__getitem__(index)
        if block is None:
            block = self._make()
            super().__setitem__(index, block)
        return block

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class JaxGraphBackend:
    """Graph-compiled backend over per-layer device arrays and per-layer head-major caches.

    Args:
      device: the `jax.Device` to run on (default: JAX's default device); one device only.
      decode: one of `DECODE_MODES`.
      devices: split the model over this many devices (the first N of `jax.devices()`,
        across every process of a `jax.distributed` run), tensor-parallel as
        `jllama.sharding` lays it out; 1 (the default) runs on `device`.
      mesh: a 1-D `jax.sharding.Mesh` with axis `jllama.sharding.AXIS` to split the model
        over instead (then `devices` is ignored).
      matvec: one of `MATVEC`; resolved to "xla" or "kernel" by `prepare`.

    Raises:
      BackendError: JAX cannot start its default device (e.g. JAX_PLATFORMS names a missing
        platform).
      ShardingError (at `prepare`): the model does not split over the devices
        (`jllama.sharding.check_divisible`), or there are fewer devices than asked.
      KernelBuildError (at `prepare`, a `BackendError`): matvec="kernel" and the kernels do
        not build here, or the model is not on one CPU device.

    Attributes:
      name: "jax".
      compile_seconds: wall time of the warm-up step in `prepare` (tracing + compiling the four
        programs), seconds.
      tensor_parallel: the `jllama.sharding.TensorParallel` layout after `prepare` when split
        over several devices, else None.
      sharding_notes: what `prepare` replicated instead of splitting (one line each).
      matvec: "xla" or "kernel" after `prepare` (the requested mode before).
      matvec_note: why matvec="auto" chose "xla" on a CPU (the kernels' build error, one
        line), or "" when it did not.
    """

    name = "jax"

    def __init__(
        self,
        device: jax.Device | None = None,
        decode: str = "graph",
        devices: int = 1,
        mesh: Mesh | None = None,
        matvec: str = "auto",
    ):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}; known modes: {', '.join(DECODE_MODES)}")
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be an integer >= 1")
        if matvec not in MATVEC:
            raise ValueError(f"matvec={matvec!r}; known: {', '.join(MATVEC)}")
        self.decode = decode
        self.matvec = matvec
        self.matvec_note = ""
        self.weights_note = ""
        self.devices = mesh.size if mesh is not None else devices
        self._mesh = mesh
        self.tensor_parallel: TensorParallel | None = None
        self.sharding_notes: list[str] = []
        self._programs = graphs
        self._shards = 1
        if mesh is not None:
            device = mesh.devices.flat[0]
        if device is None:
            try:
                device = jax.devices()[0]
            except Exception as e:  # JAX reports a missing platform in several ways
                why = str(e) or type(e).__name__
                platforms = os.environ.get("JAX_PLATFORMS")
                hint = f" (JAX_PLATFORMS={platforms}: is that platform installed?)" if platforms else ""
                raise BackendError(f"JAX could not start a device: {why}{hint}") from e
        self.device = device
        self.config: ModelConfig | None = None
        self.compile_seconds = 0.0

    def prepare(self, config: ModelConfig, weights: TransformerWeights) -> None:
        """Convert the weights to the per-layer layout on the device, allocate the caches
        (2 * n_layers arrays of f32[n_kv_heads, seq_len, head_dim]) and compile the programs.

        Weight matrices keep their dtype on the device (float32; bfloat16: half the bytes;
        int8 `jllama.quant.Int8Matrix`: a quarter; both widened to float32 inside each
        product); activations, caches and logits are float32."""
        check_shapes(config, weights)
        if self.devices > 1:
            self._split_over_devices(config)
        self.config = config
        self.matvec = self._resolve_matvec(self.matvec)
        host = to_graph_weights(weights)
        self._shared_embedding = host.token_embedding_table is host.wcls
        if self.matvec != "kernel":
            # XLA's products cannot read GGML blocks: Q8_0 / Q4_0 become grouped int8 (exact),
            # other types float32 (`jllama.ggml_matrix.for_xla`).
            leaves = jax.tree_util.tree_leaves(host, is_leaf=is_ggml)
            converted = {id(m): for_xla(m) for m in leaves if is_ggml(m)}  # a tied table once
            host = jax.tree_util.tree_map(
                lambda m: converted.get(id(m), m), host, is_leaf=is_ggml
            )
            if converted:
                leaves = {id(a): a for a in jax.tree_util.tree_leaves(host)}
                nbytes = sum(a.nbytes for a in leaves.values())
                self.weights_note = (
                    "XLA's products take GGML blocks as grouped int8 (Q8_0, Q4_0) or dequantized "
                    f"float32 (other types), with float32 activations: weights {nbytes / 1e6:.1f} MB"
                )
        elif kernels.vector_width() >= 8:
            # GGML blocks eight rows at a time where the kernels have that path (AVX2 or
            # AVX-512): the same bytes, 2-3x faster products (`jllama.ggml_repack`). The host's
            # embedding table stays as stored (it is only read a row at a time).
            table = host.token_embedding_table
            host = dataclasses.replace(
                jax.tree_util.tree_map(repacked, host, is_leaf=is_ggml),
                token_embedding_table=table,
            )
        # The embedding table stays on the host: one row per token is all a step needs.
        self.token_embedding_table = host.token_embedding_table
        self._host_wcls = host.wcls
        self._loop_embedding = None
        tp = self.tensor_parallel
        if tp is None:
            layers, wcls = host.layers, host.wcls
            if self.device.platform == "cpu":
                # One buffer in reading order, which device_put aliases rather than copies
                # (`jllama.packing`): the matrices end to end stream faster.
                layers, wcls = pack_in_decode_order(layers, wcls)
            self.layers, self.rms_final_weight, self.wcls = jax.device_put(
                (layers, host.rms_final_weight, wcls), self.device
            )
        else:
            # Layer by layer: the regrouped wqkv is a host copy, freed once placed.
            self.layers = tuple(tp.place_layer(config, layer) for layer in host.layers)
            self.rms_final_weight = tp.put(host.rms_final_weight)
            self.wcls = tp.put(host.wcls, tp.classifier_spec(host.wcls))
        self._inv_freq = rope_frequencies(config)  # the host's copy, for prefill's angles
        self.inv_freq = self._put(self._inv_freq)
        # Per layer, a list of cache blocks (`jllama.graphs.attention`): whole arrays, so no
        # program ever copies a window out of a larger cache.
        self.block_length = graphs.block_length(config.seq_len)
        shape = (config.n_kv_heads, self.block_length, config.head_dim)
        count = graphs.n_blocks(config.seq_len)

        where = self.device if tp is None else tp.by_head  # split by KV head

        def blocks():
            if tp is None:
                return LazyBlocks(count, lambda: jnp.zeros(shape, jnp.float32, device=where))
            return [jnp.zeros(shape, jnp.float32, device=where) for _ in range(count)]

        self.key_cache = [blocks() for _ in self.layers]
        self.value_cache = [blocks() for _ in self.layers]
        self._zero_block = jnp.zeros(shape, jnp.float32, device=where)
        start = time.perf_counter()
        # Warm-up: traces and compiles all four programs. Harmless to the sequence that follows:
        # position 0 is rewritten by the first real step and later positions are masked.
        self.forward(0, 0)
        self.compile_seconds = time.perf_counter() - start
        # What compile_for need not run again: ("forward", k), ("loop", kind, k) and
        # ("prefill", size, k) for k cache blocks read.
        self._compiled = {("forward", graphs.attention_blocks(config.seq_len, 0))}

    def _resolve_matvec(self, requested: str) -> str:
        """"xla" or "kernel" for `requested`, building the kernels when they may be used."""
        if requested == "xla":
            return "xla"
        if self.tensor_parallel is not None or self.device.platform != "cpu":
            if requested == "kernel":
                where = ("split over devices" if self.tensor_parallel is not None
                         else f"on {self.device.platform}")
                raise kernels.KernelBuildError(
                    f"matvec=kernel runs on one CPU device only, not {where}"
                )
            return "xla"
        try:
            kernels.load()
        except kernels.KernelBuildError as e:
            if requested == "kernel":
                raise kernels.KernelBuildError(f"matvec=kernel: {e}") from None
            self.matvec_note = str(e)
            return "xla"
        return "kernel"

    def _split_over_devices(self, config: ModelConfig) -> None:
        """Choose the mesh and the layout, and the programs that run under it."""
        from jllama.graphs.sharded import sharded_programs
        from jllama.sharding import check_divisible, tensor_parallel

        if self._mesh is not None:
            self.sharding_notes = check_divisible(config, self._mesh.size)
            self.tensor_parallel = TensorParallel(
                self._mesh, split_classifier=config.vocab_size % self._mesh.size == 0
            )
        else:
            self.tensor_parallel, self.sharding_notes = tensor_parallel(config, self.devices)
            self.device = self.tensor_parallel.mesh.devices.flat[0]
        self._programs = sharded_programs(self.tensor_parallel.mesh)
        self._shards = self.devices

    def _put(self, host):
        """A host array (or scalar) on the device, or replicated over the mesh."""
        if self.tensor_parallel is None:
            return jax.device_put(host, self.device)
        return self.tensor_parallel.put(np.asarray(host))

    def _arg(self, host):
        """A small host argument for a program: passed as is on one device (jit moves it),
        a replicated global array over a mesh (what every process of a multi-process run
        can pass)."""
        return host if self.tensor_parallel is None else self._put(host)

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
        config = self.config
        if config is None:
            raise RuntimeError("JaxGraphBackend.prefill called before prepare")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("prefill needs at least one token")
        check_token_pos(config, tokens[-1], start_pos + len(tokens) - 1)  # the last position
        for t in tokens:
            check_token_pos(config, t, start_pos)
        logits, x = None, None
        for pos, size in self._prefill_plan(start_pos, len(tokens)):
            if size:
                x = self._prefill_chunk(tokens[pos - start_pos:pos - start_pos + size], pos)
                logits = None
            else:
                logits = self.forward(tokens[pos - start_pos], pos)
                x = None
        if logits is None:
            logits = np.asarray(
                self._programs.classifier_last(config, x, self.rms_final_weight, self.wcls)
            )
        return logits

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
        config = self.config
        if config is None:
            raise RuntimeError("JaxGraphBackend.prefill_logits called before prepare")
        tokens = [int(t) for t in tokens]
        if not 0 <= first < len(tokens):
            raise ValueError(f"first={first} must index one of the {len(tokens)} tokens")
        check_token_pos(config, tokens[-1], start_pos + len(tokens) - 1)
        for t in tokens:
            check_token_pos(config, t, start_pos)
        rows = []
        for pos, size in self._prefill_plan(start_pos, len(tokens)):
            i = pos - start_pos  # index of the step's first token
            if not size:
                logits = self.forward(tokens[i], pos)
                if i >= first:
                    rows.append(logits[None])
                continue
            x = self._prefill_chunk(tokens[i:i + size], pos)
            if i + size > first:
                logits = self._programs.classifier_rows(config, x, self.rms_final_weight,
                                                        self.wcls)
                rows.append(np.asarray(logits)[max(first - i, 0):])
        return np.concatenate(rows)

    def _prefill_plan(self, start_pos: int, n: int):
        """(pos, size) of each step of a prefill of n tokens from start_pos: a chunk of
        `size` tokens, or one token through `forward` when size is 0. A chunk never crosses a
        cache block boundary (it writes into one block)."""
        pos, end = start_pos, start_pos + n
        while pos < end:
            room = min(end - pos, self.block_length - pos % self.block_length)
            size = next((s for s in PREFILL_CHUNKS if s <= room), 0)
            yield pos, size
            pos += size or 1

    def _prefill_chunk(self, chunk: list[int], pos: int) -> jax.Array:
        config = self.config
        rows = embedding_rows(self.token_embedding_table, np.asarray(chunk))
        x = self._put(rows)
        pos_arr = self._put(np.int32(pos))
        cos, sin = map(self._put, rope_cos_sin(np.arange(pos, pos + len(chunk)), self._inv_freq))
        k = graphs.attention_blocks(config.seq_len, pos + len(chunk) - 1)
        b = pos // self.block_length
        programs = self._programs
        for l, layer in enumerate(self.layers):
            keys, values = self.key_cache[l], self.value_cache[l]
            q, keys[b], values[b] = programs.qkv_chunk(
                config, x, layer.rms_att_weight, layer.wqkv, keys[b], values[b], pos_arr,
                cos, sin, shards=self._shards,
            )
            att = programs.attention_chunk(
                config, q, tuple(keys[:k]), tuple(values[:k]), pos_arr, matvec=self.matvec
            )
            x = programs.block_chunk(
                config, x, att, layer.wo, layer.rms_ffn_weight, layer.w1, layer.w2, layer.w3
            )
        return x

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

        Returns:
          (ids, finite): the sampled tokens (ending early after a stop token), and False if
          the loop stopped at logits that are not finite (positions pos .. pos + len(ids) are
          then in the cache).

        Raises:
          ValueError: token or pos out of range, n < 1, too few coins, an unknown kind.
        """
        config = self.config
        if config is None:
            raise RuntimeError("JaxGraphBackend.decode_loop called before prepare")
        token, pos = check_token_pos(config, token, pos)
        if n < 1:
            raise ValueError(f"decode_loop needs n >= 1, got {n}")
        if kind not in graphs.SAMPLING_KINDS:
            raise ValueError(f"kind={kind!r}; known: {', '.join(graphs.SAMPLING_KINDS)}")
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
            shared = self._shared_embedding
            if shared:
                self._loop_embedding = self.wcls
            elif self.tensor_parallel is None:
                self._loop_embedding = jax.device_put(self.token_embedding_table, self.device)
            else:  # split by vocabulary rows, as the classifier
                tp = self.tensor_parallel
                table = self.token_embedding_table
                self._loop_embedding = tp.put(table, tp.classifier_spec(table))
        def others(blocks):  # the first k blocks, zeros in the current one's slot
            return tuple(self._zero_block if i == cur else blocks[i] for i in range(k))

        arg = self._arg
        out, count, finite, keys, values = self._programs.decode_loop(
            config, arg(np.int32(token)), arg(np.int32(pos)), arg(np.int32(n)),
            self._loop_embedding, self.layers, tuple(kc[cur] for kc in self.key_cache),
            tuple(vc[cur] for vc in self.value_cache),
            tuple(others(kc) for kc in self.key_cache),
            tuple(others(vc) for vc in self.value_cache), arg(np.int32(cur)), self.inv_freq,
            self.rms_final_weight, self.wcls, arg(np.float32(temperature)), arg(np.float32(top_p)),
            arg(draws), arg(stops), n_steps=LOOP_CHUNK, kind=kind, shards=self._shards,
            matvec=self.matvec,
        )
        for kc, vc, key, value in zip(self.key_cache, self.value_cache, keys, values,
                                      strict=True):
            kc[cur], vc[cur] = key, value
        count = int(count)
        return [int(t) for t in np.asarray(out)[:count]], bool(finite)

    def compile_loop(self, kind: str = "greedy") -> float:
        """Compile `decode_loop` for `kind` and the first cache block, by running it once
        at position 0 (harmless before a sequence starts: position 0 is rewritten by the first
        real step; do not call it in the middle of one). Returns the seconds it took (also
        added to `compile_seconds`). Longer windows compile when the context reaches them."""
        start = time.perf_counter()
        self.decode_loop(0, 0, 1, kind=kind, coins=[0.0])
        self._compiled.add(("loop", kind, graphs.attention_blocks(self.config.seq_len, 0)))
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        return seconds

    def compile_for(
        self, prompt_len: int, last: int, kind: str | None = None, chunked: bool = True,
        start: int = 0,
    ) -> float:
        """Compile, before a generation, the programs it will need that are not compiled yet:
        the prefill chunk programs of `prompt_len` prompt tokens fed from position `start`
        (one chunk of each size and window it will use; with chunked=False the prompt goes
        through `forward` instead) and the decode programs of every attention window that the
        positions up to `last` grow into (`forward`; with `kind`, one of
        `graphs.SAMPLING_KINDS`, `decode_loop` for the positions after the prompt). Without it
        these compile inside the first prefill and in the middle of decoding (about 1.5 s for
        SmolLM2's loop program at each new window), and the rates printed count the compiles.

        Runs each program not run by `prepare`, `compile_loop` or an earlier `compile_for` once
        on token 0 at a position >= start it will serve: it writes only positions that the
        generation writes again before anything reads them, so a conversation can call it
        before each turn with `start` at the turn's first new position (positions < start
        keep their keys and values). Returns the seconds it took (also added to
        `compile_seconds`)."""
        config = self.config
        if config is None:
            raise RuntimeError("JaxGraphBackend.compile_for called before prepare")
        began = time.perf_counter()
        blocks = functools.partial(graphs.attention_blocks, config.seq_len)
        end = min(start + prompt_len, config.seq_len)
        for pos, size in self._prefill_plan(start, (end - start) * chunked):
            key = ("prefill", size, blocks(pos + max(size, 1) - 1))
            if size and key not in self._compiled:
                self._compiled.add(key)
                self._prefill_chunk([0] * size, pos)
        first, final = end if chunked else start, min(last, config.seq_len - 1)
        # Where a program can first be needed: the first position, the first after the prompt
        # and each block's first (where the window can grow); not every position.
        starts = range((first // self.block_length + 1) * self.block_length, final + 1,
                       self.block_length)
        for pos in sorted({p for p in (first, end, *starts) if first <= p <= final}):
            if ("forward", blocks(pos)) not in self._compiled:
                self._compiled.add(("forward", blocks(pos)))
                self.forward(0, pos)
            if kind is not None and pos >= end and ("loop", kind, blocks(pos)) not in self._compiled:
                self._compiled.add(("loop", kind, blocks(pos)))
                self.decode_loop(0, pos, 1, kind=kind, coins=[0.0])
        seconds = time.perf_counter() - began
        self.compile_seconds += seconds
        return seconds

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits f32[vocab_size] for `token` at `pos` (see `jllama.backends.base.Backend`)."""
        config = self.config
        if config is None:
            raise RuntimeError("JaxGraphBackend.forward called before prepare")
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
