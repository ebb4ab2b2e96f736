"""llama2.c's versioned checkpoints (export.py's version 1, float32, and version 2, Q8_0):
header bytes and tensor offsets checked against the format as export.py and runq.c define it
(the expected bytes are assembled here with struct and NumPy, and Q8_0 with torch following
export.py's quantize_q80 step by step), round trips against the original arrays, the
stories260K model through each version, and one-line errors."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from conftest import STORIES260K

from jllama.backends import make_backend
from jllama.model.config import ModelConfig, RopeScaling
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.llama2c import (
    checkpoint_nbytes,
    fit_group_size,
    read_checkpoint,
    read_checkpoint_header,
    write_checkpoint,
)
from jllama.model.weights import expected_shapes, random_weights

MAGIC = 0x616B3432  # export.py: struct.pack('I', 0x616b3432), "ak42"
# dim and hidden_dim multiples of 64, so export.py's default group size 64 is kept.
SMALL = ModelConfig(
    dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=16,
    shared_weights=False,
)
FIELDS = list(expected_shapes(SMALL))  # a Llama's: no biases, no q/k norms


def _config(shared: bool, base: ModelConfig = SMALL) -> ModelConfig:
    return dataclasses.replace(base, shared_weights=shared)


def _weights(config: ModelConfig, seed: int = 3):
    return random_weights(config, seed=seed, scale=0.1)


def _f32(array) -> bytes:
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def _layers(stacked):
    return [stacked[l] for l in range(stacked.shape[0])]


def _spec_header(config: ModelConfig, version: int, group_size: int = 0) -> bytes:
    """export.py's header: I magic, i version, 7 i, B shared_classifier, (v2) i group_size,
    zeros to 256 bytes. Native '=' packing, no alignment padding, as struct.pack('B') then
    struct.pack('i') write them one after the other."""
    c = config
    raw = struct.pack("<Ii", MAGIC, version)
    raw += struct.pack("<7i", c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                       c.vocab_size, c.seq_len)
    raw += struct.pack("<B", int(c.shared_weights))
    if version == 2:
        raw += struct.pack("<i", group_size)
    return raw + b"\0" * (256 - len(raw))


def _spec_v1(config: ModelConfig, w) -> bytes:
    """version1_export: norms (all layers), final norm, embedding, then wq..w3 for all
    layers each, classifier when not shared."""
    tensors = [*_layers(w.rms_att_weight), *_layers(w.rms_ffn_weight), w.rms_final_weight,
               w.token_embedding_table]
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        tensors += _layers(getattr(w, name))
    if not config.shared_weights:
        tensors.append(w.wcls)
    return _spec_header(config, 1) + b"".join(_f32(t) for t in tensors)


def _export_py_q80(w, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """export.py's quantize_q80 in torch: scale = max|w| / 127 per group, q = round(w / scale)
    (torch.round: half to even), for groups that are not all zero."""
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(-1, group_size)
    scale = torch.abs(t).max(dim=1).values / 127.0
    q = torch.round(t / scale[:, None]).to(torch.int8)
    return q.numpy().reshape(-1), scale.numpy()


def _spec_v2(config: ModelConfig, w, group_size: int) -> bytes:
    """version2_export (current export.py, as runq.c maps it): norms in f32, then per weight
    (embedding, wq[0..L-1], ..., w3[..], classifier when not shared) int8 values followed by
    its f32 scales."""
    raw = _spec_header(config, 2, group_size)
    raw += b"".join(_f32(t) for t in [*_layers(w.rms_att_weight), *_layers(w.rms_ffn_weight),
                                      w.rms_final_weight])
    matrices = [w.token_embedding_table]
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        matrices += _layers(getattr(w, name))
    if not config.shared_weights:
        matrices.append(w.wcls)
    for m in matrices:
        q, s = _export_py_q80(m, group_size)
        raw += q.tobytes() + _f32(s)
    return raw


def _assert_equal_weights(got, want, fields=FIELDS):
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == np.float32 and a.shape == b.shape, name
        assert a.tobytes() == np.ascontiguousarray(b, np.float32).tobytes(), name


# --- headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False])
def test_version_1_header_field_by_field(tmp_path, shared):
    config = _config(shared)
    path = tmp_path / "v1.bin"
    write_checkpoint(path, config, _weights(config), version=1)
    raw = path.read_bytes()[:256]
    assert raw[:4] == b"24ka"  # "ak42" as a little-endian uint32
    assert struct.unpack_from("<I", raw, 0) == (MAGIC,)
    assert struct.unpack_from("<i", raw, 4) == (1,)
    assert struct.unpack_from("<7i", raw, 8) == (64, 128, 2, 4, 2, 96, 16)  # vocab stays positive
    assert struct.unpack_from("<B", raw, 36) == (int(shared),)
    assert raw[37:] == bytes(256 - 37)


@pytest.mark.parametrize("shared", [True, False])
def test_version_2_header_field_by_field(tmp_path, shared):
    config = _config(shared)
    path = tmp_path / "v2.bin"
    written = write_checkpoint(path, config, _weights(config), version=2)
    raw = path.read_bytes()[:256]
    assert struct.unpack_from("<I", raw, 0) == (MAGIC,)
    assert struct.unpack_from("<i", raw, 4) == (2,)
    assert struct.unpack_from("<7i", raw, 8) == (64, 128, 2, 4, 2, 96, 16)
    assert struct.unpack_from("<B", raw, 36) == (int(shared),)
    assert struct.unpack_from("<i", raw, 37) == (64,)  # unaligned, right after the flag byte
    assert raw[41:] == bytes(256 - 41)
    assert written.group_size == 64
    header = read_checkpoint_header(path)
    assert (header.version, header.group_size, header.nbytes) == (2, 64, 256)
    assert header.config == config


# --- version 1 --------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False])
def test_version_1_file_is_export_py_layout_and_round_trips_bit_exactly(tmp_path, shared):
    config = _config(shared)
    weights = _weights(config)
    path = tmp_path / "v1.bin"
    written = write_checkpoint(path, config, weights, version=1)
    assert path.read_bytes() == _spec_v1(config, weights)
    assert written.nbytes == path.stat().st_size == checkpoint_nbytes(config, version=1)
    assert written.max_quantization_error == 0.0
    config2, weights2 = read_checkpoint(path)
    assert config2 == config
    _assert_equal_weights(weights2, weights)
    assert (weights2.wcls is weights2.token_embedding_table) == shared
    assert not weights2.wq.flags.writeable  # a view of the mapped file, as version 0


def test_version_1_tensors_at_their_spec_offsets(tmp_path):
    c = _config(shared=False)
    weights = _weights(c)
    path = tmp_path / "v1.bin"
    write_checkpoint(path, c, weights, version=1)
    raw = path.read_bytes()
    L, dim, kv_dim, hidden, vocab = c.n_layers, c.dim, c.kv_dim, c.hidden_dim, c.vocab_size

    def floats_at(offset_floats, shape):
        n = int(np.prod(shape))
        return np.frombuffer(raw, "<f4", count=n, offset=256 + 4 * offset_floats).reshape(shape)

    # Offsets in floats after the 256-byte header, from version1_export's order.
    norms = 2 * L * dim + dim
    emb = norms
    wq = emb + vocab * dim
    wk = wq + L * dim * dim
    wv = wk + L * kv_dim * dim
    wo = wv + L * kv_dim * dim
    w1 = wo + L * dim * dim
    w2 = w1 + L * hidden * dim
    w3 = w2 + L * dim * hidden
    wcls = w3 + L * hidden * dim
    assert np.array_equal(floats_at(L * dim + dim, (dim,)), weights.rms_ffn_weight[1])
    assert np.array_equal(floats_at(2 * L * dim, (dim,)), weights.rms_final_weight)
    assert np.array_equal(floats_at(emb, (vocab, dim)), weights.token_embedding_table)
    assert np.array_equal(floats_at(wk + kv_dim * dim, (kv_dim, dim)), weights.wk[1])
    assert np.array_equal(floats_at(w2, (dim, hidden)), weights.w2[0])
    assert np.array_equal(floats_at(wcls, (vocab, dim)), weights.wcls)
    assert len(raw) == 256 + 4 * (wcls + vocab * dim)


# --- version 2 --------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False])
def test_version_2_file_is_export_py_quantization_in_runq_layout(tmp_path, shared):
    config = _config(shared)
    weights = _weights(config)
    path = tmp_path / "v2.bin"
    written = write_checkpoint(path, config, weights, version=2)
    assert path.read_bytes() == _spec_v2(config, weights, 64)
    assert written.nbytes == path.stat().st_size == checkpoint_nbytes(config, 2, 64)


@pytest.mark.parametrize("shared", [True, False])
def test_version_2_dequantized_within_half_a_step_of_the_originals(tmp_path, shared):
    config = _config(shared)
    weights = _weights(config)
    path = tmp_path / "v2.bin"
    written = write_checkpoint(path, config, weights, version=2)
    config2, weights2 = read_checkpoint(path)
    assert config2 == config
    # The norms stay float32, exactly.
    _assert_equal_weights(weights2, weights, ["rms_att_weight", "rms_ffn_weight",
                                               "rms_final_weight"])
    worst = 0.0
    for name in ("token_embedding_table", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wcls"):
        original = getattr(weights, name).reshape(-1, 64)  # groups never cross a layer here
        got = getattr(weights2, name).reshape(-1, 64)
        step = np.abs(original).max(axis=1, keepdims=True) / 127  # scale per group
        error = np.abs(got - original)
        # half a quantization step, plus float32 rounding of w / scale and of q * scale
        assert np.all(error <= step / 2 + 1e-6 * step * 127), name
        worst = max(worst, float(error.max()))
    assert written.max_quantization_error == worst  # what export.py prints
    assert (weights2.wcls is weights2.token_embedding_table) == shared


def test_hand_made_version_2_file_reads_as_q_times_s(tmp_path):
    """A file assembled here byte by byte: group_size 8 divides dim but not hidden_dim (12),
    as export.py allows, so groups of w1/w2 cross matrix rows; dequantization is over the
    flattened matrix."""
    c = ModelConfig(dim=8, hidden_dim=12, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10,
                    seq_len=6, shared_weights=False)
    gs = 8
    rng = np.random.default_rng(7)
    raw = struct.pack("<Ii7iBi", MAGIC, 2, 8, 12, 2, 2, 1, 10, 6, 0, gs)
    raw += bytes(256 - len(raw))
    norms = {
        "rms_att_weight": rng.standard_normal((2, 8)).astype("<f4"),
        "rms_ffn_weight": rng.standard_normal((2, 8)).astype("<f4"),
        "rms_final_weight": rng.standard_normal(8).astype("<f4"),
    }
    raw += b"".join(a.tobytes() for a in norms.values())
    # (field, shape of one stored matrix, how many: one per layer or one)
    order = [("token_embedding_table", (10, 8), 1), ("wq", (8, 8), 2), ("wk", (4, 8), 2),
             ("wv", (4, 8), 2), ("wo", (8, 8), 2), ("w1", (12, 8), 2), ("w2", (8, 12), 2),
             ("w3", (12, 8), 2), ("wcls", (10, 8), 1)]
    want = dict(norms)
    for name, shape, count in order:
        mats = []
        for _ in range(count):
            n = int(np.prod(shape))
            q = rng.integers(-127, 128, n).astype(np.int8)
            s = rng.uniform(0.001, 0.1, n // gs).astype("<f4")
            raw += q.tobytes() + s.tobytes()
            mats.append((q.astype(np.float32) * np.repeat(s, gs)).reshape(shape))
        want[name] = mats[0] if count == 1 else np.stack(mats)
    path = tmp_path / "hand.bin"
    path.write_bytes(raw)
    config, weights = read_checkpoint(path)
    assert config == c
    for name, array in want.items():
        assert np.array_equal(getattr(weights, name), array), name
    # The same bytes with shared_classifier = 1 and no classifier: wcls is the embedding.
    shared = bytearray(raw[: len(raw) - (80 + 80 // gs * 4)])
    shared[36] = 1
    path.write_bytes(bytes(shared))
    config, weights = read_checkpoint(path)
    assert config.shared_weights and weights.wcls is weights.token_embedding_table
    assert np.array_equal(weights.token_embedding_table, want["token_embedding_table"])


def test_zero_groups_quantize_to_zero(tmp_path):
    config = _config(shared=True)
    weights = _weights(config)
    wq = np.array(weights.wq)
    wq[0, :2] = 0.0  # two rows = two whole groups of 64 zeros
    weights = dataclasses.replace(weights, wq=wq)
    path = tmp_path / "z.bin"
    write_checkpoint(path, config, weights, version=2)
    _, weights2 = read_checkpoint(path)
    assert np.all(weights2.wq[0, :2] == 0) and np.all(np.isfinite(weights2.wq))


def test_group_size_backs_off_until_it_divides_dim_and_hidden_dim():
    assert fit_group_size(SMALL) == 64
    assert fit_group_size(SMALL, 256) == 64
    assert fit_group_size(dataclasses.replace(SMALL, hidden_dim=96)) == 32
    # stories260K: dim 64, hidden_dim 172 = 4 * 43. export.py would keep 64 (it checks dim
    # only), leaving runq.c's w2 matmul to drop the last 44 inputs of every row.
    stories = read_checkpoint_header(STORIES260K).config
    assert fit_group_size(stories) == 4
    with pytest.raises(ConfigError, match="group_size=0"):
        fit_group_size(SMALL, 0)


# --- stories260K through each version ---------------------------------------------------------


def _logits(config, weights, tokens):
    backend = make_backend("numpy")
    backend.prepare(config, weights)
    return np.stack([backend.forward(t, pos) for pos, t in enumerate(tokens)])


@pytest.fixture(scope="module")
def greedy_story(stories260k):
    """stories260K's first 64 greedy tokens after BOS, and the logits that chose them."""
    config, weights = stories260k
    backend = make_backend("numpy")
    backend.prepare(config, weights)
    tokens, logits = [1], []
    for pos in range(64):
        logits.append(backend.forward(tokens[-1], pos))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens[:64], np.stack(logits)


def test_stories260k_through_version_1_gives_the_same_logits(tmp_path, stories260k, greedy_story):
    config, weights = stories260k
    tokens, want = greedy_story
    write_checkpoint(tmp_path / "v1.bin", config, weights, version=1)
    config1, weights1 = read_checkpoint(tmp_path / "v1.bin")
    assert config1 == config
    np.testing.assert_array_equal(_logits(config1, weights1, tokens), want)


def test_stories260k_through_version_2_gives_close_logits(tmp_path, stories260k, greedy_story):
    config, weights = stories260k
    tokens, want = greedy_story
    written = write_checkpoint(tmp_path / "v2.bin", config, weights, version=2)
    assert written.group_size == 4
    # Measured: largest weight error 0.00556 (wq), file 521728 bytes against 1040384 for v1.
    assert 0.004 < written.max_quantization_error < 0.006
    config2, weights2 = read_checkpoint(tmp_path / "v2.bin")
    got = _logits(config2, weights2, tokens)
    # Measured over these 64 positions: max |logit difference| 0.19 (logits up to ~22 in
    # magnitude), mean 0.03; every greedy token the same.
    assert np.abs(got - want).max() < 0.25
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


# --- errors -----------------------------------------------------------------------------------


def _one_line(message: str, *needles: str) -> None:
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("scale", [3e38, float("inf"), float("nan")])
def test_a_huge_group_scale_is_one_stderr_line_and_exit_1(tmp_path, stories260k, scale):
    """The command on the stories260K file written as version 2, the first group scale of its
    embedding (after the header and the three norms in f32, then the embedding's int8 values)
    set to 3e38: finite, but 3e38 * 127 is not a float32 (dequantizing it once printed two
    NumPy RuntimeWarning lines before the error). One line on stderr, exit code 1."""
    from test_cli import run

    config, weights = stories260k
    path = tmp_path / "v2.bin"
    write_checkpoint(path, config, weights, version=2)
    norms = (2 * config.n_layers + 1) * config.dim
    first_scale = 256 + 4 * norms + config.vocab_size * config.dim
    raw = bytearray(path.read_bytes())
    raw[first_scale:first_scale + 4] = struct.pack("<f", scale)
    path.write_bytes(bytes(raw))
    done = run(f"--checkpoint={path}", "--steps=4", "--temperature=0")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"jllama: error: checkpoint {path}: version-2 tensor "
                               "token_embedding_table: group scale [0] is "), lines[0]


def test_unknown_version_is_named(tmp_path):
    path = tmp_path / "v3.bin"
    path.write_bytes(_spec_header(SMALL, 3) + bytes(4096))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "v3.bin", "version 3", "not supported")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("change", [-1, -100, 3])
def test_truncated_or_too_long(tmp_path, version, change):
    config = _config(shared=False)
    path = tmp_path / "m.bin"
    write_checkpoint(path, config, _weights(config), version=version)
    data = path.read_bytes()
    data = data[:change] if change < 0 else data + bytes(change)
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    what = "truncated" if change < 0 else "longer"
    _one_line(str(e.value), "m.bin", what, f"version-{version}", str(len(data)),
              str(len(data) - change))


@pytest.mark.parametrize("version", [1, 2])
def test_shorter_than_the_256_byte_header(tmp_path, version):
    path = tmp_path / "short.bin"
    path.write_bytes(_spec_header(SMALL, version)[:100])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "short.bin", "100 bytes", "256-byte header", f"version-{version}")


@pytest.mark.parametrize(
    "patch, needle",
    [
        ((8, struct.pack("<i", 0)), "dim=0"),
        ((28, struct.pack("<i", -96)), "vocab_size=-96"),  # no sign flag in versions 1 and 2
        ((36, b"\x02"), "shared_classifier byte is 2"),
        ((37, struct.pack("<i", 0)), "group_size=0"),
        ((37, struct.pack("<i", 48)), "group_size=48 does not divide"),
    ],
)
def test_bad_versioned_header(tmp_path, patch, needle):
    raw = bytearray(_spec_header(SMALL, 2, 64) + bytes(1000))
    offset, value = patch
    raw[offset : offset + len(value)] = value
    path = tmp_path / "bad.bin"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    _one_line(str(e.value), "bad.bin", "bad llama2.c version-2 header", needle)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "change, needle",
    [
        ({"head_dim": 32}, "head_dim=32"),
        ({"rope_theta": 500000.0}, "rope_theta=500000.0"),
        ({"norm_eps": 1e-6}, "norm_eps=1e-06"),
        ({"rope_scaling": RopeScaling("linear", 2.0)}, "rope_scaling="),
    ],
)
def test_write_refuses_what_llama2c_readers_hard_code(tmp_path, version, change, needle):
    config = dataclasses.replace(SMALL, **change)
    with pytest.raises(ConfigError) as e:
        write_checkpoint(tmp_path / "x.bin", config, _weights(config), version=version)
    _one_line(str(e.value), needle, f"version-{version}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", [0, 1, 2])
def test_force_writes_the_weights_and_the_readers_assume_the_defaults(tmp_path, version):
    config = dataclasses.replace(SMALL, rope_theta=500000.0, norm_eps=1e-6)
    weights = _weights(config)
    write_checkpoint(tmp_path / "x.bin", config, weights, version=version, force=True)
    config2, weights2 = read_checkpoint(tmp_path / "x.bin")
    assert config2 == SMALL  # 10000 and 1e-5: the file cannot say otherwise
    if version < 2:
        _assert_equal_weights(weights2, weights)
    # head_dim changes the tensor sizes: refused even with force
    other = dataclasses.replace(SMALL, head_dim=32)
    with pytest.raises(ConfigError, match="head_dim=32"):
        write_checkpoint(tmp_path / "y.bin", other, _weights(other), version=version, force=True)


def test_norm_eps_is_compared_as_run_c_s_float(tmp_path):
    # A GGUF file stores 1e-5 as a float32 (9.99999974e-06); run.c's 1e-5f is the same float.
    config = dataclasses.replace(SMALL, norm_eps=float(np.float32(1e-5)))
    write_checkpoint(tmp_path / "x.bin", config, _weights(config), version=1)


def test_write_refuses_bad_versions_group_sizes_and_non_finite_q80(tmp_path):
    weights = _weights(SMALL)
    with pytest.raises(ConfigError, match="version=3"):
        write_checkpoint(tmp_path / "x.bin", SMALL, weights, version=3)
    with pytest.raises(ConfigError, match="group_size=-4"):
        write_checkpoint(tmp_path / "x.bin", SMALL, weights, version=2, group_size=-4)
    wo = np.array(weights.wo)
    wo[1, 3, 5] = np.nan
    with pytest.raises(ConfigError, match="weights.wo: NaN or infinite"):
        write_checkpoint(tmp_path / "x.bin", SMALL, dataclasses.replace(weights, wo=wo),
                         version=2)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
