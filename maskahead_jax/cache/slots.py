"""Slot operations of every cache: ONE slot chooser, and the top-k / gather it is built on.

`choose_slots` is the only place that turns scores into a keep set: top-k per lane (layer,
row, KV head), re-sorted by position, padded to a static capacity. Eviction (float, packed and
simulated caches), MaskAhead's selection and MaskKV's ragged budgets all call it, so all of
them take the seq-sharded path below when the cache's slot axis is split over `seq`:
`top_k` merges per-shard candidates, `take_slots` gathers with one psum of K-sized data.
Without a seq-sharded mesh in context both are the plain jnp ops.
"""
from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..axes import CACHE_AXES, RULES, cache_spec, mesh_sizes

_LAST = jnp.iinfo(jnp.int32).max  # sort key of unchosen slots: after every kept position


def choose_slots(valid: jax.Array, pos: jax.Array, scores: jax.Array, keep_count,
                 capacity: int) -> tuple[jax.Array, jax.Array]:
    """Which slots survive, per lane: (idx, keep), each [L, B, Hkv, capacity].

    valid, pos, scores [L, B, Hkv, N]; keep_count: [B] (one count per row) or [L, B, Hkv]
    (ragged, per lane), each <= capacity. The keep_count highest-scoring valid slots of a lane
    come first in idx, in position order; keep marks them; the rest of idx is padding (slot 0).
    Ties in score go to the lower slot (lax.top_k's order).
    """
    n = valid.shape[-1]
    scores = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    kk = min(capacity, n)
    _, top = top_k(scores, kk)  # [L, B, Hkv, kk] best first
    kc = jnp.asarray(keep_count)
    kc = kc[None, :, None] if kc.ndim == 1 else kc
    chosen = take_slots(valid, top) & (jnp.arange(kk) < kc[..., None])
    order = jnp.argsort(jnp.where(chosen, take_slots(pos, top), _LAST), axis=3)
    idx = jnp.take_along_axis(top, order, axis=3)
    keep = jnp.take_along_axis(chosen, order, axis=3)
    if kk < capacity:  # a larger buffer than the lane: pad with empty slots
        pad = capacity - kk
        idx = jnp.concatenate([idx, jnp.zeros(idx.shape[:3] + (pad,), idx.dtype)], axis=3)
        keep = jnp.concatenate([keep, jnp.zeros(keep.shape[:3] + (pad,), bool)], axis=3)
    return idx, keep


def top_k(x: jax.Array, k: int, rules: Mapping[str, Optional[str]] = RULES):
    """`jax.lax.top_k(x, k)` over the last axis, two-stage when that axis is sharded over `seq`.

    Under ``jax.set_mesh`` with a `seq` axis of size S > 1 that divides the last axis (the
    cache's slot axis), each seq shard takes its local top-k (k <= N/S), the S*k candidates are
    all-gathered along `seq` (k values + indices per shard, never the whole axis), and a second
    top-k merges them. Ties resolve exactly as `lax.top_k` (lower index first): the candidates
    are laid out in shard order and each shard's in index order among equal values. Other mesh
    axes stay automatic. Without such a mesh this is `jax.lax.top_k`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = x.shape[-1]
    s = mesh_sizes(mesh).get(rules.get("cache_seq") or "", 1) if not mesh.empty else 1
    ax = rules.get("cache_seq")
    if s <= 1 or n % s or k > n or x.ndim < 1:
        return jax.lax.top_k(x, k)
    kl = min(k, n // s)  # a shard holds at most min(k, N/S) of the global top k
    spec = tuple(cache_spec(x.shape, mesh, rules)) if x.ndim in CACHE_AXES else ()
    spec = spec + (None,) * (x.ndim - len(spec))
    spec = spec[:-1] + (ax,)  # [L, B, Hkv, N]: keep batch / kv-head sharding, slots over seq
    out_spec = P(*spec[:-1])

    def local(xs):
        v, i = jax.lax.top_k(xs, kl)
        i = i + (jax.lax.axis_index(ax) * (n // s)).astype(i.dtype)
        v = jax.lax.all_gather(v, ax, axis=x.ndim - 1, tiled=True)
        i = jax.lax.all_gather(i, ax, axis=x.ndim - 1, tiled=True)
        v2, j = jax.lax.top_k(v, k)
        return v2, jnp.take_along_axis(i, j, axis=-1)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(*spec), out_specs=(out_spec, out_spec),
                      check_vma=False)
    return f(x)


def _seq_mesh(n: int, rules: Mapping[str, Optional[str]]):
    """(abstract mesh, seq axis name, shards) when the context mesh shards a slot axis of n."""
    mesh = jax.sharding.get_abstract_mesh()
    ax = rules.get("cache_seq")
    if mesh.empty or ax is None:
        return None
    s = mesh_sizes(mesh).get(ax, 1)
    if s <= 1 or n % s:
        return None
    return mesh, ax, s


def take_slots(a: jax.Array, idx: jax.Array, rules: Mapping[str, Optional[str]] = RULES) -> jax.Array:
    """`take_along_axis(a, idx, axis=3)` for cache fields a [L, B, Hkv, N(, D)] and slot indices
    idx [L, B, Hkv, K] (compaction / selection gathers), with explicit collectives when the
    slot axis is sharded over `seq`: each shard gathers the requested slots it owns, zeros the
    rest, and a psum over `seq` of the raw bits (exactly one shard contributes each entry, so
    the result is bit-exact) assembles the [.., K(, D)] result; only K-sized data moves, never
    the N-sized cache. Without such a mesh this is `jnp.take_along_axis`.
    """
    ix = idx if a.ndim == idx.ndim else idx[..., None]
    found = _seq_mesh(a.shape[3], rules) if a.ndim in (4, 5) else None
    if found is None:
        return jnp.take_along_axis(a, ix, axis=3)
    mesh, ax, s = found
    n_loc = a.shape[3] // s
    a_spec = tuple(cache_spec(a.shape, mesh, rules)) + (None,) * a.ndim
    a_spec = a_spec[:3] + (ax,) + a_spec[4:a.ndim]
    i_spec = a_spec[:3] + (None,) * (idx.ndim - 3)
    o_spec = a_spec[:3] + (None,) * (a.ndim - 3)
    dt = a.dtype
    bits = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(dt).itemsize]

    def local(al, il):
        off = jax.lax.axis_index(ax) * n_loc
        j = il - off
        own = (j >= 0) & (j < n_loc)
        jl = jnp.clip(j, 0, n_loc - 1)
        jl = jl if al.ndim == jl.ndim else jl[..., None]
        own = own if al.ndim == own.ndim else own[..., None]
        raw = al.astype(jnp.int8) if dt == jnp.bool_ else jax.lax.bitcast_convert_type(al, bits)
        got = jnp.where(own, jnp.take_along_axis(raw, jl, axis=3), jnp.zeros((), raw.dtype))
        got = jax.lax.psum(got.astype(jnp.int32) if raw.dtype.itemsize < 4 else got, ax)
        if dt == jnp.bool_:
            return got != 0
        return jax.lax.bitcast_convert_type(got.astype(bits), dt)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(*a_spec), P(*i_spec)), out_specs=P(*o_spec),
                      check_vma=False)
    return f(a, idx)
