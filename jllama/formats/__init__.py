"""Readers and writers of model files, a few modules per format, one job each (none imports JAX):

  llama2c.py          llama2.c checkpoints: the reader (and the package's names for all three)
  llama2c_layout.py   their layouts by version, sizes, Q8_0 groups
  llama2c_writer.py   the writer (export.py's versions 0, 1, 2)
  gguf.py             GGUF: tensors -> TransformerWeights (as stored or float32)
  gguf_config.py      GGUF metadata (and rope_freqs.weight) -> ModelConfig
  gguf_header.py      the GGUF container in one pass
  ggml_types.py       GGML type ids, names, block sizes
  ggml_quants.py      GGML blocks dequantized (F32 .. Q6_K)
  hf.py               Hugging Face folders: tensors -> TransformerWeights, Q/K rows permuted
  hf_config.py        config.json -> ModelConfig
  safetensors_file.py the safetensors container: header, memory map, a folder's shards
  tensor_names.py     a format's tensor names <-> TransformerWeights fields
  base.py             ModelFile, what the GGUF and Hugging Face readers return
"""
