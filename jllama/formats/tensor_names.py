"""How a file format names the tensors of `jllama.model.weights.TransformerWeights`.

GGUF (`blk.N.attn_q.weight`) and Hugging Face (`model.layers.N.self_attn.q_proj.weight`) name
each layer's tensors as a prefix, the layer number, a module name and a suffix, and the
tensors outside the layers by fixed names. `TensorNames` holds one format's table and maps
names to fields and back; `check_complete` names the tensors a file lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError
from jllama.model.weights import expected_shapes


BIAS = ".bias"
"""The suffix of a bias tensor's name (a layer module named with it is a whole name)."""


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """One format's tensor names.

    Attributes:
      global_names: {tensor name: field} of the tensors outside the layers (the embedding
        table, the final norm, the classifier).
      layer_names: {module name: field} of each layer's tensors (`rms_att_weight`, `wq`...);
        a module name that ends in ".bias" is the tensor's whole name after the layer number
        (`suffix` not added): "attn_q.bias" -> bq.
      layer_prefix: what precedes the layer number, e.g. "blk.".
      suffix: what follows the module name, e.g. ".weight".
    """

    global_names: Mapping[str, str]
    layer_names: Mapping[str, str]
    layer_prefix: str
    suffix: str = ".weight"

    def target(self, name: str, n_layers: int) -> tuple[str, int | None] | None:
        """(field, layer) of tensor `name`; layer None for a global tensor; None for a name
        that is not a model tensor or is of a layer >= n_layers."""
        if name in self.global_names:
            return self.global_names[name], None
        if not name.startswith(self.layer_prefix):
            return None
        number, _, module = name[len(self.layer_prefix) :].partition(".")
        if module.endswith(self.suffix):
            module = module[: -len(self.suffix)]
        elif not module.endswith(BIAS):
            return None
        field = self.layer_names.get(module)
        if field is None or not number.isdecimal() or int(number) >= n_layers:
            return None
        return field, int(number)

    def name(self, field: str, layer: int | None) -> str:
        """The tensor name of `field` (of `layer`, None for a global field)."""
        if layer is None:
            return next(k for k, v in self.global_names.items() if v == field)
        module = next(k for k, v in self.layer_names.items() if v == field)
        suffix = "" if module.endswith(BIAS) else self.suffix
        return f"{self.layer_prefix}{layer}.{module}{suffix}"

    def check_complete(
        self, config: ModelConfig, present: set[tuple[str, int | None]], source: str
    ) -> None:
        """Raise CheckpointError naming the first three missing tensors (of `config`'s fields
        in llama2.c order, wcls skipped when `config.shared_weights`), given the (field,
        layer) pairs `present`; the message counts the rest."""
        missing = []
        for field in expected_shapes(config):
            if field == "wcls" and config.shared_weights:
                continue
            layers = [None] if field in self.global_names.values() else range(config.n_layers)
            missing += [self.name(field, l) for l in layers if (field, l) not in present]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CheckpointError(f"{source}: missing tensor {', '.join(missing[:3])}{more}")
