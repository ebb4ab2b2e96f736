"""What a run will hold in memory, planned before anything big is allocated.

A `MemoryPlan` adds up:
  - the weights as held (`jllama.model.weights.weights_nbytes`: a GGUF's blocks as stored, whether
    placed in the kernels' buffer or read from the mapped file);
  - the KV cache of every slot the run may fill: slots x seq_len positions x the cache type's
    bytes per position (`jllama.model.cache_types.kv_cache_nbytes`; `jllama serve --parallel=N` holds
    N slots, each growing to the whole context);
  - a draft model's weights and its drafters' KV caches, where speculative decoding drafts with
    one (`--draft=CHECKPOINT`: its weights as held; `--draft=self:q4` / `self:int8` /
    `self:bfloat16`: the target's at that type, `jllama.model.cast_nbytes`); each drafter holds
    a cache of the draft's own for one sequence, and one exists per sequence that may draft
    (`jllama serve --parallel=N` and `jllama batch`: N, each request's drafter keeping its cache
    until its slot's next request; generate and chat: 1). An n-gram drafter holds no cache;
  - the process itself, measured: its RSS when the plan is made (Python, the imports, the
    tokenizer; JAX and its CPU client, as measured here, when they have not started yet), and
    what it allocates as it runs (`scratch_nbytes`: compiled programs, the largest step's
    activations, the session's own first cache block).

`check` refuses, in one line, a plan that needs more than the memory the host has available.
jllama allocates cache blocks as positions reach them, so a plan too big for the host would
start and then be killed under load, whenever the slots fill; refusing it at start is the
predictable choice (llama.cpp's `-np` shares one `-c` context among the slots instead, and
vLLM sizes a KV pool to a fraction of the memory: both serve shorter contexts than asked
without saying so).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jllama.model.cache_types import cache_type as get_cache_type
from jllama.model.cache_types import describe, kv_cache_nbytes
from jllama.model.config import ModelConfig
from jllama.errors import ResourceError
from jllama.platform.runtime import available_memory_bytes, rss_bytes

JAX_START_BYTES = 121 << 20
"""RSS that importing JAX and starting its CPU client added to a process here (Python 3.11,
jaxlib 0.10, x86-64; 117 MB of it the import, mostly jaxlib's library pages), counted when a
plan is made before JAX has started."""

PROGRAMS_BYTES = 160 << 20
"""The fixed part of `scratch_nbytes`: XLA's compiled programs and runtime, the rest of
jaxlib's pages its first programs touch, the server's own. Measured (bench/memory_plan.py,
4 clients filling every slot, on this project's 2-core Intel VM): the peak RSS less the
weights, the slots' caches, the RSS at the plan and the activations below was 151-191 MB for
SmolLM2 Q4_1 (--parallel=4, --seq_len=2048) and 179 MB for Llama-3.2-1B Q4_K_M (--parallel=2,
--seq_len=1024)."""

BLOCK = 256
"""Positions per cache block (`jllama.graphs.attention.MIN_WINDOW`; not imported: that module
imports JAX): a slot's cache is whole blocks, ceil(seq_len / BLOCK) of them."""

PREFILL_CHUNK = 256
"""Tokens of the largest prefill chunk (`jllama.backends.jax_prefill.PREFILL_CHUNKS`)."""

def scratch_nbytes(config: ModelConfig, slots: int, cache_type: str = "f32",
                   value_type: str | None = None) -> int:
    """Bytes a running process holds beyond its start, its weights and its slots' caches:
    `PROGRAMS_BYTES`, the float32 activations of the largest step (a prefill chunk of
    `PREFILL_CHUNK` tokens: its hidden states, q, k, v, the feed-forward's three, and its
    attention scores over the context; one row of logits per slot), and the session's own
    first cache block (the warm-up step writes it whatever the slots)."""
    widths = (4 * config.dim + 3 * config.hidden_dim + config.q_dim + 2 * config.kv_dim
              + config.n_heads * config.seq_len)
    activations = 4 * (PREFILL_CHUNK * widths + slots * config.vocab_size)
    first_block = kv_cache_nbytes(config.n_layers, config.n_kv_heads, config.head_dim,
                                  min(BLOCK, config.seq_len), cache_type,
                                  value_type or cache_type)
    return PROGRAMS_BYTES + activations + first_block


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What `memory_plan` counted, bytes.

    Attributes:
      weights: the weights as held; weights_kind: their dtype or GGML types ("Q4_K+Q6_K").
      kv_cache: every slot's KV cache, whole.
      slots, seq_len, cache_type: what kv_cache counts (cache_type a `cache_types` name, or
        "key/value" names when the two differ).
      process: the process's RSS when planned (with JAX's start added if it had not started).
      scratch: `scratch_nbytes`.
      resident: the RSS when planned (part of `process`, already allocated).
      draft: what drafts with a model of its own ("self:q4", a checkpoint's name), or "" for
        none; draft_weights, draft_weights_kind: its weights as held; draft_kv_cache: its
        drafters' KV caches, whole (`drafters` of them, `seq_len` positions each, of
        `draft_cache_type`).
    """

    weights: int
    weights_kind: str
    kv_cache: int
    slots: int
    seq_len: int
    cache_type: str
    process: int
    scratch: int
    resident: int
    draft: str = ""
    draft_weights: int = 0
    draft_weights_kind: str = ""
    draft_kv_cache: int = 0
    drafters: int = 0
    draft_cache_type: str = ""

    @property
    def cache_label(self) -> str:
        """The cache types for a line: "f16", or "keys q8_0, values f16"."""
        key, _, value = self.cache_type.partition("/")
        return describe(key, value or key)

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.draft_weights + self.draft_kv_cache
                + self.process + self.scratch)

    def draft_part(self) -> str:
        """The draft model's part of `line` ("" without one)."""
        if not self.draft:
            return ""
        mb = 1e6
        key, _, value = self.draft_cache_type.partition("/")
        many = f"{self.drafters} drafters x " if self.drafters != 1 else ""
        return (f" + draft {self.draft} {(self.draft_weights + self.draft_kv_cache) / mb:.1f} MB "
                f"(weights {self.draft_weights / mb:.1f} MB, {self.draft_weights_kind}; KV cache "
                f"{self.draft_kv_cache / mb:.1f} MB, {many}{self.seq_len} tokens, "
                f"{describe(key, value or key)})")

    def line(self) -> str:
        """"required memory: ..." as the CLI prints it, in MB (10^6 bytes)."""
        mb = 1e6
        cache = self.cache_label
        tokens = (f"{self.seq_len} tokens" if self.slots == 1
                  else f"{self.slots} slots x {self.seq_len} tokens")
        return (
            f"required memory: {self.total / mb:.1f} MB = weights {self.weights / mb:.1f} MB "
            f"({self.weights_kind}) + KV cache {self.kv_cache / mb:.1f} MB ({tokens}, {cache})"
            f"{self.draft_part()} + the process {(self.process + self.scratch) / mb:.1f} MB (Python, JAX, the "
            f"tokenizer: {self.process / mb:.1f} MB; programs and activations "
            f"{self.scratch / mb:.1f} MB)"
        )

    def check(self, available: int | None = None, *, slots_flag: str = "--parallel") -> None:
        """Refuse the plan when what it has yet to allocate is more than the memory available
        (`available` bytes, default Linux's MemAvailable; no check where that is unknown).

        Raises:
          ResourceError: one line: the plan, the memory available, and the most slots (at
            this context) or the longest context (in one slot) that would fit.
        """
        if available is None:
            available = available_memory_bytes()
        if available is None:
            return
        needed = self.total - self.resident
        if needed <= available:
            return
        gb = 1e9
        # The drafters' caches grow with the slots where there is one per slot.
        per_slots = self.kv_cache + (self.draft_kv_cache if self.drafters == self.slots else 0)
        fixed = needed - per_slots
        per_slot = per_slots / max(self.slots, 1)
        room = available - fixed
        if self.slots > 1 and room >= per_slot:
            hint = f"at most {int(room // per_slot)} slots of {self.seq_len} tokens fit: lower {slots_flag} or --seq_len"
        elif room > 0 and self.seq_len > 1:
            per_token = per_slot / self.seq_len
            hint = f"at most {int(room // per_token)} tokens of context fit in one slot: lower --seq_len"
        else:
            hint = "the weights alone do not fit"
        cache = self.cache_label
        raise ResourceError(
            f"not enough memory: the run needs {needed / gb:.1f} GB more (weights "
            f"{self.weights / gb:.1f} GB + KV cache {self.kv_cache / gb:.1f} GB for {self.slots} "
            f"x {self.seq_len} tokens, {cache} + the process) but {available / gb:.1f} GB is "
            f"available; {hint}"
        )


def memory_plan(model, slots: int = 1, cache_type: str = "f32",
                value_type: str | None = None, draft=None,
                drafters: int | None = None) -> MemoryPlan:
    """The plan of running `model` (a `jllama.model.loading.Model`) with `slots` sequences of its
    config's seq_len positions in caches of `cache_type` (a `jllama.model.cache_types` name; the
    values' of `value_type` when given, else the same).

    Args:
      draft: speculative decoding's drafter: None, "none", "ngram" or "ngram-pool" (nothing
        counted), a `jllama.model.cast_nbytes.SELF_TYPES` name (the target's weights at
        that type, sized without converting them), or the draft checkpoint's opened `Model`.
      drafters: draft KV caches held at once (default `slots`).

    Raises:
      ConfigError: an unknown cache type.
    """
    from jllama.model.weights import weights_dtype, weights_nbytes

    config = model.config
    key = get_cache_type(cache_type).name
    value = get_cache_type(value_type or cache_type).name
    kind = key if key == value else f"{key}/{value}"
    block = min(BLOCK, config.seq_len)
    positions = -(-config.seq_len // block) * block  # whole blocks
    kv = kv_cache_nbytes(config.n_layers, config.n_kv_heads, config.head_dim, positions,
                         key, value, sequences=slots)
    resident = rss_bytes()
    process = resident + (0 if "jax" in sys.modules else JAX_START_BYTES)
    return MemoryPlan(
        weights=weights_nbytes(model.weights), weights_kind=weights_dtype(model.weights),
        kv_cache=kv, slots=slots, seq_len=config.seq_len, cache_type=kind, process=process,
        scratch=scratch_nbytes(config, slots, key, value), resident=resident,
        **_draft_fields(model, draft, slots if drafters is None else drafters),
    )


def _draft_fields(model, draft, drafters: int) -> dict:
    """`MemoryPlan`'s draft fields for `memory_plan`'s `draft`: its weights as the draft
    backend will hold them and `drafters` caches of the type that backend picks ("auto" for
    its file: `open_draft` prepares it so), whole blocks of the target's seq_len."""
    from jllama.model import cache_types
    from jllama.model.weights import weights_dtype, weights_nbytes

    if draft is None or draft in ("none", "ngram", "ngram-pool"):
        return {}
    if isinstance(draft, str):
        from jllama.model.cast_nbytes import SELF_TYPES, cast_nbytes

        if draft not in SELF_TYPES:
            raise ValueError(f"draft={draft!r}: a self: type, or the draft's opened Model")
        dtype = SELF_TYPES[draft]
        name, nbytes, kind = draft, cast_nbytes(model.weights, dtype), dtype
        source = model
    else:
        name = os.path.basename(str(draft.source))
        nbytes, kind, source = weights_nbytes(draft.weights), weights_dtype(draft.weights), draft
    config = source.config
    key, value = cache_types.resolve(file_format=source.file_format, head_dim=config.head_dim)
    seq_len = model.config.seq_len  # a draft's context is capped at the target's
    positions = -(-seq_len // min(BLOCK, seq_len)) * min(BLOCK, seq_len)
    kv = kv_cache_nbytes(config.n_layers, config.n_kv_heads, config.head_dim, positions,
                         key.name, value.name, sequences=drafters)
    return {"draft": name, "draft_weights": nbytes, "draft_weights_kind": kind,
            "draft_kv_cache": kv, "drafters": drafters,
            "draft_cache_type": key.name if key == value else f"{key.name}/{value.name}"}


def check_memory(model, backend: str = "jax", slots: int = 1, cache_type: str = "f32",
                 value_type: str | None = None, draft=None) -> None:
    """Refuse, before the weights are placed or a cache block allocated, a run of `slots`
    sequences (each up to the whole context) that would not fit in the host's memory
    (`MemoryPlan.check`), a draft model's weights and caches included (`memory_plan`'s
    `draft`). The jax backend's CPU client is started first, so that the plan
    measures it; on another platform the caches are the device's, and nothing is checked.

    Raises:
      ResourceError: one line, with the most slots or the longest context that fit.
    """
    if backend == "jax":
        import jax

        if jax.devices()[0].platform != "cpu":
            return
    memory_plan(model, slots=slots, cache_type=cache_type, value_type=value_type,
                draft=draft).check()
