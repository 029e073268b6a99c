"""The eviction probe writes nothing into the cache (issue 37), checked through `generate`.

MaskAhead's lookahead probe runs a forward of the block and (m - 1) mask blocks at the next
positions over the pre-eviction cache. Run A records, per block, the mass each probe returned
and the cache each on_block hands back. Run B replays A's masses from a probe that runs no
forward at all. If the probe forward left anything in the cache (its tokens, positions, K/V)
or the engine's state depended on it other than through the returned mass, B's caches would
differ from A's; they must be equal block by block, and no kept entry may sit at or after the
block's first position (where the probe's tokens were).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np
import pytest

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import MaskAhead
from tiny import tiny_model

REC: dict = {}


def _rec(key, start, *arrays):
    REC.setdefault(key, []).append((tuple(np.asarray(start).tolist()), [np.asarray(a) for a in arrays]))


@dataclasses.dataclass(frozen=True)
class RecordingProbe:
    """The real probe; its mass goes to REC[tag] keyed by the block's start positions."""
    inner: object
    tag: str

    def mass(self, cache, ctx):
        m = self.inner.mass(cache, ctx)
        jax.debug.callback(partial(_rec, self.tag + ":mass"), ctx.start, m)
        return m


@dataclasses.dataclass(frozen=True)
class ReplayProbe:
    """No forward: the mass run `source` recorded for this block (by start positions)."""
    source: str
    tag: str

    def mass(self, cache, ctx):
        def replay(start):
            table = {k: a[0] for k, a in REC[self.source + ":mass"]}
            _rec(self.tag + ":replayed", start)
            return table[tuple(np.asarray(start).tolist())]

        shape = jax.ShapeDtypeStruct(cache.pos.shape, np.float32)
        return jax.pure_callback(replay, shape, ctx.start)


@dataclasses.dataclass(frozen=True)
class Spy(MaskAhead):
    tag: str = "A"
    replay_from: str = ""

    @property
    def eviction(self):
        ev = super().eviction
        probe = ReplayProbe(self.replay_from, self.tag) if self.replay_from else RecordingProbe(ev.schedule.probe, self.tag)
        return dataclasses.replace(ev, schedule=dataclasses.replace(ev.schedule, probe=probe))

    def on_block(self, cache, ctx):
        res = super().on_block(cache, ctx)
        c = res.cache
        jax.debug.callback(partial(_rec, self.tag + ":out"), ctx.start, c.pos, c.valid, c.k, c.v, res.evicted)
        return res


KNOBS = dict(capacity_pct=10, capacity_floor=24, topk_pct=5, topk_floor=16, dense_layers=1, sinks=2,
             recent=8, interval_blocks=1, lookahead_blocks=3)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_probe_writes_nothing_into_the_cache():
    REC.clear()
    m = tiny_model("sdar", num_layers=3)
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(0, 40, size=n))) for n in (70, 45)]
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=32, stop_at_eos=False)
    a = generate(m, prompts, gc, policy=Spy(**KNOBS, tag="A"))
    b = generate(m, prompts, gc, policy=Spy(**KNOBS, tag="B", replay_from="A"))
    probes = REC["A:mass"]
    assert len(probes) >= 2 and a.stats["evictions"] >= 2  # the probe ran and evictions happened
    assert len(REC["B:replayed"]) == len(probes)  # B evicted at the same blocks, with A's masses
    assert a.tokens == b.tokens
    outs_a, outs_b = REC["A:out"], REC["B:out"]
    assert len(outs_a) == len(outs_b) > 0
    for (sa, ca), (sb, cb) in zip(outs_a, outs_b):
        assert sa == sb
        for x, y in zip(ca, cb):
            np.testing.assert_array_equal(x, y)
        pos, valid = ca[0], ca[1]
        np.testing.assert_array_equal(valid, pos >= 0)
        start = np.asarray(sa)[None, :, None, None]
        assert not (valid & (pos >= start)).any(), "an entry at or after the block's start (the probe's positions)"
    evicted_blocks = sum(bool(c[-1]) for _, c in outs_a)
    assert evicted_blocks >= 2
