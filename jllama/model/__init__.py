"""The model: its shape, its weights and their numbers.

`config` (ModelConfig: dim, n_layers, n_heads, ...), `weights` (TransformerWeights and the
layouts the graphs read), `loading` (any checkpoint + tokenizer into those), `convert` (any
checkpoint to a llama2.c file), `quant` and `ggml_matrix` (quantized matrices: llama2.c's
int8 groups, GGML's blocks kept as stored), `ggml_repack` and `packing` (the kernels' layout
and the one buffer it lives in), `rope` (rotary frequencies, Llama 3.1 scaling), `cache_types`
(KV cache element types) and `pytrees` (the dataclasses registered with JAX).
"""
