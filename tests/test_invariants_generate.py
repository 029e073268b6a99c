"""Cache invariants under hypothesis-generated schedules, driven through `generate` (issue 37).

A spy subclass of the policy records the cache every on_block / after_commit hands back (a host
callback); each recorded cache must satisfy, per lane (layer, row, KV head):

* valid == (pos >= 0), kept positions unique and < the row's tokens seen;
* the first `sinks` positions and the newest `recent` positions are kept;
* live entries <= C(seen) + interval_blocks * block_size (an eviction brings a due row down to
  C(seen); at most interval_blocks blocks are appended before the next one), plus one prefill
  chunk for the end-of-block baselines (released: the prompt is compressed before its final
  chunk is admitted, which then stays until the first block eviction).

Schedules vary the budget, floor, sinks / recent, block size, interval, policy (MaskAhead's
deferred step-0 eviction, StreamingLLM / H2O at the end of blocks) and ragged batches.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import H2O, MaskAhead, StreamingLLM
from tiny import tiny_model

SEEN: list = []


def _record(pos, valid, seen):
    SEEN.append((np.asarray(pos), np.asarray(valid), np.asarray(seen)))


def spy(cls):
    """`cls` whose on_block / after_commit also record the cache they return."""

    @dataclasses.dataclass(frozen=True)
    class Spy(cls):
        def on_block(self, cache, ctx):
            res = super().on_block(cache, ctx)
            jax.debug.callback(_record, res.cache.pos, res.cache.valid, res.cache.seen)
            return res

        def after_commit(self, cache, ctx):
            c, ev = super().after_commit(cache, ctx)
            jax.debug.callback(_record, c.pos, c.valid, c.seen)
            return c, ev

    Spy.__name__ = Spy.__qualname__ = f"Spy{cls.__name__}"
    return Spy


POLICIES = {"maskahead": MaskAhead, "streaming": StreamingLLM, "h2o": H2O}
MODEL = {}


def _model():
    if not MODEL:
        MODEL["m"] = tiny_model("sdar", num_layers=2, max_position_embeddings=512)
    return MODEL["m"]


@st.composite
def schedules(draw):
    bs = draw(st.sampled_from([4, 8]))
    sinks = draw(st.sampled_from([0, 2, 4]))
    recent = draw(st.sampled_from([4, 8]))
    floor = draw(st.sampled_from([16, 24, 40]))
    return dict(
        policy=draw(st.sampled_from(sorted(POLICIES))), block_size=bs,
        knobs=dict(capacity_pct=draw(st.sampled_from([5.0, 20.0, 50.0])), capacity_floor=max(floor, sinks + recent),
                   sinks=sinks, recent=recent, interval_blocks=draw(st.integers(1, 3))),
        lens=draw(st.lists(st.integers(9, 90), min_size=1, max_size=3)),
        new=draw(st.sampled_from([16, 24])), seed=draw(st.integers(0, 1000)))


def check(rec, pol, bs: int, chunk: int) -> None:
    k = pol.knobs_for_test
    cap = lambda seen: np.asarray(pol.eviction.budget.capacity(jnp.asarray(seen, jnp.int32)))
    for pos, valid, seen in rec:
        np.testing.assert_array_equal(valid, pos >= 0)
        s = seen[None, :, None, None]
        assert not (valid & (pos >= s)).any(), "a kept position >= the row's tokens seen"
        L, B, H, N = pos.shape
        for l in range(L):
            for b in range(B):
                for h in range(H):
                    p = pos[l, b, h][valid[l, b, h]]
                    assert len(set(p.tolist())) == len(p), "duplicate positions in a lane"
                    have = set(p.tolist())
                    n = int(seen[b])
                    want = set(range(min(k["sinks"], n))) | set(range(max(0, n - k["recent"]), n))
                    assert want <= have, f"sinks / recent missing: {sorted(want - have)[:8]}"
        live = valid.sum(-1)  # [L, B, H]
        ev = pol.eviction
        bound = cap(seen) + k["interval_blocks"] * bs + (0 if ev.deferred or ev.bounded_prefill else chunk)
        assert (live <= bound[None, :, None]).all(), (live.max(), bound)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schedules())
def test_cache_invariants_through_generate(s):
    m = _model()
    rng = np.random.RandomState(s["seed"])
    prompts = [list(map(int, rng.randint(0, 40, size=n))) for n in s["lens"]]
    cls = spy(POLICIES[s["policy"]])
    pol = cls(**s["knobs"])
    object.__setattr__(pol, "knobs_for_test", s["knobs"])
    gc = GenerationConfig(max_new_tokens=s["new"], block_size=s["block_size"], prefill_chunk=32,
                          stop_at_eos=False)
    SEEN.clear()
    out = generate(m, prompts, gc, policy=pol)
    assert len(out.tokens) == len(prompts)
    assert SEEN, "the spy recorded no cache"
    check(list(SEEN), pol, s["block_size"], gc.prefill_chunk)
