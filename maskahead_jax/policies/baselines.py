"""Eviction / selection baselines of the released MaskAhead code (research/maskahead.md §6
"Baselines"): every one shares MaskAhead's value-aware selector (step-0 a_i * ||v_i - c||, top-k
per (layer, batch, KV head)), its capacity C = max(floor(capacity_pct% * seen), capacity_floor),
its schedule (every `interval_blocks` blocks, deferred to step 0 of the next block) and its
compaction; only the keep ranking differs.

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
             eviction
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..cache import KVCache
from . import register
from .maskahead import BoundedPrefillMaskAhead, MaskAhead, PolicyError


@dataclasses.dataclass(frozen=True)
class StreamingLLM(MaskAhead):
    """Keep the first `sinks` positions and the newest C - sinks entries."""

    name = "streaming"
    needs_probe = False

    def eviction_scores(self, cache: KVCache, mass0, probe_mass):
        # newest first; sinks / the recent window are forced by MaskAhead.forced
        return cache.pos.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class BoundedPrefillStreamingLLM(BoundedPrefillMaskAhead, StreamingLLM):
    """StreamingLLM that evicts during chunked prefill too, as StreamingLLM itself does (it never
    holds more than its sinks and window). `streaming` defers the prompt's compression to step 0
    of the first block, as the released MaskAhead code does for every baseline, so a one-token
    answer committed at that step still reads the whole prompt; this one shows what keeping the
    recent window alone loses. No probe forward (the ranking is by position), nothing pinned."""

    name = "streaming-bounded"
    pin_question: bool = False


@dataclasses.dataclass(frozen=True)
class H2O(MaskAhead):
    """Heavy hitters: rank by the step-0 mass accumulated since an entry entered the cache."""

    name = "h2o"
    decay: float = 1.0  # acc <- decay * acc + mass at every block's step 0 (1: plain sum)
    needs_probe = False

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if not 0.0 < self.decay <= 1.0:
            raise PolicyError(f"decay must be in (0, 1], got {self.decay}")

    def observe(self, cache: KVCache, mass) -> KVCache:
        if mass is None:
            return cache
        acc = self.decay * cache.acc + jnp.where(cache.valid, mass.astype(jnp.float32), 0.0)
        return cache._replace(acc=acc)

    def eviction_scores(self, cache: KVCache, mass0, probe_mass):
        return cache.acc


def caote_scores(acc: jax.Array, v: jax.Array, valid: jax.Array, eps: float = 1e-6) -> jax.Array:
    """CAOTE eviction error h_i / (1 - h_i) * ||v_i - o||, h = acc normalised over the lane's valid
    entries, o = sum_i h_i v_i.  acc/valid [..., S], v [..., S, D]."""
    h = jnp.where(valid, acc.astype(jnp.float32), 0.0)
    h = h / jnp.maximum(h.sum(-1, keepdims=True), 1e-30)
    vf = v.astype(jnp.float32)
    o = jnp.einsum("...s,...sd->...d", h, vf)
    dist = jnp.linalg.norm(vf - o[..., None, :], axis=-1)
    return h / jnp.maximum(1.0 - h, eps) * dist


@dataclasses.dataclass(frozen=True)
class CAOTE(H2O):
    name = "caote"

    def eviction_scores(self, cache: KVCache, mass0, probe_mass):
        return caote_scores(cache.acc, cache.v, cache.valid)


def max_pool_1d(x: jax.Array, kernel: int) -> jax.Array:
    """Max over a centred window of `kernel` neighbours along the last axis (stride 1, 'same')."""
    if kernel <= 1:
        return x
    lo = (kernel - 1) // 2
    hi = kernel - 1 - lo
    cfg = [(0, 0)] * (x.ndim - 1) + [(lo, hi)]
    xp = jnp.pad(x, cfg, constant_values=-jnp.inf)
    n = x.shape[-1]
    return jnp.max(jnp.stack([xp[..., i:i + n] for i in range(kernel)], axis=0), axis=0)


@dataclasses.dataclass(frozen=True)
class SnapKV(MaskAhead):
    """Prompt-only compression after prefill, voted by the last `window` prompt queries."""

    name = "snapkv"
    window: int = 32
    pool: int = 5
    sinks: int = 0
    recent: int = 0  # the observation window plays the role of the recent window
    probe_kind = "prompt_window"
    needs_probe = True

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if self.window <= 0 or self.pool <= 0:
            raise PolicyError(f"window and pool must be positive, got {self.window}, {self.pool}")
        forced = max(self.window, self.recent) + self.sinks
        if self.capacity_floor < forced:
            raise PolicyError(
                f"capacity_floor={self.capacity_floor} is below max(window, recent) + sinks = "
                f"{forced}: the forced keeps would not fit")

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        # the prompt is compressed once; every generated block is then kept
        return prompt_cap, total_cap

    def schedule(self, blocks_done, cache: KVCache) -> jax.Array:
        return jnp.zeros(cache.length.shape, bool)

    def eviction_scores(self, cache: KVCache, mass0, probe_mass):
        a = mass0 if probe_mass is None else probe_mass  # the window queries' vote only
        a = jnp.where(cache.valid, a.astype(jnp.float32), -jnp.inf)
        return max_pool_1d(a, self.pool)

    def forced(self, cache: KVCache) -> jax.Array:
        slot = jnp.arange(cache.capacity)[None, None, None, :]
        win = slot >= (cache.length[None, :, None, None] - max(self.window, self.recent))
        return cache.valid & (win | ((cache.pos >= 0) & (cache.pos < self.sinks)))


@dataclasses.dataclass(frozen=True)
class HERALD(MaskAhead):
    """Selection statistics from the single centre mask query of the block; no eviction."""

    name = "herald"
    evict_ranking: str = "none"

    def stat_rows(self, masked, active):
        """[B, T]: only the middle one of each row's masked positions (the lower median)."""
        rank = jnp.cumsum(masked.astype(jnp.int32), axis=-1) - 1
        n = masked.sum(-1, keepdims=True)
        return masked & (rank == (n - 1) // 2) & active[:, None]


register("streaming", lambda **kw: StreamingLLM(**kw))
register("streaming-bounded", lambda **kw: BoundedPrefillStreamingLLM(**kw))
register("h2o", lambda **kw: H2O(**kw))
register("caote", lambda **kw: CAOTE(**kw))
register("snapkv", lambda **kw: SnapKV(**kw))
register("herald", lambda **kw: HERALD(**kw))

__all__ = ["StreamingLLM", "H2O", "CAOTE", "SnapKV", "HERALD", "caote_scores", "max_pool_1d"]
