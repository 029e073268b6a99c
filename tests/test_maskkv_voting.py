"""The MaskKV family's votes against a plain reference: MaskKV on block-causal models (the first
block's mask queries vote once), and the prompt-compression baselines on bidirectional models
(SnapKV, PyramidKV, AdaKV: SnapKV's observation window; MaskKV: the mask queries).

The reference is a per-layer numpy loop over the whole sequence with an explicit attention mask
(the model's own projections, RoPE and MLP, but none of the engine, cache, kernels or probe
plumbing); from its attention probabilities it derives each (layer, KV head)'s scores, the
budgets from the budget formulas (hand-tested in test_maskkv.py) and the kept positions. The
policies run inside `generate(jit=False)` through a recording subclass, so the engine's own
hooks (on_block with ctx.block_kv / ctx.forward, on_prompt with vote) feed them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.model.decoder import _qkv_pre_rope, output_projection
from maskahead_jax.model.layers import apply_rope, rms_norm, rope_tables, swiglu
from maskahead_jax.policies import AdaKV, MaskKV, PyramidKV, SnapKV, make
from maskahead_jax.policies.maskkv import adakv_head_budgets, head_budgets, layer_budgets, pyramid_budgets
from maskahead_jax.policies.scorers import max_pool_1d
from tiny import MASK, tiny_model

BS = 8
# 4 steps per 8-token block: the eager runs cost their steps; the votes are over the prompt
GC_BC = GenerationConfig(max_new_tokens=16, steps_per_block=4, stop_at_eos=False)
GC_BI = GenerationConfig(max_new_tokens=16, steps_per_block=4, stop_at_eos=False, prompt_refresh=0)
SEEN: list = []  # (cache before, cache after, plen) recorded by the policies below


def _prompts(lens=(70, 45), seed=0):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


# ----------------------------------------------------------------------------- recorders
def _recording(cls):
    @dataclasses.dataclass(frozen=True)
    class Rec(cls):
        if hasattr(cls, "layerwise"):  # the online variant: its vote passes through on_prompt (the
            layerwise: bool = False   # layer-by-layer cut keeps the same: tests/test_long_context.py)

        def on_block(self, cache, ctx):
            res = super().on_block(cache, ctx)
            if ctx.first:
                SEEN.append((cache, res.cache, cache.length))
            return res

        def on_prompt(self, cache, vote, plen):
            out = super().on_prompt(cache, vote, plen)
            SEEN.append((cache, out, plen))
            return out

    Rec.name = cls.name
    return Rec


def _run(model, prompts, gc, policy):
    """generate eagerly and return (output, [L, B, Hkv] kept positions as sets, prompt lens)."""
    SEEN.clear()
    out = generate(model, prompts, gc, policy=policy, jit=False)
    assert len(SEEN) == 1
    _, after, plen = SEEN[0]
    pos, val = np.asarray(after.pos), np.asarray(after.valid)
    L, B, H = val.shape[:3]
    kept = [[[set(pos[l, b, h][val[l, b, h]].tolist()) for h in range(H)] for b in range(B)] for l in range(L)]
    return out, kept, np.asarray(plen)


# ----------------------------------------------------------------------------- reference
def ref_probs(model, toks, allowed) -> np.ndarray:
    """Attention probabilities [L, H, T, T] of one sequence (positions 0..T-1) under the boolean
    mask allowed [T, T] (query row may read key column), float64 softmax."""
    cfg, params = model.config, model.params
    t = len(toks)
    x = params["embed"][jnp.asarray(toks)][None]
    cos, sin = rope_tables(jnp.arange(t)[None], cfg.rope_dim, cfg.rope_theta)
    g = cfg.num_heads // cfg.num_kv_heads
    out_probs = []
    for l in range(cfg.num_layers):
        p = jax.tree_util.tree_map(lambda a: a[l], params["layers"])
        q, k, v = _qkv_pre_rope(p, x, cfg)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (np.asarray(a[0], np.float64) for a in (q, k, v))  # [T, H(kv), D]
        kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # query head h reads kv head h // g
        lg = np.einsum("thd,shd->hts", q, kr) / np.sqrt(cfg.head_dim)
        lg = np.where(allowed[None], lg, -np.inf)
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->htd", pr, vr)  # [H, T, D]
        o = o.reshape(cfg.num_kv_heads, g, t, cfg.head_dim)[None]
        x = x + output_projection(p, jnp.asarray(o, jnp.float32), cfg)
        x = x + swiglu(p["mlp"], rms_norm(x, p["mlp_norm"], cfg.rms_eps))
        out_probs.append(pr)
    return np.stack(out_probs)


def pooled(probs, rows, cols, hkv) -> np.ndarray:
    """[L, Hkv, len(cols)]: probabilities of query rows over key cols, mean over rows and group."""
    a = probs[:, :, rows][:, :, :, cols].mean(2)  # [L, H, C]
    return a.reshape(a.shape[0], hkv, -1, a.shape[-1]).mean(2)


def top_positions(scores, k, forced=None) -> set:
    """The k best of a 1-d score vector (ties: lower index), plus the forced positions."""
    s = np.asarray(scores, np.float64).copy()
    forced = set() if forced is None else set(forced)
    for f in forced:
        s[f] = -np.inf
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    return set(i for i in order[:k] if np.isfinite(s[i])) | forced


def window_ref_scores(mass, n, w, pool):
    """SnapKV's pooled scores over prompt slots [0, n - w) (window excluded from pooling)."""
    a = np.full(mass.shape[:-1] + (n,), -np.inf)
    a[..., :n - w] = mass[..., :n - w]
    out = np.asarray(max_pool_1d(jnp.asarray(a, jnp.float32), pool), np.float64)
    out[..., n - w:] = -np.inf
    return out


# ----------------------------------------------------------------------------- block-causal
def _bc_reference(model, prompt, n_new=16):
    """Mask voting at the first block of a block-causal model: (mass [L, Hkv, n_pre], P_h
    [L, Hkv] = mass on the prompt, stored prefix and tail)."""
    cfg = model.config
    plen = len(prompt)
    n_pre = plen // BS * BS
    block = prompt[n_pre:] + [MASK] * (BS - (plen - n_pre))
    toks = prompt[:n_pre] + block
    t = len(toks)
    qb, kb = np.arange(t)[:, None] // BS, np.arange(t)[None, :] // BS
    probs = ref_probs(model, toks, kb <= qb)
    rows = [i for i in range(n_pre, t) if toks[i] == MASK]
    m = pooled(probs, rows, list(range(t)), cfg.num_kv_heads)
    return m[..., :n_pre], m[..., :plen].sum(-1)


@pytest.mark.parametrize("family", ["sdar", "dream_reasoner"])
def test_blockcausal_vote_keeps_the_reference_top_entries(family):
    m = tiny_model(family)
    prompts = _prompts()
    pol = _recording(MaskKV)(budget_per_head=8, block_causal=True, layer_importance=(1.0, 0.5, 2.0))
    out, kept, n_pre = _run(m, prompts, GC_BC, pol)
    L, hkv = m.config.num_layers, m.config.num_kv_heads
    for b, p in enumerate(prompts):
        mass, pref = _bc_reference(m, p)
        assert n_pre[b] == len(p) // BS * BS
        kl = layer_budgets(8 * L, (1.0, 0.5, 2.0), 0.4)
        k = head_budgets(kl, pref, 0.1)  # [L, Hkv]
        assert k.sum() == 8 * L * hkv  # the budget, spent exactly
        for l in range(L):
            for h in range(hkv):
                assert kept[l][b][h] == top_positions(mass[l, h], int(k[l, h])), (b, l, h)


def test_blockcausal_shifted_logits_family_runs_and_spends_the_budget():
    m = tiny_model("fast_dllm_v2")  # logits_shift: the block's first slot holds a prediction, not a vote
    pol = _recording(MaskKV)(budget_per_head=8, block_causal=True)
    out, kept, n_pre = _run(m, _prompts(), GC_BC, pol)
    counts = np.array([[[len(s) for s in row] for row in lay] for lay in kept])  # [L, B, Hkv]
    assert (counts.sum(axis=(0, 2)) == 8 * 3 * 2).all() and (counts <= n_pre[None, :, None]).all()


def test_blockcausal_budgets_memory_and_no_later_eviction():
    m = tiny_model("sdar").astype(jnp.bfloat16)
    prompts = _prompts()  # 70 and 45 tokens: stored prefixes 64 and 40, tails 6 and 5
    gen_entries = 24  # three blocks of 8 appended per lane (tail + 16 new tokens)
    per_tok = 2 * 8 * 2  # bf16 K + V per (layer, KV head), head_dim 8
    lanes = 3 * 2
    for pol, b_head in [(make("maskkv-blockcausal", kv_entries=8), [8, 8]),
                        (make("maskkv-blockcausal", 10), [6, 4])]:  # floor(10% of 64 / 40)
        out = generate(m, prompts, GC_BC, policy=pol)
        assert out.stats["evictions"] == 1 and all(len(t) == 16 for t in out.tokens)
        assert out.stats["kv_bytes_final"] == [lanes * (b + gen_entries) * per_tok for b in b_head]
        assert out.stats["kv_bytes_peak"] == [lanes * n * per_tok for n in (64, 40)]  # the prompt, before the vote
        assert out.stats["reduction_final"][0] == pytest.approx((64 + gen_entries) / (b_head[0] + gen_entries))


def test_blockcausal_full_budget_equals_dense_and_plain_maskkv_refuses():
    m = tiny_model("sdar")
    dense = generate(m, _prompts(), GC_BC)
    with pytest.warns(UserWarning, match="holds the whole"):
        full = generate(m, _prompts(), GC_BC, policy=make("maskkv-blockcausal", kv_entries=10_000))
    assert full.tokens == dense.tokens and full.stats["live_entries"] == dense.stats["live_entries"]
    with pytest.raises(ValueError, match="maskkv-blockcausal"):
        generate(m, _prompts(), GC_BC, policy=make("maskkv", 10))


# ----------------------------------------------------------------------------- bidirectional
def _bi_reference(model, prompt, rows_of):
    """Bidirectional first step: [prompt | G masks] under full attention; mass of the voters
    (rows_of(plen, T) -> row indices) over every key [L, Hkv, T]."""
    g = 16
    toks = prompt + [MASK] * g
    t = len(toks)
    probs = ref_probs(model, toks, np.ones((t, t), bool))
    return pooled(probs, rows_of(len(prompt), t), list(range(t)), model.config.num_kv_heads)


MASK_ROWS = lambda n, t: list(range(n, t))
WINDOW = 16


def window_rows(n, t):
    return list(range(max(0, n - WINDOW), n))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_maskkv_matches_the_reference(family):
    m = tiny_model(family)
    prompts = _prompts()
    pol = _recording(MaskKV)(budget_per_head=8)
    _, kept, _ = _run(m, prompts, GC_BI, pol)
    L, hkv = m.config.num_layers, m.config.num_kv_heads
    for b, p in enumerate(prompts):
        mass = _bi_reference(m, p, MASK_ROWS)
        n = len(p)
        k = head_budgets(layer_budgets(8 * L, (1.0,) * L, 0.4), mass[..., :n].sum(-1), 0.1)
        for l in range(L):
            for h in range(hkv):
                assert kept[l][b][h] == top_positions(mass[l, h, :n], int(k[l, h])), (b, l, h)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("which", ["snapkv", "pyramidkv", "adakv"])
def test_bidirectional_window_baselines_match_the_reference(family, which):
    m = tiny_model(family)
    prompts = _prompts()
    L, hkv = m.config.num_layers, m.config.num_kv_heads
    B = 24  # KV pairs per head, the window (16) inside it
    if which == "snapkv":
        pol = _recording(SnapKV)(capacity_entries=B, window=WINDOW, pool=7, sinks=0)
    else:
        pol = _recording({"pyramidkv": PyramidKV, "adakv": AdaKV}[which])(budget_per_head=B, window=WINDOW)
    _, kept, _ = _run(m, prompts, GC_BI, pol)
    for b, p in enumerate(prompts):
        n = len(p)
        mass = _bi_reference(m, p, window_rows)[..., :n]
        scores = window_ref_scores(mass, n, WINDOW, 7)
        win = list(range(n - WINDOW, n))
        if which == "snapkv":
            k = np.full((L, hkv), B - WINDOW)
        elif which == "pyramidkv":
            k = np.repeat(pyramid_budgets(B - WINDOW, L)[:, None], hkv, 1)
        else:
            valid = np.isfinite(scores)
            k = adakv_head_budgets(np.full(L, B - WINDOW), np.where(valid, scores, 0.0), valid, 0.2)
        assert k.sum() == (B - WINDOW) * L * hkv
        for l in range(L):
            for h in range(hkv):
                assert kept[l][b][h] == top_positions(scores[l, h], int(k[l, h]), win), (which, b, l, h)
                assert len(kept[l][b][h]) == k[l, h] + WINDOW


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_baselines_generate_with_exact_budgets(family):
    """Each runs through the jitted generate with an absolute budget and a percentage, and
    holds exactly the budgeted entries (per-head average x lanes)."""
    m = tiny_model(family)
    prompts = _prompts()
    lanes = m.config.num_layers * m.config.num_kv_heads
    for name in ("snapkv", "pyramidkv", "adakv", "maskkv"):
        out = generate(m, prompts, GC_BI, policy=make(name, kv_entries=40))
        assert all(len(t) == 16 for t in out.tokens)
        per_entry = 2 * 8 * 4  # float32 K + V per (layer, KV head), head_dim 8
        if name == "snapkv":
            assert out.stats["live_entries"] == [40, 40]
        elif name == "maskkv":  # a head's budget over the prompt length is clipped, not redistributed (paper)
            assert out.stats["kv_bytes_final"][0] == 40 * lanes * per_entry
            assert 0 < out.stats["kv_bytes_final"][1] <= 40 * lanes * per_entry
        else:
            assert out.stats["kv_bytes_final"] == [40 * lanes * per_entry] * 2, name
    pct = generate(m, prompts, GC_BI, policy=make("snapkv", 25, capacity_floor=16, window=8))
    assert pct.stats["live_entries"] == [17, 16]  # floor(25% of 70), max(floor(25% of 45), 16)
    pct = generate(m, prompts, GC_BI, policy=make("adakv", 40, window=8))
    assert pct.stats["kv_bytes_final"] == [28 * lanes * per_entry, 18 * lanes * per_entry]


def test_pyramid_clamp_as_adakv():
    # AdaKV's PyramidKV: a max above the selectable length becomes it, min = 2B - max
    assert pyramid_budgets(64, 4, 20.0, exact_total=False, max_len=100).tolist() == [100, 76, 52, 28]
    k = pyramid_budgets(jnp.asarray([8, 8]), 3, max_len=jnp.asarray([54, 13]))
    assert np.asarray(k).T.tolist() == [[16, 8, 0], [13, 8, 3]]  # each row spends L * B = 24


def test_percent_budget_is_exact_at_integers_under_jit():
    # 5% of 1000 is 50 (float32 under jit computed 49.99999 -> 49 with an absolute guard)
    f = jax.jit(lambda n: MaskKV(budget_pct=5.0).per_head_budget(n))
    assert np.asarray(f(jnp.asarray([1000, 2000, 999, 20]))).tolist() == [50, 100, 49, 1]
    f = jax.jit(lambda n: MaskKV(budget_pct=30.0).per_head_budget(n))
    assert np.asarray(f(jnp.asarray([70, 45]))).tolist() == [21, 13]
