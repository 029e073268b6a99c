"""KV caches behind one protocol (protocol.py): float, packed (int4 / int2: packed.py over the layout
operations of packed_layout.py) and simulated, and the one slot chooser (slots.py) every eviction
and selection goes through.

The module functions below are the protocol's methods spelled as functions, for callers that
prefer `cache.append(c, ...)` to `c.append(...)`.
"""
from __future__ import annotations

from .float_cache import KVCache, empty
from .packed import QKVCache
from .protocol import Cache
from .simulated import SimQuantKVCache
from .slots import choose_slots, take_slots, top_k


def append(cache: Cache, k_new, v_new, pos_new, n_new) -> Cache:
    return cache.append(k_new, v_new, pos_new, n_new)


def gather(cache: Cache, idx, keep) -> Cache:
    return cache.gather(idx, keep)


def keep_top(cache: Cache, scores, keep_count, capacity: int) -> Cache:
    return cache.keep_top(scores, keep_count, capacity)


def resize(cache: Cache, capacity: int) -> Cache:
    return cache.resize(capacity)


__all__ = ["Cache", "KVCache", "QKVCache", "SimQuantKVCache", "append", "choose_slots", "empty",
           "gather", "keep_top", "resize", "take_slots", "top_k"]
