"""Q-MaskAhead end to end: the packed cache (maskahead_jax.cache.QKVCache) against a float cache holding the
same quantize -> dequantize values, memory from the arrays, 2-bit, registry and errors."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import cache as kvc
from maskahead_jax import quant
from maskahead_jax.cache import QKVCache, choose_slots, packed, packed_layout, simulated
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import MaskAhead, PolicyError, QuestionAwareMaskAhead, make
from tiny import tiny_model

# selection every block (30% of the live set) and an eviction after every block
SMALL = dict(capacity_pct=30, capacity_floor=64, topk_pct=30, topk_floor=32, dense_layers=1, sinks=2,
             recent=32, interval_blocks=1, lookahead_blocks=2)


def _model(**over):
    kw = dict(num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
              intermediate_size=64, block_size=32)
    kw.update(over)
    return tiny_model("sdar", **kw)


def _prompts(lens=(150, 90), seed=0):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


GC = GenerationConfig(max_new_tokens=64, prefill_chunk=64, stop_at_eos=False)


def q_maskahead(**kw):
    """q-maskahead (MaskAhead on the packed 4-bit cache) with these policy and storage knobs."""
    return make("q-maskahead", **kw)


def q_maskahead_qa(**kw):
    return make("q-maskahead-qa", **kw)


def simulated_twin(policy):
    """The same policy on the float cache holding the packed cache's round-trip values."""
    return dataclasses.replace(policy, storage=dataclasses.replace(policy.storage, simulate=True))


# ----------------------------------------------------------------------------- cache ops
def _kv(key, l=2, b=2, h=1, t=64, d=32):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (l, b, h, t, d)) * 2.0 + 0.5, jax.random.normal(k2, (l, b, h, t, d))


def _deq(c):
    return quant.dequantize_kv(c.q, jnp.float32)


def test_cache_ops_match_the_float_round_trip():
    """append / keep_top / resize on the packed cache == the same ops on a float cache that
    stores quantize -> dequantize values (keys of survivors requantized on eviction)."""
    l, b, h, d = 2, 2, 1, 32
    qc = packed.empty(l, b, h, 128, d, 4)
    sc = simulated.sim_empty(l, b, h, 128, d, jnp.float32, 4)
    assert isinstance(qc, QKVCache) and qc.capacity == 128
    for step in range(2):
        k, v = _kv(jax.random.PRNGKey(step))
        pos = jnp.broadcast_to(step * 64 + jnp.arange(64, dtype=jnp.int32), (b, 64))
        n = jnp.array([64, 32 if step else 64], jnp.int32)  # row 1 gets half a chunk the 2nd time
        qc, sc = kvc.append(qc, k, v, pos, n), kvc.append(sc, k, v, pos, n)
    np.testing.assert_array_equal(qc.valid, sc.valid)
    np.testing.assert_array_equal(qc.pos, sc.pos)
    np.testing.assert_array_equal(qc.length, [128, 96])
    kq, vq = _deq(qc)
    m = np.asarray(qc.valid)[..., None]
    np.testing.assert_array_equal(np.where(m, kq, 0), np.where(m, sc.k, 0))
    np.testing.assert_array_equal(np.where(m, vq, 0), np.where(m, sc.v, 0))
    # the cache's own values are the round trip of the appended tokens (within half a step)
    assert float(jnp.abs(jnp.where(m, kq - jnp.concatenate([_kv(jax.random.PRNGKey(0))[0],
                                                             _kv(jax.random.PRNGKey(1))[0]], 3), 0)).max()) < 0.5

    scores = jax.random.uniform(jax.random.PRNGKey(7), qc.valid.shape)
    keep = jnp.array([64, 32], jnp.int32)
    q2, s2 = kvc.keep_top(qc, scores, keep, 64), kvc.keep_top(sc, scores, keep, 64)
    assert q2.capacity == 64 and q2.q.k_res.shape[-2] == 0
    np.testing.assert_array_equal(q2.valid, s2.valid)
    np.testing.assert_array_equal(q2.pos, s2.pos)
    np.testing.assert_array_equal(q2.live()[:, :, 0], [[64, 32], [64, 32]])
    kq, vq = _deq(q2)
    m = np.asarray(q2.valid)[..., None]
    np.testing.assert_allclose(np.where(m, kq, 0), np.where(m, s2.k, 0), atol=1e-6)
    np.testing.assert_array_equal(np.where(m, vq, 0), np.where(m, s2.v, 0))  # values move bit-exactly

    q3, s3 = kvc.resize(q2, 96), kvc.resize(s2, 96)
    assert q3.capacity == 96 and q3.q.k_scale.shape[-2] == 3
    np.testing.assert_array_equal(q3.valid, s3.valid)
    np.testing.assert_array_equal(kvc.resize(q3, 64).q.k_codes, q2.q.k_codes)
    # the packed context a layer reads, and the compact bf16 buffer of selected entries
    ctx = q3.context(1, 2)
    assert isinstance(ctx.k, quant.QuantKV) and ctx.v is None and ctx.valid.shape == (1, b, h, 96)
    idx, kp = choose_slots(q3.valid, q3.pos, scores[..., :96], jnp.array([8, 8]), 8)
    sel = q3.select_context(idx, kp)
    assert sel.k.dtype == jnp.bfloat16 and sel.k.shape == (l, b, h, 8, d)
    with pytest.raises(ValueError, match="multiple of 32"):
        kvc.resize(q3, 80)


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("budget", ["small", "question"])
def test_generate_matches_float_cache_on_dequantized_kv(budget):
    """The packed run (step 0 and dense layers read codes, later steps read the gathered compact
    buffer) == the float-cache run whose appended K/V are quantized -> dequantized. "small":
    selection every block and evictions (survivor keys requantized on both sides); "question":
    "small" with the first eviction probing and pinning the question. (A full budget, no
    eviction, is the subset of "small" before its first eviction.)"""
    m = _model()
    kw = {"small": SMALL, "question": dict(SMALL, question_tokens=48, pin_question=True)}[budget]
    packed = generate(m, _prompts(), GC, policy=q_maskahead(compact_dtype="float32", **kw))
    sim = generate(m, _prompts(), GC, policy=q_maskahead(compact_dtype="float32", simulate=True, **kw))
    assert packed.tokens == sim.tokens
    assert all(len(t) == 64 for t in packed.tokens)
    assert packed.stats["live_entries"] == sim.stats["live_entries"]
    assert packed.stats["evictions"] >= 3
    assert max(packed.stats["live_entries"]) <= 96 + 32  # C rounded to whole groups + a block
    # same number of slots, 4-bit bytes (72 B/token at D = 32 + 10 B state) vs float32 (256)
    assert packed.stats["kv_bytes_final"][0] < sim.stats["kv_bytes_final"][0] / 3


@pytest.mark.parametrize("alloc", [dict(head_alloc="uniform"), dict(head_alloc="adakv", alloc_floor=0.1)])
def test_question_aware_packed_run_matches_the_simulated_cache(alloc):
    """`q-maskahead-qa`: maskahead-qa's eviction parts (question probe at every eviction, bounded
    prefill) over the packed cache == the same policy on the quantize -> dequantize float cache;
    bounded prefill keeps the peak near C + one chunk, far below q-maskahead's whole prompt.
    With AdaKV's head budgets (ragged lanes, each a whole number of key groups) as well."""
    m = _model(num_kv_heads=2, num_heads=4)
    kw = dict(SMALL, question_tokens=48, **alloc)
    qa = q_maskahead_qa(compact_dtype="float32", **kw)
    ev = qa.eviction
    flt = QuestionAwareMaskAhead(**kw).eviction
    assert ev == dataclasses.replace(flt, budget=ev.budget, allocation=dataclasses.replace(flt.allocation, multiple=32))
    assert ev.allocation.multiple == 32 and make("q-maskahead-qa", 10).head_alloc == "adakv"
    assert ev.budget.multiple == 32 and make("q-maskahead-qa", 10).question_tokens == 128
    packed_run = generate(m, _prompts((320, 250)), GC, policy=qa)
    sim = generate(m, _prompts((320, 250)), GC, policy=simulated_twin(qa))
    assert packed_run.tokens == sim.tokens
    assert packed_run.stats["live_entries"] == sim.stats["live_entries"]
    assert packed_run.stats["evictions"] >= 2
    if not alloc.get("head_alloc") == "adakv":  # the peak: once is enough
        plain = generate(m, _prompts((320, 250)), GC, policy=q_maskahead(compact_dtype="float32", **SMALL))
        assert packed_run.stats["kv_bytes_peak"][0] < plain.stats["kv_bytes_peak"][0]


def test_two_bit_and_bf16_runs_end_to_end():
    m = _model().astype(jnp.bfloat16)
    for bits in (2, 4):
        out = generate(m, _prompts(), GC, policy=make("q-maskahead", bits=bits, **SMALL))
        assert all(len(t) == 64 for t in out.tokens)
        assert out.stats["policy"] == "q-maskahead" and out.stats["evictions"] >= 3
        assert min(out.stats["reduction_final"]) > 3.0, out.stats


# ----------------------------------------------------------------------------- memory
def test_bytes_per_token_at_d128_from_the_arrays():
    q4 = packed.empty(1, 1, 1, 64, 128, 4)
    q2 = packed.empty(1, 1, 1, 64, 128, 2)
    f = kvc.empty(1, 1, 1, 64, 128, jnp.bfloat16)
    dense = (f.k.nbytes + f.v.nbytes) / 64
    assert q4.bytes_per_token == 160 and q2.bytes_per_token == 96 and dense == 512
    assert packed_layout.nbytes_breakdown(q4.q) == {"key_payload": 64 * 64, "key_metadata": 16 * 64,
                                                    "value_payload": 64 * 64, "value_metadata": 16 * 64,
                                                    "residual": 0}


def test_memory_on_a_10k_prompt_is_at_least_20x():
    """As tests/test_maskahead.py::test_memory_metric_on_a_10k_prompt_is_about_9_5x (1 layer, 1 KV
    head, D = 128, bf16, C = 10%), with the 4-bit cache: (160 + 10) B per kept entry."""
    m = tiny_model("sdar", num_layers=1, hidden_size=128, num_heads=1, num_kv_heads=1, head_dim=128,
                   intermediate_size=64, block_size=32, max_position_embeddings=16384)
    rng = np.random.RandomState(0)
    prompt = list(map(int, rng.randint(0, 40, size=10_000)))
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=512, stop_at_eos=False)
    out = generate(m.astype(jnp.bfloat16), [prompt], gc, policy=q_maskahead(dense_layers=0), bucket=512)
    red = out.stats["reduction_final"][0]
    # C(9,984) = 998 -> 1,024 (whole groups), + two blocks = 1,088 live; 10,048 tokens seen
    assert out.stats["live_entries"] == [1088]
    assert red >= 20.0, out.stats
    assert red == pytest.approx(10_048 * 512 / (1088 * 170), rel=1e-4)  # 27.8x
    # the peak is the whole prompt, packed, with its eviction state
    assert out.stats["kv_bytes_peak"][0] == 9_984 * 170


# ----------------------------------------------------------------------------- errors
def test_invalid_settings_are_clear_errors():
    gc = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    with pytest.raises(PolicyError, match="head_dim"):
        generate(tiny_model("sdar", block_size=32), [[1, 2]], gc, policy=q_maskahead(**SMALL))
    with pytest.raises(PolicyError, match="bits"):
        generate(_model(), [[1, 2]], gc, policy=q_maskahead(bits=3, **SMALL))
    with pytest.raises(PolicyError, match="block_size=16"):  # the open group forced off
        generate(_model(block_size=16), [[1, 2]], GenerationConfig(max_new_tokens=8, prefill_chunk=64),
                 policy=q_maskahead(residual=False, **SMALL))
    with pytest.raises(PolicyError, match="block-causal"):
        generate(tiny_model("llada", head_dim=32, block_size=32), [[1, 2]], gc, policy=q_maskahead(**SMALL))
    assert isinstance(make("q-maskahead"), MaskAhead)


# ----------------------------------------------------------------------------- the open group
@pytest.mark.parametrize("t,d", [(4, 64), (8, 96), (16, 128), (24, 32)])
def test_unaligned_appends_keep_an_open_group_equal_to_the_simulated_cache(t, d):
    """Appends of t tokens (not whole key groups) with the bf16 open group: the packed cache ==
    the simulated cache on every valid slot, through appends of ragged sizes and evictions that
    leave a partial group; complete groups are quantized once from their originals; the open
    group is counted in bytes_per_token."""
    l, b, h, cap = 2, 2, 1, 128
    qc = packed.empty(l, b, h, cap, d, 4, residual=True)
    sc = simulated.sim_empty(l, b, h, cap, d, jnp.float32, 4, residual=True)
    assert qc.open_k.shape == (l, b, h, 32, d)
    assert qc.bytes_per_token == packed.empty(l, b, h, cap, d, 4).bytes_per_token + 2 * 32 * d * 2 / cap
    ks, vs = [], []

    def check(qc, sc):
        m = np.asarray(qc.valid)[..., None]
        np.testing.assert_array_equal(qc.valid, sc.valid)
        np.testing.assert_array_equal(qc.pos, sc.pos)
        np.testing.assert_array_equal(qc.length, sc.length)
        kq, vq = _deq(qc)
        np.testing.assert_allclose(np.where(m, kq, 0), np.where(m, sc.k, 0), atol=1e-6)
        np.testing.assert_allclose(np.where(m, vq, 0), np.where(m, sc.v, 0), atol=1e-6)
        np.testing.assert_array_equal(qc.open_k, sc.open_k)

    step = 0
    rng = np.random.RandomState(t + d)
    while int(qc.length.max()) + t <= 96:
        k, v = _kv(jax.random.PRNGKey(step), l, b, h, t, d)
        ks.append(k), vs.append(v)
        n = jnp.array([t, int(rng.randint(0, t + 1))], jnp.int32)
        pos = jnp.broadcast_to(qc.seen[:, None] + jnp.arange(t, dtype=jnp.int32), (b, t))
        qc, sc = kvc.append(qc, k, v, pos, n), kvc.append(sc, k, v, pos, n)
        check(qc, sc)
        step += 1
    # row 0 got every token: its complete groups are the one-shot quantization of the originals
    # (open-group tokens as bf16), the trailing partial group's originals sit in open_k
    full = jnp.concatenate(ks, 3)[:, :1]
    n0 = int(qc.length[0])
    nq = n0 - n0 % 32
    kq = _deq(qc)[0][:, :1, :, :nq]
    step_k = jnp.repeat(qc.q.k_scale[:, :1, :, :nq // 32].astype(jnp.float32), 32, axis=3)
    # within half a step of the originals (+ the bf16 rounding of the staged tokens)
    assert float((jnp.abs(kq - full[..., :nq, :]) / step_k).max()) < 0.52
    np.testing.assert_array_equal(qc.open_k[:, 0, :, :n0 - nq], full[:, 0, :, nq:n0].astype(jnp.bfloat16))
    # an eviction to a partial group, then more appends onto it
    scores = jax.random.uniform(jax.random.PRNGKey(9), qc.valid.shape)
    keep = jnp.array([45, 37], jnp.int32)
    qc, sc = kvc.keep_top(qc, scores, keep, 64), kvc.keep_top(sc, scores, keep, 64)
    check(qc, sc)
    assert list(map(int, qc.length)) == [45, min(37, int(sc.valid[0, 1, 0].sum()))]
    qc, sc = kvc.resize(qc, 96), kvc.resize(sc, 96)
    for s in range(3):
        k, v = _kv(jax.random.PRNGKey(100 + s), l, b, h, t, d)
        n = jnp.array([t, t - 1], jnp.int32)
        pos = jnp.broadcast_to(qc.seen[:, None] + jnp.arange(t, dtype=jnp.int32), (b, t))
        qc, sc = kvc.append(qc, k, v, pos, n), kvc.append(sc, k, v, pos, n)
        check(qc, sc)
    sel = qc.select_context(*choose_slots(qc.valid, qc.pos, scores[..., :96], jnp.array([8, 8]), 8))
    assert sel.k.shape == (l, b, h, 8, d)


def test_aligned_appends_without_an_open_group_still_refuse_partial_groups():
    qc = packed.empty(1, 1, 1, 64, 32, 4)
    k, v = _kv(jax.random.PRNGKey(0), 1, 1, 1, 8, 32)
    with pytest.raises(ValueError, match="residual=True"):
        kvc.append(qc, k, v, jnp.arange(8, dtype=jnp.int32)[None], jnp.array([8]))


@pytest.mark.parametrize("bs,d,chunk", [(4, 32, 64), (8, 96, 48), (16, 128, 64)])  # chunks 64 / 48: aligned and not
def test_small_blocks_and_head_sizes_match_the_simulated_cache(bs, d, chunk):
    """Q-MaskAhead at block sizes 4 / 8 / 16 (SDAR's) and head sizes 32 / 96 / 128, with the
    policy's defaults: the open group turns on by itself (block or chunk not a multiple of 32),
    and the packed run == the simulated float run, with selections and evictions; forcing
    residual=False refuses such sizes with a PolicyError that names them."""
    m = _model(head_dim=d, hidden_size=max(64, 2 * d), block_size=bs)
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=chunk, stop_at_eos=False)
    gen = gc.resolve(m.config)
    kw = dict(SMALL, compact_dtype="float32")
    assert q_maskahead(**kw).for_run(m.config, gen).storage.residual is True
    assert q_maskahead(**kw).for_run(m.config, GC.resolve(_model().config)).storage.residual is False  # 32 / 64
    out = generate(m, _prompts((70, 45)), gc, policy=q_maskahead(**kw))
    sim = generate(m, _prompts((70, 45)), gc, policy=q_maskahead(simulate=True, **kw))
    assert out.tokens == sim.tokens and all(len(t) == 32 for t in out.tokens)
    assert out.stats["live_entries"] == sim.stats["live_entries"]
    assert out.stats["evictions"] >= 1
    with pytest.raises(PolicyError, match=f"block_size={bs}"):
        q_maskahead(residual=False, **SMALL).check_run(m.config, gen)
    # ragged per-lane budgets work on whole key groups: a clear error, with the way out
    with pytest.raises(PolicyError, match="head_alloc='uniform'"):
        q_maskahead_qa(**SMALL).check_run(m.config, gen)
    q_maskahead_qa(**SMALL, head_alloc="uniform").check_run(m.config, gen)


# ----------------------------------------------------------------------------- lazy compaction
def _np_released_quant(x: np.ndarray, axis: int, bits: int):
    """The released min/max rule in numpy float32: codes from the unrounded min and scale,
    floor(. + 0.5), then fp16 storage of scale / zero. x float32; reduces over `axis`."""
    qmax = np.float32(2 ** bits - 1)
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    s32 = np.maximum((hi - lo) / qmax, np.float32(1e-8)).astype(np.float32)
    codes = np.clip(np.floor((x - lo) / s32 + np.float32(0.5)), 0, qmax).astype(np.uint8)
    return codes, s32.astype(np.float16), lo.astype(np.float16)


def _np_lazy_lane(k_old, v_old, kc_old, ks_old, kz_old, vc_old, vs_old, vz_old, pos_old, surv, need, bits):
    """Released lazy compaction of one lane, from the old slots' codes and dequantized values:
    {position: (key codes, key group scale/zero row, value codes, value scale, value zero)}
    of every survivor, and (kept groups, re-encoded count)."""
    g = surv // 32
    groups, counts = np.unique(g, return_counts=True)
    kept = set(groups[counts >= need].tolist())
    out = {}
    for s in surv:
        if s // 32 in kept:  # bit-exact copy of the group's codes and metadata
            out[int(pos_old[s])] = (kc_old[s], ks_old[s // 32], kz_old[s // 32], vc_old[s], vs_old[s], vz_old[s])
    enc = sorted((int(pos_old[s]), s) for s in surv if s // 32 not in kept)
    n = len(enc)
    if n:
        m = -(-n // 32) * 32
        kx = np.zeros((m, k_old.shape[-1]), np.float32)
        vx = np.zeros_like(kx)
        for i, (_, s) in enumerate(enc):
            kx[i], vx[i] = k_old[s], v_old[s]
        kcod, ksc, kze = _np_released_quant(kx.reshape(m // 32, 32, -1), 1, bits)  # per channel over 32 tokens
        vcod, vsc, vze = _np_released_quant(vx.reshape(m, -1, 32), 2, bits)  # per token over 32 channels
        kcod, vcod = kcod.reshape(m, -1), vcod.reshape(m, -1)
        for i, (p, _) in enumerate(enc):
            out[p] = (kcod[i], ksc[i // 32, 0], kze[i // 32, 0], vcod[i], vsc[i, :, 0], vze[i, :, 0])
    return out, (len(kept), n)


@pytest.mark.parametrize("repack_below", [1.0, 0.75])
def test_lazy_compaction_matches_the_released_rule_in_numpy(repack_below, monkeypatch):
    """packed_layout.lazy_compact / the lazy cache == a direct numpy computation of the released
    `compaction: lazy` (session._evict_to -> PackedKVCache.rebuild): groups keeping >= need
    survivors copied bit-exactly, the others requantized (keys and values, zero-padded last
    group) in position order; the row's physical length 32 * (G1 + ceil(max re-encoded / 32))."""
    monkeypatch.setattr(quant, "ROUNDING", "released")
    l, b, h, d, n, bits = 2, 2, 2, 32, 256, 4
    need = max(1, int(np.ceil(repack_below * 32)))
    rng = np.random.RandomState(0)
    k, v = _kv(jax.random.PRNGKey(3), l, b, h, n, d)
    c = packed.lazy_type(need)(*packed.empty(l, b, h, n, d, bits))
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    c = kvc.append(c, k, v, pos, jnp.full((b,), n, jnp.int32))
    # survivors per lane: whole groups, groups missing a few entries, sparse groups
    scores = np.zeros((l, b, h, n), np.float32)
    for lane in np.ndindex(l, b, h):
        for g in range(n // 32):
            kind = rng.randint(3)
            keep = {0: 32, 1: 32 - rng.randint(1, 8), 2: rng.randint(0, 12)}[kind]
            sl = g * 32 + rng.choice(32, keep, replace=False)
            scores[lane + (sl,)] = 1.0 + rng.rand(keep)
    keep_n = (scores > 0).sum(-1)
    cap = 2 * n
    idx, keep = choose_slots(c.valid, c.pos, jnp.asarray(scores), jnp.asarray(keep_n), cap)
    live = keep & jnp.take_along_axis(c.valid, idx, axis=-1)
    new = c.gather(idx, keep)
    assert type(new) is type(c)
    kd, vd = (np.asarray(a) for a in quant.dequantize_kv(c.q, jnp.float32))
    old = [np.asarray(a) for a in (c.q.k_codes, c.q.k_scale, c.q.k_zero, c.q.v_codes, c.q.v_scale, c.q.v_zero)]
    old[0], old[3] = np.asarray(quant.unpack(c.q.k_codes, bits)), np.asarray(quant.unpack(c.q.v_codes, bits))
    nq = [np.asarray(quant.unpack(new.q.k_codes, bits)), np.asarray(new.q.k_scale), np.asarray(new.q.k_zero),
          np.asarray(quant.unpack(new.q.v_codes, bits)), np.asarray(new.q.v_scale), np.asarray(new.q.v_zero)]
    npos, nval = np.asarray(new.pos), np.asarray(new.valid)
    idx_np, live_np = np.asarray(idx), np.asarray(live)
    for bi in range(b):
        kept_max = enc_max = 0
        for li in range(l):
            for hi in range(h):
                lane = (li, bi, hi)
                surv = idx_np[lane][live_np[lane]]
                want, (nk, ne) = _np_lazy_lane(kd[lane], vd[lane], *(a[lane] for a in old),
                                               np.asarray(c.pos)[lane], surv, need, bits)
                kept_max, enc_max = max(kept_max, nk), max(enc_max, ne)
                slots = np.nonzero(nval[lane])[0]
                assert sorted(npos[lane][slots].tolist()) == sorted(want)
                for s in slots:
                    w = want[int(npos[lane][s])]
                    got = (nq[0][lane][s], nq[1][lane][s // 32], nq[2][lane][s // 32], nq[3][lane][s],
                           nq[4][lane][s], nq[5][lane][s])
                    for x, y in zip(got, w):
                        np.testing.assert_array_equal(x, y)
        assert int(new.length[bi]) == 32 * (kept_max + -(-enc_max // 32))
        assert int(np.max(np.nonzero(nval[:, bi].any(axis=(0, 1)))[0])) + 1 <= int(new.length[bi])
    assert (nval.sum(-1) == keep_n).all()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lazy_compaction_end_to_end():
    """q-maskahead compaction='lazy' through generate: at a small budget it evicts, and its memory
    is never below the requantize run's (it holds the padded physical layout); bad settings are
    clear errors. (Its layout against the released rule: the numpy test above.)"""
    m = _model()
    runs = {c: generate(m, _prompts(), GC, policy=q_maskahead(**SMALL, compaction=c)) for c in ("requantize", "lazy")}
    assert runs["lazy"].stats["evictions"] >= 2
    for a, r in zip(runs["lazy"].stats["kv_bytes_final"], runs["requantize"].stats["kv_bytes_final"]):
        assert a >= r
    # with bounded prefill (q-maskahead-qa) the prefill buffer gets the lazy layout's room too:
    # without it the padded extent plus the next chunk ran past the buffer, and the append
    # (dynamic_update_slice clamps its start) overwrote kept entries
    qa = q_maskahead_qa(**SMALL, question_tokens=48, head_alloc="uniform", compaction="lazy")
    plain = dataclasses.replace(qa, storage=dataclasses.replace(qa.storage, compaction="requantize"))
    c0, _ = qa.plan(320, 400, 32, 64)
    assert c0 >= plain.plan(320, 400, 32, 64)[0] + qa.eviction.prefill_capacity(320)
    lazy = generate(m, _prompts((200, 150)), GC, policy=qa)
    assert lazy.stats["evictions"] >= 2 and all(len(t) == 64 for t in lazy.tokens)
    cfg = m.config
    gen = GC.resolve(cfg)
    for kw, msg in ((dict(compaction="eager"), "compaction must be"), (dict(repack_below=0.0), "repack_below"),
                    (dict(compaction="lazy", residual=True), "residual=True"),
                    (dict(compaction="lazy", recent=64, capacity_floor=128, interval_blocks=1), "recent window")):
        with pytest.raises(PolicyError, match=msg):
            q_maskahead(**{**SMALL, **kw}).check_run(cfg, gen)
