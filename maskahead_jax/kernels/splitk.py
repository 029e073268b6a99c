"""The two-pass split-K algorithm shared by the Pallas kernels, and its jnp glue.

Rows.  The G query heads of a KV head and the T block queries are flattened into R = G * T
rows (row r = g * T + t), so GQA pooling is a sum over rows.

Pass 1 (kernel, per KV tile, tiles grouped into `splits` that run in parallel): online
softmax over the *context* keys only, giving per split a partial state (m, l, acc):
running max [R], sum of exp [R], unnormalised output [R, D].  `finish` (jnp, tiny) merges the
splits, which yields the prefix-only log-sum-exp lse_p [R] and the prefix output
O_p = acc / l; then it adds the block keys (T of them, under blk_mask) to the same state for
the joint [context | block] softmax output.  Because the prefix state is a prefix of the
joint one, the prefix statistics cost nothing extra.

Pass 2 (kernel, every context tile independent): p = exp(logit - lse_p) on valid keys,
mass a_i = sum_r w_r p_ri with w_r = stat_rows[t] / (G * #stat rows), and the score
a_i * ||v_i - c||, with the centre c = sum_r w_r O_p[r] / sum_i a_i computed in `finish`
(equal to sum_i a_i v_i / sum_i a_i, the reference's definition).

Other poolings (reference.pool_rows: "max", "mean+max", "max_joint"; `attention.stat_pool`):
pass 2 keeps, per key, the weighted sum above and the largest p_ri over the selected rows
(w_r > 0), and sums mass_max_i * v_i per tile; "max_joint" runs it on the joint [context |
block] normaliser, which `finish` reads off the same state. `pool_mass` (jnp, [B, Hkv, S])
combines them (mean+max: the max renormalised over all keys, so only after every tile) with
the value centre c; pass 3 (kernel, values only) then gives ||v_i - c|| for the score.

Packed tiles are unpacked into `cpb` = 8 / bits channel planes (plane p holds the channels
j * cpb + p), which needs only shifts and masks; the query, the key metadata and the centre
are split into the same planes outside the kernel and the output planes are interleaved back.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .reference import NEG_INF

BIG = 1e30  # lse of a row with no valid context key: exp(logit - BIG) == 0


class Partial(NamedTuple):
    """Partial online-softmax state over a part of the context, per split."""

    m: jax.Array  # [B, Hkv, NS, R] running max of the logits (NEG_INF if no valid key)
    l: jax.Array  # [B, Hkv, NS, R] sum of exp(logit - m)
    acc: jax.Array  # [B, Hkv, NS, R, D] sum of exp(logit - m) * v


def rows(q: jax.Array) -> jax.Array:
    """q [B, Hkv, G, T, D] -> [B, Hkv, G*T, D]."""
    b, h, g, t, d = q.shape
    return q.reshape(b, h, g * t, d)


def row_weights(stat_rows: jax.Array, g: int) -> jax.Array:
    """stat_rows [B, T] -> normalised pooling weights w [B, G*T] (sum 1 when any row is set)."""
    w = stat_rows.astype(jnp.float32)
    n = jnp.maximum(w.sum(-1, keepdims=True), 1.0) * g
    return jnp.tile(w / n, (1, g))


def to_planes(x: jax.Array, cpb: int) -> jax.Array:
    """[..., D] -> [..., cpb, D/cpb] with plane p = channels p, p+cpb, ...; then moved so the
    plane axis comes right after the first two (B, Hkv) axes: [B, Hkv, cpb, ..., D/cpb]."""
    y = x.reshape(x.shape[:-1] + (x.shape[-1] // cpb, cpb))
    return jnp.moveaxis(y, -1, 2)


def partial_jnp(q_rows, k, v, valid) -> Partial:
    """One-split partial state in plain jnp (used for the bf16 residual tokens of a QuantKV).

    q_rows [B, Hkv, R, D]; k, v [B, Hkv, S, D]; valid [B, Hkv, S].
    """
    scale = 1.0 / jnp.sqrt(jnp.float32(q_rows.shape[-1]))
    s = jnp.einsum("bhrd,bhsd->bhrs", q_rows, k.astype(q_rows.dtype),
                   preferred_element_type=jnp.float32) * scale
    vm = valid[:, :, None, :]
    s = jnp.where(vm, s, NEG_INF)
    m = s.max(-1)
    p = jnp.where(vm, jnp.exp(s - m[..., None]), 0.0)
    cdt = q_rows.dtype  # operand dtype of the kernels' matmuls
    acc = jnp.einsum("bhrs,bhsd->bhrd", p.astype(cdt), v.astype(cdt), preferred_element_type=jnp.float32)
    return Partial(m[:, :, None], p.sum(-1)[:, :, None], acc[:, :, None])


def concat(*parts: Partial) -> Partial:
    return Partial(*(jnp.concatenate(xs, axis=2) for xs in zip(*parts)))


def _merge(part: Partial):
    m = part.m.max(2)  # [B, H, R]
    f = jnp.exp(part.m - m[:, :, None])
    l = (part.l * f).sum(2)
    acc = (part.acc * f[..., None]).sum(2)
    return m, l, acc


class Finished(NamedTuple):
    out: jax.Array  # [B, Hkv, G, T, D] joint [context | block] attention output
    lse: jax.Array  # [B, Hkv, R] prefix-only log-sum-exp (BIG where a row saw no valid key)
    centre: Optional[jax.Array]  # [B, Hkv, D] value centre c (None without stat rows)
    lse_joint: Optional[jax.Array] = None  # [B, Hkv, R] joint [context | block] log-sum-exp
    vsum: Optional[jax.Array] = None  # [B, Hkv, D] sum_i a_i v_i of the mean-pooled mass a


def finish(part: Partial, q: jax.Array, k_blk, v_blk, blk_mask, stat_rows=None) -> Finished:
    """Merge the splits, read off the prefix statistics, then add the block keys.

    q [B, Hkv, G, T, D]; k_blk, v_blk [B, Hkv, T, D]; blk_mask [B, T, T]; stat_rows [B, T].
    """
    b, h, g, t, d = q.shape
    m, l, acc = _merge(part)
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), BIG)
    centre = vsum = None
    if stat_rows is not None:
        w = row_weights(stat_rows, g)  # [B, R]
        o_p = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        tot = jnp.einsum("br,bhr->bh", w, seen.astype(jnp.float32))
        vsum = jnp.einsum("br,bhrd->bhd", w, o_p)
        centre = vsum / jnp.maximum(tot, 1e-30)[..., None]
    # block keys, joined to the same softmax
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    sb = jnp.einsum("bhrd,bhsd->bhrs", rows(q), k_blk.astype(q.dtype),
                    preferred_element_type=jnp.float32) * scale
    bm = jnp.tile(blk_mask, (1, g, 1))[:, None]  # [B, 1, R, T]
    sb = jnp.where(bm, sb, NEG_INF)
    m2 = jnp.maximum(m, sb.max(-1))
    pb = jnp.where(bm, jnp.exp(sb - m2[..., None]), 0.0)
    f = jnp.exp(m - m2)
    l2 = l * f + pb.sum(-1)
    acc2 = acc * f[..., None] + jnp.einsum("bhrs,bhsd->bhrd", pb.astype(v_blk.dtype), v_blk,
                                           preferred_element_type=jnp.float32)
    out = acc2 / jnp.maximum(l2, 1e-30)[..., None]
    any_key = l2 > 0
    lse_joint = jnp.where(any_key, m2 + jnp.log(jnp.where(any_key, l2, 1.0)), BIG)
    return Finished(out.reshape(b, h, g, t, d).astype(q.dtype), lse, centre, lse_joint, vsum)


def stats_jnp(q_rows, k, v, valid, lse, w, centre):
    """Pass 2 in plain jnp for a float context part -> (mass, score) [B, Hkv, S]."""
    scale = 1.0 / jnp.sqrt(jnp.float32(q_rows.shape[-1]))
    s = jnp.einsum("bhrd,bhsd->bhrs", q_rows, k.astype(q_rows.dtype),
                   preferred_element_type=jnp.float32) * scale
    p = jnp.where(valid[:, :, None, :], jnp.exp(s - lse[..., None]), 0.0)
    mass = jnp.einsum("br,bhrs->bhs", w, p)
    dist = jnp.linalg.norm(v.astype(jnp.float32) - centre[:, :, None, :], axis=-1)
    return mass, mass * dist


def pool_stats_jnp(q_rows, k, v, valid, lse, w):
    """Pass 2 of a non-mean pooling in plain jnp for a float context part (the bf16 residual):
    (mass_sum, mass_max [B, Hkv, S], vsum_max [B, Hkv, D]), see `pool_mass`."""
    scale = 1.0 / jnp.sqrt(jnp.float32(q_rows.shape[-1]))
    s = jnp.einsum("bhrd,bhsd->bhrs", q_rows, k.astype(q_rows.dtype),
                   preferred_element_type=jnp.float32) * scale
    p = jnp.where(valid[:, :, None, :], jnp.exp(s - lse[..., None]), 0.0)
    msum = jnp.einsum("br,bhrs->bhs", w, p)
    mmax = jnp.where((w > 0)[:, None, :, None], p, 0.0).max(axis=2)
    return msum, mmax, jnp.einsum("bhs,bhsd->bhd", mmax, v.astype(jnp.float32))


def pool_mass(pool: str, mass_sum, mass_max, vsum_max, vsum_mean):
    """The pooled mass [B, Hkv, S] and its value centre c [B, Hkv, D] (reference.pool_rows and
    value_score) from the kernels' per-key sums and maxima over the rows.

    mass_sum: the mean-pooled mass; mass_max: the largest probability a selected row gives the
    key; vsum_max = sum_i mass_max_i v_i; vsum_mean = sum_i mass_sum_i v_i (`Finished.vsum`).
    "max" / "max_joint" (pass 2 ran on the joint normaliser) take the max; "mean+max" the mean
    plus the max renormalised to sum to 1, whose centre mixes both value sums alike."""
    smax = jnp.maximum(mass_max.sum(-1), 1e-30)  # [B, Hkv]
    if pool in ("max", "max_joint"):
        return mass_max, vsum_max / smax[..., None]
    if pool != "mean+max":
        raise ValueError(f"pool_mass takes max, max_joint or mean+max, got {pool!r}")
    mass = mass_sum + mass_max / smax[..., None]
    tot = jnp.maximum(mass.sum(-1), 1e-30)
    return mass, (vsum_mean + vsum_max / smax[..., None]) / tot[..., None]


def distance_jnp(v, centre):
    """||v_i - c||^2 [B, Hkv, S] for a float context part; v [B, Hkv, S, D], centre [B, Hkv, D]."""
    diff = v.astype(jnp.float32) - centre[:, :, None, :]
    return (diff * diff).sum(-1)


def planes_to_channels(x):
    """[B, Hkv, cpb, Dp] -> [B, Hkv, D] (the inverse of `to_planes` on a [B, Hkv, D] array)."""
    b, h, cpb, dp = x.shape
    return jnp.moveaxis(x, 2, -1).reshape(b, h, cpb * dp)


def default_splits(n: int, tile: int) -> int:
    """Pass-1 KV splits of the GPU backends: enough CTAs / programs to fill the SMs at small
    batch (at most 8 splits, each of >= 4 tiles)."""
    nt = max(n // tile, 1)
    for s in (8, 4, 2):
        if nt % s == 0 and nt // s >= 4:
            return s
    return 1
