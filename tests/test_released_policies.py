"""The baselines as the released MaskAhead code runs them (issue 37 items 1-3), each against a
direct numpy computation of the released rule (brain-lab-research/MaskAhead @ c37f4b6:
src/maskahead/eviction.py EvictionState.observe / survivors, src/maskahead/config.py
SelectorConfig.query_indices, src/maskahead/runtime/session.py end_prefill_chunk / end_block)
on small hand-built tensors, plus the engine hooks that carry them. The added released policies
(ea, dapq, bitsieve-v1) are in tests/test_released_added.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import H2O, HERALD, MaskAhead, Policy, SnapKV, StatsRequest, StreamingLLM, make
from maskahead_jax.policies.selection import centre_rows
from released_reference import _ctx, _hand_cache, _kept, _row, np_softmax, released_middle, released_survivors
from tiny import tiny_model


# ----------------------------------------------------------------------------- item 2: HERALD
@pytest.mark.parametrize("bs", [8, 32])
def test_centre_query_is_the_released_middle_rule(bs):
    rng = np.random.RandomState(bs)
    masks = rng.rand(200, bs) < rng.rand(200, 1)
    masks[0] = np.arange(bs) >= 1  # the examples: masks at 1..31 -> 15; 16..31 -> 16
    masks[1] = np.arange(bs) >= bs // 2
    masks = masks[masks.any(1)]
    got = np.asarray(centre_rows(jnp.asarray(masks), jnp.ones(len(masks), bool)))
    assert (got.sum(1) == 1).all()
    want = [released_middle(np.flatnonzero(m).tolist(), bs) for m in masks]
    assert got.argmax(1).tolist() == want
    if bs == 32:
        assert want[:2] == [15, 16]
    assert not np.asarray(centre_rows(jnp.asarray(masks[:1]), jnp.asarray([False]))).any()


def test_herald_ranks_by_the_centre_query_mass():
    """configs/herald.yaml: selector mode middle, value_aware unset (False): mass ranking."""
    sel = HERALD().selector
    assert (sel.ranking, sel.rows) == ("mass", "centre")


# ----------------------------------------------------------------------------- item 1: H2O
def test_h2o_accumulates_queries_times_mass_at_blocks_and_prefill_chunks():
    """EvictionState.observe with decay 1: g += len(query_indices) * alpha, alpha the mean over
    those queries (x the GQA group); every block's step 0 (its masked queries) and every prefill
    chunk after the first (its tokens, over the cache before it) is observed."""
    rng = np.random.RandomState(0)
    n, g = 12, 2
    c = _hand_cache(rng.randn(n, 4), list(range(n)))
    pol = H2O(capacity_floor=8, sinks=0, recent=0)

    def alpha(r):  # softmax rows of r queries x g heads, pooled by their mean (the selector's)
        return np_softmax(rng.randn(g * r, n)).mean(0)

    a_blk, a_chunk, a_first = alpha(5), alpha(8), alpha(8)
    blk_rows = jnp.asarray([[True] * 5 + [False] * 3])
    c = pol.on_block(c, _ctx(n, due=jnp.asarray([False]), tokens=jnp.zeros((1, 8), jnp.int32),
                             start=jnp.asarray([n]), mass=_row(a_blk), rows=blk_rows)).cache
    chunk = dict(n_pre=jnp.asarray([64]), appended=jnp.asarray([8]), rows=jnp.ones((1, 8), bool))
    c = pol.on_prefill_chunk(c, _ctx(n, start=jnp.asarray([16]), mass=_row(a_chunk), **chunk))
    c = pol.on_prefill_chunk(c, _ctx(n, start=jnp.asarray([0]), mass=_row(a_first), **chunk))  # unobserved
    want = 5 * a_blk + 8 * a_chunk
    np.testing.assert_allclose(np.asarray(c.acc)[0, 0, 0], want, rtol=1e-5)
    assert pol.prefill_stats_request(jnp.ones((1, 8), bool)).mass
    assert MaskAhead().prefill_stats_request(jnp.ones((1, 8), bool)) is None  # MaskAhead computes none


# ----------------------------------------------------------------------------- item 3: timing
def test_end_of_block_eviction_is_the_released_survivors_after_the_commit():
    """end_block -> maybe_evict: after every interval_blocks-th block (block_index + 1), if live >
    C(seen), keep the W newest, the sinks and the top C - W by the accumulator."""
    rng = np.random.RandomState(1)
    n = 20
    acc = rng.rand(n)
    c = _hand_cache(rng.randn(n, 4), list(range(n)), acc=acc)
    pol = H2O(capacity_pct=10, capacity_floor=9, sinks=2, recent=3, interval_blocks=2)
    ctx = _ctx(n, appended=jnp.asarray([8]))
    same, ev = pol.after_commit(c, ctx._replace(blocks_done=jnp.int32(3)))
    assert not bool(ev) and _kept(same) == list(range(n))
    out, ev = pol.after_commit(c, ctx._replace(blocks_done=jnp.int32(4)))
    assert bool(ev)
    assert _kept(out) == released_survivors(range(n), acc, "ema_recent", 9, window=3, sinks=2)
    # nothing is ever due at a step 0 at this timing, and MaskAhead never evicts after a commit
    assert not bool(pol.due_after_block(jnp.int32(4), c)[0]) and not bool(pol.due_after_prefill(c)[0])
    assert not bool(MaskAhead(capacity_floor=9).after_commit(c, ctx._replace(blocks_done=jnp.int32(4)))[1])
    s_out, _ = StreamingLLM(capacity_floor=9, sinks=2, recent=3, interval_blocks=2).after_commit(
        c, ctx._replace(blocks_done=jnp.int32(2)))
    assert _kept(s_out) == released_survivors(range(n), acc, "recent", 9, sinks=2)


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_prompt_is_compressed_before_its_final_chunk_is_admitted(name):
    """end_prefill_chunk(final=True): the live set (every chunk but the final one) is evicted to
    C(tokens seen before the final chunk); then the final chunk is admitted whole."""
    rng = np.random.RandomState(2)
    n_old, chunk = 24, 8
    n = n_old + chunk
    acc = rng.rand(n)
    c = _hand_cache(rng.randn(n, 4), list(range(n)), acc=acc)
    pol = make(name, capacity_pct=10, capacity_floor=10, sinks=2, recent=3)
    ctx = _ctx(n, start=jnp.asarray([n_old]), appended=jnp.asarray([chunk]), n_pre=jnp.asarray([n]))
    out = pol.on_prefill_chunk(c, ctx)
    policy = "recent" if name == "streaming" else "ema_recent"
    want = released_survivors(range(n_old), acc[:n_old], policy, 10, window=3, sinks=2) + list(range(n_old, n))
    assert _kept(out) == want
    # a chunk that is not the prompt's last one compresses nothing (prefill_capacity_percent: 100)
    assert _kept(pol.on_prefill_chunk(c, ctx._replace(n_pre=jnp.asarray([n + 8])))) == list(range(n))


def test_snapkv_compresses_after_admitting_the_final_chunk():
    """SnapKV: the final chunk is admitted first; its last `window` queries vote over the whole
    prompt (the probe: their own positions, no self-block, the whole stored prompt), max-pooled
    (kernel 5, padding 2), and the window and sinks are kept, to C(whole prompt)."""
    rng = np.random.RandomState(3)
    n = 40
    mass = rng.rand(n).astype(np.float32)
    seen = {}

    def forward(cache, tokens, positions, mask, rows):
        rows = getattr(rows, "rows", rows)  # a StatsRequest or rows
        seen.update(positions=np.asarray(positions), mask=np.asarray(mask), rows=np.asarray(rows))
        return _row(mass)

    c = _hand_cache(rng.randn(n, 4), list(range(n)))
    pol = SnapKV(capacity_floor=12, window=8)
    assert pol.sinks == 4 and pol.pool == 5  # configs/snapkv.yaml
    ctx = _ctx(n, forward, start=jnp.asarray([32]), appended=jnp.asarray([8]), n_pre=jnp.asarray([n]))
    with jax.disable_jit():  # the fake forward records concrete arrays inside lax.cond
        out = pol.on_prefill_chunk(c, ctx)
    assert seen["positions"].tolist() == [list(range(32, 40))] and not seen["mask"].any() and seen["rows"].all()
    pooled = np.array([mass[max(0, i - 2):i + 3].max() for i in range(n)])  # F.max_pool1d(5, 1, 2)
    assert _kept(out) == released_survivors(range(n), pooled, "snapkv", 12, window=8, sinks=4)
    assert not bool(pol.due_after_prefill(out)[0])


def test_end_to_end_timing_of_the_baselines():
    """A 70-token prompt, 32-token chunks, 8-token blocks: the prefix [0, 64) is two chunks, the
    first compressed to C(32) = 12 before the second is admitted (44 live after prefill), and
    with interval_blocks 2 the cache is compacted to C(seen) right after the second block."""
    model = tiny_model("sdar", num_layers=2)
    prompt = [list(map(int, np.random.RandomState(4).randint(0, 40, size=70)))]
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=32, stop_at_eos=False)  # 2 blocks
    kw = dict(capacity_pct=10, capacity_floor=12, topk_floor=8, dense_layers=1, sinks=2, recent=4)
    out = generate(model, prompt, gc, policy=make("streaming", interval_blocks=4, **kw))
    assert out.stats["live_entries"] == [12 + 32 + 16] and out.stats["evictions"] == 0
    out = generate(model, prompt, gc, policy=make("streaming", interval_blocks=2, **kw))
    assert out.stats["live_entries"] == [12] and out.stats["evictions"] == 1
    # the peak: the whole 64-entry prefix, stored before its compression (as released)
    per_entry = out.stats["kv_bytes_final"][0] / 12
    assert out.stats["kv_bytes_peak"][0] == pytest.approx(per_entry * 64, rel=0.05)
    # MaskAhead defers: compressed at the first block's step 0 to C(64)
    ma = generate(model, prompt, gc, policy=make("maskahead", interval_blocks=4, lookahead_blocks=2, **kw))
    assert ma.stats["live_entries"] == [12 + 16] and ma.stats["evictions"] == 1


# ----------------------------------------------------------------------------- engine hooks
RECORD: list = []


@dataclasses.dataclass(frozen=True)
class _Recorder(Policy):
    name = "recorder"

    def prefill_stats_request(self, valid):
        return StatsRequest(valid)

    def on_prefill_chunk(self, cache, ctx):
        RECORD.append(("chunk", np.asarray(ctx.start), np.asarray(ctx.appended), np.asarray(ctx.mass),
                       np.asarray(ctx.rows), np.asarray(cache.length)))
        return cache

    def after_commit(self, cache, ctx):
        RECORD.append(("commit", int(ctx.blocks_done), np.asarray(ctx.appended), np.asarray(cache.length)))
        return cache, jnp.bool_(False)


def test_engine_hands_prefill_statistics_and_calls_after_commit():
    RECORD.clear()
    model = tiny_model("sdar", num_layers=2)
    prompt = [list(map(int, np.random.RandomState(5).randint(0, 40, size=n))) for n in (70, 45)]
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=32, stop_at_eos=False)
    generate(model, prompt, gc, policy=_Recorder(), jit=False)
    chunks = [r for r in RECORD if r[0] == "chunk"]  # the prompt bucket (128) is 4 chunks
    assert [r[1].tolist() for r in chunks] == [[0, 0], [32, 32], [64, 64], [96, 96]]
    assert [r[2].tolist() for r in chunks] == [[32, 32], [32, 8], [0, 0], [0, 0]]  # n_pre = 64, 40
    stored = np.zeros(2, int)
    for _, start, app, mass, rows, length in chunks:
        assert rows.sum(1).tolist() == app.tolist()
        tot = mass.sum(-1)  # prefix-only softmax over the cache before the chunk
        want = ((app > 0) & (stored > 0)).astype(float)[None, :, None]
        np.testing.assert_allclose(tot, np.broadcast_to(want, tot.shape), atol=1e-5)
        for i in range(2):
            assert not mass[:, i, :, stored[i]:].any()
        stored += app
        assert length.tolist() == stored.tolist()
    commits = [r for r in RECORD if r[0] == "commit"]
    assert [r[1] for r in commits] == [1, 2]
    assert commits[0][3].tolist() == [72, 48]  # called after the block's append


