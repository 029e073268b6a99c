"""Plain jnp attention ops: the reference every optimized kernel is tested against.

Layout (per layer): queries grouped by KV head, q [B, Hkv, G, T, D]; cached context
k_ctx/v_ctx [B, Hkv, S, D] (keys already rotated) with a validity mask ctx_valid [B, Hkv, S];
the current block's own keys/values k_blk/v_blk [B, Hkv, T, D] with blk_mask [B, T, T]
(query t may read block key u). Softmax in float32, output in q's dtype.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30


class ScoredStats(NamedTuple):
    """Per (batch, KV head) statistics over the context keys.

    mass [B, Hkv, S]: prefix-only softmax mass pooled over the selected query rows and the G
        query heads of the group (sums to 1 over valid keys when any row is selected).
    score [B, Hkv, S]: value-aware score mass * ||v - c||, c = sum_i mass_i v_i.
    """

    mass: jax.Array
    score: jax.Array


def _logits(q, k, scale):
    return jnp.einsum("bhgtd,bhsd->bhgts", q, k, preferred_element_type=jnp.float32) * scale


def value_score(mass: jax.Array, v: jax.Array) -> jax.Array:
    """s_i = a_i * ||v_i - c||_2 with c = sum_i a_i v_i / sum_i a_i.  mass [..., S], v [..., S, D]."""
    v = v.astype(jnp.float32)
    tot = jnp.maximum(mass.sum(-1, keepdims=True), 1e-30)
    centre = jnp.einsum("...s,...sd->...d", mass, v) / tot
    return mass * jnp.linalg.norm(v - centre[..., None, :], axis=-1)


# How statistics pool their query rows (`pool_rows`). "mean" is the released rule and the only
# one the Pallas kernels compute; the others are ours (issue 40, docs/results.md §2c-4).
POOLS = ("mean", "max", "mean+max", "max_joint")


def pool_rows(p: jax.Array, stat_rows: jax.Array, pool: str = "mean") -> jax.Array:
    """Per-key mass [B, Hkv, S] from per-row probabilities p [B, Hkv, G, T, S] (0 on invalid keys).

    "mean"      the mean over the selected rows and the G heads: each key's share of the rows'
                attention (sums to 1)
    "max"       the largest probability any selected row (and head) gives the key, so a key
                one query wants outright ranks above a key many queries glance at
    "mean+max"  the mean plus the max renormalised to sum to 1 (both terms weigh the same)
    "max_joint" as "max" over the joint softmax of [context | block] (`attention` passes it),
                so a query that mostly reads its own block gives the cache little
    """
    w = stat_rows.astype(jnp.float32)  # [B, T]
    n = jnp.maximum(w.sum(-1), 1.0) * p.shape[2]  # rows * G
    mean = lambda: jnp.einsum("bhgts,bt->bhs", p, w) / n[:, None, None]
    mx = lambda: jnp.max(p * w[:, None, None, :, None], axis=(2, 3))
    if pool == "mean":
        return mean()
    if pool in ("max", "max_joint"):
        return mx()
    if pool == "mean+max":
        m = mx()
        return mean() + m / jnp.maximum(m.sum(-1, keepdims=True), 1e-30)
    raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")


def prefix_mass(logits_ctx: jax.Array, ctx_valid: jax.Array, stat_rows: jax.Array,
                pool: str = "mean") -> jax.Array:
    """Prefix-only softmax (context keys only) pooled over rows (`pool_rows`).  logits [B,Hkv,G,T,S]."""
    lg = jnp.where(ctx_valid[:, :, None, None, :], logits_ctx, NEG_INF)
    p = jax.nn.softmax(lg, axis=-1)
    p = jnp.where(ctx_valid[:, :, None, None, :], p, 0.0)
    return pool_rows(p, stat_rows, pool)


def attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask,
              stat_rows: Optional[jax.Array] = None, pool: str = "mean"):
    """Exact attention of the block over [context | block] with one joint softmax.

    Returns (out [B, Hkv, G, T, D], ScoredStats or None). Stats are computed when
    `stat_rows` [B, T] (bool, which queries are pooled) is given and a context exists; `pool`
    is how (`prefix_mass`).
    """
    d = q.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    lb = _logits(q, k_blk, scale)
    lb = jnp.where(blk_mask[:, None, None, :, :], lb, NEG_INF)
    if k_ctx is None:
        p = jax.nn.softmax(lb, axis=-1)
        out = jnp.einsum("bhgts,bhsd->bhgtd", p.astype(v_blk.dtype), v_blk,
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), None
    lc = _logits(q, k_ctx, scale)
    lc_m = jnp.where(ctx_valid[:, :, None, None, :], lc, NEG_INF)
    p = jax.nn.softmax(jnp.concatenate([lc_m, lb], axis=-1), axis=-1)
    s = k_ctx.shape[2]
    out = (jnp.einsum("bhgts,bhsd->bhgtd", p[..., :s].astype(v_ctx.dtype), v_ctx,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bhgts,bhsd->bhgtd", p[..., s:].astype(v_blk.dtype), v_blk,
                        preferred_element_type=jnp.float32))
    stats = None
    if stat_rows is not None:
        if pool == "max_joint":
            joint = jnp.where(ctx_valid[:, :, None, None, :], p[..., :s], 0.0)
            mass = pool_rows(joint, stat_rows, pool)
        else:
            mass = prefix_mass(lc, ctx_valid, stat_rows, pool)
        stats = ScoredStats(mass, value_score(mass, v_ctx))
    return out.astype(q.dtype), stats
