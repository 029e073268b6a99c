"""Eviction / selection baselines of the released MaskAhead code (research/maskahead.md §6
"Baselines"). Every one composes MaskAhead's value-aware selector (step-0 a_i * ||v_i - c||,
top-k per (layer, batch, KV head)) with an eviction part of its own; they share the budget
C = max(floor(capacity_pct% * seen), capacity_floor), the schedule (every `interval_blocks`
blocks, deferred to step 0 of the next block) and the compaction. Only the ranking differs:

  streaming  StreamingLLM: sinks + the most recent entries (score = position)
  streaming-bounded  StreamingLLM as it streams: the same ranking also applied after every
             prefill chunk, so the middle of the prompt is gone before the question is read
  h2o        H2O: per-entry accumulated step-0 attention mass (EMA decay 1), kept in cache.acc
  caote      H2O + CAOTE: h_i/(1-h_i) * ||v_i - o||, h = accumulated mass normalised per lane,
             o = sum h_i v_i
  snapkv     SnapKV, prompt-only: once after prefill, the last `window` (32) prompt queries vote,
             scores max-pooled over `pool` (5) neighbouring positions; the window is kept;
             no later evictions
  herald     HERALD-like: the selection statistics come from a single centre mask query; no
             eviction (so no budget)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from .composed import ComposedPolicy
from .eviction import Eviction, ForcedKeeps, budget_of, check_budget
from .maskahead import check_pct, check_positive
from .probes import PromptWindow
from .protocol import PolicyError
from .scorers import CAOTE as CAOTEScore, Accumulated, PooledVote, PositionScore, caote_scores, max_pool_1d
from .selection import Selector


@dataclasses.dataclass(frozen=True)
class SelectKnobs:
    """The released selector's knobs (MaskAhead's), shared by every baseline."""

    topk_pct: float = 5.0
    topk_floor: int = 256
    dense_layers: int = 2

    @property
    def selector(self) -> Selector:
        return Selector("value", self.topk_pct, self.topk_floor, self.dense_layers)

    def check_selector(self) -> None:
        check_pct(topk_pct=self.topk_pct)
        check_positive(topk_floor=self.topk_floor)
        if self.dense_layers < 0:
            raise PolicyError(f"dense_layers must be >= 0, got {self.dense_layers}")


@dataclasses.dataclass(frozen=True)
class ScheduledEviction(SelectKnobs, ComposedPolicy):
    """Selector + an eviction every `interval_blocks` blocks to C(seen), keeping sinks + recent;
    a subclass names its scorer (and its probe, if any)."""

    capacity_pct: float = 10.0
    capacity_floor: int = 512
    sinks: int = 4
    recent: int = 64
    interval_blocks: int = 4
    capacity_entries: int = 0  # > 0: an absolute budget of KV entries per lane

    def scorer(self):
        raise NotImplementedError

    @property
    def eviction(self) -> Eviction:
        return Eviction(budget_of(self), self.scorer(),
                        ForcedKeeps(self.sinks, self.recent), interval_blocks=self.interval_blocks)

    def validate(self, cfg, gen) -> None:
        self.check_selector()
        check_positive(interval_blocks=self.interval_blocks)
        if self.sinks < 0 or self.recent < 0:
            raise PolicyError("sinks and recent must be >= 0")
        check_budget(self, self.recent + self.sinks)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScheduledEviction):
    """Keep the first `sinks` positions and the newest C - sinks entries."""

    name = "streaming"

    def scorer(self):
        return PositionScore()


@dataclasses.dataclass(frozen=True)
class BoundedPrefillStreamingLLM(StreamingLLM):
    """StreamingLLM that evicts during chunked prefill too, as StreamingLLM itself does (it never
    holds more than its sinks and window). `streaming` defers the prompt's compression to step 0
    of the first block, so a one-token answer committed at that step still reads the whole
    prompt; this one shows what keeping the recent window alone loses. No probe forward (the
    ranking is by position), nothing pinned."""

    name = "streaming-bounded"

    @property
    def eviction(self) -> Eviction:
        return dataclasses.replace(super().eviction, bounded_prefill=True)


@dataclasses.dataclass(frozen=True)
class H2O(ScheduledEviction):
    """Heavy hitters: rank by the step-0 mass accumulated since an entry entered the cache."""

    name = "h2o"
    decay: float = 1.0  # acc <- decay * acc + mass at every block's step 0 (1: plain sum)

    def scorer(self):
        return Accumulated(self.decay)

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if not 0.0 < self.decay <= 1.0:
            raise PolicyError(f"decay must be in (0, 1], got {self.decay}")


@dataclasses.dataclass(frozen=True)
class CAOTE(H2O):
    name = "caote"

    def scorer(self):
        return CAOTEScore(self.decay)


@dataclasses.dataclass(frozen=True)
class SnapKV(SelectKnobs, ComposedPolicy):
    """Prompt-only compression after prefill, voted by the last `window` prompt queries; the
    window and the first `sinks` positions are kept."""

    name = "snapkv"
    capacity_pct: float = 10.0
    capacity_floor: int = 512
    window: int = 32
    pool: int = 5
    sinks: int = 0
    capacity_entries: int = 0  # > 0: an absolute budget of KV entries per lane

    @property
    def eviction(self) -> Eviction:
        return Eviction(budget_of(self), PooledVote(self.pool),
                        ForcedKeeps(self.sinks, self.window), probe=PromptWindow(self.window))

    def validate(self, cfg, gen) -> None:
        self.check_selector()
        check_positive(window=self.window, pool=self.pool)
        if self.sinks < 0:
            raise PolicyError(f"sinks must be >= 0, got {self.sinks}")
        check_budget(self, self.window + self.sinks, "window + sinks")


@dataclasses.dataclass(frozen=True)
class HERALD(SelectKnobs, ComposedPolicy):
    """Selection statistics from the single centre mask query of the block; no eviction."""

    name = "herald"
    takes_budget: ClassVar[bool] = False

    @property
    def selector(self) -> Selector:
        return dataclasses.replace(super().selector, rows="centre")

    def validate(self, cfg, gen) -> None:
        self.check_selector()


__all__ = ["CAOTE", "H2O", "HERALD", "SnapKV", "StreamingLLM", "BoundedPrefillStreamingLLM",
           "caote_scores", "max_pool_1d"]
