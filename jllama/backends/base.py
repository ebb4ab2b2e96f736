"""The backend protocols: what the generation loop needs from a model implementation, and
what else a backend may offer.

A backend turns one token at one position into next-token logits, keeping its own KV cache
(`Backend`). Positions are given in order from 0 for each sequence; a call at position 0 starts
a new sequence (nothing from earlier sequences is visible to it).

The other protocols are capabilities a backend may have; `jllama.generation.session.Session` checks them
with `isinstance` (each is `runtime_checkable`) and uses what is there:

  Prefill          a whole prompt in one call
  PrefillLogits    every position's logits of a batch (perplexity)
  DeviceLoop       a chunk of tokens sampled on the device per call
  CompilePlanning  compiling a generation's programs before it starts
  Described        its platform, and notes on what `prepare` chose
  SlotCaches       more than one sequence's KV cache, switched between without copies
  BatchDecode      one token for each of several sequences (their own caches) per call
  Verify           several consecutive positions of one sequence per call, each row's logits
                   bit-identical to `forward`'s (speculative decoding's check)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from jllama.model.config import ModelConfig
from jllama.model.weights import TransformerWeights


@runtime_checkable
class Backend(Protocol):
    """A model implementation the generation loop can drive.

    Attributes:
      name: a short name shown to users (e.g. "numpy", "jax").
    """

    name: str

    def prepare(self, config: ModelConfig, weights: TransformerWeights) -> None:
        """Take the model: convert the weights to the backend's layout, allocate the KV cache
        (f32, `seq_len` positions) and compile what needs compiling. Called once, before any
        `forward`."""
        ...

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Run the transformer on `token` (0 <= token < vocab_size) at position `pos`
        (0 <= pos < seq_len, given in order from 0) and return the logits for the next token,
        f32[vocab_size] as a NumPy array. Raises ValueError for a token or position out of
        range."""
        ...


@runtime_checkable
class Prefill(Protocol):
    """A backend that feeds a whole prompt in one call (batched prefill)."""

    def prefill(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Feed `tokens` at positions start_pos, start_pos+1, ... and return the logits after
        the last one, f32[vocab_size] (what `forward` of the last token returns, up to float
        rounding). Raises ValueError for no tokens or positions beyond seq_len."""
        ...


@runtime_checkable
class PrefillLogits(Protocol):
    """A backend that returns the logits after every token of a batch (for a perplexity)."""

    def prefill_logits(self, tokens: Sequence[int], start_pos: int, first: int = 0) -> np.ndarray:
        """Feed `tokens` from `start_pos` and return the logits after each of tokens[first:],
        f32[len(tokens) - first, vocab_size]. Raises ValueError for no tokens, `first` out of
        range or positions beyond seq_len."""
        ...


@runtime_checkable
class DeviceLoop(Protocol):
    """A backend that samples a chunk of tokens on the device per call (the `loop` decode
    mode), with run.c's sampler (`jllama.graphs.SAMPLING_KINDS`)."""

    loop_chunk: int
    """The most tokens one `decode_loop` call samples."""

    loop_masks: bool
    """Whether `decode_loop` takes a grammar's `allowed_bits`."""

    def decode_loop(self, token: int, pos: int, n: int, kind: str = "greedy",
                    temperature: float = 1.0, top_p: float = 1.0, coins=None,
                    stop_ids: Sequence[int] = (), allowed_bits=None) -> tuple[list[int], bool]:
        """Feed `token` at `pos` and sample up to min(n, loop_chunk) tokens after it; returns
        (ids, finite), ids ending early after a stop token, finite False at NaN/inf logits.
        `allowed_bits`: a grammar's mask, i32[ceil(vocab_size / 32)] as llguidance writes it
        (where `loop_masks`; then n is 1)."""
        ...

    def compile_loop(self, kind: str = "greedy", masked: bool = False) -> float:
        """Compile `decode_loop` for `kind` (with a mask if `masked`) before a sequence starts;
        seconds taken."""
        ...


@runtime_checkable
class CompilePlanning(Protocol):
    """A backend that compiles, before a generation, the programs the generation will need."""

    compile_seconds: float
    """Seconds spent compiling so far (the warm-up in `prepare` and every `compile_for`)."""

    def compile_for(self, prompt_len: int, last: int, kind: str | None = None,
                    chunked: bool = True, start: int = 0, masked: bool = False) -> float:
        """Compile what `prompt_len` prompt tokens fed from `start` (batched when `chunked`)
        and decoding up to position `last` need (`kind`: the device loop's sampler, or None;
        `masked`: its program with a grammar's mask);
        leaves positions < start in the cache as they are. Returns the seconds taken.
        A `Verify` backend also takes `verify=True` (asked only of a generation decoded with
        drafts): its verification programs too."""
        ...


@runtime_checkable
class Described(Protocol):
    """A backend that says where it runs and what it chose in `prepare`."""

    platform: str
    """The platform it runs on: "cpu", "gpu", "tpu"."""

    def notes(self) -> list[str]:
        """Lines for the user about choices made in `prepare` (a fallback to XLA's products,
        widened weights, parts not split over devices); empty when there are none."""
        ...



@runtime_checkable
class SlotCaches(Protocol):
    """A backend that keeps several sequences' KV caches and runs on whichever is in use:
    `forward`, `prefill`, `decode_loop` and `compile_for` read and write the caches last given
    to `use_caches` (or the ones `prepare` made). Switching copies nothing."""

    def new_caches(self) -> object:
        """A zeroed KV cache for one more sequence (after `prepare`), in the backend's own
        layout; allocated lazily where the backend can."""
        ...

    def use_caches(self, caches: object) -> object:
        """Run on `caches` (from `new_caches`, or returned by an earlier call) from now on;
        returns the caches in use before."""
        ...


@runtime_checkable
class BatchDecode(Protocol):
    """A `SlotCaches` backend that decodes one token for each of several sequences per call."""

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int],
                     caches: Sequence[object]) -> np.ndarray:
        """Logits f32[B, vocab_size]: row b is what `forward(tokens[b], positions[b])`
        returns on caches[b] (from `new_caches`), and caches[b] is updated as that forward
        would; the caches in use stay in use. Bit for bit on jllama's CPU kernels
        (`batch_kernels`); the jax backend's XLA program for the batch (matvec="xla")
        gives forward's logits and cache rows to float rounding (its products are matrix
        products), the same bits for a row whatever its neighbours in one batch size."""
        ...

    def batch_kernels(self) -> bool:
        """Whether `decode_batch` runs jllama's CPU kernels (so the rows' tokens may be drawn
        by `jllama.kernels.batched.sample_batch` too); else one XLA program for the batch
        (the jax backend with matvec="xla") or `forward` per sequence."""
        ...


@runtime_checkable
class Verify(Protocol):
    """A backend that runs several consecutive positions of the sequence in use in one call,
    each row's logits the bits `forward` gives (speculative decoding's verification)."""

    def verify(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Logits f32[R, vocab_size] of `tokens` fed at start_pos, start_pos + 1, ...: row r
        is what `forward(tokens[r], start_pos + r)` returns after the rows before it, bit for
        bit, and the KV cache holds what those forwards would write."""
        ...


def check_token_pos(config: ModelConfig, token: int, pos: int) -> tuple[int, int]:
    """`(token, pos)` as Python ints.

    Raises:
      TypeError: a token or position that is not an integer (a float, a bool).
      ValueError: a token or position outside the model's vocabulary / context.
    """
    if isinstance(token, bool) or isinstance(pos, bool):
        raise TypeError(f"token and position must be integers, got {token!r}, {pos!r}")
    token, pos = operator.index(token), operator.index(pos)
    if not 0 <= token < config.vocab_size:
        raise ValueError(f"token {token} is out of range for vocab_size={config.vocab_size}")
    if not 0 <= pos < config.seq_len:
        raise ValueError(f"position {pos} is out of range for seq_len={config.seq_len}")
    return token, pos
