"""ModelConfig validation, the per-layer conversion and tensor statistics (values by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from jllama.model.config import ModelConfig
from jllama.errors import ConfigError
from jllama.model.weights import random_weights, tensor_stats, to_graph_weights

GQA = ModelConfig(dim=32, hidden_dim=40, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=20,
                  seq_len=16, shared_weights=False)


def test_derived_sizes_as_run_c():
    assert (GQA.head_dim, GQA.q_dim, GQA.kv_dim, GQA.kv_mul) == (8, 32, 16, 2)
    assert GQA.norm_eps == 1e-5 and GQA.rope_theta == 10000.0
    # hashable and comparable: usable as a static argument under jit
    assert hash(GQA) == hash(ModelConfig(**GQA.__dict__)) and GQA == ModelConfig(**GQA.__dict__)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"dim": 0}, "dim=0"),
        ({"n_kv_heads": 3}, "n_kv_heads=3"),
        ({"n_heads": 5, "n_kv_heads": 5}, "dim=32 is not a multiple of n_heads=5"),
        ({"dim": 36, "n_heads": 4, "n_kv_heads": 4}, "head_dim=9 is odd"),
        ({"vocab_size": 1 << 30}, "vocab_size"),
        ({"seq_len": 2.5}, "seq_len must be an integer"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation(change, needle):
    fields = {**GQA.__dict__, "head_dim": 0, **change}
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(**fields)


def test_params_count_by_hand():
    # per layer: 2*32 norms + 32*32*2 (wq, wo) + 16*32*2 (wk, wv) + 40*32*3 (w1..w3) = 6976
    # + embedding 20*32 + final norm 32 + separate classifier 20*32
    assert GQA.n_params() == 2 * 6976 + 640 + 32 + 640


def test_graph_weights_stack_qkv_per_layer():
    w = random_weights(GQA, seed=2)
    g = to_graph_weights(w)
    assert len(g.layers) == 2
    for l, layer in enumerate(g.layers):
        assert layer.wqkv.shape == (32 + 2 * 16, 32)
        np.testing.assert_array_equal(layer.wqkv[:32], w.wq[l])
        np.testing.assert_array_equal(layer.wqkv[32:48], w.wk[l])
        np.testing.assert_array_equal(layer.wqkv[48:], w.wv[l])
        for name in ("rms_att_weight", "wo", "rms_ffn_weight", "w1", "w2", "w3"):
            np.testing.assert_array_equal(getattr(layer, name), getattr(w, name)[l])
    assert g.wcls is w.wcls


def test_tensor_stats_by_hand():
    w = random_weights(GQA, seed=0)
    w.rms_final_weight[:] = np.arange(32, dtype=np.float32)  # min 0, max 31, mean 15.5
    w.wo[1, 3, 4] = np.nan
    w.w2[0, 0, 0] = np.inf
    stats = {s.name: s for s in tensor_stats(w)}
    final = stats["rms_final_weight"]
    assert (final.shape, final.min, final.max, final.mean, final.finite) == ((32,), 0, 31, 15.5, True)
    assert stats["wo"].n_nonfinite == 1 and not stats["wo"].finite
    assert stats["w2"].n_nonfinite == 1 and np.isfinite(stats["w2"].max)
    assert "wcls" in stats  # unshared: listed


def test_numpy_integers_are_accepted_as_sizes():
    c = ModelConfig(*(np.int64(v) for v in (32, 40, 2, 4, 2, 20, 16)))
    assert c == ModelConfig(32, 40, 2, 4, 2, 20, 16) and type(c.dim) is int


def test_kv_cache_larger_than_memory_is_refused_before_allocating():
    from jllama.errors import ResourceError
    from jllama.platform.runtime import check_kv_cache_fits

    huge = ModelConfig(dim=64, hidden_dim=64, n_layers=1024, n_heads=8, n_kv_heads=8,
                       vocab_size=512, seq_len=1 << 22)
    assert huge.kv_cache_nbytes() == 2 * 1024 * 8 * (1 << 22) * 8 * 4  # 2 TiB
    with pytest.raises(ResourceError, match="KV cache needs 2048.0 GiB"):
        check_kv_cache_fits(huge)
    check_kv_cache_fits(GQA)  # a small one passes
