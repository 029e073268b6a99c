"""Eviction scorers: what an eviction ranks cache entries by (higher survives).

A scorer is a small frozen dataclass (subclass `Scorer`) with `scores(cache, mass0, probe) ->
[L, B, Hkv, N]` (mass0: the step-0 prefix mass or None; probe: the probe's mass or None) and, if
it keeps state, `observe(cache, ctx) -> cache`, called at every block's step 0 (ctx.mass: the
prefix mass pooled over the ctx.rows queries; ctx.queries: their pre-RoPE moments) and, when
`observes_prefill` / `reads_queries` ask for it, after every prefill chunk but the first.
`reads_mass = False` tells the engine that step 0 need not compute statistics for it.

  ValueScore     MaskAhead: A_i * ||v_i - c||, A = mass0 + probe, c = sum A_i v_i / sum A_i
  MassScore      A_i alone (the MAGE-like ranking)
  ProbeMass      DapQ, SnapKV: the probe's mass alone (no step-0 term)
  PositionScore  StreamingLLM: newest first (sinks / recent are forced keeps)
  Accumulated    H2O: the attention every query gave an entry since it entered the cache, in
                 cache.acc: each step 0 adds (its mask queries) x (their pooled mass), each
                 prefill chunk (its tokens) x (their pooled mass over the cache before it)
  CAOTE          H2O + CAOTE: h_i / (1 - h_i) * ||v_i - o||, h = acc normalised per lane
  Pooled         any scorer's scores max-pooled over `pool` neighbouring valid slots: SnapKV is
                 Pooled(ProbeMass(), pool), its window's vote pooled; MaskAhead's evict_pool (ours) pools its value score, so a
                 kept entry keeps its neighbours (docs/results.md "Beyond the paper")
(Expected Attention's scorer, with its query moments, is in policies/expected_attention.py.)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..kernels.reference import value_score


def _total(mass0, probe):
    return mass0 if probe is None else mass0 + probe


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Base: no per-entry state; reads the step-0 mass."""

    reads_mass: ClassVar[bool] = True
    observes_prefill: ClassVar[bool] = False  # observe() every prefill chunk's mass too
    reads_queries: ClassVar[bool] = False  # observe() reads ctx.queries (pre-RoPE query moments)
    # scores() ranks by the step-0 mass it is handed (mass0): only the deferred timing has one
    ranks_by_step0: ClassVar[bool] = False

    def observe(self, cache, ctx):
        return cache

    def scores(self, cache, mass0, probe):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ValueScore(Scorer):
    ranks_by_step0 = True

    def scores(self, cache, mass0, probe):
        return value_score(_total(mass0, probe), cache.values())


@dataclasses.dataclass(frozen=True)
class MassScore(Scorer):
    ranks_by_step0 = True

    def scores(self, cache, mass0, probe):
        return _total(mass0, probe)


@dataclasses.dataclass(frozen=True)
class ProbeMass(Scorer):
    reads_mass = False

    def scores(self, cache, mass0, probe):
        return probe


@dataclasses.dataclass(frozen=True)
class PositionScore(Scorer):
    reads_mass = False

    def scores(self, cache, mass0, probe):
        return cache.pos.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Accumulated(Scorer):
    """acc <- decay * acc + n * mass, n the queries pooled into mass (released
    EvictionState.observe with decay 1: g += len(query_indices) * alpha, alpha the mean over
    those queries and the GQA group; decay < 1 is ours)."""

    observes_prefill = True
    decay: float = 1.0

    def observe(self, cache, ctx):
        if ctx.mass is None:
            return cache
        n = ctx.rows.sum(-1).astype(jnp.float32)[None, :, None, None]
        acc = self.decay * cache.acc + jnp.where(cache.valid, n * ctx.mass.astype(jnp.float32), 0.0)
        return cache._replace(acc=acc)

    def scores(self, cache, mass0, probe):
        return cache.acc


def caote_scores(acc: jax.Array, v: jax.Array, valid: jax.Array, eps: float = 1e-6) -> jax.Array:
    """CAOTE eviction error h_i / (1 - h_i) * ||v_i - o||, h = acc normalised over the lane's valid
    entries, o = sum_i h_i v_i.  acc/valid [..., S], v [..., S, D]."""
    h = jnp.where(valid, acc.astype(jnp.float32), 0.0)
    h = h / jnp.maximum(h.sum(-1, keepdims=True), 1e-12)
    vf = v.astype(jnp.float32)
    o = jnp.einsum("...s,...sd->...d", h, vf)
    dist = jnp.linalg.norm(vf - o[..., None, :], axis=-1)
    return h / jnp.maximum(1.0 - h, eps) * dist


@dataclasses.dataclass(frozen=True)
class CAOTE(Accumulated):
    def scores(self, cache, mass0, probe):
        return caote_scores(cache.acc, cache.values(), cache.valid)


def max_pool_1d(x: jax.Array, kernel: int) -> jax.Array:
    """Max over a centred window of `kernel` neighbours along the last axis (stride 1, 'same')."""
    if kernel <= 1:
        return x
    lo = (kernel - 1) // 2
    hi = kernel - 1 - lo
    cfg = [(0, 0)] * (x.ndim - 1) + [(lo, hi)]
    xp = jnp.pad(x, cfg, constant_values=-jnp.inf)
    n = x.shape[-1]
    return jnp.max(jnp.stack([xp[..., i:i + n] for i in range(kernel)], axis=0), axis=0)


@dataclasses.dataclass(frozen=True)
class Pooled(Scorer):
    """`inner`'s scores max-pooled over a centred window of `pool` slots: SnapKV's pooled vote
    (`Pooled(ProbeMass(), 5)`) and, ours, MaskAhead's `evict_pool` (ValueScore inside). Slots hold
    entries in position order, so the neighbours are the nearest kept positions (adjacent ones
    in a part of the cache nothing has been evicted from yet); invalid slots take no part."""

    inner: Scorer = ValueScore()
    pool: int = 3

    @property
    def reads_mass(self) -> bool:  # the engine reads the class attribute through instances
        return self.inner.reads_mass

    @property
    def ranks_by_step0(self) -> bool:
        return self.inner.ranks_by_step0

    def scores(self, cache, mass0, probe):
        a = jnp.where(cache.valid, self.inner.scores(cache, mass0, probe).astype(jnp.float32), -jnp.inf)
        return jnp.where(cache.valid, max_pool_1d(a, self.pool), -jnp.inf)
