"""Baseline policies (StreamingLLM, H2O, H2O+CAOTE, Expected Attention, DapQ, SnapKV, HERALD): end
to end in generate, exactness at full budget, and hand-built keep sets. tests/test_released_policies.py
checks each against the released code's rule in numpy."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import cache as kvc
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import PolicyError, knobs, make
from maskahead_jax.policies.baselines import (CAOTE, H2O, HERALD, SnapKV, StreamingLLM, caote_scores,
                                              max_pool_1d)
from tiny import tiny_model

NAMES = ["streaming", "streaming-bounded", "h2o", "caote", "ea", "dapq", "snapkv", "herald"]
FULL = dict(capacity_pct=100, capacity_floor=4096, topk_pct=100, topk_floor=4096, dense_layers=1)
SMALL = dict(capacity_pct=10, capacity_floor=24, topk_pct=5, topk_floor=16, dense_layers=1, sinks=2,
             recent=8, interval_blocks=2, lookahead_blocks=3)
EXTRA = {"snapkv": dict(window=8)}  # the default 32-query window does not fit a 24-entry floor


def _knobs(name, kw):
    """The knobs of `kw` that policy `name` has (a policy refuses knobs it lacks)."""
    return {k: v for k, v in kw.items() if k in knobs(name)}
GC = GenerationConfig(max_new_tokens=32, prefill_chunk=32, stop_at_eos=False)


def _prompts(lens=(70, 45), seed=0):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


@pytest.fixture(scope="module")
def model():
    return tiny_model("sdar", num_layers=3)


@pytest.fixture(scope="module")
def dense_tokens(model):
    return generate(model, _prompts(), GC).tokens


def test_registered_names():
    for n in NAMES:
        assert make(n).name == n
    assert isinstance(make("snapkv", capacity_pct=20), SnapKV) and make("snapkv", capacity_pct=20).capacity_pct == 20


@pytest.mark.parametrize("name", NAMES)
def test_full_budget_equals_dense(model, dense_tokens, name):
    out = generate(model, _prompts(), GC, policy=make(name, **_knobs(name, FULL)))
    assert out.tokens == dense_tokens
    assert out.stats["evictions"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_small_budget_runs_end_to_end(model, name):
    pol = make(name, **_knobs(name, SMALL), **EXTRA.get(name, {}))
    out = generate(model, _prompts(), GC, policy=pol, cache_dtype=jnp.bfloat16)
    assert all(len(t) == 32 for t in out.tokens)
    if name == "herald":
        assert out.stats["evictions"] == 0
        return
    seen = [70 + 32, 45 + 32]
    if name == "snapkv":  # the prompt only, once; every generated block is then kept
        # released: the compression happens at the final prefill chunk (end_prefill_chunk), which
        # `evictions` does not count (as released, whose trace counts it as prefill_evictions)
        assert out.stats["evictions"] == 0
        for live, plen in zip(out.stats["live_entries"], (70, 45)):
            n_pre = plen // 8 * 8
            assert live <= max(pol.eviction.budget.capacity(n_pre), 0) + (32 + 8)
            assert live < plen + 32
        return
    else:
        assert out.stats["evictions"] >= 2
        for live, s in zip(out.stats["live_entries"], seen):
            assert live <= pol.eviction.budget.capacity(s) + pol.interval_blocks * 8
    assert min(out.stats["reduction_final"]) > 1.0


def _hand_cache(v, pos, layers=1):
    """`layers` layers, one row, one KV head holding values v [N, D] at positions pos."""
    n, d = v.shape
    c = kvc.empty(layers, 1, 1, n, d, jnp.float32)
    vv = jnp.broadcast_to(jnp.asarray(v, jnp.float32), (layers, 1, 1, n, d))
    return kvc.append(c, jnp.zeros_like(vv), vv, jnp.asarray([pos], jnp.int32), jnp.asarray([n], jnp.int32))


def _kept(c):
    return np.asarray(c.pos)[0, 0, 0][np.asarray(c.valid)[0, 0, 0]].tolist()


def _row(x):
    return jnp.asarray(np.asarray(x, np.float32))[None, None, None]


def test_streaming_keeps_exactly_sinks_and_newest():
    n = 20
    c = _hand_cache(np.random.RandomState(0).randn(n, 4), list(range(n)))
    pol = StreamingLLM(capacity_floor=9, sinks=3, recent=2)
    mass = _row(np.random.RandomState(1).rand(n))  # ignored
    out = pol.eviction.evict(c, mass, None, jnp.asarray([9]), 9)
    assert _kept(out) == [0, 1, 2] + list(range(14, 20))


def test_streaming_bounded_evicts_while_prefilling(model):
    """After a prefill chunk the lane keeps exactly its sinks and newest entries, with no probe
    forward (no params are read); end to end, the peak stays near C + one chunk while
    `streaming` holds the whole prompt until its final chunk is stored (as released)."""
    from maskahead_jax.policies import StepContext

    n = 20
    c = _hand_cache(np.random.RandomState(0).randn(n, 4), list(range(n)))
    pol = make("streaming-bounded", capacity_floor=9, sinks=3, recent=2)

    def no_forward(*args):
        raise AssertionError("a position ranking needs no probe forward")

    ctx = StepContext(no_forward, None, jnp.asarray([n]), jnp.asarray([n]), 8, 0, n, jnp.asarray([True]))
    out = pol.on_prefill_chunk(c, ctx)
    assert _kept(out) == [0, 1, 2] + list(range(14, 20))

    prompts = _prompts((150, 97), seed=3)
    bounded = generate(model, prompts, GC, policy=make("streaming-bounded", **_knobs("streaming", SMALL)))
    plain = generate(model, prompts, GC, policy=make("streaming", **_knobs("streaming", SMALL)))
    assert max(bounded.stats["kv_bytes_peak"]) < 0.6 * max(plain.stats["kv_bytes_peak"])
    assert bounded.tokens != plain.tokens  # `streaming` keeps the prompt's final chunk whole


def test_h2o_keeps_highest_accumulated_mass():
    n = 8
    c = _hand_cache(np.random.RandomState(0).randn(n, 4), list(range(n)))
    pol = H2O(capacity_floor=3, sinks=0, recent=0)
    m1 = np.array([0.5, 0.0, 0.1, 0.0, 0.1, 0.1, 0.2, 0.0])
    m2 = np.array([0.0, 0.4, 0.1, 0.0, 0.3, 0.0, 0.2, 0.0])
    from maskahead_jax.policies import StepContext

    def obs(c, m, n_queries):  # released EvictionState.observe, decay 1: g += n_queries * alpha
        ctx = StepContext(None, None, None, None, 8, 0, n, None, mass=m, rows=jnp.arange(8)[None] < n_queries)
        return pol.eviction.scorer.observe(c, ctx)

    c = obs(obs(c, _row(m1), 1), _row(m2), 1)
    np.testing.assert_allclose(np.asarray(c.acc)[0, 0, 0], m1 + m2, atol=1e-7)
    np.testing.assert_allclose(np.asarray(obs(c, _row(m2), 3).acc)[0, 0, 0], m1 + 4 * m2, atol=1e-6)
    # accumulated: 0.5 0.4 0.2 0 0.4 0.1 0.4 0 -> the top 4 are 0, 1, 4, 6
    out = pol.eviction.evict(c, _row(np.zeros(n)), None, jnp.asarray([4]), 4)
    assert _kept(out) == [0, 1, 4, 6]
    # the step-0 mass of the evicting block alone would pick differently
    assert set(np.argsort(-m2)[:4]) != {0, 1, 4, 6}
    # the accumulator survives compaction with its entries
    np.testing.assert_allclose(np.asarray(out.acc)[0, 0, 0][:4], (m1 + m2)[[0, 1, 4, 6]], atol=1e-7)


def test_caote_score_matches_formula_and_ranks_far_values_first():
    v = np.array([[1.0, 0.0], [0.0, 0.0], [4.0, 0.0], [1.0, 1.0]], np.float32)
    acc = np.array([2.0, 1.0, 0.5, 0.5], np.float32)
    h = acc / acc.sum()
    o = h @ v
    want = h / (1 - h) * np.linalg.norm(v - o, axis=-1)
    got = np.asarray(caote_scores(jnp.asarray(acc), jnp.asarray(v), jnp.ones(4, bool)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    c = _hand_cache(v, [0, 1, 2, 3])._replace(acc=_row(acc))
    out = CAOTE(capacity_floor=2, sinks=0, recent=0).eviction.evict(c, _row(np.zeros(4)), None, jnp.asarray([2]), 2)
    assert _kept(out) == sorted(np.argsort(-want)[:2].tolist())
    # plain H2O keeps the two largest accumulators instead
    out = H2O(capacity_floor=2, sinks=0, recent=0).eviction.evict(c, _row(np.zeros(4)), None, jnp.asarray([2]), 2)
    assert _kept(out) == [0, 1]


def test_snapkv_keeps_window_and_max_pooled_top():
    n = 16
    c = _hand_cache(np.random.RandomState(0).randn(n, 4), list(range(n)))
    probe = np.full(n, 0.01, np.float32)
    probe[5] = 1.0  # a peak: max-pooling (kernel 3 here) lifts its neighbours 4 and 6 too
    probe[9] = 0.5
    probe[12] = 0.9  # inside the window anyway
    pol = SnapKV(capacity_floor=7, window=4, pool=3, sinks=0)  # released default: 4 sinks
    pooled = np.asarray(max_pool_1d(jnp.asarray(probe), 3))
    np.testing.assert_allclose(pooled[4:7], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(pooled[[0, 13, 15]], [0.01, 0.9, 0.01])
    out = pol.eviction.evict(c, _row(np.ones(n)), _row(probe), jnp.asarray([7]), 7)
    assert _kept(out) == [4, 5, 6, 12, 13, 14, 15]  # 3 pooled around the peak + the 4-entry window
    # the step-0 mass is ignored by SnapKV (only the window queries vote)
    assert pol.due_after_block(jnp.int32(4), out).tolist() == [False]


def test_herald_pools_a_single_centre_query():
    masked = jnp.asarray([[True] * 8, [False] * 5 + [True] * 3, [False] + [True] * 7])
    rows = np.asarray(HERALD().stats_request(masked, jnp.asarray([True, True, True])).rows)
    assert rows.sum(1).tolist() == [1, 1, 1]
    # released SelectorConfig.query_indices "middle": the masked position closest to the block
    # centre 3.5, the lower on a tie (it was the lower median of the masked positions: 3, 6, 4)
    assert rows.argmax(1).tolist() == [3, 5, 3]
    assert not HERALD().stats_request(masked, jnp.asarray([False, True, True])).rows[0].any()


def test_invalid_settings_are_clear_errors(model):
    gc = GenerationConfig(max_new_tokens=8)
    with pytest.raises(PolicyError, match="window"):
        generate(model, [[1, 2]], gc, policy=SnapKV(capacity_floor=16, window=32))
    with pytest.raises(PolicyError, match="below recent"):
        generate(model, [[1, 2]], gc, policy=make("streaming", capacity_floor=10, recent=64))
    with pytest.raises(PolicyError, match="decay"):
        generate(model, [[1, 2]], gc, policy=H2O(decay=0.0))
    with pytest.raises(PolicyError, match="odd"):
        generate(model, [[1, 2]], gc, policy=SnapKV(capacity_floor=64, window=8, pool=4))
    with pytest.raises(PolicyError, match="capacity_pct"):
        generate(model, [[1, 2]], gc, policy=make("h2o", capacity_pct=-5))
