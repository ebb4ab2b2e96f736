"""Random numbers: run.c's xorshift64* generator, and the seeds it starts from.

The same seed gives the same draws as llama2.c run.c's `random_u32` / `random_f32`, so a
`Sampler` with run.c's seed samples run.c's tokens.
"""

from __future__ import annotations

import time

import numpy as np

from jllama.sampling.config import check_seed

_U64_MASK = (1 << 64) - 1
_XORSHIFT_MULTIPLIER = 0x2545F4914F6CDD1D

# (u32 >> 8) / 2**24: a float32 in [0, 1) on a grid of 2**-24, exact in float32.
_F32_DENOMINATOR = np.float32(16777216.0)


def xorshift_step(state: int) -> tuple[int, int]:
    """Advances run.c's xorshift64* generator by one draw, as llama2.c run.c `random_u32`.

    Args:
        state: the generator state, an unsigned 64-bit integer (a Python int in [0, 2**64)).

    Returns:
        `(new_state, u32)`: the next state, and the draw, an int in [0, 2**32):
        `state ^= state >> 12; state ^= state << 25; state ^= state >> 27` (mod 2**64), then
        `u32 = (state * 0x2545F4914F6CDD1D mod 2**64) >> 32`.
    """
    state ^= state >> 12
    state = (state ^ (state << 25)) & _U64_MASK
    state ^= state >> 27
    return state, ((state * _XORSHIFT_MULTIPLIER) & _U64_MASK) >> 32


def u32_to_f32(u32: int) -> np.float32:
    """Maps a 32-bit draw to a float32 in [0, 1), as llama2.c run.c `random_f32`.

    Args:
        u32: an int in [0, 2**32).

    Returns:
        `np.float32((u32 >> 8) / 16777216)`: the top 24 bits over 2**24, exact in float32.
    """
    return np.float32(u32 >> 8) / _F32_DENOMINATOR


class XorShiftRng:
    """run.c's random number generator (xorshift64*), a small mutable object: it IS its state.

    The same seed gives the same draws as llama2.c run.c's `random_u32` / `random_f32` with
    `rng_state = seed`. Draws are plain Python integer arithmetic (constant time).

    Args:
        seed: the initial state, an integer in [1, 2**64). Zero is refused: xorshift maps the
            state 0 to itself, so it would draw zeros forever.

    Raises:
        SamplerSettingError (a SamplerError, a ValueError): seed not an integer, 0,
            negative, or >= 2**64.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = check_seed(seed)

    @property
    def state(self) -> int:
        """The current state, an int in [1, 2**64) (never 0: xorshift keeps nonzero states)."""
        return self._state

    def random_u32(self) -> int:
        """Advances the state and returns a draw, an int in [0, 2**32), as run.c `random_u32`."""
        self._state, u32 = xorshift_step(self._state)
        return u32

    def random_f32(self) -> np.float32:
        """Advances the state and returns an `np.float32` in [0, 1), as run.c `random_f32`."""
        return u32_to_f32(self.random_u32())

    def __repr__(self) -> str:
        return f"XorShiftRng(state={self._state:#018x})"


def seed_from_clock() -> int:
    """A seed from the wall clock, for runs that give none (run.c uses `time(NULL)`).

    Returns:
        An int in [1, 2**64): the clock in nanoseconds since the epoch (never 0).
    """
    return (time.time_ns() & _U64_MASK) or 1
