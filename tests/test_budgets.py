"""Budgets that mean what they say: a floor that overrides the requested percentage is warned
about and reported; the budget in effect is in stats; budgets can be a percentage, a kvpress
compression ratio or an absolute number of KV entries."""
from __future__ import annotations

import warnings

import pytest

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import BudgetWarning, generate
from maskahead_jax.policies import MaskAhead, MaskKV, PolicyError, SnapKV, make
from tiny import tiny_model

GC = GenerationConfig(max_new_tokens=16, prefill_chunk=32, stop_at_eos=False)
PROMPT = [list(range(1, 41)) * 3]  # 120 tokens


def test_floor_over_the_budget_is_warned_and_reported():
    m = tiny_model("sdar")
    with pytest.warns(BudgetWarning, match=r"capacity_floor=512 keeps 120 of a 120-token prompt \(100%\)"):
        out = generate(m, PROMPT, GC, policy=make("maskahead", 10))
    assert "not capacity_pct=10%" in out.stats["budget_note"]
    assert out.stats["kept_pct"] == [100.0]  # the floor kept everything: no 10% cache here
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)  # a floor below 10% of the prompt: silent
        out = generate(m, PROMPT, GC, policy=make("maskahead", 10, capacity_floor=8, recent=4, topk_floor=8))
    assert out.stats["budget_note"] is None
    assert out.stats["kept_pct"][0] < 30.0


def test_three_ways_to_give_a_budget():
    assert make("maskahead", compression_ratio=0.9) == MaskAhead(capacity_pct=pytest.approx(10.0))
    assert make("snapkv", kv_entries=256) == SnapKV(capacity_entries=256)
    assert make("maskkv", kv_entries=64) == MaskKV(budget_per_head=64)
    assert make("maskkv", compression_ratio=0.95).budget_pct == pytest.approx(5.0)
    with pytest.raises(PolicyError, match="give one budget"):
        make("maskahead", 10, kv_entries=64)
    with pytest.raises(PolicyError, match="compression_ratio must be in"):
        make("maskahead", compression_ratio=1.0)
    with pytest.raises(PolicyError, match="takes no budget"):
        make("mage", compression_ratio=0.5)
    with pytest.raises(PolicyError, match="kv_entries must be a positive integer"):
        make("h2o", kv_entries=0)


def test_absolute_budget_keeps_that_many_entries():
    m = tiny_model("sdar")
    pol = make("maskahead", kv_entries=24, recent=8, sinks=2, topk_floor=8, interval_blocks=1)
    out = generate(m, PROMPT, GC, policy=pol)
    assert out.stats["budget_note"] is None and out.stats["evictions"] >= 1
    # after the last eviction (every block) at most one more 8-token block was appended
    assert all(live <= 24 + 8 for live in out.stats["live_entries"])
    with pytest.raises(PolicyError, match="capacity_entries=4 is below recent \\+ sinks = 10"):
        generate(m, PROMPT, GC, policy=make("maskahead", kv_entries=4, recent=8, sinks=2))


def test_testbed_preset_carries_scaled_floors(tmp_path):
    """`--preset testbed` brings the floors docs/results.md uses to the policies that have them;
    --policy-kw still wins."""
    import argparse

    from maskahead_jax import cli
    from maskahead_jax.evaluation.presets import preset_config, preset_policy_knobs

    assert preset_policy_knobs("testbed") == dict(capacity_floor=64, topk_floor=32, recent=32)
    assert preset_policy_knobs("sdar") == {} and preset_policy_knobs(None) == {}
    cfg = tiny_model("sdar").config
    gen = preset_config("testbed", 16)
    _, built = cli.build_run_policies(cfg, gen, ["maskahead", "snapkv"], [10.0], {"maskahead:recent": 16},
                             preset="testbed")
    ma, sk = built[("maskahead", 10.0)], built[("snapkv", 10.0)]
    assert (ma.capacity_floor, ma.topk_floor, ma.recent) == (64, 32, 16)
    assert (sk.capacity_floor, sk.topk_floor) == (64, 32) and not hasattr(sk, "recent")


def test_percent_capacity_is_exact_at_integers_under_jit():
    """C(seen) = floor(pct% of seen): under jit float32 (and XLA's x / 100 -> x * 0.01) gave one
    less than the released code's Python arithmetic at exact integers (30% of 70: 20, not 21)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maskahead_jax.policies.budgets import guarded as _guarded
    from maskahead_jax.policies.eviction import Budget

    for pct, seens in ((30.0, [70, 45, 100, 7]), (10.0, [2080, 2036, 100, 9]), (7.0, [100, 300, 14])):
        b = Budget(pct=pct, floor=1)
        eager = [b.capacity(int(n)) for n in seens]
        assert eager == [max(int(pct * n // 100), 1) for n in seens]  # Python arithmetic, as released
        jitted = jax.jit(lambda s: b.capacity(s))(jnp.asarray(seens, jnp.int32))
        assert np.asarray(jitted).tolist() == eager, (pct, seens)
        # the float32 form XLA may reassociate to inside a larger program, (pct * 0.01) * seen,
        # lands below the integer (30% of 70: 20.999998); the guard puts it back
        worst = np.float32(pct) * np.float32(0.01) * np.asarray(seens, np.float32)
        assert [max(int(np.floor(_guarded(w))), 1) for w in worst] == eager, (pct, seens)
    assert int(np.floor(np.float32(30) * np.float32(0.01) * np.float32(70))) == 20  # what it guards against
