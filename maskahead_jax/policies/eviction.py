"""The eviction part: how much the cache keeps, when it compacts, what it always keeps, what it
ranks by, and which probe informs the ranking (research/maskahead.md §3, §6).

  Budget        C(seen) = max(floor(pct% * seen), floor), rounded up to `multiple` (32 for a
                packed cache: whole key groups)
  ForcedKeeps   the newest `recent` entries and positions < `sinks` always survive
  Eviction      budget + scorer + keeps + probes + schedule:
                  after the prompt (due at step 0 of the first block) and, with interval_blocks
                  > 0, at step 0 of the block after every interval_blocks blocks;
                  probe: the block probe (Lookahead, PromptWindow or None);
                  first_probe: replaces it at the first block (the question probe), and
                  pin_first pins the question span there;
                  bounded_prefill: also evict after every stored prefill chunk, ranked with
                  prefill_probe (or without a probe), pinning its span when pin_prefill.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .protocol import StepContext


@dataclasses.dataclass(frozen=True)
class Budget:
    pct: float = 10.0
    floor: int = 512
    multiple: int = 1

    def capacity(self, seen):
        """C(seen) = max(floor(pct% * seen), floor), rounded up to a multiple of `multiple`."""
        m = self.multiple
        if isinstance(seen, int):
            c = max(int(self.pct * seen // 100), self.floor)
            return -(-c // m) * m
        c = jnp.floor(self.pct * seen.astype(jnp.float32) / 100.0).astype(jnp.int32)
        c = jnp.maximum(c, self.floor)
        return c if m == 1 else ((c + (m - 1)) // m) * m


@dataclasses.dataclass(frozen=True)
class ForcedKeeps:
    sinks: int = 4
    recent: int = 64

    def mask(self, cache) -> jax.Array:
        """[L, B, Hkv, N] entries that always survive: the newest `recent` and the sinks."""
        slot = jnp.arange(cache.capacity)[None, None, None, :]
        recent = slot >= (cache.length[None, :, None, None] - self.recent)
        return cache.valid & (recent | ((cache.pos >= 0) & (cache.pos < self.sinks)))


@dataclasses.dataclass(frozen=True)
class Eviction:
    budget: Budget
    scorer: Any  # policies.scorers
    keeps: ForcedKeeps = ForcedKeeps()
    probe: Any = None  # policies.probes, run before every block eviction
    interval_blocks: int = 0  # 0: only after the prompt
    first_probe: Any = None  # replaces `probe` at the first block
    pin_first: bool = False
    bounded_prefill: bool = False  # also evict after every stored prefill chunk
    prefill_probe: Any = None  # its probe (None: rank without one, e.g. by position)
    pin_prefill: bool = False  # keep prefill_probe's span (the question)

    # ---------------------------------------------------------------- schedule
    def due_after_prefill(self, cache) -> jax.Array:
        return cache.length > self.budget.capacity(cache.seen)

    def due_after_block(self, blocks_done, cache) -> jax.Array:
        if not self.interval_blocks:
            return jnp.zeros(cache.length.shape, bool)
        due = (blocks_done % self.interval_blocks) == 0
        return due & (cache.length > self.budget.capacity(cache.seen))

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int):
        """Static buffers: the prompt's while prefilling (C(prompt) + one chunk when bounded),
        then C(total) plus the blocks admitted between two evictions (or everything when the
        prompt is the only thing ever compressed)."""
        pre = prompt_cap if not self.bounded_prefill else min(prompt_cap, self.budget.capacity(prompt_cap) + chunk)
        if not self.interval_blocks:
            return pre, total_cap
        return pre, min(total_cap, self.budget.capacity(total_cap) + (self.interval_blocks + 1) * block_size)

    # ---------------------------------------------------------------- the step
    def evict(self, cache, mass0, probe_mass, keep, capacity: int, pinned=None):
        """Keep `keep` [B] entries per lane (forced and `pinned` ones first, then by the scorer),
        compacted in position order into `capacity` slots."""
        scores = self.scorer.scores(cache, mass0, probe_mass)
        forced = self.keeps.mask(cache)
        if pinned is not None:
            forced = forced | (pinned & cache.valid)
        return cache.keep_top(jnp.where(forced, jnp.inf, scores), keep, capacity)

    def compact(self, cache, mass0, probe_mass, rows, capacity: int, pinned=None):
        """`evict` down to C(seen) in the `rows` [B] (other rows keep everything)."""
        keep = jnp.where(rows, jnp.minimum(cache.length, self.budget.capacity(cache.seen)), cache.length)
        return self.evict(cache, mass0, probe_mass, keep, capacity, pinned)

    def at_block(self, cache, ctx: StepContext):
        """(cache in ctx.capacity slots, evicted, probe forwards) at step 0 of a block."""
        rows = ctx.due & ctx.active
        do = jnp.any(rows)
        probe = self.first_probe if (ctx.first and self.first_probe is not None) else self.probe
        pin = ctx.first and self.first_probe is not None and self.pin_first

        def evict(c):
            pm = probe.mass(c, ctx) if probe is not None else None
            pinned = probe.span(c, ctx) if pin else None
            return self.compact(c, ctx.mass, pm, rows, ctx.capacity, pinned)

        cache = jax.lax.cond(do, evict, lambda c: c.resize(ctx.capacity), cache)
        return cache, do, do.astype(jnp.int32) * int(probe is not None)

    def at_prefill_chunk(self, cache, ctx: StepContext):
        """Bounded prefill: rows over C(seen) are compacted into ctx.capacity slots."""
        if not self.bounded_prefill:
            return cache
        over = cache.length > self.budget.capacity(cache.seen)

        def evict(c):
            pinned = self.prefill_probe.span(c, ctx) if self.pin_prefill else None
            if self.prefill_probe is None:  # a ranking that reads no queries: no probe forward
                return self.compact(c, None, None, over, ctx.capacity, pinned)
            pm = self.prefill_probe.mass(c, ctx)
            return self.compact(c, jnp.zeros_like(pm), pm, over, ctx.capacity, pinned)

        return jax.lax.cond(jnp.any(over), evict, lambda c: c, cache)
