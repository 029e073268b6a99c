"""Storage as a part (policies/storage.py): every evicting policy runs on the packed low-bit cache
with `bits=4`, scored and attended from low bits, and equals the same policy on the float cache
that holds the packed cache's round-trip values (the simulated reference)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from maskahead_jax.cache import QKVCache
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import Float, MaskAhead, Packed, PolicyError, knobs, make, names, takes_budget
from tiny import tiny_model

GC = GenerationConfig(max_new_tokens=64, prefill_chunk=64, stop_at_eos=False)
# evictions every block at whole-key-group floors
SMALL = dict(capacity_pct=30, capacity_floor=64, topk_pct=30, topk_floor=32, dense_layers=1, sinks=2,
             recent=32, interval_blocks=1, lookahead_blocks=2, window=16)
BIDIRECTIONAL_ONLY = ("maskkv", "maskkv-online", "pyramidkv", "adakv")  # prompt compressors


def _model():
    return tiny_model("sdar", num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      intermediate_size=64, block_size=32)


def _prompts(lens=(250, 150)):  # SnapKV compresses at the final chunk: C(192 seen) < 192
    rng = np.random.RandomState(1)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


def _small(name, **kw):
    return make(name, **{k: v for k, v in SMALL.items() if k in knobs(name)}, **kw)


def _evicting():
    return [n for n in names() if takes_budget(n) and n not in BIDIRECTIONAL_ONLY and n != "maskkv-blockcausal"
            and not make(n).storage.prefix]


@pytest.mark.parametrize("name", _evicting())
def test_every_evicting_policy_takes_bits(name):
    """bits=4 puts the policy on the packed cache: its name gets the q- prefix, its budgets whole key
    groups, its empty cache is the packed one, and it passes the run checks on a block-causal model."""
    m = _model()
    pol = _small(name, bits=4)
    assert pol.storage == Packed(4) and pol.label == "q-" + pol.name
    cache = pol.empty_cache(1, 1, 1, 64, 32)
    assert isinstance(getattr(cache, "inner", cache), QKVCache)  # ea wraps it with its statistics
    pol.check_run(m.config, GC.resolve(m.config))
    ev = pol.eviction
    assert ev.budget.multiple == 32 and ev.budget.capacity(100) % 32 == 0
    assert _small(name).storage == Float() and _small(name).label == pol.name


@pytest.mark.parametrize("name", ["h2o", "snapkv", "ea"])
def test_baselines_on_the_packed_cache_match_the_simulated_cache(name):
    """H2O (accumulated mass in cache.acc), SnapKV (a window probe at the final prefill chunk) and
    Expected Attention (a statistics cache around the packed one) at 4 bits == the same policy on
    the float cache holding the round-trip values; the packed bytes are >= 3x fewer (2.5x for
    Expected Attention, whose float32 query statistics are not the cache's)."""
    m = _model()
    pol = _small(name, bits=4, compact_dtype="float32")
    packed = generate(m, _prompts(), GC, policy=pol)
    sim = generate(m, _prompts(), GC, policy=dataclasses.replace(pol, storage=dataclasses.replace(pol.storage, simulate=True)))
    assert packed.tokens == sim.tokens
    assert packed.stats["live_entries"] == sim.stats["live_entries"]
    assert packed.stats["live_entries"][0] < 250 + 64 and packed.stats["policy"] == "q-" + name  # evicted
    ratio = sim.stats["kv_bytes_final"][0] / packed.stats["kv_bytes_final"][0]
    assert ratio > (2.5 if name == "ea" else 3.0), ratio


def test_storage_knobs_and_refusals():
    q = make("q-maskahead", 10, bits=2, compaction="lazy")
    assert isinstance(q, MaskAhead) and q.storage == Packed(2, compaction="lazy") and q.label == "q-maskahead"
    assert make("q-maskahead-qa").head_alloc == "adakv" and make("q-maskahead-qa", head_alloc="uniform").head_alloc == "uniform"
    assert make("h2o", 10, storage=Packed(4)) == make("h2o", 10, bits=4)
    with pytest.raises(PolicyError, match="give bits=4"):
        make("h2o", 10, compaction="lazy")
    m = _model()
    gen = GC.resolve(m.config)
    with pytest.raises(PolicyError, match="bits must be one of"):
        make("snapkv", 10, bits=3).check_run(m.config, gen)
    with pytest.raises(PolicyError, match="ragged per-head budgets"):
        make("maskkv-blockcausal", 10, bits=4).check_run(m.config, gen)
    llada = tiny_model("llada", head_dim=32, block_size=32)
    with pytest.raises(PolicyError, match="block-causal family"):
        make("snapkv", 10, bits=4).check_run(llada.config, GC.resolve(llada.config))


def test_a_step0_scorer_under_end_of_block_is_refused_before_tracing():
    """A scheduled (end_of_block) eviction that ranks by the step-0 mass has none to rank by: the
    run check says so, instead of a trace-time failure on mass0=None."""
    from maskahead_jax.policies.baselines import ScheduledEviction
    from maskahead_jax.policies.scorers import Pooled, ValueScore

    class ValueAtEnd(ScheduledEviction):
        def scorer(self):
            return Pooled(ValueScore(), 3)

    m = _model()
    with pytest.raises(PolicyError, match="ranks by the step-0 mass.*end_of_block"):
        ValueAtEnd().check_run(m.config, GC.resolve(m.config))
