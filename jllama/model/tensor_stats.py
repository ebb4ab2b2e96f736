"""Per-tensor statistics of a model's weights, for `jllama --verify_checkpoint`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # jllama.model.weights re-exports this module's names
    from jllama.model.weights import TransformerWeights


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """Summary of one weight tensor (for `jllama --verify_checkpoint`).

    Attributes:
      name: field name in `TransformerWeights`.
      shape: tensor shape.
      min, max, mean: over the finite values (NaN when there are none), as float64.
      n_nonfinite: number of NaN or infinite values.
    """

    name: str
    shape: tuple[int, ...]
    min: float
    max: float
    mean: float
    n_nonfinite: int

    @property
    def finite(self) -> bool:
        return self.n_nonfinite == 0


def tensor_stats(weights: TransformerWeights) -> list[TensorStats]:
    """Statistics of every tensor in file order (a shared `wcls` listed once, as the
    embedding table). Reads each tensor once."""
    stats = []
    for field in dataclasses.fields(weights):
        if field.name == "wcls" and weights.wcls is weights.token_embedding_table:
            continue
        if getattr(weights, field.name) is None:
            continue
        array = np.asarray(getattr(weights, field.name))
        finite_mask = np.isfinite(array)
        n_finite = int(np.count_nonzero(finite_mask))
        values = array[finite_mask] if n_finite < array.size else array
        stats.append(
            TensorStats(
                name=field.name,
                shape=tuple(array.shape),
                min=float(values.min()) if n_finite else float("nan"),
                max=float(values.max()) if n_finite else float("nan"),
                mean=float(values.mean(dtype=np.float64)) if n_finite else float("nan"),
                n_nonfinite=array.size - n_finite,
            )
        )
    return stats
