"""Converting any checkpoint jllama reads into a llama2.c checkpoint file.

The source is read with `jllama.model.loading.open_model` (a llama2.c file of any version, a GGUF
file, a known model's name, and whatever else that function reads), so its weights arrive as
float32 or bfloat16 arrays in llama2.c's layout (GGUF quantized tensors already dequantized).
They are written with `jllama.formats.llama2c.write_checkpoint`: version 1 (float32, export.py's
`version1_export`) by default, version 2 (Q8_0, for runq.c) or the legacy version 0 (run.c).

The tokenizer is not converted: only the weights file is written.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jllama.model.config import ModelConfig
from jllama.errors import ConfigError
from jllama.formats.llama2c import (
    DEFAULT_GROUP_SIZE,
    WrittenCheckpoint,
    check_version,
    fit_group_size,
    write_checkpoint,
)
from jllama.model.loading import open_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertReport(WrittenCheckpoint):
    """What `convert` read and wrote: the `WrittenCheckpoint` of the file (its path, version,
    nbytes, group_size, max_quantization_error and quantization_errors) and the source.

    Attributes:
      source: the checkpoint read (its resolved path).
      source_format: `open_model`'s file_format ("llama2c", "gguf", ...).
      config: the model's config as written (seq_len: the source's whole context).
    """

    source: str
    source_format: str
    config: ModelConfig

    @property
    def destination(self) -> Path:
        """The file written (a link's target when `dst` was a symbolic link): `path`."""
        return self.path


def _refuse_overwriting_source(source: Path, dst: Path) -> None:
    """A conversion must not replace or damage what it reads: refuse `dst` when it is the
    source file, or lies inside the source folder (a Hugging Face folder's own files)."""
    target = dst.resolve()
    source = source.resolve()
    if target == source or (source.is_dir() and source in target.parents):
        raise ConfigError(
            f"--output={dst} would overwrite the checkpoint being converted ({source}); "
            "write somewhere else"
        )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    version: int = 1,
    group_size: int = DEFAULT_GROUP_SIZE,
    force: bool = False,
    exact_group_size: bool = False,
) -> ConvertReport:
    """Read the checkpoint `src` and write it to `dst` as a llama2.c checkpoint.

    Args:
      src: anything `open_model` takes as a checkpoint (a path or a known model's name).
      dst: the llama2.c file to write (atomically, see `write_checkpoint`).
      version: 1 (float32, the default), 2 (Q8_0) or 0 (legacy).
      group_size: version 2's Q8_0 group size, reduced to fit the model as
        `jllama.formats.llama2c.fit_group_size` says; the report gives the one stored.
      force: write even if the source's norm_eps, rope_theta or rope_scaling differ from the
        1e-5, 10000 and plain RoPE that llama2.c's readers assume; the file then describes a
        different model (see `write_checkpoint`).
      exact_group_size: refuse a group_size that would have to be reduced to fit the model
        (and any group_size for versions other than 2) instead of adjusting it.

    Returns:
      a `ConvertReport`.

    Raises:
      CheckpointError, FetchError: `src` cannot be read (see `open_model`), or `dst` cannot be
        written.
      ConfigError: the model cannot be stored in a llama2.c file (a field named in the
        message: head_dim, norm_eps, rope_theta, rope_scaling), a bad version or group_size,
        or NaN/infinite weights for version 2.
    """
    check_version(version)  # before reading a model that could not be written
    model = open_model(src, need_tokenizer=False)
    _refuse_overwriting_source(Path(model.source), Path(dst))
    if exact_group_size:
        if version != 2:
            raise ConfigError(f"group_size={group_size} is for version 2 files only")
        fitted = fit_group_size(model.config, group_size)
        if fitted != group_size:
            raise ConfigError(
                f"group_size={group_size} does not divide dim={model.config.dim} and "
                f"hidden_dim={model.config.hidden_dim} (e.g. {fitted} does)"
            )
    written = write_checkpoint(
        dst, model.config, model.weights, version=version, group_size=group_size, force=force
    )
    written_fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
    return ConvertReport(
        **written_fields, source=model.source, source_format=model.file_format,
        config=model.config,
    )
