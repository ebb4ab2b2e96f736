"""Model hyperparameters.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument under `jax.jit`
and a dictionary key. The derived sizes (`head_dim`, `q_dim`, `kv_dim`, `kv_mul`) are computed
once here, with llama2.c run.c's meanings, so no other module re-derives them.
"""

from __future__ import annotations

import dataclasses
import math
import operator

from jllama.errors import ConfigError

# Sizes above these are not models anyone runs on this engine; a header that claims them is
# almost certainly a corrupt or foreign file, and refusing early avoids multi-GB allocations.
MAX_DIM = 1 << 16
MAX_LAYERS = 1 << 10
MAX_VOCAB = 1 << 22
MAX_SEQ_LEN = 1 << 22


ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for a longer context (Hugging Face's `rope_scaling`,
    or llama.cpp's `rope_freqs` tensor).

    Attributes:
      rope_type: "linear" (every frequency divided by `factor`, i.e. positions compressed),
        "llama3" (Llama 3.1/3.2: low frequencies divided by `factor`, high ones kept, a smooth
        blend between; `jllama.rope.rope_frequencies` has the formula), or "freq_factors"
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
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling factor={self.factor} must be positive")
        if self.rope_type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ConfigError(
                    f"rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < "
                    f"high_freq_factor ({self.high_freq_factor})"
                )
            if not self.original_max_position_embeddings > 0:
                raise ConfigError("rope_scaling original_max_position_embeddings must be positive")
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
      head_dim: size of one attention head; defaults to `dim // n_heads` as in run.c.
      rope_scaling: a `RopeScaling`, or None for plain RoPE.

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
        if not 0 < self.norm_eps < math.inf:
            raise ConfigError(f"norm_eps={self.norm_eps} must be positive and finite")
        if not 0 < self.rope_theta < math.inf:
            raise ConfigError(f"rope_theta={self.rope_theta} must be positive and finite")
        scaling = self.rope_scaling
        if scaling is not None and scaling.freq_factors:
            if len(scaling.freq_factors) != self.head_dim // 2:
                raise ConfigError(
                    f"rope_scaling has {len(scaling.freq_factors)} freq_factors; "
                    f"head_dim={self.head_dim} rotates {self.head_dim // 2} pairs"
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
        """Number of parameters (a shared classifier counted once)."""
        per_layer = (
            2 * self.dim  # rms_att_weight, rms_ffn_weight
            + self.q_dim * self.dim * 2  # wq, wo
            + self.kv_dim * self.dim * 2  # wk, wv
            + self.hidden_dim * self.dim * 3  # w1, w2, w3
        )
        cls = 0 if self.shared_weights else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + cls
