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


# How statistics pool their query rows (`pool_rows`). "mean" is the released rule; the others
# are ours (issue 40, docs/results.md §2c-4); the Pallas kernels compute each (splitk.py).
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


# ----------------------------------------------------------------------------- long passes
# A pass whose [T, S + T] logits would be large runs over query chunks and key chunks with an
# online softmax (running max, sum, output per row), as flash attention does: its temporaries
# are O(q_chunk x k_chunk) per head instead of O(T x (S + T)); the statistics are pooled chunk by
# chunk into [B, Hkv, S] sums. Short passes (every decode block, every test-sized pass) keep the
# exact one-softmax code above. `chunking(...)` changes the thresholds for the forwards traced
# inside (tests force tiny chunks; a trace-time setting like attention.use).
import contextlib as _contextlib  # noqa: E402
import contextvars as _contextvars  # noqa: E402
import math as _math  # noqa: E402

from .masks import PositionMask, dense as _dense_mask  # noqa: E402


class Chunking(NamedTuple):
    q: int = 512  # query rows per chunk
    k: int = 1024  # keys per chunk
    min_elems: int = 1 << 21  # chunk a pass when T * (S + T) exceeds this (per (batch, head))


_CHUNKING: _contextvars.ContextVar[Chunking] = _contextvars.ContextVar("maskahead_chunking",
                                                                       default=Chunking())


@_contextlib.contextmanager
def chunking(q: int = 512, k: int = 1024, min_elems: int = 1 << 21):
    """Run the long-pass path for the forwards traced inside whenever T * (S + T) > min_elems."""
    if q <= 0 or k <= 0 or min_elems < 0:
        raise ValueError(f"chunk sizes must be positive and min_elems >= 0, got {q}, {k}, {min_elems}")
    token = _CHUNKING.set(Chunking(q, k, min_elems))
    try:
        yield
    finally:
        _CHUNKING.reset(token)


def current_chunking() -> Chunking:
    return _CHUNKING.get()


def is_long(t: int, s: int) -> bool:
    """Whether a pass of t queries over s context keys (plus its own t) takes the chunked path."""
    return t * (s + t) > _CHUNKING.get().min_elems


def _pad_axis(x, axis, n, value=0):
    pad = n - x.shape[axis]
    if pad <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _online(state, lg, allowed, v):
    """One key chunk into the running softmax state (m, l, acc) of a query chunk.
    lg [B, Hkv, G, Tq, Sk] float32, allowed broadcastable to it, v [B, Hkv, Sk, D]."""
    m, l, acc = state
    lg = jnp.where(allowed, lg, NEG_INF)
    m_new = jnp.maximum(m, lg.max(-1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(allowed, jnp.exp(lg - m_new[..., None]), 0.0)
    acc = acc * corr[..., None] + jnp.einsum("bhgts,bhsd->bhgtd", p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(-1), acc


def _block_tile(blk_mask, qp, q0, k0, cq, ck, kb_pos, kb_valid):
    """[B, 1, 1, Tq, Sk] tile of the block mask (a PositionMask, or a dense boolean sliced)."""
    if isinstance(blk_mask, PositionMask):
        t = blk_mask.tile(qp, kb_pos, kb_valid)
    else:
        t = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(blk_mask, q0, cq, 1), k0, ck, 2)
    return t[:, None, None]


def _block_keys(blk_mask, k_blk, v_blk, b, t, nq, cq, tp, ck):
    """The block's keys in chunks of ckb = min(ck, T), for `attention_chunked`: the query
    positions [B, nq, Cq], the block mask padded (dense) or its key positions / validity padded
    (PositionMask, tiled per chunk pair), and the padded block K/V."""
    if isinstance(blk_mask, PositionMask):
        qpos = _pad_axis(blk_mask.q_pos, 1, tp).reshape(b, nq, cq)
        ckb = min(ck, t)
        nkb = _math.ceil(t / ckb)
        kb_pos = _pad_axis(blk_mask.k_pos, 1, nkb * ckb)
        kv = blk_mask.k_valid if blk_mask.k_valid is not None else jnp.ones(blk_mask.k_pos.shape, bool)
        kb_valid = _pad_axis(kv, 1, nkb * ckb, False)
    else:
        qpos, ckb = jnp.zeros((b, nq, cq), jnp.int32), min(ck, t)
        nkb = _math.ceil(t / ckb)
        blk_mask = _pad_axis(_pad_axis(blk_mask, 1, tp, False), 2, nkb * ckb, False)
        kb_pos = kb_valid = None
    kb = _pad_axis(k_blk, 2, nkb * ckb)
    vb = _pad_axis(v_blk, 2, nkb * ckb)
    return qpos, ckb, nkb, blk_mask, kb_pos, kb_valid, kb, vb


def _context_keys(k_ctx, v_ctx, ctx_valid, ck):
    """The context's keys in chunks of ckc = min(ck, S), padded, for `attention_chunked`, and
    n_live: the chunks up to the last valid slot (the sweeps skip the rest)."""
    s = k_ctx.shape[2]
    ckc = min(ck, s)
    nkc = _math.ceil(s / ckc)
    kc = _pad_axis(k_ctx, 2, nkc * ckc)
    vc = _pad_axis(v_ctx, 2, nkc * ckc)
    cvalid = _pad_axis(ctx_valid, 2, nkc * ckc, False)
    last = jnp.max(jnp.where(cvalid, jnp.arange(nkc * ckc), -1))
    n_live = (last + ckc) // ckc  # context chunks up to the last valid slot (0 when none)
    return s, ckc, nkc, kc, vc, cvalid, n_live


def _stat_sweep(carry, ctx_logits, qi, m_ref, l_ref, w, n_live, ckc):
    """One query chunk's second sweep over the context chunks: each row's softmax probabilities
    from its own (m_ref, l_ref), weighted by the stat rows w [B, Cq], added into the running sum
    and max (msum, mmax) [B, Hkv, S'] of `attention_chunked`."""
    def stat_step(j, acc_stats):
        msum, mmax = acc_stats
        lg, ok = ctx_logits(qi, j)
        p = jnp.where(ok[:, :, None, None, :],
                      jnp.exp(lg - m_ref[..., None]) / jnp.maximum(l_ref, 1e-30)[..., None], 0.0)
        psum = jnp.einsum("bhgts,bt->bhs", p, w)
        pmax = jnp.max(p * w[:, None, None, :, None], axis=(2, 3))
        upd = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x, j * ckc, 2)
        cur = lambda a: jax.lax.dynamic_slice_in_dim(a, j * ckc, ckc, 2)
        return upd(msum, cur(msum) + psum), upd(mmax, jnp.maximum(cur(mmax), pmax))
    return jax.lax.fori_loop(0, n_live, stat_step, carry)


def _pooled_mass(msum, mmax, stat_rows, g, pool):
    """The prefix mass [B, Hkv, S] from the swept sum / max over the stat rows (`pool`)."""
    n = jnp.maximum(stat_rows.astype(jnp.float32).sum(-1), 1.0) * g
    mean = msum / n[:, None, None]
    if pool == "mean":
        mass = mean
    elif pool in ("max", "max_joint"):
        mass = mmax
    elif pool == "mean+max":
        mass = mean + mmax / jnp.maximum(mmax.sum(-1, keepdims=True), 1e-30)
    else:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    return mass


def attention_chunked(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask,
                      stat_rows: Optional[jax.Array] = None, pool: str = "mean",
                      q_chunk: Optional[int] = None, k_chunk: Optional[int] = None):
    """`attention` in O(chunk) temporaries: same contract, same results up to float rounding.

    Keys are [context (S, validity ctx_valid) | block (T, blk_mask)]; each query chunk runs an
    online softmax over the context's key chunks (only up to the last valid context slot),
    then over the block's key chunks (a chunk the mask forbids entirely is skipped). The
    statistics pool each row's prefix-only softmax (or the joint one for "max_joint") in a
    second sweep over the context chunks, from the row's own (max, sum)."""
    ch = _CHUNKING.get()
    cq, ck = q_chunk or ch.q, k_chunk or ch.k
    b, hkv, g, t, d = q.shape
    cq = min(cq, t)
    nq = _math.ceil(t / cq)
    tp = nq * cq
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qc = _pad_axis(q, 3, tp).reshape(b, hkv, g, nq, cq, d)
    qpos, ckb, nkb, blk_mask, kb_pos, kb_valid, kb, vb = _block_keys(
        blk_mask, k_blk, v_blk, b, t, nq, cq, tp, ck)

    has_ctx = k_ctx is not None
    if has_ctx:
        s, ckc, nkc, kc, vc, cvalid, n_live = _context_keys(k_ctx, v_ctx, ctx_valid, ck)
        want_stats = stat_rows is not None
    else:
        want_stats = False
    rows = _pad_axis(stat_rows, 1, tp, False).reshape(b, nq, cq) if want_stats else None

    def ctx_logits(qi, j):
        k = jax.lax.dynamic_slice_in_dim(kc, j * ckc, ckc, 2)
        return _logits(qi, k, scale), jax.lax.dynamic_slice_in_dim(cvalid, j * ckc, ckc, 2)

    def one_query_chunk(carry, i):
        qi = qc[:, :, :, i]  # [B, Hkv, G, Cq, D]
        qp = qpos[:, i]
        state = (jnp.full((b, hkv, g, cq), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, cq), jnp.float32),
                 jnp.zeros((b, hkv, g, cq, d), jnp.float32))
        if has_ctx:
            def ctx_step(j, st):
                lg, ok = ctx_logits(qi, j)
                return _online(st, lg, ok[:, :, None, None, :], jax.lax.dynamic_slice_in_dim(vc, j * ckc, ckc, 2))
            state = jax.lax.fori_loop(0, n_live, ctx_step, state)
        m_ctx, l_ctx = state[0], state[1]

        def blk_step(st, j):
            allowed = _block_tile(blk_mask, qp, i * cq, j * ckb, cq, ckb,
                                  None if kb_pos is None else jax.lax.dynamic_slice_in_dim(kb_pos, j * ckb, ckb, 1),
                                  None if kb_valid is None else jax.lax.dynamic_slice_in_dim(kb_valid, j * ckb, ckb, 1))
            upd = lambda st: _online(st, _logits(qi, jax.lax.dynamic_slice_in_dim(kb, j * ckb, ckb, 2), scale),
                                     allowed, jax.lax.dynamic_slice_in_dim(vb, j * ckb, ckb, 2))
            return jax.lax.cond(jnp.any(allowed), upd, lambda st: st, st), None

        state, _ = jax.lax.scan(blk_step, state, jnp.arange(nkb))
        m, l, acc = state
        out = (acc / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype)
        if want_stats:
            m_ref, l_ref = (m, l) if pool == "max_joint" else (m_ctx, l_ctx)
            w = rows[:, i].astype(jnp.float32)  # [B, Cq]
            carry = _stat_sweep(carry, ctx_logits, qi, m_ref, l_ref, w, n_live, ckc)
        return carry, out

    zeros = jnp.zeros((b, hkv, nkc * ckc) if has_ctx else (1,), jnp.float32)
    (msum, mmax), outs = jax.lax.scan(one_query_chunk, (zeros, zeros), jnp.arange(nq))
    out = jnp.moveaxis(outs, 0, 3).reshape(b, hkv, g, tp, d)[:, :, :, :t]
    if not want_stats:
        return out, None
    msum, mmax = msum[..., :s], mmax[..., :s]
    mass = _pooled_mass(msum, mmax, stat_rows, g, pool)
    return out, ScoredStats(mass, value_score(mass, v_ctx))


def attention_any(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask,
                  stat_rows: Optional[jax.Array] = None, pool: str = "mean"):
    """`attention` for a mask in either form: the chunked path for a long pass, else the exact
    one-softmax path on the materialised mask."""
    s = 0 if k_ctx is None else k_ctx.shape[2]
    if is_long(q.shape[3], s):
        return attention_chunked(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask, stat_rows, pool)
    return attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, _dense_mask(blk_mask), stat_rows, pool)
