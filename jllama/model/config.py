"""Model hyperparameters.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument under `jax.jit`
and a dictionary key. The derived sizes (`head_dim`, `q_dim`, `kv_dim`, `kv_mul`) are computed
once here, with llama2.c run.c's meanings, so no other module re-derives them.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

from jllama.errors import ConfigError
from jllama.model.rope import rope_frequencies

# Sizes above these are not models anyone runs on this engine; a header that claims them is
# almost certainly a corrupt or foreign file, and refusing early avoids multi-GB allocations.
MAX_DIM = 1 << 16
MAX_LAYERS = 1 << 10
MAX_VOCAB = 1 << 22
MAX_SEQ_LEN = 1 << 22
MAX_EXPERTS = 1 << 12


ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors")


# --- Hyperparameters checked in the type the forward pass computes them in.
#
# Every backend computes in float32 (run.c's floats): a value that is finite and positive as
# a Python float (float64) can be inf or 0 there. 1e300 as an RMS epsilon is inf in float32,
# so every normalized row is 0 and the model prints token 0 forever; 1e-300 as a RoPE factor
# is 0, and dividing the frequencies by it gives inf angles and NaN logits. Readers call these
# with the file's own key as `name` (so the message names the field the file holds), and
# `ModelConfig` / `RopeScaling` call them again with their own field names for configs made in
# Python. None of them lets NumPy print a RuntimeWarning: the casts run with warnings off and
# their results are checked.


def _shown(value) -> str:
    """A number for a message: a float32's own shortest digits when it is one (a GGUF
    FLOAT32 -1e-5 reads as -9.999999747378752e-06 in float64 and shows as -1e-05), else
    Python's repr."""
    if not isinstance(value, (float, np.floating)):
        return repr(value)
    with np.errstate(over="ignore", invalid="ignore"):
        v32 = np.float32(value)
    return str(v32) if np.isfinite(v32) and float(v32) == float(value) else repr(float(value))


def float32_of(name: str, value, user: str) -> np.float32:
    """`value` rounded to float32, the type it is computed in.

    Args:
      name: the field as the caller's source names it, for the message.
      value: a real number (int, float, NumPy scalar).
      user: what computes with it ("RMSNorm", "RoPE"), for the message.

    Raises:
      ConfigError: NaN, or a value beyond float32's range (|value| > 3.4028235e38 after
        rounding: inf there), one line naming `name`.
    """
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            v32 = np.float32(value)
    except OverflowError:  # a Python int beyond float64 (config.json allows 10^400)
        v32 = np.float32(np.inf)
    if not np.isfinite(v32):
        raise ConfigError(f"{name}={_shown(value)} is not finite as float32 (the type {user} "
                          "computes in)")
    return v32


def _positive_float32(name: str, value, user: str, why: str) -> np.float32:
    v32 = float32_of(name, value, user)
    if v32 > 0:
        return v32
    if value > 0:  # positive in float64, but below float32's smallest subnormal (1.4e-45)
        raise ConfigError(f"{name}={_shown(value)} is 0 as float32; it must be positive ({why})")
    raise ConfigError(f"{name}={_shown(value)} must be positive ({why})")


def check_norm_eps(value, name: str = "norm_eps") -> None:
    """Check RMSNorm's epsilon (`weight * x / sqrt(mean(x^2) + eps)`, in float32).

    Bounds: 0 < float32(eps) < inf. Positive, so an all-zero row does not divide 0 by 0
    (NaN); any positive float32, even the smallest subnormal, keeps 1 / sqrt(eps) finite
    (at most 2.7e22). Finite, since inf makes every normalized row 0. No tighter upper bound:
    the formula is defined for any finite eps (a large one only flattens the activations),
    and Llama-family files hold 1e-6 or 1e-5.

    Raises:
      ConfigError: NaN, not finite as float32, zero there (e.g. 1e-50) or negative; one line
        naming `name`.
    """
    _positive_float32(name, value, "RMSNorm", "RMSNorm divides by sqrt(mean(x^2) + eps)")


def check_rope_theta(value, name: str = "rope_theta") -> None:
    """Check RoPE's base theta (`inv_freq[i] = theta ** (-2i / head_dim)`, in float32).

    Bounds: 1 < float32(theta) < inf. At theta <= 0 the power is NaN or inf; at theta = 1
    every pair turns at the same 1 rad/token and below 1 the rates grow past it with i, so
    positions alias within a few tokens: RoPE's wavelengths 2 pi theta^(2i/d) must grow with
    i, which is theta > 1 (Llama: 10000 or 500000). Finite, since theta = inf gives 0 for
    every frequency but the first. A theta > 1 keeps every inv_freq in (1/theta, 1], finite.

    Raises:
      ConfigError: NaN, not finite as float32, or not above 1; one line naming `name`.
    """
    v32 = float32_of(name, value, "RoPE")
    if not v32 > 1:
        raise ConfigError(
            f"{name}={_shown(value)} must be greater than 1 (RoPE's wavelengths "
            "2*pi*theta^(2i/head_dim) must grow with i)"
        )


def check_rope_divisor(value, name: str) -> None:
    """Check a RoPE scaling factor that frequencies are divided by (a linear or llama3
    `factor`, llama3's `low_freq_factor` / `high_freq_factor`, a `rope_freqs` entry).

    Bounds: float32(value) > 0 and 1 / float32(value) finite, i.e. value >= 2.9e-39 (1 / the
    largest float32): RoPE divides inverse frequencies of at most 1 rad/token by it, and the
    quotient must stay finite. (`ModelConfig` then checks the whole table, angles included.)

    Raises:
      ConfigError: NaN, not finite as float32, zero there or negative, or a reciprocal that
        overflows float32; one line naming `name`.
    """
    why = "RoPE divides frequencies by it"
    v32 = _positive_float32(name, value, "RoPE", why)
    with np.errstate(over="ignore", divide="ignore"):
        reciprocal = np.float32(1.0) / v32
    if not np.isfinite(reciprocal):
        raise ConfigError(
            f"{name}={_shown(value)}: its reciprocal is not finite as float32 ({why})"
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for a longer context (Hugging Face's `rope_scaling`,
    or llama.cpp's `rope_freqs` tensor).

    Attributes:
      rope_type: "linear" (every frequency divided by `factor`, i.e. positions compressed),
        "llama3" (Llama 3.1/3.2: low frequencies divided by `factor`, high ones kept, a smooth
        blend between; `jllama.model.rope.rope_frequencies` has the formula), or "freq_factors"
        (llama.cpp's per-frequency divisors, a GGUF's `rope_freqs.weight`: frequency i divided
        by `freq_factors[i]` and then by `factor`).
      factor: the stretch, > 0 (e.g. 8.0 for Llama 3.1, 32.0 for Llama 3.2); for
        "freq_factors" the linear factor applied on top of them (1.0: none).
      low_freq_factor, high_freq_factor: llama3 only; wavelengths longer than
        original_max_position_embeddings / low_freq_factor are fully scaled, shorter than
        original_max_position_embeddings / high_freq_factor untouched (Llama 3.1: 1.0, 4.0).
      original_max_position_embeddings: llama3 only; the pre-training context, tokens (8192).
      freq_factors: "freq_factors" only: one finite divisor > 0 per rotated pair, a tuple of
        head_dim // 2 floats (a tuple, so the config stays hashable); () for the other types.
        `ModelConfig` checks the length against its head_dim.

    Raises:
      ConfigError: an unknown type or out-of-range values.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ConfigError(
                f"rope_scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_SCALING_TYPES)})"
            )
        check_rope_divisor(self.factor, "rope_scaling factor")
        if self.rope_type == "llama3":
            # transformers' _compute_llama3_parameters (and llama.cpp's converter) divide by
            # low_freq_factor, high_freq_factor and their difference: all nonzero in float32,
            # the difference positive (the band between the two wavelengths is not empty).
            check_rope_divisor(self.low_freq_factor, "rope_scaling low_freq_factor")
            check_rope_divisor(self.high_freq_factor, "rope_scaling high_freq_factor")
            if not np.float32(self.low_freq_factor) < np.float32(self.high_freq_factor):
                raise ConfigError(
                    f"rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < "
                    f"high_freq_factor ({self.high_freq_factor}), in float32"
                )
            if not self.original_max_position_embeddings > 0:
                raise ConfigError("rope_scaling original_max_position_embeddings must be positive")
            float32_of("rope_scaling original_max_position_embeddings",
                       self.original_max_position_embeddings, "RoPE")
        factors = tuple(float(f) for f in self.freq_factors)
        object.__setattr__(self, "freq_factors", factors)
        if self.rope_type != "freq_factors":
            if factors:
                raise ConfigError(
                    f"rope_scaling freq_factors are given but the type is {self.rope_type!r}"
                )
            return
        if not factors:
            raise ConfigError("rope_scaling type 'freq_factors' needs at least one factor")
        for i, f in enumerate(factors):
            if not (math.isfinite(f) and f > 0):
                raise ConfigError(
                    f"rope_scaling freq_factors[{i}] is {f}; each must be finite and positive"
                )
            check_rope_divisor(f, f"rope_scaling freq_factors[{i}]")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family transformer hyperparameters (llama2.c's `Config`, plus norm and RoPE settings).

    Attributes:
      dim: width of the residual stream (tokens are `f32[dim]` vectors).
      hidden_dim: width of the SwiGLU feed-forward layer.
      n_layers: number of transformer layers.
      n_heads: number of query heads.
      n_kv_heads: number of key/value heads; `n_heads % n_kv_heads == 0` (grouped-query
        attention when smaller than `n_heads`).
      vocab_size: number of tokens.
      seq_len: maximum sequence length in tokens (size of the KV cache).
      shared_weights: True when the classifier `wcls` is the token embedding table.
      norm_eps: epsilon inside RMSNorm's square root (llama2.c: 1e-5).
      rope_theta: RoPE base frequency (llama2.c: 10000).
      head_dim: size of one attention head; defaults to `dim // n_heads` as in run.c (Qwen3
        and Mistral's newer models set their own: Qwen3-0.6B has dim 1024, 16 heads of 128).
      rope_scaling: a `RopeScaling`, or None for plain RoPE.
      qkv_bias: the q, k and v projections add a bias (Qwen2 / Qwen2.5: `bq`, `bk`, `bv` in
        `TransformerWeights`), added before q/k normalization and RoPE.
      qk_norm: each head's query and key is RMSNorm'd over head_dim with its own gains (Qwen3:
        `q_norm`, `k_norm`, eps `norm_eps`) after the projection and before RoPE.
      sliding_window: attention sees only the last `sliding_window` positions, in every layer
        (Mistral v0.1: 4096); 0 for none. Full causal attention is the same while every
        position is within the window, so the readers cap the context there unless a longer
        seq_len is asked for; past it attention masks older positions (the NumPy reference,
        and XLA's attention, which runs in place of the CPU attention kernels: they have no
        window, `jllama.graphs.attention.windowed`).
      n_experts: a Mixture-of-Experts FFN with this many experts per layer (Qwen3-MoE:
        `ffn_gate_inp` routes each token to `n_experts_per_tok` of them; `hidden_dim` is then
        one expert's width, Hugging Face's moe_intermediate_size); 0 for a dense SwiGLU FFN.
      n_experts_per_tok: experts each token is routed to (top-k of the router's softmax);
        0 when n_experts is 0.
      norm_topk_prob: the k routed experts' softmax weights are divided by their sum
        (Qwen3-MoE's norm_topk_prob; llama.cpp always does for qwen3moe); MoE only.

    Raises:
      ConfigError: a size that is non-positive or absurdly large, or sizes that do not fit
        together (heads not dividing, odd head_dim, freq_factors not one per rotated pair).
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_weights: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int = 0  # 0: derive dim // n_heads
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # 0: none
    n_experts: int = 0  # 0: a dense FFN
    n_experts_per_tok: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self):
        limits = {
            "dim": MAX_DIM,
            "hidden_dim": 8 * MAX_DIM,
            "n_layers": MAX_LAYERS,
            "n_heads": MAX_DIM,
            "n_kv_heads": MAX_DIM,
            "vocab_size": MAX_VOCAB,
            "seq_len": MAX_SEQ_LEN,
        }
        for name, limit in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            try:
                value = operator.index(value)  # int, or a NumPy integer from a file header
            except TypeError:
                raise ConfigError(f"{name} must be an integer, got {value!r}") from None
            object.__setattr__(self, name, value)
            if not 0 < value <= limit:
                raise ConfigError(f"{name}={value} is out of range (1..{limit})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if not 0 < self.head_dim <= MAX_DIM:
            raise ConfigError(f"head_dim={self.head_dim} is out of range (1..{MAX_DIM})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd; RoPE rotates pairs")
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        window = self.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ConfigError(f"sliding_window={window!r} must be a non-negative integer")
        self._check_experts()
        check_norm_eps(self.norm_eps)
        check_rope_theta(self.rope_theta)
        scaling = self.rope_scaling
        if scaling is not None and scaling.freq_factors:
            if len(scaling.freq_factors) != self.head_dim // 2:
                raise ConfigError(
                    f"rope_scaling has {len(scaling.freq_factors)} freq_factors; "
                    f"head_dim={self.head_dim} rotates {self.head_dim // 2} pairs"
                )
        self._check_rope_angles()

    def _check_experts(self) -> None:
        """Raise ConfigError unless the MoE fields fit: both 0 (dense), or 0 < n_experts <=
        MAX_EXPERTS and 0 < n_experts_per_tok <= n_experts."""
        e, k = self.n_experts, self.n_experts_per_tok
        for name, value in (("n_experts", e), ("n_experts_per_tok", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}")
        if e == 0 and k == 0:
            return
        if not 0 < e <= MAX_EXPERTS:
            raise ConfigError(f"n_experts={e} is out of range (1..{MAX_EXPERTS}) with "
                              f"n_experts_per_tok={k}")
        if not 0 < k <= e:
            raise ConfigError(f"n_experts_per_tok={k} must be in 1..n_experts={e}")

    @property
    def moe(self) -> bool:
        """Whether the FFN is a Mixture of Experts (`n_experts` > 0)."""
        return self.n_experts > 0

    def _check_rope_angles(self) -> None:
        """Raise ConfigError unless every RoPE inverse frequency, and its angle at the last
        position (seq_len - 1) * inv_freq, is finite in float32.

        Each parameter was checked alone above; this checks what they make together, as the
        backends compute it (`jllama.model.rope.rope_frequencies`), e.g. a finite factor of 1e-38
        whose inverse frequencies times 4096 positions overflow. A few microseconds.
        """
        with np.errstate(all="ignore"):  # what overflows is reported below, not printed
            inv_freq = rope_frequencies(self)
            last = np.float32(self.seq_len - 1) * inv_freq
        bad = np.flatnonzero(~np.isfinite(last) | ~(inv_freq >= 0))
        if bad.size:
            i, s = int(bad[0]), self.rope_scaling
            scaled = f", {s.rope_type} scaling by {s.factor!r}" if s is not None else ""
            raise ConfigError(
                f"RoPE's inverse frequency of pair {i} is {float(inv_freq[i]):g} rad/token "
                f"as float32 (rope_theta={self.rope_theta!r}{scaled}): its angle at position "
                f"{self.seq_len - 1} is not finite"
            )

    @property
    def q_dim(self) -> int:
        """Width of all query heads together: `n_heads * head_dim` (== dim for llama2.c models)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together: `n_kv_heads * head_dim`."""
        return self.n_kv_heads * self.head_dim

    @property
    def kv_mul(self) -> int:
        """Query heads per key/value head (`n_heads // n_kv_heads`), as run.c's kv_mul."""
        return self.n_heads // self.n_kv_heads

    def kv_cache_nbytes(self, itemsize: int = 4) -> int:
        """Bytes of the key and value caches for `seq_len` positions (f32 by default):
        `2 * n_layers * n_kv_heads * seq_len * head_dim * itemsize`."""
        return 2 * self.n_layers * self.n_kv_heads * self.seq_len * self.head_dim * itemsize

    def n_params(self) -> int:
        """Number of parameters (a shared classifier counted once; every expert counted)."""
        per_layer = (
            2 * self.dim  # rms_att_weight, rms_ffn_weight
            + self.q_dim * self.dim * 2  # wq, wo
            + self.kv_dim * self.dim * 2  # wk, wv
            + self.hidden_dim * self.dim * 3 * max(self.n_experts, 1)  # w1, w2, w3 (each expert's)
            + self.n_experts * self.dim  # ffn_gate_inp
            + (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0)  # bq, bk, bv
            + (2 * self.head_dim if self.qk_norm else 0)  # q_norm, k_norm
        )
        cls = 0 if self.shared_weights else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + cls
