"""Expected Attention (`ea`, Devoto et al., arXiv 2510.00636) as the released MaskAhead code runs
it (runtime/session.py `_ea_observe`, `_ea_score`; configs/ea.yaml).

State, per (layer, row, query head): discounted moments of the pre-RoPE queries the model ran,
mu <- lam mu + (1 - lam) mean(q), M <- lam M + (1 - lam) mean(q q^T) (lam = ea_decay), folded in
at every block's step 0 (its masked queries) and every prefill chunk but the first (all its
queries), with n the number of observations and the RoPE phase / per-position step of the last
one. At an eviction, per layer and KV head, for every live entry with post-RoPE key k_i:

    mu' = mu / (1 - lam^n),  S = M / (1 - lam^n) - mu' mu'^T,
    Rbar = mean over the next `horizon` positions t of the RoPE rotation R(phase + t * step)
         = diag(cbar) + diag(sbar) rot   (rot x = rotate_half(x); identity past rope_dim),
    z_i  = k_i . (Rbar mu') / sqrt(D) + k_i^T (Rbar S Rbar^T) k_i / (2 D),
    a_i  = softmax_i(z) over the live set, per query head, averaged over the GQA group,
    score_i = (a_i + eps) * ||v_i||.

The ranking then keeps the sinks and the `recent` newest entries and fills C(seen) by score, at
the end of every interval_blocks-th block and at the prompt's final chunk (the baselines' timing,
policies/eviction.py). The moments live next to the cache (`StatsCache`, a cache that carries
them through compaction untouched); their bytes count in the memory metric, as released
`ea_stats_bytes` counts in its peak.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import memory
from .baselines import ScheduledEviction
from .maskahead import check_positive
from .protocol import PolicyError
from .scorers import Scorer


class StatsCache(NamedTuple):
    """A cache plus Expected Attention's query statistics; every Cache method acts on `inner`
    and keeps the statistics. mu / m2 are rank 6 ([L, B, Hkv, G, 1|D, D]) so that the cache
    sharding rules (ranks 1, 4, 5) leave them replicated."""

    inner: Any
    mu: jax.Array  # [L, B, Hkv, G, 1, D] discounted mean of pre-RoPE queries
    m2: jax.Array  # [L, B, Hkv, G, D, D] discounted second moment
    nobs: jax.Array  # [B] int32 observations folded in
    rbar: jax.Array  # [B, D, D] the RoPE rotation averaged over the horizon after the last one

    pos = property(lambda self: self.inner.pos)
    valid = property(lambda self: self.inner.valid)
    acc = property(lambda self: self.inner.acc)
    length = property(lambda self: self.inner.length)
    seen = property(lambda self: self.inner.seen)
    capacity = property(lambda self: self.inner.capacity)
    bytes_per_token = property(lambda self: self.inner.bytes_per_token)

    def _wrap(self, inner):
        return self._replace(inner=inner)

    def append(self, *a):
        return self._wrap(self.inner.append(*a))

    def keep_top(self, *a):
        return self._wrap(self.inner.keep_top(*a))

    def gather(self, *a):
        return self._wrap(self.inner.gather(*a))

    def resize(self, capacity):
        return self._wrap(self.inner.resize(capacity))

    def layers(self, start, stop):
        return self.inner.layers(start, stop)

    def context(self, *a):
        return self.inner.context(*a)

    def select_context(self, *a, **k):
        return self.inner.select_context(*a, **k)

    def values(self):
        return self.inner.values()

    def keys(self):
        return self.inner.keys()

    def live(self):
        return self.inner.live()

    @property
    def stats_bytes(self) -> float:
        """Bytes of the statistics per batch row: the fp32 mean and second moment per query head
        (released `ea_stats_bytes`; Rbar, one D x D matrix per row, is not counted)."""
        return 4.0 * (self.mu.size + self.m2.size) / self.mu.shape[1]


def rope_average(freq, phase, horizon: int, head_dim: int):
    """Rbar [B, D, D]: the RoPE rotation averaged over positions last + 1 .. last + horizon
    (NeoX rotate-half layout; dimensions past rope_dim pass through)."""
    r = freq.shape[-1]
    t = jnp.arange(1, horizon + 1, dtype=jnp.float32)
    ang = phase[:, None, :] + t[None, :, None] * freq[:, None, :]  # [B, H, R]
    cbar, sbar = jnp.cos(ang).mean(1), jnp.sin(ang).mean(1)  # [B, R]
    pad = head_dim - r
    cbar = jnp.concatenate([cbar, jnp.ones(cbar.shape[:1] + (pad,))], -1)
    sbar = jnp.concatenate([sbar, jnp.zeros(sbar.shape[:1] + (pad,))], -1)
    half = r // 2
    rot = jnp.zeros((head_dim, head_dim), jnp.float32)  # rot @ x = rotate_half(x) on [0, r)
    i = jnp.arange(half)
    rot = rot.at[i, i + half].set(-1.0).at[i + half, i].set(1.0)
    return jax.vmap(lambda c, s: jnp.diag(c) + jnp.diag(s) @ rot)(cbar, sbar)


def ea_scores(k, v, valid, mu, m2, nobs, rbar, decay: float, eps: float):
    """Expected Attention's eviction score [L, B, Hkv, N] (the module docstring's formula).
    k, v [L, B, Hkv, N, D] (keys post-RoPE); valid [L, B, Hkv, N]; mu [L, B, Hkv, G, D];
    m2 [L, B, Hkv, G, D, D]; nobs [B]; rbar [B, D, D] (rope_average). Rows with no observation
    score 0 (released: the mass EMA, which its fast path never updates for this policy)."""
    d = k.shape[-1]
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    corr = (1.0 - decay ** nobs.astype(jnp.float32))[None, :, None, None]  # [1, B, 1, 1]
    corr = jnp.maximum(corr, 1e-12)
    mu = mu / corr[..., None]
    cov = m2 / corr[..., None, None] - mu[..., :, None] * mu[..., None, :]
    mu_bar = jnp.einsum("bde,lbhge->lbhgd", rbar, mu)
    cov_bar = jnp.einsum("bde,lbhgef,bcf->lbhgdc", rbar, cov, rbar)
    z = jnp.einsum("lbhnd,lbhgd->lbhgn", kf, mu_bar) / jnp.sqrt(jnp.float32(d))
    z = z + jnp.einsum("lbhnd,lbhgde,lbhne->lbhgn", kf, cov_bar, kf) / (2.0 * d)
    z = jnp.where(valid[:, :, :, None, :], z, -1e30)
    a = jax.nn.softmax(z, axis=-1).mean(3)  # [L, B, Hkv, N]
    score = (a + eps) * jnp.linalg.norm(vf, axis=-1)
    score = jnp.where((nobs > 0)[None, :, None, None], score, 0.0)
    return jnp.where(valid, score, 0.0)


@dataclasses.dataclass(frozen=True)
class EAScore(Scorer):
    reads_mass = False
    reads_queries = True
    horizon: int = 128
    decay: float = 0.9
    eps: float = 0.02

    def observe(self, cache, ctx):
        if ctx.queries is None or not isinstance(cache, StatsCache):
            return cache
        m1, m2 = ctx.queries  # [L, B, Hkv, G, D], [L, B, Hkv, G, D, D]
        on = ctx.rows.sum(-1) > 0  # [B] rows that ran observed queries
        lam = self.decay
        upd = lambda old, new: jnp.where(on.reshape((1, -1) + (1,) * (old.ndim - 2)),
                                         lam * old + (1.0 - lam) * new, old)
        # released: the angle step from the last two positions exactly (every RoPE step is
        # below pi), the phase at the last one
        cos, sin = ctx.rope  # [B, 2, R]
        c0, s0, c1, s1 = cos[:, 0], sin[:, 0], cos[:, 1], sin[:, 1]
        freq = jnp.arctan2(s1 * c0 - c1 * s0, c1 * c0 + s1 * s0)
        rbar = rope_average(freq, jnp.arctan2(s1, c1), self.horizon, cache.rbar.shape[-1])
        return cache._replace(mu=upd(cache.mu, m1[..., None, :]), m2=upd(cache.m2, m2),
                              nobs=cache.nobs + on.astype(jnp.int32),
                              rbar=jnp.where(on[:, None, None], rbar, cache.rbar))

    def scores(self, cache, mass0, probe):
        return ea_scores(cache.keys(), cache.values(), cache.valid, cache.mu[..., 0, :], cache.m2,
                         cache.nobs, cache.rbar, self.decay, self.eps)


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(ScheduledEviction):
    """Expected Attention with the released defaults (configs/ea.yaml: horizon 128, decay 0.9,
    eps 0.02, full covariance; C, W = 64, 4 sinks, every 4 blocks as every baseline)."""

    name = "ea"
    horizon: int = 128
    ea_decay: float = 0.9
    eps: float = 0.02

    def scorer(self):
        return EAScore(self.horizon, self.ea_decay, self.eps)

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        check_positive(horizon=self.horizon)
        if not 0.0 <= self.ea_decay < 1.0 or self.eps < 0.0:
            raise PolicyError(f"ea needs 0 <= ea_decay < 1 and eps >= 0, got {self.ea_decay}, {self.eps}")

    def empty_cache(self, num_layers, batch, kv_heads, capacity, head_dim, dtype=jnp.bfloat16, group_size=1):
        inner = self.storage.empty(num_layers, batch, kv_heads, capacity, head_dim, dtype)
        g, d = group_size, head_dim
        lead = (num_layers, batch, kv_heads, g)
        z = lambda *s: jnp.zeros(s, jnp.float32)
        return StatsCache(inner, z(*lead, 1, d), z(*lead, d, d), jnp.zeros((batch,), jnp.int32),
                          jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (batch, d, d)))

    def held_bytes(self, cache) -> jax.Array:
        base = memory.row_bytes(cache.valid, cache.bytes_per_token, self.keeps_state)
        return base + (cache.stats_bytes if isinstance(cache, StatsCache) else 0.0)
