"""llama2.c version-0 checkpoints: reading the real stories260K file, bit-exact round trips,
and one-line errors for bad files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import STORIES260K

from jllama.model.config import ModelConfig
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.llama2c import (
    checkpoint_nbytes,
    read_checkpoint,
    read_header,
    write_checkpoint,
)
from jllama.model.weights import expected_shapes, random_weights

GQA_UNSHARED = ModelConfig(
    dim=48, hidden_dim=100, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=96, seq_len=40,
    shared_weights=False,
)


def test_stories260k_header_is_what_the_model_card_says():
    # ../shared/README.md: dim 64, hidden_dim 172, n_layers 5, n_heads 8, n_kv_heads 4,
    # vocab_size 512, seq_len 512, shared classifier.
    config = read_header(STORIES260K)
    assert (config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
            config.vocab_size, config.seq_len) == (64, 172, 5, 8, 4, 512, 512)
    assert config.shared_weights and config.head_dim == 8 and config.kv_mul == 2


def test_stories260k_tensors_sit_where_run_c_reads_them(stories260k):
    config, weights = stories260k
    raw = np.fromfile(STORIES260K, dtype="<f4", offset=28)
    # Offsets computed by hand from run.c's memory_map_weights for this header.
    emb = 512 * 64
    assert np.array_equal(weights.token_embedding_table.ravel(), raw[:emb])
    off = emb + 5 * 64  # after rms_att_weight
    assert np.array_equal(weights.wq[0].ravel(), raw[off : off + 64 * 64])
    off += 5 * 64 * 64 + 2 * 5 * 32 * 64 + 5 * 64 * 64 + 5 * 64 + 3 * 5 * 172 * 64
    assert np.array_equal(weights.rms_final_weight, raw[off : off + 64])
    assert weights.wcls is weights.token_embedding_table
    assert raw.size == off + 64 + 2 * 512 * 4  # then only the two skipped RoPE tables


@pytest.mark.parametrize("shared", [True, False])
def test_write_then_read_round_trips_bit_exactly(tmp_path, shared):
    config = ModelConfig(**{**GQA_UNSHARED.__dict__, "shared_weights": shared})
    weights = random_weights(config, seed=3)
    path = tmp_path / "model.bin"
    write_checkpoint(path, config, weights)
    assert path.stat().st_size == checkpoint_nbytes(config)
    config2, weights2 = read_checkpoint(path)
    assert config2 == config
    for name in expected_shapes(config):
        a, b = getattr(weights, name), getattr(weights2, name)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert (weights2.wcls is weights2.token_embedding_table) == shared
    # Header as run.c reads it: a negative vocab_size flags the separate classifier.
    header = struct.unpack("<7i", path.read_bytes()[:28])
    assert header == (48, 100, 3, 6, 2, 96 if shared else -96, 40)
    # Writing what was read gives the same bytes again.
    write_checkpoint(tmp_path / "again.bin", config2, weights2)
    assert (tmp_path / "again.bin").read_bytes() == path.read_bytes()


def test_writing_the_real_model_reproduces_its_file_exactly(tmp_path, stories260k):
    config, weights = stories260k
    write_checkpoint(tmp_path / "copy.bin", config, weights)
    # The RoPE tables run.c skips are regenerated, so compare everything else byte for byte.
    original = STORIES260K.read_bytes()
    copy = (tmp_path / "copy.bin").read_bytes()
    tables = 2 * config.seq_len * config.head_dim // 2 * 4
    assert len(copy) == len(original)
    assert copy[: len(copy) - tables] == original[: len(original) - tables]
    # export.py writes cos/sin of pos * theta^(-2i/head_dim) with the angle rounded to f32
    # (error up to ~512 * 2^-24 rad here); ours uses f64 angles: agreement to ~1e-5.
    ours = np.frombuffer(copy[len(copy) - tables :], "<f4")
    theirs = np.frombuffer(original[len(original) - tables :], "<f4")
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_write_refuses_weights_that_do_not_fit_the_config(tmp_path):
    weights = random_weights(GQA_UNSHARED)
    other = ModelConfig(**{**GQA_UNSHARED.__dict__, "hidden_dim": 64})
    with pytest.raises(ConfigError, match="w1"):
        write_checkpoint(tmp_path / "x.bin", other, weights)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _header(*values):
    return struct.pack("<7i", *values)


def _one_line(message: str, *needles: str) -> None:
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path / "nope.bin")
    _one_line(str(e.value), "nope.bin", "no such file")


def test_directory(tmp_path):
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)
    _one_line(str(e.value), str(tmp_path), "directory")


def test_shorter_than_header(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "short.bin", "3 bytes", "28-byte header")


@pytest.mark.parametrize(
    "values, needle",
    [
        ((0, 172, 5, 8, 4, 512, 512), "dim=0"),
        ((64, -1, 5, 8, 4, 512, 512), "hidden_dim=-1"),
        ((64, 172, 5, 8, 3, 512, 512), "n_kv_heads=3"),
        ((64, 172, 5, 7, 7, 512, 512), "dim=64 is not a multiple of n_heads=7"),
        ((64, 172, 5, 8, 4, 0, 512), "vocab_size=0"),
        ((64, 172, 5, 8, 4, 512, 2**30), "seq_len=1073741824"),
        ((2**30, 172, 5, 8, 4, 512, 512), "dim=1073741824"),
        ((0x7F454C46, 0x00010102, 0, 0, 0, 0, 0), "dim="),  # an ELF binary, say
    ],
)
def test_bad_header(tmp_path, values, needle):
    path = tmp_path / "bad.bin"
    path.write_bytes(_header(*values) + bytes(64))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "bad.bin", "bad header", needle)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.bin"
    data = STORIES260K.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "cut.bin", "truncated", str(len(data) - 1000), str(len(data)))


def test_trailing_bytes(tmp_path):
    path = tmp_path / "long.bin"
    data = STORIES260K.read_bytes()
    path.write_bytes(data + bytes(12))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "long.bin", "longer", str(len(data) + 12), str(len(data)))


def test_unshared_flag_changes_the_expected_size(tmp_path):
    # The same tensors with a negative vocab_size: the file lacks the separate classifier.
    path = tmp_path / "neg.bin"
    data = bytearray(STORIES260K.read_bytes())
    data[20:24] = struct.pack("<i", -512)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "neg.bin", "truncated", "shared_weights=False")


def test_weights_are_memory_mapped_not_copied(stories260k):
    _, weights = stories260k
    assert not weights.wq.flags.writeable  # a read-only view of the mapped file
    assert not weights.wq.flags.owndata


@pytest.mark.parametrize(
    "change, needle",
    [({"head_dim": 16}, "head_dim=16"), ({"norm_eps": 1e-6}, "norm_eps"),
     ({"rope_theta": 500000.0}, "rope_theta")],
)
def test_write_refuses_what_version_0_cannot_record(tmp_path, change, needle):
    config = ModelConfig(**{**GQA_UNSHARED.__dict__, **change})
    with pytest.raises(ConfigError, match=needle):
        write_checkpoint(tmp_path / "x.bin", config, random_weights(config))
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_a_separate_classifier_under_shared_weights(tmp_path):
    import dataclasses

    config = ModelConfig(**{**GQA_UNSHARED.__dict__, "shared_weights": True})
    weights = random_weights(config)
    other = dataclasses.replace(weights, wcls=2 * weights.token_embedding_table)
    with pytest.raises(ConfigError, match="shared_weights=True but wcls differs"):
        write_checkpoint(tmp_path / "x.bin", config, other)
    # an equal copy is fine: it is the same classifier
    same = dataclasses.replace(weights, wcls=weights.token_embedding_table.copy())
    write_checkpoint(tmp_path / "y.bin", config, same)


def test_write_goes_through_links_and_refuses_special_files(tmp_path):
    import os

    config = GQA_UNSHARED
    weights = random_weights(config)
    real = tmp_path / "real.bin"
    real.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    write_checkpoint(link, config, weights)
    assert link.is_symlink() and real.stat().st_size == checkpoint_nbytes(config)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        write_checkpoint(fifo, config, weights)
    assert fifo.exists() and not fifo.is_file()
    with pytest.raises(CheckpointError, match="empty"):
        write_checkpoint("", config, weights)
