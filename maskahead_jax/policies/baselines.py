"""Eviction / selection baselines of the released MaskAhead code (research/maskahead.md §6
"Baselines"). Every evicting one composes MaskAhead's value-aware selector (step-0
a_i * ||v_i - c||, top-k per (layer, batch, KV head)) with an eviction part of its own; they
share the budget C = max(floor(capacity_pct% * seen), capacity_floor) and the compaction, and
evict when the released session does (runtime/session.py `end_prefill_chunk`, `end_block`; the
EndOfBlock schedule of policies/schedules.py): the prompt is compressed at its final prefill
chunk, to C(tokens seen before that chunk), before the chunk is admitted (the chunk survives
whole), and every `interval_blocks` blocks right after the commit forward's append. Only
MaskAhead (and DapQ, a lookahead variant) defer to the next block's step 0. The rankings:

  streaming  StreamingLLM: sinks + the most recent entries (score = position)
  streaming-bounded  StreamingLLM as it streams: the same ranking also applied after every
             prefill chunk, so the middle of the prompt is gone before the question is read
  h2o        H2O: per-entry accumulated attention, kept in cache.acc: every block's step 0 adds
             (its mask queries) x (their pooled mass), every prefill chunk after the first
             (its tokens) x (their pooled mass over the cache before it)
  caote      H2O + CAOTE: h_i/(1-h_i) * ||v_i - o||, h = accumulated mass normalised per lane,
             o = sum h_i v_i
  ea         Expected Attention (policies/expected_attention.py)
  snapkv     SnapKV, prompt-only: at the final prefill chunk, after it is admitted, the last
             `window` (32) prompt queries vote over the whole prompt, scores max-pooled over
             `pool` (5) neighbouring positions; the window and 4 sinks are kept; no later
             evictions. On bidirectional families (`on_prompt`): the same vote at the
             first step, from the full pass's window queries, the prompt cut once
  herald     HERALD-like: the selection ranks by the mass of the single masked query closest to
             the block centre (mass only, as released configs/herald.yaml); no eviction (so no
             budget)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .composed import ComposedPolicy
from .eviction import Eviction, ForcedKeeps, budget_of, check_budget
from .maskahead import check_pct, check_positive
from .probes import PromptWindow
from .protocol import PolicyError
from .schedules import BoundedPrefill, EndOfBlock
from .scorers import CAOTE as CAOTEScore, Accumulated, Pooled, PositionScore, ProbeMass, caote_scores, max_pool_1d
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
    """Selector + an eviction to C(seen) at the end of every `interval_blocks`-th block (and at
    the prompt's final prefill chunk), keeping sinks + recent; a subclass names its scorer."""

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
        return Eviction(budget_of(self), self.scorer(), ForcedKeeps(self.sinks, self.recent),
                        EndOfBlock(self.interval_blocks))

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
    """StreamingLLM that evicts after every prefill chunk too, as StreamingLLM itself does (it
    never holds more than its sinks and window). `streaming` compresses the prompt once, at its
    final chunk (as released), so it holds the whole prompt but that chunk until then; this one
    bounds the prefill peak too. No probe forward (the ranking is by position), nothing pinned."""

    name = "streaming-bounded"

    @property
    def eviction(self) -> Eviction:
        return dataclasses.replace(super().eviction, prefill=BoundedPrefill())


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
    """Prompt-only compression at the final prefill chunk, voted by the last `window` prompt
    queries over the whole prompt; the window and the first `sinks` positions are kept. Released,
    a prompt whose block-aligned part fits in one prefill chunk is never compressed (its only
    chunk goes through the model's own prefill, which scores nothing); ours compresses every
    prompt at its final chunk."""

    name = "snapkv"
    capacity_pct: float = 10.0
    capacity_floor: int = 512
    window: int = 32
    pool: int = 5
    sinks: int = 4  # released configs/snapkv.yaml sink_tokens: 4
    capacity_entries: int = 0  # > 0: an absolute budget of KV entries per lane

    @property
    def eviction(self) -> Eviction:
        return Eviction(budget_of(self), Pooled(ProbeMass(), self.pool), ForcedKeeps(self.sinks, self.window),
                        EndOfBlock(probe=PromptWindow(self.window), admit_final_first=True))

    def on_prompt(self, cache, vote, plen):
        """Bidirectional families (LLaDA, Dream; the MaskKV paper's SnapKV baseline): at the
        first step the prompt's last `window` queries vote over the prompt (vote(window): their
        attention in the full pass, one softmax over [prompt | response]), scores max-pooled
        over `pool` neighbours outside the window; each lane keeps the window, the first `sinks`
        positions and the top rest, C(prompt length) entries in all (capacity_pct / floor, or
        capacity_entries). No later eviction: the engine never refreshes a compressed prompt."""
        from .maskkv import window_mask, window_scores

        budget = budget_of(self)
        n = cache.capacity
        mass = vote(self.window)[..., :n]
        forced = window_mask(cache.valid, plen, self.window) | (cache.valid & (cache.pos < self.sinks))
        scores = jnp.where(forced, jnp.inf, window_scores(mass, cache.valid, forced, self.pool))
        cap = min(n, budget.capacity(n))  # C is monotone in the prompt length: every row fits
        return cache.keep_top(scores, jnp.minimum(cache.length, budget.capacity(plen)), cap)

    def validate(self, cfg, gen) -> None:
        self.check_selector()
        check_positive(window=self.window, pool=self.pool)
        if self.pool % 2 == 0:
            raise PolicyError(f"pool must be odd (a centred max-pool, as released), got {self.pool}")
        if self.sinks < 0:
            raise PolicyError(f"sinks must be >= 0, got {self.sinks}")
        check_budget(self, self.window + self.sinks, "window + sinks")


@dataclasses.dataclass(frozen=True)
class HERALD(SelectKnobs, ComposedPolicy):
    """Selection by the mass of the single masked query closest to the block centre; no
    eviction (released configs/herald.yaml: selector mode middle, value_aware off)."""

    name = "herald"
    takes_budget: ClassVar[bool] = False

    @property
    def selector(self) -> Selector:
        return dataclasses.replace(super().selector, ranking="mass", rows="centre")

    def validate(self, cfg, gen) -> None:
        self.check_selector()


__all__ = ["CAOTE", "H2O", "HERALD", "SnapKV", "StreamingLLM", "BoundedPrefillStreamingLLM",
           "caote_scores", "max_pool_1d"]
