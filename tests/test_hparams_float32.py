"""Hyperparameters and weights checked in float32, the type the forward pass computes in
(issue 33, part 2).

A fuzzer found files whose numbers are finite as float64 but not in float32: an RMS epsilon of
1e300 or 1e308 stored as a GGUF FLOAT64 (inf in float32: every normalized row is 0, logits all
0, and greedy decoding printed token 0, the byte 0x00, with exit 0), a RoPE base of 1e300, a
rope_freqs factor of 1e-45 and a linear RoPE factor of 1e-300 (inf / 0 divisors: NaN logits),
a llama2.c version-2 group scale of 3e38 (finite, but times an int8 of 127 it overflows). Each
ran on or failed late with NumPy RuntimeWarnings on stderr. Here each is rebuilt and must be
refused at read time by the real command: exit 1, one line naming the file and the field, no
warning, within 5 s and 1 GB. The bounds are checked at the float32 values around them,
worked out by hand: float32's largest value (2 - 2^-23) * 2^127 = 3.4028234663852886e38, its
smallest subnormal 2^-149, 1 + 2^-23 just above 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import TOK512
from gguf_files import converter_rope_factors, write_gguf
from test_cli import REPO, jllama_command

from jllama.model.config import (
    ModelConfig,
    RopeScaling,
    check_norm_eps,
    check_rope_divisor,
    check_rope_theta,
)
from jllama.errors import CheckpointError, ConfigError
from jllama.formats.gguf import read_gguf
from jllama.formats.llama2c import MAX_GROUP_SCALE, read_checkpoint, write_checkpoint
from jllama.formats.llama2c_layout import layout
from jllama.model.weights import random_weights

DATA = Path(__file__).parent / "data" / "llama32_tiny"
HF = DATA / "hf"
Q4_K_M = DATA / "llama32-tiny-Q4_K_M.gguf"

F32_MAX = (2 - 2**-23) * 2.0**127  # float32's largest finite value, by hand
assert F32_MAX == 3.4028234663852886e38
TINY = ModelConfig(dim=64, hidden_dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=259,
                   seq_len=32, rope_theta=500000.0, norm_eps=1e-6)  # head_dim 16
V2 = dataclasses.replace(TINY, vocab_size=512, rope_theta=10000.0, norm_eps=1e-5)
"""A llama2.c model: run.c's fixed eps and theta; llama2.c's tok512.bin fits it."""
EPS = "llama.attention.layer_norm_rms_epsilon"
THETA = "llama.rope.freq_base"
FACTOR = "llama.rope.scaling.factor"


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_rss_mb: float


# Starts the command from a small process and writes its exit code and peak RSS (KiB) to the
# file argv[1]. A child forked by pytest itself would count pytest's own pages (GBs late in the
# suite) in its ru_maxrss: its maximum covers the time before exec.
_SPAWN = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def run_cli(*args: str, tmp: Path) -> Result:
    """The `jllama` command on `args`, with its wall time and its own peak RSS."""
    out, err, rusage = tmp / "cli.stdout", tmp / "cli.stderr", tmp / "cli.rusage"
    with open(out, "wb") as o, open(err, "wb") as e:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", _SPAWN, str(rusage), *jllama_command(), *args],
                       stdout=o, stderr=e, cwd=REPO, timeout=120, check=True)
        seconds = time.perf_counter() - start
    code, kib = map(int, rusage.read_text().split())
    return Result(code, out.read_text(), err.read_text(), seconds, kib / 1024)


def assert_refused(result: Result, *needles: str) -> str:
    """Exit 1, one stderr line "jllama: error: ..." holding every needle, nothing printed,
    no NumPy warning, within 5 s and 1 GB. Returns the line."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result
    assert len(lines) == 1 and lines[0].startswith("jllama: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Warning" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert result.seconds < 5 and result.peak_rss_mb < 1024, result
    return lines[0]


def generate(path: Path, backend: str, tmp: Path, *extra: str) -> Result:
    return run_cli(f"--checkpoint={path}", f"--backend={backend}", "--steps=2",
                   "--temperature=0", "--prompt=hi", *extra, tmp=tmp)


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=33, scale=0.1)


# --- the five cases the fuzzer found, rebuilt ---


def _gguf(tmp: Path, weights, name: str, **kwargs) -> Path:
    return write_gguf(tmp / name, TINY, weights, **kwargs)


def _v2_with_scale(tmp: Path, scale: float, q: int | None = None) -> Path:
    """A llama2.c version-2 file (group size 64) whose first group scale, that of the
    embedding's first 64 values, is `scale` (and, with `q`, whose first int8 is `q`)."""
    path = tmp / "v2.bin"
    write_checkpoint(path, V2, random_weights(V2, seed=2), version=2, group_size=64)
    at = 256
    for segment in layout(V2, 2):  # the three norms as float32, then the embedding's int8
        if segment.q80:
            break
        at += segment.nbytes(64)
    data = bytearray(path.read_bytes())
    struct.pack_into("<f", data, at + segment.size, scale)
    if q is not None:
        struct.pack_into("<b", data, at, q)
    path.write_bytes(bytes(data))
    return path


CASES = {
    "eps_float64_1e300": (
        lambda tmp, w: _gguf(tmp, w, "eps.gguf", metadata={EPS: ("float64", 1e300)}),
        [f"{EPS}=1e+300 is not finite as float32"]),
    "eps_float64_1e308": (
        lambda tmp, w: _gguf(tmp, w, "eps.gguf", metadata={EPS: ("float64", 1e308)}),
        [f"{EPS}=1e+308 is not finite as float32"]),
    "theta_float64_1e300": (
        lambda tmp, w: _gguf(tmp, w, "theta.gguf", metadata={THETA: ("float64", 1e300)}),
        [f"{THETA}=1e+300 is not finite as float32"]),
    "rope_freqs_1e-45": (
        lambda tmp, w: _gguf(tmp, w, "freqs.gguf",
                             extra_tensors={"rope_freqs.weight": np.full(8, 1e-45, np.float32)}),
        ["tensor 'rope_freqs.weight': factor [0] is 1.4013e-45",
         "reciprocal is not finite as float32"]),
    "linear_factor_1e-300": (
        lambda tmp, w: _gguf(tmp, w, "linear.gguf", metadata={FACTOR: ("float64", 1e-300)}),
        [f"{FACTOR}=1e-300 is 0 as float32"]),
    "v2_group_scale_3e38": (
        lambda tmp, w: _v2_with_scale(tmp, 3e38),
        ["version-2 tensor token_embedding_table: group scale [0] is 3e+38",
         "not finite as float32"]),
}


@pytest.mark.parametrize("backend", ["numpy", "jax"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fuzzers_files_are_refused_in_one_line(tmp_path, weights, case, backend):
    build, needles = CASES[case]
    path = build(tmp_path, weights)
    extra = [f"--tokenizer={TOK512}"] if path.suffix == ".bin" else []
    assert_refused(generate(path, backend, tmp_path, *extra), str(path), *needles)


def _hf_folder(tmp: Path, edit) -> Path:
    folder = tmp / "hf"
    shutil.copytree(HF, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(rms_norm_eps=1e300), "config.json rms_norm_eps=1e+300 is not finite"),
    (lambda c: c["rope_parameters"].update(rope_theta=1e300),
     "config.json rope_parameters rope_theta=1e+300 is not finite"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 1e-300,
                                         "rope_theta": 500000.0}),
     "config.json rope_parameters factor=1e-300 is 0 as float32"),
    (lambda c: c["rope_parameters"].update(high_freq_factor=1.00000001),
     "low_freq_factor (1.0) < high_freq_factor (1.00000001), in float32"),
], ids=["eps", "theta", "linear", "llama3_equal_in_float32"])
def test_hugging_face_configs_are_refused_in_one_line(tmp_path, edit, needle):
    folder = _hf_folder(tmp_path, edit)
    assert_refused(generate(folder, "numpy", tmp_path), str(folder), needle)


def test_a_json_integer_beyond_float64_is_refused(tmp_path):
    folder = _hf_folder(tmp_path, lambda c: c.update(rms_norm_eps=0))
    text = (folder / "config.json").read_text().replace('"rms_norm_eps": 0', '"rms_norm_eps": 1'
                                                        + "0" * 400)
    (folder / "config.json").write_text(text)
    assert_refused(generate(folder, "numpy", tmp_path),
                   "'rms_norm_eps' is an integer of 401 digits")


# --- boundary values that still run ---


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_float64_keys_holding_real_values_run_as_their_float32_twins(tmp_path, weights,
                                                                   backend):
    """Llama 3.1's settings (eps 1e-5, theta 500000, rope_freqs from its rope_scaling: factor
    8, low 1, high 4, original 8192, as llama.cpp's converter writes them) stored as FLOAT64
    run, with no warning, and greedy decoding picks the same tokens as the same file with
    FLOAT32 keys (the reference: the float32 values are the same)."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = {"rope_freqs.weight": converter_rope_factors(500000.0, 16, scaling)}
    ids = []
    for kind in ("float32", "float64"):
        path = _gguf(tmp_path, weights, f"{kind}.gguf", extra_tensors=freqs,
                     metadata={EPS: (kind, 1e-5), THETA: (kind, 500000.0)})
        result = run_cli(f"--checkpoint={path}", f"--backend={backend}", "--steps=8",
                         "--temperature=0", "--prompt=hi", "--output_format=json",
                         tmp=tmp_path)
        assert result.returncode == 0 and "Warning" not in result.stderr, result
        ids.append(json.loads(result.stdout)["generated_ids"])
    assert ids[0] == ids[1] and len(ids[0]) >= 6


def test_the_llama32_configuration_runs_without_warnings(tmp_path):
    """Llama 3.2's config.json (factor 32, low 1, high 4, original 8192, theta 500000, eps
    1e-5): the checks pass and nothing is printed but the usual lines."""
    result = generate(HF, "numpy", tmp_path)
    assert result.returncode == 0 and "Warning" not in result.stderr, result


# --- the bounds, at the float32 values on either side ---


@pytest.mark.parametrize("value, ok", [
    (2.0**-149, True),  # the smallest float32 subnormal: 1 / sqrt(eps) = 2^74.5, finite
    (2.0**-150, False),  # halfway to it: rounds to even, 0
    (1e-6, True), (1e-5, True), (1.0, True),
    (3.4028235e38, True),  # prints as float32's max and rounds to it
    (3.4028236e38, False),  # past max + half an ulp: inf
    (0.0, False), (-1e-5, False), (math.nan, False), (math.inf, False),
])
def test_norm_eps_bounds(value, ok):
    if ok:
        check_norm_eps(value)
        dataclasses.replace(TINY, norm_eps=value)
    else:
        with pytest.raises(ConfigError, match="norm_eps="):
            dataclasses.replace(TINY, norm_eps=value)


@pytest.mark.parametrize("value, ok", [
    (1.0, False), (0.5, False), (0.0, False), (-10000.0, False),
    (1.00000001, False),  # above 1 in float64, exactly 1 in float32
    (1 + 2**-23, True),  # the next float32 above 1
    (10000.0, True), (500000.0, True), (F32_MAX, True),
    (3.4028236e38, False), (1e300, False),
])
def test_rope_theta_bounds(value, ok):
    if ok:
        check_rope_theta(value)
        dataclasses.replace(TINY, rope_theta=value)
    else:
        with pytest.raises(ConfigError, match="rope_theta="):
            dataclasses.replace(TINY, rope_theta=value)


@pytest.mark.parametrize("value, message", [
    (2.0**-127, None),  # 1 / 2^-127 = 2^127 < F32_MAX
    (2.0**-128, "its reciprocal is not finite as float32"),  # 2^128: inf
    (1e-300, "is 0 as float32"), (0.0, "must be positive"), (-2.0, "must be positive"),
    (math.nan, "not finite"), (1e39, "not finite"),
])
def test_rope_divisor_bounds(value, message):
    if message is None:
        check_rope_divisor(value, "factor")
    else:
        with pytest.raises(ConfigError, match=message):
            check_rope_divisor(value, "factor")


def test_rope_angles_are_checked_over_the_context():
    """A linear factor of 1e-38 passes alone (float32 1e-38 is a subnormal, 1 / it ~ 1e38 is
    finite), but pair 0's inverse frequency 1 / 1e-38 ~ 1e38 rad/token times position 31 is
    3e39 > F32_MAX; with a context of 2 tokens the last angle is 1e38 and it is accepted."""
    scaling = RopeScaling("linear", 1e-38)
    with pytest.raises(ConfigError, match="pair 0 .* its angle at position 31 is not finite"):
        dataclasses.replace(TINY, rope_scaling=scaling)
    dataclasses.replace(TINY, rope_scaling=scaling, seq_len=2)


def test_llama3_factors_are_compared_in_float32():
    RopeScaling("llama3", 8.0, 1.0, 1 + 2**-23, 8192)  # the next float32 above 1
    with pytest.raises(ConfigError, match="in float32"):
        RopeScaling("llama3", 8.0, 1.0, 1.00000001, 8192)
    with pytest.raises(ConfigError, match="low_freq_factor=1e-300 is 0 as float32"):
        RopeScaling("llama3", 8.0, 1e-300, 4.0, 8192)


def test_the_largest_group_scale_dequantizes_to_the_largest_float32(tmp_path):
    """MAX_GROUP_SCALE = F32_MAX / 128 = (2 - 2^-23) * 2^120 exactly; with it an int8 of -128
    gives -F32_MAX, finite. The next float32 up is refused. Read with warnings as errors."""
    assert MAX_GROUP_SCALE == (2 - 2**-23) * 2.0**120
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, w = read_checkpoint(_v2_with_scale(tmp_path, MAX_GROUP_SCALE, q=-128))
        assert w.token_embedding_table[0, 0] == -F32_MAX
        assert np.isfinite(w.token_embedding_table).all()
        above = float(np.nextafter(np.float32(MAX_GROUP_SCALE), np.float32(np.inf)))
        with pytest.raises(CheckpointError, match=r"group scale \[0\] is 2\.6584"):
            read_checkpoint(_v2_with_scale(tmp_path, above))
        with pytest.raises(CheckpointError, match=r"group scale \[0\] is nan; .* finite"):
            read_checkpoint(_v2_with_scale(tmp_path, math.nan))
        with pytest.raises(CheckpointError, match=r"group scale \[0\] is -inf"):
            read_checkpoint(_v2_with_scale(tmp_path, -math.inf))


def test_gguf_readers_raise_no_numpy_warning(tmp_path, weights):
    """Every GGUF case read in-process with warnings as errors: the one-line error, never a
    RuntimeWarning turned into an exception."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for case, (build, needles) in CASES.items():
            if case.startswith("v2"):
                continue
            with pytest.raises((ConfigError, CheckpointError)) as info:
                read_gguf(build(tmp_path, weights))
            assert needles[0] in str(info.value)


# --- K-quant blocks with an infinite or NaN scale ---


def _kquant_with(tmp: Path, tensor: str, at: int, bits: int) -> Path:
    """The Q4_K_M test file (llama.cpp's llama-quantize) with the f16 at byte `at` of
    `tensor`'s first block set to `bits`."""
    reader = gguf.GGUFReader(str(Q4_K_M))
    start = next(int(t.data_offset) for t in reader.tensors if t.name == tensor)
    data = bytearray(Q4_K_M.read_bytes())
    struct.pack_into("<H", data, start + at, bits)
    path = tmp / "kquant.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("backend", ["numpy", "jax"])
@pytest.mark.parametrize("tensor, at, bits", [
    ("blk.0.attn_q.weight", 0, 0x7C00),  # Q4_K d = +inf
    ("blk.0.attn_q.weight", 2, 0x7C00),  # Q4_K dmin = +inf
    ("blk.1.ffn_down.weight", 208, 0x7E00),  # Q6_K d = NaN
], ids=["q4k_d_inf", "q4k_dmin_inf", "q6k_d_nan"])
def test_kquant_scales_that_are_not_finite_stop_generation_in_one_line(tmp_path, backend,
                                                                       tensor, at, bits):
    """Not looked for at load (llama.cpp runs such blocks too, unless --check-tensors, and
    scanning every block would read the whole file): the weights are inf/NaN, so are the
    logits, and the generator stops with one line, without a NumPy warning."""
    path = _kquant_with(tmp_path, tensor, at, bits)
    result = run_cli(f"--checkpoint={path}", f"--backend={backend}", "--steps=4",
                     "--temperature=0", "--prompt=hi", tmp=tmp_path)  # a token is sampled
    lines = [line for line in result.stderr.splitlines() if not line.startswith(
        ("jllama: note:", "jllama: required memory:"))]
    assert result.returncode == 1 and len(lines) == 1, result
    assert "logits at position" in lines[0] and "not finite" in lines[0], lines
    assert "Warning" not in result.stderr
