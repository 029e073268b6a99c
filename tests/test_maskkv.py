"""MaskKV (and the PyramidKV / AdaKV allocations): budget formulas on worked examples, sums,
clipping, ragged keep sets, exactness at full budget on tiny LLaDA / Dream, kept-only memory,
calibration, and errors."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import cache as kvc
from maskahead_jax.calibrate import layer_importance, load_importance, main as calibrate_main
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import PolicyError, make
from maskahead_jax.policies.maskkv import (AdaKV, MaskKV, PyramidKV, adakv_head_budgets, head_budgets,
                                           layer_budgets, pyramid_budgets)
from tiny import tiny_model

GC = GenerationConfig(max_new_tokens=16, stop_at_eos=False, prompt_refresh=0)


def _prompts(lens=(70, 45), seed=0):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


# ----------------------------------------------------------------------------- budget formulas
def test_layer_budgets_paper_worked_example():
    """maskkv.md §3a: LLaDA, 32 layers, B = 256 -> k_p = 8192, k_base = 102, k_imp = 4928; with
    I_B = I_M each boundary layer gets 102 + 1232 = 1334 and each middle layer 102 + 82 = 184."""
    imp = [15.0] + [1.0] * 30 + [15.0]  # I_B = 30 = I_M
    raw = layer_budgets(8192, imp, beta=0.4, exact_total=False)
    assert raw[0] == raw[31] == 1334 and set(raw[1:31].tolist()) == {184}
    k = layer_budgets(8192, imp, beta=0.4)
    assert k.sum() == 8192
    # k_group,M = 2464 = 30 * 82 + 4: the remainder goes to the first 4 middle layers
    assert k[1:5].tolist() == [185] * 4 and set(k[5:31].tolist()) == {184}
    assert k[0] == k[31] == 1334


def test_layer_budgets_hand_computed():
    # L = 4, I = [.5, .1, .2, .4], k_p = 44, beta = .4:
    # k_base = floor(4.4) = 4, k_imp = 28, share = .9 / 1.2 -> k_B = floor(21) = 21, k_M = 7,
    # boundary 4 + floor(21/2) = 14 (+1 remainder to layer 0), middle 4 + floor(7/2) = 7 (+1 to layer 1)
    imp = [0.5, 0.1, 0.2, 0.4]
    assert layer_budgets(44, imp, 0.4, exact_total=False).tolist() == [14, 7, 7, 14]
    assert layer_budgets(44, imp, 0.4).tolist() == [15, 8, 7, 14]
    # beta = 1: everything is the base rate; beta = 0: everything by importance
    assert layer_budgets(40, imp, 1.0).tolist() == [10] * 4
    assert layer_budgets(40, imp, 0.0).tolist() == [15, 5, 5, 15]
    # uniform importance = uniform budgets
    assert layer_budgets(4 * 256, [1.0] * 4).tolist() == [256] * 4
    # rows with their own totals (percentage budgets), traced
    kb = np.asarray(layer_budgets(jnp.asarray([44, 40]), imp, 0.4))
    assert kb.shape == (4, 2) and kb[:, 0].tolist() == [15, 8, 7, 14] and kb.sum(0).tolist() == [44, 40]


def test_head_budgets_hand_computed_and_sum():
    # k_l = 100, P = [.2, .3, .5] (sum 1), alpha .1, N_h = 3: .1*100 + .9*300*P^ = 64, 91, 145
    k = head_budgets(np.array([100]), np.array([[0.2, 0.3, 0.5]]), alpha=0.1)
    assert k.tolist() == [[64, 91, 145]]
    # unnormalised preferences give the same split; remainders go to the largest fractions
    k2 = head_budgets(np.array([10]), np.array([[1.0, 1.0, 1.0]]) * 0.37, alpha=0.1)
    assert k2.tolist() == [[10, 10, 10]]
    # x = 1 + .9*30*P^ with P^ = [.1, .2, .7]: 3.7, 6.4, 19.9 -> floors 3, 6, 19 (sum 28), +1 to
    # the largest fractions (.9 then .7)
    k3 = head_budgets(np.array([10]), np.array([[0.1, 0.2, 0.7]]), alpha=0.1)
    assert k3.tolist() == [[4, 6, 20]] and k3.sum() == 30
    assert head_budgets(np.array([10]), np.array([[0.1, 0.2, 0.7]]), 0.1, exact_total=False).tolist() == [[3, 6, 19]]
    # alpha = 1: uniform regardless of preference
    assert head_budgets(np.array([7]), np.array([[0.9, 0.1]]), alpha=1.0).tolist() == [[7, 7]]


def test_budgets_sum_to_the_total_random():
    rng = np.random.RandomState(0)
    for _ in range(20):
        L, H = rng.randint(1, 9), rng.randint(1, 9)
        B = int(rng.randint(1, 500))
        imp = rng.rand(L)
        kl = layer_budgets(B * L, imp, 0.4)
        assert kl.sum() == B * L and (kl >= 0).all()
        kh = head_budgets(kl, rng.rand(L, H), 0.1)
        assert (kh.sum(-1) == H * kl).all() and (kh >= 0).all()
        pk = pyramid_budgets(B, L)
        assert pk.sum() == B * L and (np.diff(pk) <= 0).all()


def test_budgets_are_clipped_to_the_prompt_length():
    k = head_budgets(np.array([100]), np.array([[0.2, 0.3, 0.5]]), alpha=0.1, max_len=80)
    assert k.tolist() == [[64, 80, 80]]
    # inside the policy: per-row prompt lengths clip every head budget
    pol = MaskKV(budget_per_head=80, layer_importance=(3.0, 1.0, 3.0))
    rng = np.random.RandomState(0)
    valid = jnp.ones((3, 2, 4, 64), bool)
    mass = jnp.asarray(rng.rand(3, 2, 4, 64 + 16), jnp.float32)
    k = np.asarray(pol.budgets(mass, valid, jnp.asarray([64, 30])))
    assert k[:, 0].max() <= 64 and k[:, 1].max() <= 30 and k[:, 1].min() == 30
    unclipped = np.asarray(MaskKV(budget_per_head=5).budgets(mass, valid, jnp.asarray([64, 30])))
    assert (unclipped.sum(-1) == 4 * 5).all()  # N_h * k_l per layer and row, total L * N_h * B


def test_pyramid_and_adakv_allocations():
    # PyramidKV, B = 64, L = 4: min 3.2, max 124.8, step 40.53 -> 124.8 84.27 43.73 3.2
    assert pyramid_budgets(64, 4, 20.0, exact_total=False).tolist() == [124, 84, 43, 3]
    assert pyramid_budgets(64, 4).tolist() == [125, 84, 44, 3]
    # AdaKV: k_l = 4, 2 heads, floor .25 -> 1 per head + the global top 6 of the flattened scores
    scores = np.array([[0.9, 0.8, 0.7, 0.6, 0.0], [0.65, 0.1, 0.05, 0.0, 0.0]])
    k = adakv_head_budgets(np.array(4), scores, np.ones_like(scores, bool), floor_alpha=0.25)
    assert k.tolist() == [1 + 4, 1 + 2]  # top 6: .9 .8 .7 .65 .6 .1
    assert sum(k) == 2 * 4


def test_ragged_keep_counts_holes_and_order():
    c = kvc.empty(1, 1, 2, 6, 2, jnp.float32)
    v = jnp.asarray(np.random.RandomState(0).randn(1, 1, 2, 6, 2), jnp.float32)
    c = kvc.append(c, v, v, jnp.asarray([[10, 11, 12, 13, 14, 15]], jnp.int32), jnp.asarray([6]))
    s = jnp.asarray([[[[0.1, 0.9, 0.2, 0.8, 0.3, 0.7], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]]]])
    out = c.keep_top(s, jnp.asarray([[[3, 1]]]), 4)  # ragged counts [L, B, Hkv]
    assert out.capacity == 4
    pos, val = np.asarray(out.pos)[0, 0], np.asarray(out.valid)[0, 0]
    assert pos[0][val[0]].tolist() == [11, 13, 15] and pos[1][val[1]].tolist() == [10]
    assert val.sum(-1).tolist() == [3, 1] and int(out.length[0]) == 3
    np.testing.assert_allclose(np.asarray(out.v)[0, 0, 0, :3], np.asarray(v)[0, 0, 0, [1, 3, 5]])


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_full_budget_equals_dense(family):
    m = tiny_model(family)
    dense = generate(m, _prompts(), GC)
    for pol in ([MaskKV(budget_per_head=10_000), AdaKV(budget_per_head=10_000)] if family == "dream"
                else [MaskKV(budget_per_head=10_000), PyramidKV(budget_per_head=10_000)]):
        out = generate(m, _prompts(), GC, policy=pol)
        assert out.tokens == dense.tokens, pol.name
        assert out.stats["live_entries"] == [70, 45]


def test_small_budget_keeps_ragged_heads_and_counts_kept_entries_only():
    m = tiny_model("llada")  # 3 layers, 4 KV heads, head_dim 8
    imp = tuple(float(x) for x in layer_importance(m, [np.arange(32).reshape(2, 16) % 40]))
    pol = MaskKV(budget_per_head=8, layer_importance=imp)
    out = generate(m.astype(jnp.bfloat16), _prompts(), GC, policy=pol)
    assert all(len(t) == 16 for t in out.tokens)
    kept = 3 * 4 * 8  # L * N_h * B, all within the prompt
    per_tok = 2 * 8 * 2  # bf16 K + V per (layer, KV head)
    assert out.stats["kv_bytes_final"] == [kept * per_tok] * 2
    assert out.stats["reduction_final"][0] == pytest.approx(70 / 8)
    assert out.stats["live_entries"][0] <= out.stats["cache_capacity"] < 70
    # percentages: B = floor(10% of the prompt) per row
    out = generate(m.astype(jnp.bfloat16), _prompts(), GC, policy=make("maskkv", capacity_pct=10))
    assert out.stats["kv_bytes_final"] == [3 * 4 * 7 * per_tok, 3 * 4 * 4 * per_tok]


def test_calibration_importance_and_cli(tmp_path, monkeypatch):
    m = tiny_model("llada")
    a = layer_importance(m, [np.arange(24).reshape(2, 12) % 40])
    assert a.shape == (3,) and np.all(np.isfinite(a)) and np.all(a >= 0) and np.all(a <= 2)
    # ragged lists: the padding is masked out (same as running the rows one by one, token-weighted)
    r1, r2 = list(range(5, 17)), list(range(20, 27))
    both = layer_importance(m, [[r1, r2]])
    sep = (layer_importance(m, [[r1]]) * 12 + layer_importance(m, [[r2]]) * 7) / 19
    np.testing.assert_allclose(both, sep, rtol=1e-4, atol=1e-6)
    monkeypatch.setattr("maskahead_jax.api.load_pretrained", lambda path, dtype=None, **knobs: m)
    toks = tmp_path / "calib.json"
    toks.write_text(json.dumps([r1, r2]))
    out = tmp_path / "imp.json"
    assert calibrate_main([str(tmp_path), "--tokens", str(toks), "--out", str(out), "--batch", "2"]) == 0
    np.testing.assert_allclose(load_importance(str(out)), both, rtol=1e-5)
    assert json.loads(out.read_text())["num_layers"] == 3


def test_invalid_settings_are_clear_errors():
    m = tiny_model("llada")
    for bad, match in [(MaskKV(budget_per_head=0), "budget_per_head"),
                       (MaskKV(budget_per_head=-4), "budget_per_head"),
                       (MaskKV(budget_pct=0.0), "budget_pct"),
                       (PyramidKV(budget_pct=-1.0), "budget_pct"),
                       (MaskKV(layer_importance=(1.0, 2.0)), "layer_importance"),
                       (MaskKV(layer_importance=(1.0, -2.0, 1.0)), "layer_importance"),
                       (MaskKV(beta=1.5), "beta"),
                       (AdaKV(head_alloc="nope"), "head_alloc")]:
        with pytest.raises(PolicyError, match=match):
            generate(m, [[1, 2, 3]], GC, policy=bad)
    with pytest.raises(PolicyError, match="budget_pct must be a percentage"):
        make("pyramidkv", capacity_pct=-1)  # refused when built, before any model is touched
    with pytest.raises(PolicyError, match="bidirectional"):
        generate(tiny_model("sdar"), [[1, 2, 3]], GenerationConfig(max_new_tokens=8), policy=MaskKV())
    with pytest.raises(PolicyError, match="importance"):
        layer_budgets(10, [])
