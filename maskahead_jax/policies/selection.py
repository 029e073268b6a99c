"""The selection part: what a block's later steps and its commit forward read.

At step 0 every (layer >= dense_layers, row, KV head) ranks its live entries by the step-0
statistics and keeps the top k = min(live, max(topk_floor, ceil(topk_pct% * live)))
(research/maskahead.md §2): `ranking` "value" ranks by s_i = a_i * ||v_i - c|| (MaskAhead),
"mass" by a_i (MAGE-like). The chosen entries are gathered once into a compact buffer
(`compact_dtype`, e.g. bf16 from a packed cache) that all later steps reuse. `rows` says which
step-0 queries pool the statistics: every masked one, or only the centre one (HERALD-like: the masked position closest
to the block's centre (T - 1) / 2, the lower one on a tie, as released SelectorConfig.query_indices
mode "middle").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from ..cache import choose_slots

RANKINGS = ("value", "mass")


def ceil_pct(pct: float, n):
    """ceil(pct% of n) for python ints or int arrays."""
    if isinstance(n, int):
        return math.ceil(pct * n / 100.0)
    return jnp.ceil(pct * n.astype(jnp.float32) / 100.0).astype(jnp.int32)


def masked_rows(masked, active):
    """[B, T] every masked step-0 query of an active row."""
    return masked & active[:, None]


def centre_rows(masked, active):
    """[B, T] only the masked position closest to the block centre (T - 1) / 2, the lower one on
    a tie (released: min(positions, key=(|x - centre|, x))): 15 for masks at 1..31 of a
    32-token block, 16 for masks at 16..31."""
    t = masked.shape[-1]
    idx = jnp.arange(t)
    dist2 = jnp.abs(2 * idx - (t - 1))  # 2 |x - (T - 1) / 2|, an integer
    key = jnp.where(masked, dist2 * t + idx, jnp.iinfo(jnp.int32).max)
    pick = jnp.argmin(key, axis=-1)
    return (idx[None, :] == pick[:, None]) & masked & active[:, None]


@dataclasses.dataclass(frozen=True)
class Selector:
    ranking: str = "value"
    topk_pct: float = 5.0
    topk_floor: int = 256
    dense_layers: int = 2
    compact_dtype: Optional[str] = None  # None: the cache's dtype
    rows: str = "masked"  # masked | centre

    def stat_rows(self, masked, active):
        return centre_rows(masked, active) if self.rows == "centre" else masked_rows(masked, active)

    def topk(self, live):
        """k(live) = min(live, max(topk_floor, ceil(topk_pct% * live)))."""
        if isinstance(live, int):
            return min(live, max(self.topk_floor, ceil_pct(self.topk_pct, live)))
        return jnp.minimum(live, jnp.maximum(self.topk_floor, ceil_pct(self.topk_pct, live)))

    def select(self, cache, mass, score):
        """None (read everything) or (n_dense, Context of layers n_dense..L)."""
        num_layers = cache.valid.shape[0]
        nd = min(self.dense_layers, num_layers)
        if nd >= num_layers:
            return None
        kmax = self.topk(cache.capacity)
        if kmax >= cache.capacity:  # the budget covers the whole buffer: nothing to gain
            return None
        sub = cache.layers(nd, num_layers)
        ranks = (score if self.ranking == "value" else mass)[nd:]
        idx, keep = choose_slots(sub.valid, sub.pos, ranks, self.topk(sub.length), kmax)
        dtype = jnp.dtype(self.compact_dtype) if self.compact_dtype else None
        return nd, sub.select_context(idx, keep, dtype)
