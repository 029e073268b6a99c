"""converters.export: the key maps run backwards. For every layout the loader reads, an HF state
dict -> params -> export gives the same keys and bit-identical tensors back (less the keys the
loader ignores on purpose, listed per case); params -> export -> load gives the same params; the
shipped testbed checkpoint exports to its own bytes."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hf_fixtures as hf  # noqa: E402
from converters import export_hf_state_dict, load_hf_params, open_tensors, read_config, save_hf  # noqa: E402
from converters.keymaps import IGNORED  # noqa: E402
from maskahead_jax.model import init_params  # noqa: E402

TESTBED = os.path.join(os.path.dirname(__file__), os.pardir, "maskahead_jax", "testbed")


def _state_dict(path: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(ref.load()) for k, ref in open_tensors(path).items()}


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert (got[k].dtype, got[k].shape) == (want[k].dtype, want[k].shape), k
        assert got[k].tobytes() == want[k].tobytes(), k


def _with_extra_keys(src: str, dst: str, extra: dict) -> str:
    """A copy of the HF folder `src` whose state dict also holds `extra` (name -> torch tensor)."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    sd = {k: torch.from_numpy(v.copy()) for k, v in _state_dict(src).items()}
    return hf.write_checkpoint(dst, {**sd, **extra}, cfg)


def _rotary_buffers(n_layers: int, prefix: str = "model.layers.{i}.self_attn.rotary_emb.inv_freq"):
    return {prefix.format(i=i): torch.arange(4, dtype=torch.float32) for i in range(n_layers)}


# case -> (builder(tmp_path) -> HF folder, the keys of that folder the converter ignores on purpose)
def _qwen2(tmp):
    return hf.qwen2(str(tmp), seed=21).path, set()


def _qwen2_tied(tmp):  # save_pretrained stores no head: nothing to ignore
    return hf.qwen2(str(tmp), seed=22, tie=True).path, set()


def _qwen2_tied_head_copy(tmp):  # a stored copy of the tied head is accepted and not written back
    case = hf.qwen2(str(tmp / "src"), seed=23, tie=True)
    path = _with_extra_keys(case.path, str(tmp / "dst"), {"lm_head.weight": case.model.lm_head.weight})
    return path, {"lm_head.weight"}


def _qwen3(tmp):
    return hf.qwen3(str(tmp), seed=24).path, set()


def _qwen3_rotary(tmp):  # older checkpoints persist the rotary inv_freq buffer per layer
    src = hf.qwen3(str(tmp / "src"), seed=25).path
    extra = _rotary_buffers(2)
    return _with_extra_keys(src, str(tmp / "dst"), extra), set(extra)


def _llada(tmp):
    return hf.llada(str(tmp), seed=26).path, set()


def _llada_rotary(tmp):
    src = hf.llada(str(tmp / "src"), seed=27).path
    extra = _rotary_buffers(2, "model.transformer.blocks.{i}.rotary_emb.inv_freq")
    return _with_extra_keys(src, str(tmp / "dst"), extra), set(extra)


def _llada2(tmp):
    return hf.llada2(str(tmp), seed=28).path, set()


CASES = {"qwen2": _qwen2, "qwen2_tied": _qwen2_tied, "qwen2_tied_head_copy": _qwen2_tied_head_copy,
         "qwen3": _qwen3, "qwen3_rotary_buffers": _qwen3_rotary, "llada": _llada,
         "llada_rotary_buffers": _llada_rotary, "llada2": _llada2}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_state_dict_round_trips_exactly(tmp_path, case):
    path, ignored = CASES[case](tmp_path)
    orig = _state_dict(path)
    assert ignored <= set(orig)
    assert all(IGNORED.match(k) or k == "lm_head.weight" for k in ignored)
    cfg = read_config(path)
    params = load_hf_params(path, cfg)  # dtype None: the checkpoint's (float32 here)
    got = export_hf_state_dict(params, cfg)
    _assert_same_tensors(got, {k: v for k, v in orig.items() if k not in ignored})
    assert all(v.flags.c_contiguous for v in got.values())


def test_llada2_export_has_one_key_per_expert_and_fused_qkv(tmp_path):
    path = hf.llada2(str(tmp_path), seed=29).path
    cfg = read_config(path)
    got = export_hf_state_dict(load_hf_params(path, cfg), cfg)
    assert got["model.layers.1.attention.query_key_value.weight"].shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert {f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(cfg.num_experts)} <= set(got)


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "llada", "llada2"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_params_round_trip_through_save_hf(tmp_path, case, qkv_bias):
    """Random params (every hook both ways, q/k/v biases and fused QKV bias included) -> save_hf
    -> the loader gives the same params back, bit for bit."""
    cfg = read_config(getattr(hf, case)(str(tmp_path / "hf")).path).replace(qkv_bias=qkv_bias)
    params = init_params(cfg, jax.random.PRNGKey(5))
    out = save_hf(params, cfg, str(tmp_path / "out"), config={"marker": 1})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == {"marker": 1}
    back = load_hf_params(out, cfg)
    same = jax.tree_util.tree_map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params, back)
    assert all(jax.tree_util.tree_leaves(same))


def test_dtype_casts_after_the_layout_change(tmp_path):
    import ml_dtypes

    path = hf.qwen3(str(tmp_path), seed=30).path
    cfg = read_config(path)
    orig = _state_dict(path)
    got = export_hf_state_dict(load_hf_params(path, cfg), cfg, dtype=ml_dtypes.bfloat16)
    assert {v.dtype for v in got.values()} == {np.dtype(ml_dtypes.bfloat16)}
    for k in orig:
        np.testing.assert_array_equal(got[k], orig[k].astype(ml_dtypes.bfloat16))


def test_params_that_do_not_match_the_config_are_refused(tmp_path):
    cfg = read_config(hf.qwen3(str(tmp_path), seed=31).path)
    params = init_params(cfg, jax.random.PRNGKey(0))
    bad = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "q_norm"}}
    with pytest.raises(ValueError, match=r"missing \['layers\.q_norm'\]"):
        export_hf_state_dict(bad, cfg)
    with pytest.raises(ValueError, match="shape"):
        export_hf_state_dict({**params, "embed": params["embed"][:-1]}, cfg)


def test_shipped_testbed_exports_to_its_own_tensors():
    orig = _state_dict(TESTBED)
    cfg = read_config(TESTBED)
    _assert_same_tensors(export_hf_state_dict(load_hf_params(TESTBED, cfg), cfg), orig)
