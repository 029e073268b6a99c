"""The KV cache: an immutable pytree with static capacity and functional updates.

Axes everywhere: (layer, batch, kv_head, slot, head_dim). Keys are stored after RoPE, and each
slot remembers its logical position, so entries that survive an eviction never need re-rotating.
Live entries of a lane are kept left-aligned in [0, length[b]) and sorted by position; `valid`
marks which of them are kept (MaskKV's ragged per-head budgets leave holes; every other policy
keeps lanes dense). Slots at or beyond `length` are never valid.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .model import Context
from .sharding import take_slots, top_k as slot_top_k  # plain jnp ops without a seq-sharded mesh


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, Hkv, N, D]
    v: jax.Array  # [L, B, Hkv, N, D]
    pos: jax.Array  # [L, B, Hkv, N] int32 logical positions (-1 on empty slots)
    valid: jax.Array  # [L, B, Hkv, N] bool
    acc: jax.Array  # [L, B, Hkv, N] float32 per-entry eviction state (H2O accumulated mass)
    length: jax.Array  # [B] int32 write pointer
    seen: jax.Array  # [B] int32 tokens admitted so far (prompt + committed)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        """Layers [start, stop) of the cache as the Context a block reads."""
        return Context(self.k[start:stop], self.v[start:stop], self.valid[start:stop])

    def layers(self, start: int, stop: int) -> "KVCache":
        """The same cache restricted to layers [start, stop)."""
        return self._replace(**{f: getattr(self, f)[start:stop] for f in ("k", "v", "pos", "valid", "acc")})

    def live(self) -> jax.Array:
        """[L, B, Hkv] number of kept entries per lane."""
        return self.valid.sum(-1).astype(jnp.int32)


def empty(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
          dtype=jnp.bfloat16) -> KVCache:
    shape = (num_layers, batch, kv_heads, capacity)
    return KVCache(
        k=jnp.zeros(shape + (head_dim,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
        pos=jnp.full(shape, -1, jnp.int32), valid=jnp.zeros(shape, bool),
        acc=jnp.zeros(shape, jnp.float32), length=jnp.zeros((batch,), jnp.int32),
        seen=jnp.zeros((batch,), jnp.int32))


def append(cache: KVCache, k_new, v_new, pos_new, n_new) -> KVCache:
    """Write the first n_new[b] of T new entries of each row at slot length[b].

    k_new, v_new [L, B, Hkv, T, D]; pos_new [B, T]; n_new [B].  The caller guarantees
    length + T <= capacity (capacities are planned statically).
    """
    if not isinstance(cache, KVCache):  # another cache type (qcache.QKVCache): same API
        return cache.append(k_new, v_new, pos_new, n_new)
    t = k_new.shape[3]
    ok = jnp.arange(t)[None, :] < n_new[:, None]  # [B, T]

    def row(k, v, p, val, a, kn, vn, pn, okb, start):  # one batch row; arrays [L, Hkv, N, ...]
        upd = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=2)
        l, h = k.shape[:2]
        pn = jnp.broadcast_to(jnp.where(okb, pn, -1), (l, h, t))
        okb = jnp.broadcast_to(okb, (l, h, t))
        return (upd(k, kn), upd(v, vn), upd(p, pn), upd(val, okb), upd(a, jnp.zeros((l, h, t))))

    k, v, p, val, a = jax.vmap(row, in_axes=(1, 1, 1, 1, 1, 1, 1, 0, 0, 0), out_axes=1)(
        cache.k, cache.v, cache.pos, cache.valid, cache.acc, k_new, v_new, pos_new, ok,
        cache.length)
    return cache._replace(k=k, v=v, pos=p, valid=val, acc=a, length=cache.length + n_new,
                          seen=cache.seen + n_new)


def gather(cache: KVCache, idx: jax.Array, keep: jax.Array) -> KVCache:
    """New cache of capacity K holding slots idx [L, B, Hkv, K]; keep [L, B, Hkv, K] marks which are valid.

    idx must be sorted so that kept entries come first, in position order.
    """
    if not isinstance(cache, KVCache):
        return cache.gather(idx, keep)
    take = takev = lambda a: take_slots(a, idx)  # take_along_axis over slots (seq-sharded aware)
    valid = take(cache.valid) & keep
    return KVCache(k=takev(cache.k), v=takev(cache.v), pos=jnp.where(valid, take(cache.pos), -1),
                   valid=valid, acc=jnp.where(valid, take(cache.acc), 0.0),
                   length=valid.sum(-1).max(axis=(0, 2)).astype(jnp.int32), seen=cache.seen)


def keep_top(cache: KVCache, scores: jax.Array, keep_count: jax.Array, capacity: int) -> KVCache:
    """Keep, per lane, the keep_count[b] highest-scoring valid entries, sorted by position,
    compacted into a buffer of `capacity` slots (the evicted memory is really gone).

    scores [L, B, Hkv, N] (invalid slots are ignored); keep_count [B] <= capacity.
    """
    if not isinstance(cache, KVCache):
        return cache.keep_top(scores, keep_count, capacity)
    n = cache.capacity
    scores = jnp.where(cache.valid, scores.astype(jnp.float32), -jnp.inf)
    kk = min(capacity, n)
    _, top = slot_top_k(scores, kk)  # [L, B, Hkv, kk] best first (two-stage when seq-sharded)
    rank_ok = jnp.arange(kk) < keep_count[None, :, None, None]
    chosen_valid = take_slots(cache.valid, top) & rank_ok
    # sort the chosen slots by position (invalid last) so lanes stay position-ordered
    key = jnp.where(chosen_valid, take_slots(cache.pos, top), jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=3)
    idx = jnp.take_along_axis(top, order, axis=3)
    keep = jnp.take_along_axis(chosen_valid, order, axis=3)
    if kk < capacity:  # grow: pad with empty slots
        pad = capacity - kk
        idx = jnp.concatenate([idx, jnp.zeros(idx.shape[:3] + (pad,), idx.dtype)], axis=3)
        keep = jnp.concatenate([keep, jnp.zeros(keep.shape[:3] + (pad,), bool)], axis=3)
    return gather(cache, idx, keep)


def resize(cache: KVCache, capacity: int) -> KVCache:
    """Move a cache whose live entries fit into `capacity` slots into a buffer of that size."""
    if not isinstance(cache, KVCache):
        return cache.resize(capacity)
    n = cache.capacity
    if capacity == n:
        return cache
    if capacity < n:
        return jax.tree_util.tree_map(lambda a: a[:, :, :, :capacity] if a.ndim >= 4 else a, cache)
    pad = capacity - n
    padf = lambda a, val: jnp.concatenate(
        [a, jnp.full(a.shape[:3] + (pad,) + a.shape[4:], val, a.dtype)], axis=3)
    return cache._replace(k=padf(cache.k, 0), v=padf(cache.v, 0), pos=padf(cache.pos, -1),
                          valid=padf(cache.valid, False), acc=padf(cache.acc, 0.0))
