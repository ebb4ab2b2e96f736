"""jllama's weight dataclasses registered as JAX pytrees, for the JAX code that takes them.

The weight containers are plain frozen dataclasses, so the readers (`jllama.formats`), the
tokenizers and the NumPy reference import no JAX. The JAX code imports this module
(`jllama.kernels` and `jllama.platform.sharding` do, and through them `jllama.graphs` and the jax
backend), which registers them with `jax.tree_util.register_dataclass` (jax-llm-examples'
"pytrees as registered dataclasses"):

  weights.TransformerWeights, weights.LayerWeights, weights.GraphWeights,
  quant.Int8Matrix, ggml_matrix.RowStack, ggml_matrix.LayerStack, ggml_matrix.FloatRows:
      every field a child (arrays, or tuples of the other types), no static metadata;
  ggml_matrix.GGMLMatrix: `data` the one child, `type_id` and `cols` static (so a jitted
      program is specialised on the GGML type and the row length).

So they travel through `jax.device_put`, `jax.jit` and `jax.tree.map` like the arrays they
hold. Python runs this module once however often it is imported; JAX refuses a second
registration of one type, so it must not be reloaded.
"""

from __future__ import annotations

import dataclasses

import jax

from jllama.model.ggml_matrix import FloatRows, GGMLMatrix, LayerStack, RowStack
from jllama.model.quant import Int8Matrix
from jllama.model.weights import GraphWeights, LayerWeights, TransformerWeights

ALL_CHILDREN = (
    TransformerWeights, LayerWeights, GraphWeights, Int8Matrix, RowStack, LayerStack, FloatRows
)
"""The registered types whose every field is a child."""

for _cls in ALL_CHILDREN:
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[]
    )
jax.tree_util.register_dataclass(GGMLMatrix, data_fields=["data"], meta_fields=["type_id", "cols"])
