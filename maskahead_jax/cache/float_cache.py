"""The float KV cache: an immutable pytree with static capacity and functional updates.

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

from ..model import Context
from .slots import choose_slots, take_slots


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, Hkv, N, D]
    v: jax.Array  # [L, B, Hkv, N, D]
    pos: jax.Array  # [L, B, Hkv, N] int32 logical positions (-1 on empty slots)
    valid: jax.Array  # [L, B, Hkv, N] bool
    acc: jax.Array  # [L, B, Hkv, N] float32 per-entry eviction state (H2O accumulated mass)
    length: jax.Array  # [B] int32 write pointer
    seen: jax.Array  # [B] int32 tokens admitted so far (prompt + committed)

    # ---------------------------------------------------------------- reading
    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> float:
        """K + V bytes per token per (layer, KV head), from the stored dtype."""
        return 2.0 * self.k.shape[4] * jnp.dtype(self.k.dtype).itemsize

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        """Layers [start, stop) of the cache as the Context a block reads."""
        return Context(self.k[start:stop], self.v[start:stop], self.valid[start:stop])

    def layers(self, start: int, stop: int) -> "KVCache":
        """The same cache restricted to layers [start, stop)."""
        return self._replace(**{f: getattr(self, f)[start:stop] for f in ("k", "v", "pos", "valid", "acc")})

    def live(self) -> jax.Array:
        """[L, B, Hkv] number of kept entries per lane."""
        return self.valid.sum(-1).astype(jnp.int32)

    def values(self) -> jax.Array:
        """[L, B, Hkv, N, D] the values as stored (what value-aware scores read)."""
        return self.v

    def keys(self) -> jax.Array:
        """[L, B, Hkv, N, D] the (post-RoPE) keys as stored (Expected Attention's scores)."""
        return self.k

    def select_context(self, idx, keep, dtype=None) -> Context:
        """A compact Context of slots idx [L, B, Hkv, K] (keep marks the real ones), in `dtype`."""
        k, v = take_slots(self.k, idx), take_slots(self.v, idx)
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        return Context(k, v, take_slots(self.valid, idx) & keep)

    # ---------------------------------------------------------------- writing
    def append(self, k_new, v_new, pos_new, n_new) -> "KVCache":
        """Write the first n_new[b] of T new entries of each row at slot length[b].

        k_new, v_new [L, B, Hkv, T, D]; pos_new [B, T]; n_new [B].  The caller guarantees
        length + T <= capacity (capacities are planned statically).
        """
        t = k_new.shape[3]
        ok = jnp.arange(t)[None, :] < n_new[:, None]  # [B, T]

        def row(k, v, p, val, a, kn, vn, pn, okb, start):  # one batch row; arrays [L, Hkv, N, ...]
            upd = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=2)
            l, h = k.shape[:2]
            pn = jnp.broadcast_to(jnp.where(okb, pn, -1), (l, h, t))
            okb = jnp.broadcast_to(okb, (l, h, t))
            return (upd(k, kn), upd(v, vn), upd(p, pn), upd(val, okb), upd(a, jnp.zeros((l, h, t))))

        k, v, p, val, a = jax.vmap(row, in_axes=(1, 1, 1, 1, 1, 1, 1, 0, 0, 0), out_axes=1)(
            self.k, self.v, self.pos, self.valid, self.acc, k_new, v_new, pos_new, ok, self.length)
        return self._replace(k=k, v=v, pos=p, valid=val, acc=a, length=self.length + n_new,
                             seen=self.seen + n_new)

    def gather(self, idx: jax.Array, keep: jax.Array) -> "KVCache":
        """New cache of capacity K holding slots idx [L, B, Hkv, K]; keep marks which are valid.

        idx must be sorted so that kept entries come first, in position order (`choose_slots`).
        """
        take = lambda a: take_slots(a, idx)  # take_along_axis over slots (seq-sharded aware)
        valid = take(self.valid) & keep
        return KVCache(k=take(self.k), v=take(self.v), pos=jnp.where(valid, take(self.pos), -1),
                       valid=valid, acc=jnp.where(valid, take(self.acc), 0.0),
                       length=valid.sum(-1).max(axis=(0, 2)).astype(jnp.int32), seen=self.seen)

    def keep_top(self, scores: jax.Array, keep_count, capacity: int) -> "KVCache":
        """Keep, per lane, the keep_count highest-scoring valid entries, sorted by position,
        compacted into a buffer of `capacity` slots (the evicted memory is really gone).
        scores [L, B, Hkv, N]; keep_count [B] or [L, B, Hkv], <= capacity."""
        return self.gather(*choose_slots(self.valid, self.pos, scores, keep_count, capacity))

    def resize(self, capacity: int) -> "KVCache":
        """Move a cache whose live entries fit into `capacity` slots into a buffer of that size."""
        n = self.capacity
        if capacity == n:
            return self
        if capacity < n:
            return jax.tree_util.tree_map(lambda a: a[:, :, :, :capacity] if a.ndim >= 4 else a, self)
        pad = capacity - n
        padf = lambda a, val: jnp.concatenate(
            [a, jnp.full(a.shape[:3] + (pad,) + a.shape[4:], val, a.dtype)], axis=3)
        return self._replace(k=padf(self.k, 0), v=padf(self.v, 0), pos=padf(self.pos, -1),
                             valid=padf(self.valid, False), acc=padf(self.acc, 0.0))


def empty(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
          dtype=jnp.bfloat16) -> KVCache:
    shape = (num_layers, batch, kv_heads, capacity)
    return KVCache(
        k=jnp.zeros(shape + (head_dim,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
        pos=jnp.full(shape, -1, jnp.int32), valid=jnp.zeros(shape, bool),
        acc=jnp.zeros(shape, jnp.float32), length=jnp.zeros((batch,), jnp.int32),
        seen=jnp.zeros((batch,), jnp.int32))
