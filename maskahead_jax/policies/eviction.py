"""The eviction part: how much the cache keeps, when it compacts, what it always keeps, what it
ranks by, and which probe informs the ranking (research/maskahead.md §3, §6).

  Budget        C(seen) = max(floor(pct% * seen), floor), or a fixed number of `entries`,
                rounded up to `multiple` (32 for a packed cache: whole key groups)
  ForcedKeeps   the newest `recent` entries and positions < `sinks` always survive
  Allocation    how a row's budget is spread over layers and KV heads: C(seen) in every lane
                (the released rule), or MaskKV's layer budgets from an offline importance
                profile and / or AdaKV's head budgets from the eviction scores (ours, issue 40)
  Eviction      budget + scorer + keeps + allocation, evicting when its schedule says
                (policies/schedules.py: Deferred | EndOfBlock, and optional BoundedPrefill).
                A scorer with state observes every block's step-0 statistics and, when it
                asks (observes_prefill / reads_queries), every prefill chunk but the first
                (the released code prefills the first chunk through the model's own forward).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .budgets import _spread, adakv_head_budgets, guarded, layer_budgets
from .protocol import PolicyError, StepContext
from .schedules import BoundedPrefill, Deferred


def floor_percent(pct: float, n):
    """floor(pct% of n), guarded (`budgets.guarded`): a Python int for an int n, int32 for an array.
    Every percentage budget (Budget.capacity, MaskKV's per-head budget) is computed here."""
    if isinstance(n, int):
        return math.floor(guarded(pct * n / 100))
    return jnp.floor(guarded(pct * n.astype(jnp.float32) / 100.0)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Budget:
    pct: float = 10.0
    floor: int = 512
    multiple: int = 1
    entries: int = 0  # > 0: keep this many entries whatever was seen (pct and floor unused)

    def capacity(self, seen):
        """C(seen) = max(floor(pct% * seen), floor) (or `entries`), rounded up to `multiple`."""
        m = self.multiple
        if isinstance(seen, int):
            c = self.entries or max(floor_percent(self.pct, seen), self.floor)
            return -(-c // m) * m
        if self.entries:
            c = jnp.full(seen.shape, self.entries, jnp.int32)
        else:
            c = jnp.maximum(floor_percent(self.pct, seen), self.floor)
        return c if m == 1 else ((c + (m - 1)) // m) * m

    def note(self, prompt_len: int) -> Optional[str]:
        """A sentence when the floor, not the percentage, sets the budget for this prompt."""
        if self.entries or prompt_len <= 0:
            return None
        c, by_pct = self.capacity(prompt_len), Budget(self.pct, 0, self.multiple).capacity(prompt_len)
        kept = min(c, prompt_len)
        if kept <= min(by_pct, prompt_len):  # the floor keeps no more than the percentage would
            return None
        return (f"capacity_floor={self.floor} keeps {kept} of a {prompt_len}-token prompt "
                f"({100 * kept / prompt_len:.0f}%), not capacity_pct={self.pct:g}%: lower "
                f"capacity_floor, or give an absolute budget (kv_entries), for a {self.pct:g}% cache")


def budget_of(policy, multiple: int = 1) -> Budget:
    """The Budget of a policy with the usual knobs (capacity_pct, capacity_floor, capacity_entries),
    rounded up to whole units of its storage (key groups of 32 on the packed cache)."""
    multiple = max(multiple, policy.storage.multiple)
    return Budget(policy.capacity_pct, policy.capacity_floor, multiple, policy.capacity_entries)


def check_budget(policy, forced: int, forced_what: str = "recent + sinks") -> None:
    """Those knobs are in range, and the smallest budget holds the `forced` keeps."""
    if not 0 < policy.capacity_pct <= 100:
        raise PolicyError(f"capacity_pct must be in (0, 100], got {policy.capacity_pct}")
    if policy.capacity_floor <= 0:
        raise PolicyError(f"capacity_floor must be positive, got {policy.capacity_floor}")
    if policy.capacity_entries < 0:
        raise PolicyError(f"capacity_entries must be >= 0 (0: use capacity_pct), got {policy.capacity_entries}")
    name, least = (("capacity_entries", policy.capacity_entries) if policy.capacity_entries
                   else ("capacity_floor", policy.capacity_floor))
    if least < forced:
        raise PolicyError(f"{name}={least} is below {forced_what} = {forced}: the forced keeps would not fit")


@dataclasses.dataclass(frozen=True)
class ForcedKeeps:
    sinks: int = 4
    recent: int = 64

    def mask(self, cache, length=None) -> jax.Array:
        """[L, B, Hkv, N] entries that always survive: the sinks and the newest `recent` of the
        first `length` [B] slots (default: all of them)."""
        length = cache.length if length is None else length
        slot = jnp.arange(cache.capacity)[None, None, None, :]
        end = length[None, :, None, None]
        recent = (slot >= end - self.recent) & (slot < end)
        return cache.valid & (recent | ((cache.pos >= 0) & (cache.pos < self.sinks)))


HEAD_ALLOCS = ("uniform", "adakv")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Per-lane budgets from a row's budget C (ours, issue 40: MaskKV's adaptive budgets inside
    MaskAhead's eviction). The row keeps L x Hkv x C entries in all, as with one C per lane:

      layer_importance  () every layer keeps Hkv x C; else one importance per layer (`maskahead
                        calibrate`), split by MaskKV's Eq. 9-13 with `beta` (budgets.layer_budgets)
      heads             "uniform": each head C_l; "adakv": floor_alpha x C_l per head, the rest
                        of the layer's Hkv x C_l to the heads holding the layer's top eviction
                        scores (budgets.adakv_head_budgets), so a head that attends to many
                        entries keeps more of them
      lane_cap          no lane keeps more than lane_cap x C (the static buffer is planned for
                        it); what a lane cannot take is not handed to another (MaskKV's clipping)
      multiple          every lane's count a multiple of this (32 on the packed cache: whole
                        key groups, so appends stay group-aligned); a layer's lanes are rounded
                        down and the units left over go to the lanes with the largest remainders

    A lane also keeps at least its forced keeps (sinks, recent, pins). Ragged lanes are counted
    by their kept entries (a flattened / paged layout, as MaskKV's)."""

    layer_importance: tuple = ()
    beta: float = 0.4
    heads: str = "uniform"
    floor_alpha: float = 0.2
    lane_cap: float = 2.0
    multiple: int = 1

    def __post_init__(self):
        if self.heads not in HEAD_ALLOCS:
            raise PolicyError(f"head_alloc must be one of {'|'.join(HEAD_ALLOCS)}, got {self.heads!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise PolicyError(f"alloc_beta must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise PolicyError(f"alloc_floor must be in [0, 1], got {self.floor_alpha}")
        if not self.lane_cap >= 1.0:
            raise PolicyError(f"alloc_lane_cap must be >= 1, got {self.lane_cap}")

    @property
    def ragged(self) -> bool:
        return bool(self.layer_importance) or self.heads != "uniform"

    def buffer(self, c: int) -> int:
        """The most entries one lane may hold for a row budget c (a static int)."""
        return c if not self.ragged else int(math.ceil(self.lane_cap * c))

    def counts(self, keep, scores, valid, forced):
        """[L, B, Hkv] entries per lane for row budgets keep [B]: scores / valid / forced
        [L, B, Hkv, N] (forced entries are kept whatever the split)."""
        L = scores.shape[0]
        keep = keep.astype(jnp.int32)
        if self.layer_importance:
            kl = layer_budgets(keep * L, self.layer_importance, self.beta)  # [L, B]
        else:
            kl = jnp.broadcast_to(keep[None], (L,) + keep.shape)
        if self.heads == "adakv":
            finite = jnp.where(forced, jnp.finfo(jnp.float32).max, scores.astype(jnp.float32))
            k = adakv_head_budgets(kl, finite, valid, self.floor_alpha)
        else:
            k = jnp.broadcast_to(kl[..., None], valid.shape[:3])
        m = self.multiple
        cap = jnp.ceil(self.lane_cap * keep.astype(jnp.float32)).astype(jnp.int32)[None, :, None]
        k = jnp.minimum(k, cap)
        if m > 1:  # whole units per lane, the layer's total units kept (largest remainders)
            total = k.sum(-1) // m  # [L, B]
            base = k // m
            k = m * _spread(jnp, base, (k - m * base).astype(jnp.float32), total - base.sum(-1), axis=-1)
            k = jnp.minimum(k, (cap // m) * m)
        need = forced.sum(-1)
        k = jnp.maximum(k, -(-need // m) * m)
        return jnp.minimum(k, valid.sum(-1)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Eviction:
    """What to keep (budget, scorer, forced keeps, allocation) and when to evict (a schedule
    strategy, plus bounded prefill or None): policies/schedules.py."""

    budget: Budget
    scorer: Any  # policies.scorers
    keeps: ForcedKeeps = ForcedKeeps()
    schedule: Any = Deferred()  # schedules.Deferred | schedules.EndOfBlock
    prefill: Optional[BoundedPrefill] = None  # also evict after every stored prefill chunk
    allocation: Allocation = Allocation()  # how a row's budget is spread over layers / heads

    def __post_init__(self):
        if not self.schedule.deferred and getattr(self.scorer, "ranks_by_step0", False):
            raise PolicyError(
                f"{type(self.scorer).__name__} ranks by the step-0 mass, which the end_of_block timing "
                f"does not have (it evicts after the commit forward and at the prompt's final chunk, "
                f"where no block's step 0 ran): use the deferred timing, or a scorer that reads no "
                f"step-0 mass (PositionScore, Accumulated, ProbeMass with a probe)")

    @property
    def deferred(self) -> bool:
        return self.schedule.deferred

    @property
    def bounded_prefill(self) -> bool:
        return self.prefill is not None

    @property
    def interval_blocks(self) -> int:
        return self.schedule.interval_blocks

    def prefill_capacity(self, seen):
        """What a row keeps at most while prefilling: bounded prefill's bound (C(seen) without it)."""
        return self.budget.capacity(seen) if self.prefill is None else self.prefill.capacity(self.budget, seen)

    # ---------------------------------------------------------------- schedule
    def due_after_prefill(self, cache) -> jax.Array:
        return self.schedule.due_after_prefill(self, cache)

    def due_after_block(self, blocks_done, cache) -> jax.Array:
        return self.schedule.due_after_block(self, blocks_done, cache)

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int):
        """Static buffers: the prompt's while prefilling (C(prompt) + one chunk when bounded),
        then C(total) plus the blocks admitted between two evictions (or everything when the
        prompt is the only thing ever compressed). At the end_of_block timing the prompt's
        final chunk survives its compression whole: one chunk more (not with bounded prefill,
        which leaves at most C(prompt))."""
        lane = self.allocation.buffer  # ragged allocations: a lane may hold up to lane_cap x C
        pre = prompt_cap if not self.bounded_prefill else min(prompt_cap, lane(self.prefill_capacity(prompt_cap)) + chunk)
        if not self.interval_blocks:
            return pre, total_cap
        extra = 0 if (self.deferred or self.bounded_prefill) else chunk
        return pre, min(total_cap, lane(self.budget.capacity(total_cap)) + extra + (self.interval_blocks + 1) * block_size)

    # ---------------------------------------------------------------- the step
    def evict(self, cache, mass0, probe_mass, keep, capacity: int, pinned=None):
        """Keep `keep` [B] entries per lane (forced and `pinned` ones first, then by the scorer),
        compacted in position order into `capacity` slots."""
        scores = self.scorer.scores(cache, mass0, probe_mass)
        forced = self.keeps.mask(cache)
        if pinned is not None:
            forced = forced | (pinned & cache.valid)
        if self.allocation.ragged:  # rows keeping everything (keep >= length) stay whole
            split = self.allocation.counts(keep, scores, cache.valid, forced)
            whole = (keep >= cache.length)[None, :, None]
            keep = jnp.minimum(jnp.where(whole, keep[None, :, None], split), capacity)
        return cache.keep_top(jnp.where(forced, jnp.inf, scores), keep, capacity)

    def compact(self, cache, mass0, probe_mass, rows, capacity: int, pinned=None):
        """`evict` down to C(seen) in the `rows` [B] (other rows keep everything)."""
        keep = jnp.where(rows, jnp.minimum(cache.length, self.budget.capacity(cache.seen)), cache.length)
        return self.evict(cache, mass0, probe_mass, keep, capacity, pinned)

    def at_block(self, cache, ctx: StepContext):
        """(cache in ctx.capacity slots, evicted, probe forwards) at step 0 of a block."""
        return self.schedule.at_block(self, cache, ctx)

    def after_commit(self, cache, ctx: StepContext):
        """(cache, evicted) after the commit forward's append (the end_of_block timing)."""
        return self.schedule.after_commit(self, cache, ctx)

    def at_prefill_chunk(self, cache, ctx: StepContext):
        """After a stored prefill chunk: a stateful scorer observes it (not the first chunk);
        bounded prefill compacts rows over their bound; the end_of_block timing compresses the
        prompt at each row's final chunk."""
        sc = self.scorer
        if (sc.observes_prefill or sc.reads_queries) and ctx.rows is not None:
            cache = sc.observe(cache, ctx._replace(rows=ctx.rows & (ctx.start > 0)[:, None]))
        if self.prefill is not None:
            return self.prefill.at_chunk(self, cache, ctx)
        return self.schedule.at_final_chunk(self, cache, ctx)
