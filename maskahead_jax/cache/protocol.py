"""The Cache protocol: what the engine and the policies may ask of any KV cache.

Three caches implement it as methods: `KVCache` (float, float_cache.py), `QKVCache` (packed
int4 / int2, packed.py) and `SimQuantKVCache` (float storage on the packed round trip, the
packed cache's test reference, simulated.py). Each is an immutable pytree; every update returns
a new cache. Shapes: L layers, B rows, Hkv KV heads, N slots, D head size.

Bookkeeping fields every cache has: pos / valid / acc [L, B, Hkv, N] (logical positions, kept
slots, per-entry policy state such as H2O's accumulated mass), length / seen [B] (write pointer,
tokens admitted so far). Live entries are left-aligned and in position order.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from ..model import Context


@runtime_checkable
class Cache(Protocol):
    pos: jax.Array
    valid: jax.Array
    acc: jax.Array
    length: jax.Array
    seen: jax.Array

    @property
    def capacity(self) -> int:
        """N, the static number of slots per lane."""

    @property
    def bytes_per_token(self) -> float:
        """Stored bytes per token per (layer, KV head), read from the arrays (memory stats)."""

    def append(self, k_new, v_new, pos_new, n_new) -> "Cache":
        """Store the first n_new[b] of T new entries [L, B, Hkv, T, D] of each row at length[b]."""

    def keep_top(self, scores, keep_count, capacity: int) -> "Cache":
        """Evict: keep keep_count ([B] or [L, B, Hkv]) best-scoring entries per lane, in position
        order, compacted into `capacity` slots (through slots.choose_slots)."""

    def gather(self, idx, keep) -> "Cache":
        """The cache of slots idx [L, B, Hkv, K] (keep marks real ones), as choose_slots gives them."""

    def resize(self, capacity: int) -> "Cache":
        """The same live entries in a buffer of `capacity` slots."""

    def layers(self, start: int, stop: int) -> "Cache":
        """Layers [start, stop) only."""

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        """Layers [start, stop) as the Context a forward attends to (packed caches stay packed)."""

    def select_context(self, idx, keep, dtype=None) -> Context:
        """A compact float Context of slots idx [L, B, Hkv, K] (selection's gathered buffer)."""

    def values(self) -> jax.Array:
        """[L, B, Hkv, N, D] values as the model reads them (dequantized for packed caches)."""

    def keys(self) -> jax.Array:
        """[L, B, Hkv, N, D] post-RoPE keys (dequantized for packed caches)."""

    def live(self) -> jax.Array:
        """[L, B, Hkv] kept entries per lane."""
