"""A policy as a composition: a selection part and an eviction part answer every engine hook.

A subclass keeps its user-facing knobs as flat dataclass fields (`MaskAhead(capacity_pct=10,
topk_floor=256)`) and says how they compose by two properties:

    selector -> selection.Selector or None   (None: every block reads the whole cache)
    eviction -> eviction.Eviction or None    (None: nothing is ever evicted)

`ComposedPolicy` then implements the protocol (policies/protocol.py): statistics are computed
when either part reads them, the scorer's state is updated at every block (and prefill chunk,
when it asks), the block reads the selector's choice of the pre-eviction cache, and the
eviction runs when due: at step 0 (the deferred timing) or after the commit (end_of_block).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp

from .. import memory

from .eviction import Eviction
from .protocol import BlockResult, Policy, StatsRequest, StepContext
from .selection import Selector, masked_rows


@dataclasses.dataclass(frozen=True)
class ComposedPolicy(Policy):
    takes_budget: ClassVar[bool] = True
    keeps_state: ClassVar[bool] = True

    @property
    def selector(self) -> Optional[Selector]:
        return None

    @property
    def eviction(self) -> Optional[Eviction]:
        return None

    def check_run(self, cfg, gen) -> None:
        """The policy's and its storage's checks, then its parts': building the eviction part
        refuses an inconsistent one (a step-0 scorer under the end_of_block timing, ...)."""
        super().check_run(cfg, gen)
        _ = self.eviction

    @property
    def first_block_special(self) -> bool:
        ev = self.eviction  # only the eviction's first-block probe / pin reads ctx.first
        return ev is not None and ev.schedule.first_block_special

    # ---------------------------------------------------------------- hooks
    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        ev = self.eviction
        caps = (total_cap, total_cap) if ev is None else ev.plan(prompt_cap, total_cap, block_size, chunk)
        return self.storage.plan(self, caps, prompt_cap, total_cap)

    def _selector(self) -> Optional[Selector]:
        """The selector, gathering into the storage's compact dtype (bf16 from a packed cache)."""
        sel, dtype = self.selector, self.storage.compact_dtype
        return sel if sel is None or dtype is None else dataclasses.replace(sel, compact_dtype=dtype)

    def stats_request(self, masked, active) -> Optional[StatsRequest]:
        """Step 0: the selector's rows (or the masked ones) when the selector or the scorer reads
        the mass, with the query moments when the scorer reads them."""
        sel, ev = self.selector, self.eviction
        mass = sel is not None or (ev is not None and ev.scorer.reads_mass)
        moments = ev is not None and ev.scorer.reads_queries
        if not (mass or moments):
            return None  # nobody reads step-0 statistics: step 0 computes none
        rows = sel.stat_rows(masked, active) if sel is not None else masked_rows(masked, active)
        return StatsRequest(rows, mass=mass, moments=moments)

    def prefill_stats_request(self, valid) -> Optional[StatsRequest]:
        """Each prefill chunk: its valid queries' mass when the scorer observes the prefill, their
        moments when it reads queries."""
        ev = self.eviction
        mass = ev is not None and ev.scorer.observes_prefill
        moments = ev is not None and ev.scorer.reads_queries
        return StatsRequest(valid, mass=mass, moments=moments) if mass or moments else None

    def on_prefill_chunk(self, cache, ctx: StepContext):
        ev = self.eviction
        return cache if ev is None else ev.at_prefill_chunk(cache, ctx)

    def after_commit(self, cache, ctx: StepContext):
        ev = self.eviction
        return (cache, jnp.bool_(False)) if ev is None else ev.after_commit(cache, ctx)

    def due_after_prefill(self, cache):
        ev = self.eviction
        return jnp.zeros(cache.length.shape, bool) if ev is None else ev.due_after_prefill(cache)

    def due_after_block(self, blocks_done, cache):
        ev = self.eviction
        return jnp.zeros(cache.length.shape, bool) if ev is None else ev.due_after_block(blocks_done, cache)

    def budget_note(self, prompt_lens) -> Optional[str]:
        ev = self.eviction
        note = ev.budget.note(min(prompt_lens)) if ev is not None and prompt_lens else None
        return f"{self.label}: {note}" if note else None

    def held_bytes(self, cache):
        """Ragged per-lane budgets (Allocation) count their kept entries (a flattened layout,
        as MaskKV's); one budget per lane counts the rectangular extent."""
        ev = self.eviction
        ragged = ev is not None and ev.allocation.ragged
        return memory.row_bytes(cache.valid, cache.bytes_per_token, self.keeps_state, kept_only=ragged)

    def on_block(self, cache, ctx: StepContext) -> BlockResult:
        sel, ev = self._selector(), self.eviction
        if ev is not None:
            cache = ev.scorer.observe(cache, ctx)
        selection = sel.select(cache, ctx.mass, ctx.score) if sel is not None else None
        if ev is None:
            return BlockResult(cache.resize(ctx.capacity), selection, jnp.bool_(False), jnp.int32(0))
        cache, evicted, forwards = ev.at_block(cache, ctx)
        return BlockResult(cache, selection, evicted, forwards)
