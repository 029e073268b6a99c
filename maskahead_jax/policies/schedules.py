"""When an eviction runs: a schedule (one of two strategies) and, optionally, bounded prefill.

  Deferred        MaskAhead's (the released `lookahead` policy): after the prompt (due at step 0
                  of the first block) and, with interval_blocks > 0, at step 0 of the block
                  after every interval_blocks blocks, ranked with that block's real step-0
                  queries and its probe; first_probe replaces the probe at the first block (the
                  question probe), pin_first pins its span there, pin_probe pins the probe's
                  span at every block eviction
  EndOfBlock      the released StreamingLLM, H2O, CAOTE, EA, SnapKV (session.end_prefill_chunk /
                  end_block): the prompt is compressed at its final prefill chunk, to C(tokens
                  seen before that chunk), before the chunk is admitted (the chunk survives
                  whole; admit_final_first: after it is admitted, to C(whole prompt), ranked
                  with `probe`: SnapKV), and every interval_blocks blocks right after the commit
                  forward's append. No step-0 statistics exist there: a scorer that ranks by
                  them is refused (eviction.Eviction)
  BoundedPrefill  also evict after every stored prefill chunk, ranked with `probe` (or without
                  one), its span pinned when `pin`, keeping C(seen so far)

Each strategy is a small frozen dataclass whose methods take the eviction part (`ev`: budget,
scorer, keeps, allocation) and the cache; eviction.Eviction holds one schedule and an optional
BoundedPrefill and forwards the engine's hooks to them. A variant refines one method: the lab's
(experiments/qa_lab.py) weight the step-0 mass (`Deferred.step0_mass`) or bound prefill
differently (`BoundedPrefill.capacity` / `bound`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp



def _none_due(cache) -> jax.Array:
    return jnp.zeros(cache.length.shape, bool)


@dataclasses.dataclass(frozen=True)
class Deferred:
    interval_blocks: int = 0  # 0: only after the prompt
    probe: Any = None  # policies.probes, run before every block eviction
    first_probe: Any = None  # replaces `probe` at the first block
    pin_first: bool = False
    pin_probe: bool = False  # pin probe.span(...) at every block eviction

    deferred: ClassVar[bool] = True

    @property
    def first_block_special(self) -> bool:
        return self.first_probe is not None or self.pin_first

    def due_after_prefill(self, ev, cache) -> jax.Array:
        return cache.length > ev.budget.capacity(cache.seen)

    def due_after_block(self, ev, blocks_done, cache) -> jax.Array:
        if not self.interval_blocks:
            return _none_due(cache)
        due = (blocks_done % self.interval_blocks) == 0
        return due & (cache.length > ev.budget.capacity(cache.seen))

    def step0_mass(self, ctx):
        """[L, B, Hkv, N] the step-0 mass a block eviction adds to its probe's (the released rule:
        the block's own step-0 mass as it is)."""
        return ctx.mass

    def at_block(self, ev, cache, ctx):
        """(cache in ctx.capacity slots, evicted, probe forwards) at step 0 of a block."""
        rows = ctx.due & ctx.active
        do = jnp.any(rows)
        probe = self.first_probe if (ctx.first and self.first_probe is not None) else self.probe
        pin = (ctx.first and self.first_probe is not None and self.pin_first) or (
            self.pin_probe and probe is self.probe and probe is not None)
        mass0 = self.step0_mass(ctx)

        def evict(c):
            pm = probe.mass(c, ctx) if probe is not None else None
            pinned = probe.span(c, ctx) if pin else None
            return ev.compact(c, mass0, pm, rows, ctx.capacity, pinned)

        cache = jax.lax.cond(do, evict, lambda c: c.resize(ctx.capacity), cache)
        n_fwd = 0 if probe is None else getattr(probe, "forwards", 1)
        return cache, do, do.astype(jnp.int32) * n_fwd

    def after_commit(self, ev, cache, ctx):
        return cache, jnp.bool_(False)

    def at_final_chunk(self, ev, cache, ctx):
        return cache


@dataclasses.dataclass(frozen=True)
class EndOfBlock:
    interval_blocks: int = 0  # 0: only the prompt, at its final chunk
    probe: Any = None  # with admit_final_first: the final chunk's vote (SnapKV's window)
    admit_final_first: bool = False  # compress the prompt after its final chunk is admitted

    deferred: ClassVar[bool] = False
    first_block_special: ClassVar[bool] = False

    def due_after_prefill(self, ev, cache) -> jax.Array:
        return _none_due(cache)

    def due_after_block(self, ev, blocks_done, cache) -> jax.Array:
        return _none_due(cache)

    def step0_mass(self, ctx):
        """[L, B, Hkv, N] the step-0 mass a block eviction adds to its probe's (the released rule:
        the block's own step-0 mass as it is)."""
        return ctx.mass

    def at_block(self, ev, cache, ctx):
        return cache.resize(ctx.capacity), jnp.bool_(False), jnp.int32(0)

    def after_commit(self, ev, cache, ctx):
        """After every interval_blocks-th block's append, rows over C(seen) are compacted
        (released `end_block` -> `maybe_evict`). Returns (cache, evicted)."""
        if not self.interval_blocks:
            return cache, jnp.bool_(False)
        due = (ctx.blocks_done % self.interval_blocks) == 0
        rows = ctx.active & due & (cache.length > ev.budget.capacity(cache.seen))
        do = jnp.any(rows)
        cache = jax.lax.cond(do, lambda c: ev.compact(c, None, None, rows, ctx.capacity), lambda c: c, cache)
        return cache, do

    def at_final_chunk(self, ev, cache, ctx):
        """The prompt compressed at each row's final chunk."""
        final = (ctx.appended > 0) & (ctx.start + ctx.appended >= ctx.n_pre)
        if self.admit_final_first:  # SnapKV: the final chunk's queries vote over the whole prompt
            rows = final & (cache.length > ev.budget.capacity(cache.seen))

            def evict(c):
                pm = self.probe.mass(c, ctx) if self.probe is not None else None
                return ev.compact(c, None, pm, rows, ctx.capacity)

            return jax.lax.cond(jnp.any(rows), evict, lambda c: c, cache)
        # the old prefix to C(seen before the chunk); the chunk, not admitted yet, survives whole
        old, seen_old = cache.length - ctx.appended, cache.seen - ctx.appended
        cap_old = ev.budget.capacity(seen_old)
        rows = final & (old > cap_old)

        def compress(c):
            keep = jnp.where(rows, jnp.minimum(old, cap_old) + ctx.appended, c.length)
            slot = jnp.arange(c.capacity)[None, None, None, :]
            forced = ev.keeps.mask(c, old) | (c.valid & (slot >= old[None, :, None, None]))
            scores = ev.scorer.scores(c, None, None)
            return c.keep_top(jnp.where(forced, jnp.inf, scores), keep, ctx.capacity)

        return jax.lax.cond(jnp.any(rows), compress, lambda c: c, cache)


@dataclasses.dataclass(frozen=True)
class BoundedPrefill:
    probe: Any = None  # None: rank without one (e.g. by position)
    pin: bool = False  # keep the probe's span (the question)

    def capacity(self, budget, seen):
        """The most entries a row keeps while prefilling, having seen `seen` tokens (the engine
        sizes the prefill buffers by it): C(seen)."""
        return budget.capacity(seen)

    def bound(self, ev, cache, ctx):
        """([B] entries each row keeps after this chunk, [B] rows over it)."""
        cap = self.capacity(ev.budget, cache.seen)
        return cap, cache.length > cap

    def at_chunk(self, ev, cache, ctx):
        """After a stored prefill chunk: rows over their bound are compacted into ctx.capacity."""
        cap, over = self.bound(ev, cache, ctx)
        keep = jnp.where(over, cap, cache.length)

        def evict(c):
            pinned = self.probe.span(c, ctx) if self.pin else None
            if self.probe is None:  # a ranking that reads no queries: no probe forward
                return ev.evict(c, None, None, keep, ctx.capacity, pinned)
            pm = self.probe.mass(c, ctx)
            return ev.evict(c, jnp.zeros_like(pm), pm, keep, ctx.capacity, pinned)

        return jax.lax.cond(jnp.any(over), evict, lambda c: c, cache)
