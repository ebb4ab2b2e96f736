"""Binding a host `Sampler` to a backend's on-device decode loop (the jax backend's `loop`
decode mode), for `Generation(decode_loop=...)`.

The device samples with the same rule as the host sampler (`jllama.graphs.sample_on_device`)
and the same random draws: the coins come from the sampler's own xorshift generator, one per
sampled token, and the generator is left exactly where drawing token by token would leave it,
so a conversation that goes on with the host sampler continues the same random sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jllama.backends.jax_graph import LOOP_CHUNK
from jllama.errors import SamplerError
from jllama.sampling import Sampler, XorShiftRng


def sampling_kind(temperature: float, top_p: float) -> str:
    """The device sampler for run.c's settings: "greedy" at temperature 0, "mult" when top_p
    is 0 or >= 1, else "topp" (the branches of `Sampler.sample`)."""
    if np.float32(temperature) == 0:
        return "greedy"
    if np.float32(top_p) <= 0 or np.float32(top_p) >= 1:
        return "mult"
    return "topp"


def loop_decoder(
    backend, sampler: Sampler, stop_ids: Sequence[int]
) -> Callable[[int, int, int], tuple[list[int], bool]]:
    """`decode_loop(token, pos, n) -> (ids, finite)` for `Generation`: a chunk of tokens from
    `backend.decode_loop`, sampled as `sampler` would sample them.

    Call it before the backend's first sequence starts: it compiles the loop by running it
    at position 0.

    Args:
      backend: a prepared backend with `decode_loop` (the jax backend).
      sampler: a `jllama.sampling.Sampler` (run.c's temperature / top_p / seed); its `rng` is
        advanced by one draw per token sampled, as `Sampler.sample` would.
      stop_ids: tokens that end the generation.

    Raises:
      SamplerError: a sampler with settings the device loop does not implement (anything
        beyond run.c's temperature, top_p and seed).
    """
    if type(sampler) is not Sampler or not _runc_settings_only(sampler):
        raise SamplerError(
            "the loop decode mode samples with temperature, top_p and seed only "
            f"(run.c's sampler); got {sampler!r}"
        )
    config = sampler.config
    kind = sampling_kind(config.temperature, config.top_p)
    stop = tuple(int(t) for t in stop_ids)
    if hasattr(backend, "compile_loop"):
        backend.compile_loop(kind)  # now, not inside the first reply's timing

    def decode_loop(token: int, pos: int, n: int) -> tuple[list[int], bool]:
        coins = None
        if kind != "greedy":
            start = sampler.rng.state
            coins = [sampler.rng.random_f32() for _ in range(min(n, LOOP_CHUNK))]
        ids, finite = backend.decode_loop(
            token, pos, n, kind=kind, temperature=config.temperature, top_p=config.top_p,
            coins=coins, stop_ids=stop,
        )
        if kind != "greedy":
            # Rewind to one draw per token actually sampled.
            rng = XorShiftRng(start)
            for _ in ids:
                rng.random_u32()
            sampler.rng = rng
        return ids, finite

    decode_loop.kind = kind  # for `JaxGraphBackend.compile_for`
    return decode_loop


def _runc_settings_only(sampler: Sampler) -> bool:
    """True when the sampler's config has no fields beyond temperature, top_p and seed set
    away from their neutral values (other samplers may be added to `SamplerConfig`)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(sampler.config)}
    for name, default in defaults.items():
        if name in ("temperature", "top_p", "seed"):
            continue
        if getattr(sampler.config, name) != default:
            return False
    return True
