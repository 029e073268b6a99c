"""MaskAhead: the mask queries choose what a block reads (selection) and what the cache keeps
(eviction, with a lookahead probe of upcoming mask blocks). research/maskahead.md §2-§3, §5.

Selection (every block, step 0): per (layer >= dense_layers, batch, KV head) rank live entries
by s_i = a_i * ||v_i - c|| (a = prefix-only softmax mass pooled over the block's masked queries
and the GQA group, c = sum a_i v_i), keep the top k = min(live, max(topk_floor,
ceil(topk_pct% * live))), gather them once and reuse them for all later steps and the commit.

Eviction (deferred to step 0 of the block after every `interval_blocks` blocks, and after the
prompt): capacity C = max(floor(capacity_pct% * seen), capacity_floor); a probe forward of the
step-0 block plus lookahead_blocks - 1 mask blocks adds its mass to the step-0 mass (A); keep the
`recent` newest entries, positions < `sinks`, and the top C - recent by A_i * ||v_i - c'||;
survivors are compacted (position order) into a smaller static buffer.

Question probe (ours, off by default; results §2d): with question_tokens = N > 0 the first
eviction after the prompt probes the prompt's last N tokens at their real positions plus
lookahead_blocks - 1 mask blocks after the prompt, in place of the step-0 block and its
lookahead (the step-0 mass is still added); pin_question keeps that span. Bounded prefill
(below) always probes this way, after every prefill chunk.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .. import cache as kvc
from ..cache import KVCache
from ..kernels.reference import value_score
from ..model import Context
from .base import Dense, ceil_pct


class PolicyError(ValueError):
    """An invalid policy setting (budgets, windows, unknown name)."""


@dataclasses.dataclass(frozen=True)
class MaskAhead(Dense):
    """MaskAhead with the released code's defaults (research/maskahead.md §6 "Budgets")."""

    name = "maskahead"
    capacity_pct: float = 10.0
    capacity_floor: int = 512
    topk_pct: float = 5.0
    topk_floor: int = 256
    dense_layers: int = 2
    sinks: int = 4
    recent: int = 64
    interval_blocks: int = 4
    lookahead_blocks: int = 4
    select_ranking: str = "value"  # value: a*||v-c|| | mass: a (MAGE-like) | none: read everything
    evict_ranking: str = "value"  # value | mass | none (no eviction)
    question_tokens: int = 0  # > 0: the first eviction probes the question's last N tokens
    pin_question: bool = False  # with question_tokens: that span always survives

    needs_stats = True
    with_state = True

    # ------------------------------------------------------------------ static properties
    @property
    def evicts(self) -> bool:
        return self.evict_ranking != "none"

    @property
    def needs_probe(self) -> bool:
        return self.evicts and self.lookahead_blocks > 1

    def validate(self, cfg, gen) -> None:
        if self.select_ranking not in ("value", "mass", "none"):
            raise PolicyError(f"select_ranking must be value|mass|none, got {self.select_ranking!r}")
        if self.evict_ranking not in ("value", "mass", "none"):
            raise PolicyError(f"evict_ranking must be value|mass|none, got {self.evict_ranking!r}")
        for f in ("capacity_pct", "topk_pct"):
            v = getattr(self, f)
            if not 0 < v <= 100:
                raise PolicyError(f"{f} must be in (0, 100], got {v}")
        for f in ("capacity_floor", "topk_floor", "interval_blocks", "lookahead_blocks"):
            if getattr(self, f) <= 0:
                raise PolicyError(f"{f} must be positive, got {getattr(self, f)}")
        if self.sinks < 0 or self.recent < 0 or self.dense_layers < 0:
            raise PolicyError("sinks, recent and dense_layers must be >= 0")
        if self.question_tokens < 0:
            raise PolicyError(f"question_tokens must be >= 0, got {self.question_tokens}")
        if not self.bounded_prefill:
            if self.question_tokens and not (self.needs_probe and self.probe_kind == "lookahead"):
                raise PolicyError(
                    f"question_tokens={self.question_tokens} needs MaskAhead's lookahead probe "
                    f"(evict_ranking != 'none', lookahead_blocks > 1); {self.name} has none")
            if self.pin_question and not self.question_tokens:
                raise PolicyError("pin_question needs question_tokens > 0 (the span to pin)")
        if self.evicts and self.capacity_floor < self.recent + self.sinks:
            raise PolicyError(
                f"capacity_floor={self.capacity_floor} is below recent + sinks = "
                f"{self.recent + self.sinks}: the forced keeps would not fit")

    # ------------------------------------------------------------------ budgets
    def capacity(self, seen):
        """C(seen) = max(floor(capacity_pct% * seen), capacity_floor)."""
        if isinstance(seen, int):
            return max(int(self.capacity_pct * seen // 100), self.capacity_floor)
        c = jnp.floor(self.capacity_pct * seen.astype(jnp.float32) / 100.0).astype(jnp.int32)
        return jnp.maximum(c, self.capacity_floor)

    def topk(self, live):
        """k(live) = min(live, max(topk_floor, ceil(topk_pct% * live)))."""
        if isinstance(live, int):
            return min(live, max(self.topk_floor, ceil_pct(self.topk_pct, live)))
        return jnp.minimum(live, jnp.maximum(self.topk_floor, ceil_pct(self.topk_pct, live)))

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        if not self.evicts:
            return total_cap, total_cap
        decode = self.capacity(total_cap) + (self.interval_blocks + 1) * block_size
        return prompt_cap, min(total_cap, decode)

    # ------------------------------------------------------------------ hooks
    def pending_after_prefill(self, cache: KVCache) -> jax.Array:
        if not self.evicts:
            return jnp.zeros(cache.length.shape, bool)
        return cache.length > self.capacity(cache.seen)

    def schedule(self, blocks_done, cache: KVCache) -> jax.Array:
        if not self.evicts:
            return jnp.zeros(cache.length.shape, bool)
        due = (blocks_done % self.interval_blocks) == 0
        return due & (cache.length > self.capacity(cache.seen))

    def selection_scores(self, mass, score):
        return score if self.select_ranking == "value" else mass

    def select(self, cache: KVCache, num_layers: int, mass, score):
        nd = min(self.dense_layers, num_layers)
        if self.select_ranking == "none" or nd >= num_layers:
            return None
        n = cache.capacity
        kmax = self.topk(n)
        if kmax >= n:  # the budget covers the whole buffer: nothing to gain from gathering
            return None
        sub = cache.layers(nd, num_layers)
        ranks = self.selection_scores(mass, score)[nd:]
        k = self.topk(sub.length)
        sel = kvc.keep_top(sub, ranks, k, kmax)
        return nd, Context(sel.k, sel.v, sel.valid)

    def eviction_scores(self, cache: KVCache, mass0, probe_mass):
        a = mass0 if probe_mass is None else mass0 + probe_mass
        if self.evict_ranking == "mass":
            return a
        return value_score(a, cache.v)

    def forced(self, cache: KVCache) -> jax.Array:
        """[L, B, Hkv, N] entries that always survive: the newest `recent` and the sinks."""
        slot = jnp.arange(cache.capacity)[None, None, None, :]
        recent = slot >= (cache.length[None, :, None, None] - self.recent)
        return cache.valid & (recent | ((cache.pos >= 0) & (cache.pos < self.sinks)))

    def evict(self, cache: KVCache, mass0, probe_mass, keep, capacity: int, pinned=None) -> KVCache:
        """Keep `keep` [B] entries per lane (forced ones first), compacted into `capacity` slots."""
        scores = self.eviction_scores(cache, mass0, probe_mass)
        forced = self.forced(cache) if pinned is None else self.forced(cache) | (pinned & cache.valid)
        scores = jnp.where(forced, jnp.inf, scores)
        return kvc.keep_top(cache, scores, keep, capacity)


@dataclasses.dataclass(frozen=True)
class BoundedPrefillMaskAhead(MaskAhead):
    """MaskAhead that also evicts during chunked prefill (the released `ours_prefill_qprobe`):
    after each stored chunk, a probe of the question (the prompt's last `question_tokens` tokens
    at their real positions) plus lookahead_blocks - 1 mask blocks scores the cache, and rows
    over C(seen) are compacted; the question span can be pinned. Peak KV memory stays near the
    capacity plus one prefill chunk instead of the whole prompt."""

    name = "maskahead-bounded"
    question_tokens: int = 64
    pin_question: bool = True
    bounded_prefill = True

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        _, decode = super().plan(prompt_cap, total_cap, block_size, chunk)
        # prefill buffer: C(prompt) + one chunk is all that is ever live while prefilling
        pre = self.capacity(prompt_cap) + chunk
        return min(prompt_cap, pre), decode

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if self.question_tokens <= 0:
            raise PolicyError(f"question_tokens must be positive, got {self.question_tokens}")
