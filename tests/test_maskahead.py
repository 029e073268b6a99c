"""MaskAhead selection/eviction: exactness at full budget, the scoring pass, hand-built keep sets,
cache invariants, memory metric, and errors."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from maskahead_jax import cache as kvc
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies.eviction import Eviction
from maskahead_jax.kernels import reference as ref
from maskahead_jax.policies import MaskAhead, PolicyError, make, takes_budget
from tiny import tiny_model

FULL = dict(capacity_pct=100, capacity_floor=4096, topk_pct=100, topk_floor=4096, dense_layers=1)
SMALL = dict(capacity_pct=10, capacity_floor=24, topk_pct=5, topk_floor=16, dense_layers=1, sinks=2,
             recent=8, interval_blocks=2, lookahead_blocks=3)


def _prompts(lens=(70, 45), seed=0):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


@pytest.mark.parametrize("name", ["maskahead", "maskahead-noevict", "mage"])
def test_full_budget_equals_dense(name):
    m = tiny_model("sdar", num_layers=4)
    gc = GenerationConfig(max_new_tokens=40, prefill_chunk=32, stop_at_eos=False)
    dense = generate(m, _prompts(), gc)
    kw = FULL if takes_budget(name) else {k: v for k, v in FULL.items() if not k.startswith("capacity")}
    out = generate(m, _prompts(), gc, policy=make(name, **kw))
    assert out.tokens == dense.tokens


def test_small_budget_evicts_and_bounds_memory():
    m = tiny_model("fast_dllm_v2", num_layers=3)
    gc = GenerationConfig(max_new_tokens=40, prefill_chunk=32, stop_at_eos=False)
    pol = MaskAhead(**SMALL)
    out = generate(m, _prompts(), gc, policy=pol, cache_dtype=jnp.bfloat16)
    assert out.stats["evictions"] >= 2
    seen = [70 + 40, 45 + 40]
    for live, s in zip(out.stats["live_entries"], seen):
        # after the last eviction at most interval_blocks blocks were appended
        assert live <= pol.eviction.budget.capacity(s) + pol.interval_blocks * 8
    assert min(out.stats["reduction_final"]) > 1.0


def _qkv(key, b=2, hk=2, g=3, t=5, s=11, d=8):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, hk, g, t, d))
    kc = jax.random.normal(ks[1], (b, hk, s, d))
    vc = jax.random.normal(ks[2], (b, hk, s, d))
    kb = jax.random.normal(ks[3], (b, hk, t, d))
    vb = jax.random.normal(ks[4], (b, hk, t, d))
    return q, kc, vc, kb, vb


def test_scoring_pass_matches_direct_computation():
    q, kc, vc, kb, vb = _qkv(jax.random.PRNGKey(0))
    b, hk, g, t, d = q.shape
    s = kc.shape[2]
    valid = jnp.asarray(np.random.RandomState(0).rand(b, hk, s) > 0.2)
    rows = jnp.asarray([[1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], bool)
    blk = jnp.ones((b, t, t), bool)
    out, stats = ref.attention(q, kc, vc, valid, kb, vb, blk, rows)
    qn, kn, vn, kbn, vbn = map(np.asarray, (q, kc, vc, kb, vb))
    vm, rn = np.asarray(valid), np.asarray(rows)
    for bi in range(b):
        for h in range(hk):
            ps, o_rows = [], []
            for gi in range(g):
                for ti in range(t):
                    lc = kn[bi, h] @ qn[bi, h, gi, ti] / np.sqrt(d)
                    lb = kbn[bi, h] @ qn[bi, h, gi, ti] / np.sqrt(d)
                    lc = np.where(vm[bi, h], lc, -np.inf)
                    joint = np.exp(np.concatenate([lc, lb]) - np.max(np.concatenate([lc, lb])))
                    joint /= joint.sum()
                    o = joint[:s] @ vn[bi, h] + joint[s:] @ vbn[bi, h]
                    np.testing.assert_allclose(np.asarray(out)[bi, h, gi, ti], o, atol=1e-5)
                    if rn[bi, ti]:  # prefix-only: the block's keys are not in the normaliser
                        p = np.exp(lc - lc[vm[bi, h]].max())
                        ps.append(p / p.sum())
            a = np.mean(ps, axis=0)  # pooled over the group's heads and the selected rows
            c = a @ vn[bi, h]
            sc = a * np.linalg.norm(vn[bi, h] - c, axis=-1)
            np.testing.assert_allclose(np.asarray(stats.mass)[bi, h], a, atol=1e-6)
            np.testing.assert_allclose(np.asarray(stats.score)[bi, h], sc, atol=1e-5)
            assert abs(a.sum() - 1) < 1e-5


def _hand_cache(v, pos, cap=None):
    """One layer, one row, one KV head cache holding values v [N, D] at positions pos."""
    n, d = v.shape
    cap = cap or n
    c = kvc.empty(1, 1, 1, cap, d, jnp.float32)
    k = jnp.zeros((1, 1, 1, n, d))
    c = kvc.append(c, k, jnp.asarray(v, jnp.float32)[None, None, None], jnp.asarray([pos], jnp.int32),
                   jnp.asarray([n], jnp.int32))
    return c


def test_value_aware_score_prefers_far_values_over_centre():
    # entry 0: large mass but v equals the centre; entry 1: smaller mass, far value
    # with v_0 = c, c = 0.5 c + 0.1*5 + 0.2*0 + 0.2*2  =>  c = 1.8
    v = np.array([[1.8, 0.0], [5.0, 0.0], [0.0, 0.0], [2.0, 0.0]], np.float32)
    mass = np.array([0.5, 0.1, 0.2, 0.2], np.float32)
    s = np.asarray(ref.value_score(jnp.asarray(mass), jnp.asarray(v)))
    assert s[0] < 1e-5 < s[1]
    pol = MaskAhead(capacity_floor=2, recent=0, sinks=0, lookahead_blocks=1)
    c = _hand_cache(v, [10, 11, 12, 13])
    out = pol.eviction.evict(c, jnp.asarray(mass)[None, None, None], None, jnp.asarray([2]), 4)
    kept = set(np.asarray(out.pos)[0, 0, 0][np.asarray(out.valid)[0, 0, 0]].tolist())
    assert 11 in kept and 10 not in kept


def test_probe_mass_saves_a_needle_and_forced_entries_survive():
    rng = np.random.RandomState(0)
    n = 12
    v = rng.randn(n, 4).astype(np.float32)
    pos = list(range(n))
    mass0 = np.full(n, 1.0 / n, np.float32)
    mass0[6] = 0.0  # the step-0 queries ignore the needle at position 6
    probe = np.zeros(n, np.float32)
    probe[6] = 3.0  # only the probe's lookahead queries attend to it
    pol = MaskAhead(capacity_floor=5, recent=2, sinks=2, lookahead_blocks=4)
    c = _hand_cache(v, pos)
    m0 = jnp.asarray(mass0)[None, None, None]
    with_probe = pol.eviction.evict(c, m0, jnp.asarray(probe)[None, None, None], jnp.asarray([5]), 8)
    without = pol.eviction.evict(c, m0, None, jnp.asarray([5]), 8)
    kept = lambda cc: np.asarray(cc.pos)[0, 0, 0][np.asarray(cc.valid)[0, 0, 0]].tolist()
    assert 6 in kept(with_probe) and 6 not in kept(without)
    for kk in (kept(with_probe), kept(without)):
        assert {0, 1, 10, 11} <= set(kk)  # sinks (pos < 2) and the 2 newest
        assert kk == sorted(kk) and len(kk) == 5
    assert with_probe.capacity == 8


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=6),
       st.integers(0, 10_000))
def test_cache_invariants_under_random_schedules(schedule, seed):
    """Append blocks, evict to random budgets: positions increase, no duplicates, capacity holds,
    and nothing valid is lost while under capacity."""
    rng = np.random.RandomState(seed)
    cap, b = 64, 2
    c = kvc.empty(2, b, 2, cap, 4, jnp.float32)
    pol = MaskAhead(capacity_floor=3, recent=2, sinks=1, lookahead_blocks=1)
    nxt = np.zeros(b, np.int64)
    for n_new, budget in schedule:
        room = cap - int(np.asarray(c.length).max())
        n_new = min(n_new, room)
        if n_new > 0:
            k = jnp.asarray(rng.randn(2, b, 2, n_new, 4), jnp.float32)
            posn = jnp.asarray(nxt[:, None] + np.arange(n_new)[None], jnp.int32)
            before = _kept(c)
            c = kvc.append(c, k, k, posn, jnp.full((b,), n_new, jnp.int32))
            nxt += n_new
            after = _kept(c)
            for lane in before:  # appending loses nothing
                assert set(before[lane]) <= set(after[lane])
        keep = np.minimum(np.asarray(c.length), max(budget, 3))
        prev = _kept(c)
        mass = jnp.asarray(rng.rand(*c.valid.shape), jnp.float32)
        c = pol.eviction.evict(c, mass, None, jnp.asarray(keep, jnp.int32), cap)
        now = _kept(c)
        for lane, ps in now.items():
            row = lane[1]
            assert list(ps) == sorted(set(ps)), "strictly increasing positions, no duplicates"
            assert len(ps) == keep[row] <= cap
            assert set(ps) <= set(prev[lane])
            if len(prev[lane]) <= keep[row]:
                assert set(ps) == set(prev[lane]), "nothing lost while under capacity"


def _kept(c):
    pos, val = np.asarray(c.pos), np.asarray(c.valid)
    out = {}
    for l in range(pos.shape[0]):
        for b in range(pos.shape[1]):
            for h in range(pos.shape[2]):
                out[(l, b, h)] = [int(p) for p in pos[l, b, h][val[l, b, h]]]
    return out


def test_memory_metric_on_a_10k_prompt_is_about_9_5x():
    """The paper's worked arithmetic: 10k-token prompt, 32 new tokens, C = 10%, D = 128, bf16."""
    m = tiny_model("sdar", num_layers=1, hidden_size=128, num_heads=1, num_kv_heads=1, head_dim=128,
                   intermediate_size=64, block_size=32, max_position_embeddings=16384)
    rng = np.random.RandomState(0)
    prompt = list(map(int, rng.randint(0, 40, size=10_000)))
    pol = MaskAhead(dense_layers=0)
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=512, stop_at_eos=False)
    out = generate(m.astype(jnp.bfloat16), [prompt], gc, policy=pol, bucket=512)
    red = out.stats["reduction_final"][0]
    assert 9.0 < red < 10.0, out.stats
    # the peak is the whole prompt in bf16 (plus per-entry state)
    assert out.stats["kv_bytes_peak"][0] >= 9_984 * 512


def test_invalid_settings_are_clear_errors():
    m = tiny_model("sdar")
    gc = GenerationConfig(max_new_tokens=8)
    with pytest.raises(PolicyError, match="below recent"):
        generate(m, [[1, 2]], gc, policy=MaskAhead(capacity_floor=10, recent=64))
    with pytest.raises(PolicyError, match="capacity_pct"):
        generate(m, [[1, 2]], gc, policy=MaskAhead(capacity_pct=0))
    with pytest.raises(PolicyError, match="topk_floor"):
        generate(m, [[1, 2]], gc, policy=MaskAhead(topk_floor=-1))
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        make("nope")


def test_bounded_prefill_bounds_the_peak_and_matches_at_full_budget():
    from maskahead_jax.policies import BoundedPrefillMaskAhead

    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts((150, 97), seed=3)
    gc = GenerationConfig(max_new_tokens=16, prefill_chunk=32, stop_at_eos=False)
    dense = generate(m, prompts, gc)
    full = BoundedPrefillMaskAhead(**FULL, question_tokens=8)
    assert generate(m, prompts, gc, policy=full).tokens == dense.tokens
    small = dict(SMALL, capacity_floor=24, question_tokens=8)
    bounded = generate(m, prompts, gc, policy=BoundedPrefillMaskAhead(**small))
    plain = generate(m, prompts, gc, policy=MaskAhead(**SMALL))
    # the plain policy holds the whole prompt before its first eviction; the bounded one never
    # holds much more than C + one chunk
    assert max(bounded.stats["kv_bytes_peak"]) < 0.6 * max(plain.stats["kv_bytes_peak"])
    assert bounded.stats["cache_capacity"] <= plain.stats["cache_capacity"]


def test_question_probe_on_the_released_schedule():
    """MaskAhead(question_tokens=N): exact at full budget; its first eviction (and only that one)
    probes and pins the question span; bad settings are clear errors."""
    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts((150, 97), seed=3)
    gc = GenerationConfig(max_new_tokens=40, prefill_chunk=32, steps_per_block=4, stop_at_eos=False)
    dense = generate(m, prompts, gc)
    full = MaskAhead(**FULL, question_tokens=16, pin_question=True)
    assert generate(m, prompts, gc, policy=full).tokens == dense.tokens

    calls = []

    @dataclasses.dataclass(frozen=True)
    class RecordingEviction(Eviction):
        def evict(self, cache, mass0, probe_mass, keep, capacity, pinned=None):
            out = super().evict(cache, mass0, probe_mass, keep, capacity, pinned=pinned)
            calls.append((pinned is not None, _kept(out)))
            return out

    @dataclasses.dataclass(frozen=True)
    class Recording(MaskAhead):
        @property
        def eviction(self):
            ev = super().eviction
            return RecordingEviction(**{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)})

    q = 16
    pol = Recording(**SMALL, question_tokens=q, pin_question=True)
    with jax.disable_jit():  # eager: each eviction runs once, in order
        generate(m, prompts, gc, policy=pol, jit=False)
    assert len(calls) >= 2 and calls[0][0] and not any(p for p, _ in calls[1:])
    for row, plen in enumerate((150, 97)):
        n_pre = plen // 8 * 8  # the block-aligned prefix held in the cache at the first eviction
        span = set(range(plen - q, n_pre))
        for (l, b, h), kept in calls[0][1].items():
            if b == row:
                assert span <= set(kept), (l, h, sorted(span - set(kept)))
                assert len(kept) == pol.eviction.budget.capacity(n_pre) < n_pre  # it did evict

    with pytest.raises(PolicyError, match="question_tokens must be >= 0"):
        generate(m, prompts, gc, policy=MaskAhead(**SMALL, question_tokens=-1))
    with pytest.raises(PolicyError, match="has no knob .*question_tokens"):
        make("h2o", **SMALL, question_tokens=8)  # H2O has no probe to replace
    with pytest.raises(PolicyError, match="needs MaskAhead's lookahead probe"):
        generate(m, prompts, gc, policy=MaskAhead(**dict(SMALL, lookahead_blocks=1), question_tokens=8))
    with pytest.raises(PolicyError, match="pin_question needs question_tokens"):
        generate(m, prompts, gc, policy=MaskAhead(**SMALL, pin_question=True))
