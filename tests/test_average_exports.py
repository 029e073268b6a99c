"""experiments/average_exports.py: the weighted mean of exported folders, written as a folder the
library loads; folders of other shapes and bad weights are refused with the reason."""
import argparse

import jax
import numpy as np
import pytest

from experiments import average_exports as ae
from experiments.testbed.config import make_config
from experiments.testbed.export import export_hf
from maskahead_jax import load_pretrained
from maskahead_jax.model.init import init_params


def _export(tmp_path, name, seed, layers=2):
    shape = argparse.Namespace(d_model=32, heads=2, kv_heads=1, ffn=64, layers=layers, rope_theta=1e4)
    cfg = make_config(shape, 1536)
    return export_hf(init_params(cfg, jax.random.PRNGKey(seed)), cfg, str(tmp_path / name))


def test_average_is_the_weighted_mean_of_the_loaded_weights(tmp_path):
    a, b = _export(tmp_path, "a", 1), _export(tmp_path, "b", 2)
    out = ae.average_folders([a, b], [1.0, 3.0], str(tmp_path / "soup"))
    pa, pb, got = (load_pretrained(p, dtype="float32").params for p in (a, b, out))
    want = jax.tree_util.tree_map(lambda x, y: 0.25 * np.asarray(x) + 0.75 * np.asarray(y), pa, pb)
    err = jax.tree_util.tree_map(lambda g, w: float(np.abs(np.asarray(g) - w).max()
                                                    / (np.abs(w).max() + 1e-12)), got, want)
    assert max(jax.tree_util.tree_leaves(err)) < 1e-2  # bfloat16 storage: ~3 significant digits
    assert load_pretrained(out).config == load_pretrained(a).config
    # one model with all the weight is that model again
    same = ae.average_folders([a, b], [1.0, 0.0], str(tmp_path / "same"))
    ps = load_pretrained(same, dtype="float32").params
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(ps),
                                                    jax.tree_util.tree_leaves(pa)))


def test_refuses_other_shapes_and_bad_weights(tmp_path):
    a, c = _export(tmp_path, "a", 1), _export(tmp_path, "c", 1, layers=3)
    with pytest.raises(ValueError, match="another config.*num_layers"):
        ae.average_folders([a, c], [1, 1], str(tmp_path / "x"))
    with pytest.raises(ValueError, match="non-negative weight"):
        ae.average_params([{"w": np.ones(2)}], [-1.0])
    with pytest.raises(SystemExit):
        ae.main([a, a, "--weights", "1", "--out", str(tmp_path / "y")])
