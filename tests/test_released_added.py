"""The released policies added for issue 37: Expected Attention (`ea`), DapQ (`dapq`, and the
released lookahead probe fills) and `bitsieve-v1`, each against a direct numpy computation of the
released formula (brain-lab-research/MaskAhead @ c37f4b6: src/maskahead/runtime/session.py
_ea_observe / _ea_score / end_dapq_probe, runtime/generator.py _probe_tokens_impl,
configs/ea.yaml, dapq.yaml, bitsieve_v1.yaml) on small hand-built tensors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.model import decoder
from maskahead_jax.model.layers import rope_tables
from maskahead_jax.policies import DapQ, ExpectedAttention, MaskAhead, Packed, PolicyError, make
from maskahead_jax.policies.expected_attention import StatsCache
from maskahead_jax.policies.probes import dapq_tokens
from released_reference import _ctx, _hand_cache, _kept, _row, np_softmax, released_survivors, rotate_half
from tiny import tiny_model


# ----------------------------------------------------------------------------- Expected Attention
def test_ea_query_moments_are_the_unrotated_released_moments():
    """_ea_observe un-rotates the post-RoPE queries (x = y cos - rot(y) sin) and averages x and
    x x^T over the observed rows; the forward returns the same moments of the pre-RoPE queries."""
    model = tiny_model("sdar", num_layers=1)
    cfg, p = model.config, jax.tree_util.tree_map(lambda a: a[0], model.params["layers"])
    b, t = 2, 8
    x = jax.random.normal(jax.random.PRNGKey(0), (b, t, cfg.hidden_size))
    pos = jnp.asarray([[40 + i for i in range(t)], [9 + i for i in range(t)]], jnp.int32)
    rows = jnp.asarray(np.random.RandomState(6).rand(b, t) < 0.6)
    cos, sin = rope_tables(pos, cfg.rope_dim, cfg.rope_theta)
    qg = np.asarray(decoder.project_qkv(p, x, cos, sin, cfg)[0])  # [B, Hkv, G, T, D] post-RoPE
    c, s = np.asarray(cos)[:, None, None], np.asarray(sin)[:, None, None]
    pre = qg * c - rotate_half(qg) * s
    m1, m2 = decoder.query_moments(p, x, cfg, rows)
    for i in range(b):
        xr = pre[i][:, :, np.asarray(rows[i])]  # [Hkv, G, R, D]
        np.testing.assert_allclose(np.asarray(m1)[i], xr.mean(2), atol=1e-5)
        np.testing.assert_allclose(np.asarray(m2)[i], np.einsum("hgrd,hgre->hgde", xr, xr) / xr.shape[2], atol=1e-5)


def _np_ea(k, v, obs, positions, horizon, lam, eps, g):
    """The released _ea_observe (fed pre-RoPE query rows) + _ea_score for one layer / row.
    k, v [Hkv, N, D]; obs: list of pre-RoPE query rows [Hq, R, D]; positions: each
    observation's last two positions."""
    hq, d = obs[0].shape[0], k.shape[-1]
    mu, m2 = np.zeros((hq, d)), np.zeros((hq, d, d))
    for x in obs:
        mu = lam * mu + (1 - lam) * x.mean(1)
        m2 = lam * m2 + (1 - lam) * np.einsum("hrd,hre->hde", x, x) / x.shape[1]
    p0, p1 = positions[-1]
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = lambda p: np.concatenate([p * inv, p * inv])
    c0, s0, c1, s1 = np.cos(ang(p0)), np.sin(ang(p0)), np.cos(ang(p1)), np.sin(ang(p1))
    freq = np.arctan2(s1 * c0 - c1 * s0, c1 * c0 + s1 * s0)
    phase = np.arctan2(s1, c1)
    t = np.arange(1, horizon + 1)
    a = phase[None] + t[:, None] * freq[None]
    cbar, sbar = np.cos(a).mean(0), np.sin(a).mean(0)
    rot = rotate_half(np.eye(d)).T
    rbar = np.diag(cbar) + np.diag(sbar) @ rot
    corr = 1 - lam ** len(obs)
    mu = mu / corr
    cov = m2 / corr - mu[:, :, None] * mu[:, None, :]
    mu_bar = mu @ rbar.T
    cov_bar = rbar @ cov @ rbar.T
    kq = np.repeat(k, g, axis=0)  # repeat_interleave over the group
    z = np.einsum("hnd,hd->hn", kq, mu_bar) / np.sqrt(d) + np.einsum("hnd,hde,hne->hn", kq, cov_bar, kq) / (2 * d)
    a_hat = np_softmax(z).reshape(k.shape[0], g, -1).mean(1)
    return (a_hat + eps) * np.linalg.norm(v, axis=-1)


def test_ea_score_and_keep_set_match_the_released_formula():
    rng = np.random.RandomState(7)
    hkv, g, n, d, lam, eps, horizon = 2, 2, 14, 8, 0.9, 0.02, 16
    k, v = rng.randn(hkv, n, d).astype(np.float32), rng.randn(hkv, n, d).astype(np.float32)
    obs = [rng.randn(hkv * g, r, d).astype(np.float32) * 0.7 for r in (5, 3)]
    positions = [(38, 39), (46, 47)]
    pol = ExpectedAttention(capacity_floor=8, sinks=2, recent=2, horizon=horizon, ea_decay=lam, eps=eps)
    cache = pol.empty_cache(1, 1, hkv, n, d, jnp.float32, group_size=g)
    assert isinstance(cache, StatsCache)
    cache = cache.append(jnp.asarray(k)[None, None], jnp.asarray(v)[None, None],
                         jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray([n]))
    sc = pol.eviction.scorer
    for x, (p0, p1) in zip(obs, positions):
        xg = x.reshape(hkv, g, -1, d)
        m1 = jnp.asarray(xg.mean(2))[None, None]
        m2 = jnp.asarray(np.einsum("hgrd,hgre->hgde", xg, xg) / xg.shape[2])[None, None]
        cos, sin = rope_tables(jnp.asarray([[p0, p1]]), d, 10000.0)
        cache = sc.observe(cache, _ctx(n, queries=(m1, m2), rows=jnp.ones((1, x.shape[1]), bool),
                                       rope=(cos, sin)))
    got = np.asarray(sc.scores(cache, None, None))[0, 0]
    want = _np_ea(k, v, obs, positions, horizon, lam, eps, g)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    out = pol.eviction.evict(cache, None, None, jnp.asarray([8]), 8)
    for h in range(hkv):
        kept = np.asarray(out.pos)[0, 0, h][np.asarray(out.valid)[0, 0, h]].tolist()
        assert kept == released_survivors(range(n), want[h], "expected_attention", 8, window=2, sinks=2)
    assert isinstance(out, StatsCache) and int(out.nobs[0]) == 2  # the statistics survive compaction


def test_ea_runs_end_to_end_and_counts_its_statistics():
    model = tiny_model("sdar", num_layers=2)
    prompt = [list(map(int, np.random.RandomState(8).randint(0, 40, size=n))) for n in (70, 45)]
    gc = GenerationConfig(max_new_tokens=16, prefill_chunk=32, stop_at_eos=False)
    kw = dict(capacity_pct=10, capacity_floor=12, topk_floor=8, dense_layers=1, sinks=2, recent=4,
              interval_blocks=2, horizon=32)
    ea, st = generate(model, prompt, gc, policy=make("ea", **kw)), generate(model, prompt, gc, policy=make("streaming", **{
        k: v for k, v in kw.items() if k != "horizon"}))
    assert ea.stats["evictions"] == st.stats["evictions"] >= 1
    assert ea.stats["live_entries"] == st.stats["live_entries"]
    cfg = model.config
    stats = 4 * cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.head_dim ** 2)
    np.testing.assert_allclose(np.subtract(ea.stats["kv_bytes_final"], st.stats["kv_bytes_final"]), stats)
    with pytest.raises(PolicyError, match="ea_decay"):
        generate(model, prompt, gc, policy=make("ea", ea_decay=1.0))


# ----------------------------------------------------------------------------- DapQ
def _np_dapq(tokens, start, block, n):
    """generator._probe_tokens_impl('dapq'): F4-L(block - 4) of the committed context, tiled."""
    ctx = np.asarray(tokens[:start])
    pat = np.concatenate([ctx[:4], ctx[-(block - 4):]])
    return np.tile(pat, -(-n // len(pat)))[:n]


@pytest.mark.parametrize("start", [40, 56, 6])
def test_dapq_tokens_are_the_released_f4_l28_pattern(start):
    rng = np.random.RandomState(start)
    bs, n_pre = 8, 40
    prompt = rng.randint(0, 40, size=64)
    generated = rng.randint(0, 40, size=32)
    seq = np.concatenate([prompt[:n_pre], generated])
    ctx = _ctx(64, prompt=jnp.asarray(prompt)[None], n_pre=jnp.asarray([min(n_pre, start)]), start=jnp.asarray([start]),
               generated=jnp.asarray(generated)[None], tokens=jnp.zeros((1, bs), jnp.int32))
    if start < n_pre:  # a prompt shorter than the block-aligned prefix used above
        seq = prompt
    for n in (bs, 3 * bs):  # DapQ's own block; dapq_fill's probe blocks
        assert np.asarray(dapq_tokens(ctx, n))[0].tolist() == _np_dapq(seq, start, bs, n).tolist()


def test_dapq_ranks_by_the_pseudo_query_mass_alone():
    """end_dapq_probe -> _evict_by_probe(use_value=False): the probe's mass alone (no step-0
    term), W newest + sinks + top; the probe sits at the current block's positions."""
    rng = np.random.RandomState(9)
    n = 24
    probe_mass = rng.rand(n).astype(np.float32)
    got = {}

    def forward(cache, tokens, positions, mask, rows):
        got.update(tokens=np.asarray(tokens), positions=np.asarray(positions), mask=np.asarray(mask))
        return _row(probe_mass)

    c = _hand_cache(rng.randn(n, 4), list(range(n)))
    pol = DapQ(capacity_floor=10, sinks=2, recent=3)
    prompt = jnp.asarray(rng.randint(0, 40, size=64))[None]
    ctx = _ctx(n, forward, prompt=prompt, n_pre=jnp.asarray([n]), due=jnp.asarray([True]),
               tokens=jnp.full((1, 8), 47, jnp.int32), start=jnp.asarray([n]), first=True,
               mass=_row(rng.rand(n)), score=_row(rng.rand(n)), generated=jnp.zeros((1, 8), jnp.int32))
    with jax.disable_jit():
        res = pol.on_block(c, ctx)
    assert got["positions"].tolist() == [list(range(n, n + 8))] and got["mask"].all()
    assert got["tokens"][0].tolist() == _np_dapq(np.asarray(prompt[0]), n, 8, 8).tolist()
    assert _kept(res.cache) == released_survivors(range(n), probe_mass, "lookahead", 10, window=3, sinks=2)
    assert int(res.forwards) == 1
    for kind in ("random", "dapq_fill", "mask"):
        DapQ(lookahead_probe=kind).validate(tiny_model("sdar").config, GenerationConfig().resolve(tiny_model("sdar").config))
    with pytest.raises(PolicyError, match="lookahead_probe"):
        DapQ(lookahead_probe="oracle").validate(None, None)


# ----------------------------------------------------------------------------- bitsieve_v1
def test_bitsieve_v1_is_k4v4_with_mass_only_selection():
    """configs/bitsieve_v1.yaml: k_bits = v_bits = 4, selector mode all without value_aware, no
    eviction (so no budget)."""
    pol = make("bitsieve_v1")
    assert isinstance(pol, MaskAhead) and pol.storage == Packed(4) and pol.eviction is None
    assert pol.selector.ranking == "mass" and pol.selector.rows == "masked"
    with pytest.raises(PolicyError, match="no budget"):
        make("bitsieve-v1", 10)
    model = tiny_model("sdar", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                       intermediate_size=64, block_size=32)
    prompt = [list(map(int, np.random.RandomState(10).randint(0, 40, size=150)))]
    out = generate(model, prompt, GenerationConfig(max_new_tokens=32, prefill_chunk=64, stop_at_eos=False),
                   policy=make("bitsieve-v1", topk_floor=32, topk_pct=20, dense_layers=1))
    assert out.stats["evictions"] == 0 and out.stats["reduction_final"][0] > 2.0
