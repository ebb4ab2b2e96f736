"""The decode-mode policy (`decode_mode`: which of graph / fused / loop a generation runs in),
and binding a host `Sampler` to a backend's on-device decode loop (the `loop` decode mode), for
`Generation(decode_loop=...)`.

The device samples with the same rule as the host sampler (`jllama.graphs.sample_on_device`)
and the same random draws: the coins come from the sampler's own xorshift generator, one per
sampled token, and the generator is left exactly where drawing token by token would leave it,
so a conversation that goes on with the host sampler continues the same random sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jllama.backends.base import DeviceLoop
from jllama.errors import SamplerError
from jllama.sampling import Sampler, SamplerConfig, XorShiftRng

DECODE_MODES = ("auto", "graph", "fused", "loop")
"""What a `Session` takes as its decode mode: the jax backend's three (`graph`, `fused`,
`loop`) and `auto`, resolved per generation by `decode_mode`."""


def runc_settings_only(config: SamplerConfig) -> bool:
    """True when `config` sets nothing beyond temperature, top_p and seed away from their
    neutral values: run.c's sampler, the one the device loop implements."""
    for field in dataclasses.fields(config):
        if field.name not in ("temperature", "top_p", "seed"):
            if getattr(config, field.name) != field.default:
                return False
    return True


def decode_mode(requested: str, backend, sampling: SamplerConfig | None, padded: bool,
                host_logits: bool = False) -> str:
    """The decode mode a generation runs in: `requested` with "auto" resolved.

    auto is "loop" where the device loop can sample this generation (a backend with
    `DeviceLoop` and a model that is not a Mixture of Experts, run.c's sampler, a tokenizer covering every logit, no log-probs wanted:
    loop is the fastest mode on CPU, bench/NOTES.md), else "graph". "loop" asked for where the
    backend has no device loop, or the logits are wanted on the host, runs as "graph".

    Args:
      requested: one of `DECODE_MODES`.
      backend: the prepared backend.
      sampling: the generation's sampler settings; None: decided per request on the host
        (the server), which never picks the device loop.
      padded: the model has more logits than its tokenizer has tokens.
      host_logits: each token's logits are read on the host (log-probs).

    Raises:
      SamplerError: "loop" asked for with settings the device loop cannot sample, or a padded
        vocabulary it cannot skip.
    """
    if requested not in DECODE_MODES:
        raise ValueError(f"decode={requested!r}; known: {', '.join(DECODE_MODES)}")
    if requested in ("graph", "fused"):
        return requested
    usable = (isinstance(backend, DeviceLoop) and sampling is not None and not host_logits
              and not _mixture_of_experts(backend))
    if requested == "auto":
        return "loop" if usable and not padded and runc_settings_only(sampling) else "graph"
    if not usable:
        return "graph"
    if padded:
        raise SamplerError(
            "decode=loop: the model has more logits than its tokenizer has tokens; the device "
            "sampler cannot skip the padding: use decode=graph"
        )
    if not runc_settings_only(sampling):
        raise SamplerError(
            "the loop decode mode samples with temperature, top_p and seed only "
            f"(run.c's sampler); got {Sampler.from_config(sampling)!r}"
        )
    return "loop"


def _mixture_of_experts(backend) -> bool:
    """Whether the backend runs a Mixture-of-Experts model, whose layers have no device-loop
    program yet (their step routes on the host, `jllama.graphs.moe`): such a generation
    runs as "graph"."""
    return bool(getattr(getattr(backend, "config", None), "moe", False))


def sampling_kind(temperature: float, top_p: float) -> str:
    """The device sampler for run.c's settings: "greedy" at temperature 0, "mult" when top_p
    is 0 or >= 1, else "topp" (the branches of `Sampler.sample`)."""
    if np.float32(temperature) == 0:
        return "greedy"
    if np.float32(top_p) <= 0 or np.float32(top_p) >= 1:
        return "mult"
    return "topp"


class LoopDecoder:
    """`decode_loop(token, pos, n) -> (ids, finite)` for `Generation`: a chunk of tokens from
    the backend's `decode_loop`, sampled as `sampler` would sample them.

    Args:
      backend: a prepared backend with `DeviceLoop` (the jax backend).
      sampler: a `jllama.sampling.Sampler` (run.c's temperature / top_p / seed); its `rng` is
        advanced by one draw per token sampled, as `Sampler.sample` would.
      stop_ids: tokens that end the generation.

    Attributes:
      kind: the device sampler, "greedy", "mult" or "topp" (`sampling_kind`).

    Raises:
      SamplerError: a sampler with settings the device loop does not implement (anything
        beyond run.c's temperature, top_p and seed).
    """

    def __init__(self, backend: DeviceLoop, sampler: Sampler, stop_ids: Sequence[int]):
        if type(sampler) is not Sampler or not runc_settings_only(sampler.config):
            raise SamplerError(
                "the loop decode mode samples with temperature, top_p and seed only "
                f"(run.c's sampler); got {sampler!r}"
            )
        self._backend = backend
        self._sampler = sampler
        self._stop = tuple(int(t) for t in stop_ids)
        self.kind = sampling_kind(sampler.config.temperature, sampler.config.top_p)

    def __call__(self, token: int, pos: int, n: int) -> tuple[list[int], bool]:
        sampler, config, kind = self._sampler, self._sampler.config, self.kind
        coins = None
        if kind != "greedy":
            start = sampler.rng.state
            coins = [sampler.rng.random_f32() for _ in range(min(n, self._backend.loop_chunk))]
        ids, finite = self._backend.decode_loop(
            token, pos, n, kind=kind, temperature=config.temperature, top_p=config.top_p,
            coins=coins, stop_ids=self._stop,
        )
        if kind != "greedy":
            # Rewind to one draw per token actually sampled.
            rng = XorShiftRng(start)
            for _ in ids:
                rng.random_u32()
            sampler.rng = rng
        return ids, finite


class ConstrainedLoopDecoder(LoopDecoder):
    """`LoopDecoder` for a constrained generation: one token per call, sampled on the device
    over the logits `constraint`'s grammar allows (its mask passed into the loop program), the
    token then consumed by the matcher on the host. The same tokens and random draws as the
    host path (`ConstrainedSampler` around `sampler`): one coin per token drawn, none once
    the grammar is done (the end-of-generation id is then the only id allowed, and the last
    token is still fed, so the cache holds it as in graph mode).

    Args:
      backend, sampler, stop_ids: as `LoopDecoder`; the backend's `loop_masks` is True.
      constraint: the generation's `jllama.constrain.ConstrainedSampler` (the host samples
        the first token through it; this decoder goes on with its matcher).
    """

    def __init__(self, backend: DeviceLoop, sampler: Sampler, stop_ids: Sequence[int],
                 constraint):
        super().__init__(backend, sampler, stop_ids)
        self._constraint = constraint
        end = constraint.vocabulary.end_id
        self._only_end = np.zeros((constraint.vocabulary.n_logits + 31) // 32, np.int32)
        self._only_end.view(np.uint32)[end // 32] = np.uint32(1 << (end % 32))

    def __call__(self, token: int, pos: int, n: int) -> tuple[list[int], bool]:
        sampler, config, kind = self._sampler, self._sampler.config, self.kind
        bits = self._constraint.next_mask()
        done = bits is None
        coins, start = None, sampler.rng.state
        if kind != "greedy":
            coins = [0.0] if done else [sampler.rng.random_f32()]
        ids, finite = self._backend.decode_loop(
            token, pos, 1, kind=kind, temperature=config.temperature, top_p=config.top_p,
            coins=coins, stop_ids=self._stop, allowed_bits=self._only_end if done else bits,
        )
        if kind != "greedy" and not ids:
            sampler.rng = XorShiftRng(start)  # nothing sampled: no draw
        for t in ids:
            self._constraint.consume(t)
        return ids, finite


def loop_decoder(backend: DeviceLoop, sampler: Sampler, stop_ids: Sequence[int]) -> LoopDecoder:
    """A `LoopDecoder` whose program is compiled: call it before the backend's first sequence
    starts, since it compiles the loop by running it at position 0 (`DeviceLoop.compile_loop`).

    Raises:
      SamplerError: as `LoopDecoder`.
    """
    decoder = LoopDecoder(backend, sampler, stop_ids)
    backend.compile_loop(decoder.kind)  # now, not inside the first reply's timing
    return decoder
