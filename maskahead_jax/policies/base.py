"""The policy protocol, and Dense (the exact full cache).

A policy is a frozen, hashable dataclass (a static jit argument). The generation engine calls
its hooks at fixed points of the block loop (see generate.py):

  plan(prompt_cap, total_cap)      static cache capacities (prefill buffer, decode buffer)
  needs_stats                      compute step-0 prefix mass / value score per layer
  select(cache, mass, score)       segments (layer range -> context) for steps >= 1 and the commit
  pending_after_prefill(cache)     [B] bool: compress the prompt at step 0 of the first block
  schedule(blocks_done, cache)     [B] bool: compress at step 0 of the next block
  evict(cache, mass0, probe_mass, probe_valid, capacity)
                                   new cache of `capacity` slots (needs_probe: engine runs the probe)
  observe(cache, mass)             update per-entry state (H2O accumulators)
  bounded_prefill                  also evict after every stored prefill chunk (with the question
                                   probe when the policy has one; generate._evict_during_prefill)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from ..cache import KVCache
from ..model import Segment


@dataclasses.dataclass(frozen=True)
class Dense:
    """Full exact cache: every block reads everything; nothing is evicted."""

    name = "dense"
    needs_stats = False
    needs_probe = False
    evicts = False
    with_state = False
    compresses_prompt = False
    bounded_prefill = False
    probe_kind = "lookahead"

    def stat_rows(self, masked, active):
        """[B, T] which step-0 queries are pooled into the statistics (all masked ones)."""
        return masked & active[:, None]

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        """(capacity while prefilling, capacity while decoding); total_cap holds everything."""
        return total_cap, total_cap

    def capacity(self, seen):
        return seen

    def select(self, cache: KVCache, num_layers: int, mass, score):
        """None: every layer reads the whole cache. Else (n_dense, Context of layers n_dense..L)."""
        return None

    def pending_after_prefill(self, cache: KVCache) -> jax.Array:
        return jnp.zeros(cache.length.shape, bool)

    def schedule(self, blocks_done, cache: KVCache) -> jax.Array:
        return jnp.zeros(cache.length.shape, bool)

    def observe(self, cache: KVCache, mass) -> KVCache:
        return cache

    def evict(self, cache: KVCache, mass0, probe_mass, capacity: int) -> KVCache:
        raise NotImplementedError


def ceil_pct(pct: float, n):
    """ceil(pct% of n) for python ints or int arrays."""
    if isinstance(n, int):
        return math.ceil(pct * n / 100.0)
    return jnp.ceil(pct * n.astype(jnp.float32) / 100.0).astype(jnp.int32)
