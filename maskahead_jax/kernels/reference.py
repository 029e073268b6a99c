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


def prefix_mass(logits_ctx: jax.Array, ctx_valid: jax.Array, stat_rows: jax.Array) -> jax.Array:
    """Prefix-only softmax (context keys only) pooled over rows.  logits [B,Hkv,G,T,S]."""
    lg = jnp.where(ctx_valid[:, :, None, None, :], logits_ctx, NEG_INF)
    p = jax.nn.softmax(lg, axis=-1)
    p = jnp.where(ctx_valid[:, :, None, None, :], p, 0.0)
    w = stat_rows.astype(jnp.float32)  # [B, T]
    n = jnp.maximum(w.sum(-1), 1.0) * logits_ctx.shape[2]  # rows * G
    return jnp.einsum("bhgts,bt->bhs", p, w) / n[:, None, None]


def attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask,
              stat_rows: Optional[jax.Array] = None):
    """Exact attention of the block over [context | block] with one joint softmax.

    Returns (out [B, Hkv, G, T, D], ScoredStats or None). Stats are computed when
    `stat_rows` [B, T] (bool, which queries are pooled) is given and a context exists.
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
        mass = prefix_mass(lc, ctx_valid, stat_rows)
        stats = ScoredStats(mass, value_score(mass, v_ctx))
    return out.astype(q.dtype), stats
