"""MaskKV ("Mask Tokens as Prophet", arXiv 2510.09309) for the bidirectional families (LLaDA,
Dream), and the PyramidKV / AdaKV allocation baselines on the same mask-voting scores.
research/maskkv.md §2, §3, §4, §8.

One-shot compression of the prompt K/V at the first denoising step (the whole response is
[MASK]). The bidirectional engine calls the `on_prompt` hook, whose `vote()` returns `mass`
[L, B, Hkv, S] = per layer the attention of ALL response mask queries, averaged over the
queries and the GQA group, over the keys [prompt (S >= Pb) | response]: the engine runs the
mask queries against [prompt K/V | response K/V] as context, so this is the joint softmax of
Eq. 6 (A_ij), and

  Eq. 7   I_j    = sum_i A_ij over prompt keys j     (we use the mean: same ranking)
  Eq. 14  P_h    = S_m->p / (S_m->p + S_m->m) = sum_j I_j over the prompt (mean form)
  Eq. 16  keep the top-k_{l,h} prompt keys of I per (layer, batch, KV head)

If `mass` only covers the prompt (a prefix-only softmax) every P_h is 1 and the head split is
uniform; the ranking is unaffected up to per-query weights.

Budgets, all in KV pairs per head (k_p = B * num_layers, B = budget_per_head or
floor(budget_pct% * prompt length)):

  Eq. 9   k_base    = floor(beta * k_p / L)
  Eq. 10  k_imp     = k_p - L * k_base
  Eq. 11  k_group,B = floor(k_imp * I_B / (I_B + I_M))       (floor: our choice, k_group must be
  Eq. 12  k_group,M = k_imp - k_group,B                        an integer)
  Eq. 13  k_l       = k_base + floor(k_group,g / |S_g|)       S_bound = {0, L-1} (choice)
  Eq. 15  k_{l,h}   = floor(alpha * k_l + (1 - alpha) * N_h * k_l * P^_h),  P^ = P / sum_h P

Choices where maskkv.md says NOT FOUND or leaves it open:
  * exact_total (default True): the floor remainders of Eq. 13 (per group) and Eq. 15 (per
    layer) are handed out one by one, so layer budgets sum to k_p and each layer's head budgets
    to N_h * k_l; Eq. 13's remainder goes to the group's first layers, Eq. 15's to the heads with
    the largest fractional parts (ties: lower head index). exact_total=False: pure floors.
  * clipping: only head budgets are clipped, to [0, prompt length]; the clipped overflow is not
    redistributed. No minimum of 1.
  * GQA: scores and preferences are averaged over the query heads of a group, selection per KV
    head (AdaKV's GQA mode); N_h = number of KV heads.
  * no pooling of the scores (the paper's Eq. 6-7 are the whole scoring).
  * the first step's outputs use full attention; only the pruned K/V are kept afterwards; the
    prompt is never refreshed (the engine disables prompt_refresh for compressing policies).

Ragged per-head budgets live in a rectangular buffer: each lane keeps its top entries
left-aligned in position order and `valid` marks them; memory accounting counts only kept
entries (`held_bytes`).

PyramidKV (layer_alloc="pyramid", head_alloc="uniform"): linear decreasing layer budgets,
min = B / pyramid_beta, max = 2B - min, k_l = max - l (max - min) / (L - 1) (floored, remainder
as above). AdaKV (layer_alloc="uniform", head_alloc="adakv"): per layer N_h * k_l slots,
floor(adakv_floor * k_l) per head, the rest to the heads holding the global top mask-voting
scores of the layer (flattened over heads and tokens).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import memory
from ..cache import KVCache
from .budgets import (_xp, adakv_head_budgets, boundary_layers, head_budgets,  # noqa: F401 (public here too)
                      layer_budgets, pyramid_budgets)
from .eviction import floor_percent
from .protocol import BlockResult, Policy, PolicyError, StatsRequest, StepContext

LAYER_ALLOCS = ("boundary", "pyramid", "uniform")
HEAD_ALLOCS = ("preference", "adakv", "uniform")


# ----------------------------------------------------------------------------- voting
def window_mask(valid, plen, window):
    """[L, B, Hkv, N] the observation window: each lane's last min(window, ...) prompt slots, i.e.
    positions >= plen - window of a dense prompt lane (slot = position). window: int or [B]."""
    n = valid.shape[-1]
    w = jnp.asarray(window)
    w = w[None, :, None, None] if w.ndim else w
    slot = jnp.arange(n)[None, None, None, :]
    return valid & (slot >= jnp.asarray(plen)[None, :, None, None] - w)


def window_scores(mass, valid, forced, pool: int):
    """SnapKV's scores (AdaKV snapkv_utils.calcul_attn_sore): the window's mean attention over
    the prompt outside the window, max-pooled over `pool` neighbours (window and invalid slots
    take no part in the pooling). mass/valid/forced [L, B, Hkv, N] -> float32 [L, B, Hkv, N]."""
    from .scorers import max_pool_1d  # scorers imports nothing of this module

    a = jnp.where(valid & ~forced, mass.astype(jnp.float32), -jnp.inf)
    return jnp.where(valid & ~forced, max_pool_1d(a, pool), -jnp.inf)


# ----------------------------------------------------------------------------- the policy
VOTERS = ("mask", "window")


@dataclasses.dataclass(frozen=True)
class MaskKV(Policy):
    """MaskKV with the paper's defaults (beta 0.4, alpha 0.1, B = 256 KV pairs per head).

    voters: "mask" (MaskKV: the response's / first block's mask queries vote, no pooling) or
    "window" (the MaskKV paper's baselines: SnapKV's observation window, the prompt's last
    `window` tokens, scores max-pooled over `pool`, the window kept inside the budget).
    block_causal: also run on block-causal models (registered as maskkv-blockcausal): at step 0
    of the first block the block's mask queries vote over the stored prompt prefix once (one
    probe forward over [prompt | the block's own K/V], the step-0 attention), the prefix is cut
    to the same layer and head budgets, and decoding appends every block, never evicting again.
    """

    name = "maskkv"
    budget_per_head: Optional[int] = 256
    budget_pct: Optional[float] = None  # if set: B = floor(budget_pct% * prompt length), per row
    layer_importance: tuple = ()  # offline I^(l) (maskahead_jax.calibrate); () = uniform
    beta: float = 0.4
    alpha: float = 0.1
    layer_alloc: str = "boundary"  # boundary (MaskKV) | pyramid | uniform
    head_alloc: str = "preference"  # preference (MaskKV) | adakv | uniform
    pyramid_beta: float = 20.0
    adakv_floor: float = 0.2
    exact_total: bool = True
    voters: str = "mask"  # mask (MaskKV) | window (SnapKV's observation window)
    window: int = 32  # voters="window": observation window (AdaKV's window_size)
    pool: int = 7  # voters="window": max-pool kernel (AdaKV's kernel_size, pooling maxpool)
    block_causal: bool = False  # accept block-causal models (vote at the first block)
    # the paper's offline-budget mode: each layer's prompt K/V is voted and cut inside the first
    # full pass, right after that layer runs, so the peak holds one layer's whole prompt plus the
    # others' budgets; False: online (every layer's K/V first, then one vote forward, then the cut)
    layerwise: bool = True

    takes_budget = True

    def validate(self, cfg, gen) -> None:
        if cfg.attention != "bidirectional" and not self.block_causal:
            raise PolicyError(f"{self.name} compresses the prompt of bidirectional families "
                              f"(LLaDA, Dream); {cfg.family!r} is {cfg.attention} (maskkv-blockcausal, "
                              f"i.e. block_causal=True, votes with the first block's mask queries)")
        if self.storage.prefix:
            raise PolicyError(f"{self.name} keeps ragged per-head budgets (any number of entries per "
                              f"lane), which the packed cache cannot hold (whole key groups of 32 per "
                              f"lane): run it on the float cache (no bits)")
        self.check(cfg.num_layers)

    def check(self, num_layers: int) -> None:
        if self.budget_pct is not None:
            if not 0 < self.budget_pct <= 100:
                raise PolicyError(f"budget_pct must be in (0, 100], got {self.budget_pct}")
        elif self.budget_per_head is None or int(self.budget_per_head) != self.budget_per_head \
                or self.budget_per_head <= 0:
            raise PolicyError(f"budget_per_head must be a positive integer, got {self.budget_per_head}")
        if not 0.0 <= self.beta <= 1.0 or not 0.0 <= self.alpha <= 1.0:
            raise PolicyError(f"beta and alpha must be in [0, 1], got {self.beta}, {self.alpha}")
        if self.layer_alloc not in LAYER_ALLOCS:
            raise PolicyError(f"layer_alloc must be one of {LAYER_ALLOCS}, got {self.layer_alloc!r}")
        if self.head_alloc not in HEAD_ALLOCS:
            raise PolicyError(f"head_alloc must be one of {HEAD_ALLOCS}, got {self.head_alloc!r}")
        if self.voters not in VOTERS:
            raise PolicyError(f"voters must be one of {VOTERS}, got {self.voters!r}")
        if self.window <= 0 or self.pool <= 0 or self.pool % 2 == 0:
            raise PolicyError(f"window must be positive and pool a positive odd kernel, got "
                              f"window={self.window}, pool={self.pool}")
        if self.layer_importance:
            imp = np.asarray(self.layer_importance, np.float64)
            if imp.shape != (num_layers,) or not np.all(np.isfinite(imp)) or np.any(imp < 0):
                raise PolicyError(f"layer_importance must be {num_layers} finite values >= 0, "
                                  f"got {self.layer_importance}")
        if self.pyramid_beta <= 0 or not 0.0 <= self.adakv_floor <= 1.0:
            raise PolicyError("pyramid_beta must be > 0 and adakv_floor in [0, 1]")

    # ------------------------------------------------------------------ budgets
    def per_head_budget(self, plen):
        """B per row: budget_per_head, or floor(budget_pct% * prompt length) (at least 1)."""
        if self.budget_pct is None:
            return int(self.budget_per_head) if isinstance(plen, int) else \
                jnp.full(plen.shape, int(self.budget_per_head), jnp.int32)
        # guarded like every percentage budget (5% of 1000 is 50, not float32's 49.99999)
        if isinstance(plen, int):
            return max(1, floor_percent(self.budget_pct, plen))
        return jnp.maximum(floor_percent(self.budget_pct, plen), 1)

    def window_size(self, b_head):
        """Window entries per lane kept inside the budget B: min(window, B) (0 for mask voting)."""
        if self.voters != "window":
            return 0 * b_head
        return jnp.minimum(b_head, self.window) if isinstance(b_head, jax.Array) else min(b_head, self.window)

    def importance(self, num_layers: int):
        return self.layer_importance if self.layer_importance else (1.0,) * num_layers

    def layer_budgets(self, b_head, num_layers: int):
        """k_l [L] (or [L, B]) for per-head budgets b_head (int or [B])."""
        if self.layer_alloc == "boundary":
            return layer_budgets(b_head * num_layers, self.importance(num_layers), self.beta,
                                 exact_total=self.exact_total)
        if self.layer_alloc == "pyramid":
            return pyramid_budgets(b_head, num_layers, self.pyramid_beta, self.exact_total)
        xp = _xp(b_head)
        return xp.asarray(b_head)[None] * xp.ones((num_layers,) + np.shape(b_head), np.int32)

    def buffer_size(self, prompt_cap: int, num_layers: int, kv_heads: int) -> int:
        """Static slots per lane after compression: min(prompt buffer, largest head budget)."""
        b = self.per_head_budget(prompt_cap)
        kl = int(np.max(self.layer_budgets(b, num_layers)))
        if self.budget_pct is not None:  # rows' totals vary: k_l <= k_p for any row
            kl = max(kl, b * num_layers if self.layer_alloc == "boundary" else 2 * b)
        if self.head_alloc == "uniform":
            head = kl
        elif self.head_alloc == "adakv":
            head = kv_heads * kl
        else:
            head = math.ceil(self.alpha * kl + (1 - self.alpha) * kv_heads * kl) + 1
        return max(1, min(prompt_cap, head + self.window_size(b)))

    def _layer_kl(self, b_head, num_layers: int, layer):
        """k_l [L, B]: every layer's budget, or [1, B] the budget of `layer` = (index, L) (a
        traced index inside the full pass: the budgets are known before any layer runs)."""
        if layer is None:
            return self.layer_budgets(b_head, num_layers)
        l, total = layer
        return jnp.asarray(self.layer_budgets(b_head, total))[l][None]

    def budgets(self, mass, valid, plen, preference=None, layer=None):
        """Head budgets [L, B, Hkv] for the prompt slots `valid` [L, B, Hkv, N] and the vote
        `mass` [L, B, Hkv, S>=N] (mask voting: joint softmax over [prompt | response]; the scores
        AdaKV's allocation ranks). preference [L, B, Hkv]: the heads' prompt preference P_h
        (Eq. 14); default: the mass on the valid prompt slots."""
        L, _, hkv, n = valid.shape
        scores = jnp.where(valid, mass[..., :n].astype(jnp.float32), 0.0)
        kl = self._layer_kl(self.per_head_budget(plen), L, layer)  # [L, B]
        if self.head_alloc == "preference":
            pref = scores.sum(-1) if preference is None else preference
            k = head_budgets(kl, pref, self.alpha, exact_total=self.exact_total)
        elif self.head_alloc == "adakv":
            k = adakv_head_budgets(kl, scores, valid, self.adakv_floor)
        else:
            k = jnp.broadcast_to(kl[..., None], kl.shape + (hkv,))
        return jnp.clip(k, 0, plen[None, :, None]).astype(jnp.int32)

    def budget_note(self, prompt_lens) -> Optional[str]:
        n = min(prompt_lens) if prompt_lens else 0
        if self.budget_pct is None and n and self.budget_per_head >= n:
            return (f"{self.name}: budget_per_head={self.budget_per_head} holds the whole {n}-token "
                    f"prompt: nothing is compressed (give a percentage, budget_pct, for short prompts)")
        return None

    def held_bytes(self, cache) -> jax.Array:
        """Only kept entries count: ragged lanes are stored flattened (variable length)."""
        return memory.row_bytes(cache.valid, cache.bytes_per_token, False, kept_only=True)

    # ------------------------------------------------------------------ compression
    def compress(self, cache: KVCache, mass, plen, capacity: int, preference=None, layer=None) -> KVCache:
        """Cut the prompt lanes (dense, slot = position, plen [B] entries) to their budgets, from
        the vote `mass` [L, B, Hkv, >=N]: mask voting keeps the top-k_{l,h} by mass; window
        voting keeps the window plus the top-k_{l,h} of the rest by pooled mass, the budgets
        allocated over B - window. Returns the kept entries compacted into `capacity` slots."""
        n = cache.capacity
        mass = mass[..., :n].astype(jnp.float32)
        if self.voters == "mask":
            counts = self.budgets(mass, cache.valid, plen, preference, layer)
            return cache.keep_top(jnp.where(cache.valid, mass, -jnp.inf), jnp.minimum(counts, capacity), capacity)
        b = self.per_head_budget(plen)
        w = self.window_size(b)  # [B]
        forced = window_mask(cache.valid, plen, w)
        scores = window_scores(mass, cache.valid, forced, self.pool)
        # the prefix outside the window gets B - w per head on average (AdaKV: base_capacity - window)
        n_rest = jnp.maximum(plen - w, 0)
        n_layers = cache.valid.shape[0] if layer is None else layer[1]
        if self.layer_alloc == "pyramid":
            kl = pyramid_budgets(jnp.maximum(b - w, 0), n_layers, self.pyramid_beta,
                                 self.exact_total, max_len=n_rest)
            kl = kl if layer is None else jnp.asarray(kl)[layer[0]][None]
        else:
            kl = self._layer_kl(jnp.maximum(b - w, 0), n_layers, layer)  # [L, B]
        valid_rest = cache.valid & ~forced
        finite = jnp.where(valid_rest, scores, 0.0)
        if self.head_alloc == "preference":
            k = head_budgets(kl, jnp.where(valid_rest, mass, 0.0).sum(-1) if preference is None else preference,
                             self.alpha, exact_total=self.exact_total)
        elif self.head_alloc == "adakv":
            k = adakv_head_budgets(kl, finite, valid_rest, self.adakv_floor)
        else:
            k = jnp.broadcast_to(kl[..., None], kl.shape + (cache.valid.shape[2],))
        counts = jnp.clip(k, 0, n_rest[None, :, None]) + forced.sum(-1)
        return cache.keep_top(jnp.where(forced, jnp.inf, scores), jnp.minimum(counts, capacity).astype(jnp.int32),
                              capacity)

    def compress_prompt(self, cache: KVCache, mass, plen) -> KVCache:
        L, _, hkv, n = cache.valid.shape
        return self.compress(cache, mass, plen, self.buffer_size(n, L, hkv))

    # ------------------------------------------------------------------ hooks
    @property
    def prompt_layerwise(self) -> bool:
        return self.layerwise

    @property
    def prompt_voters(self) -> Optional[int]:
        """Who votes inside the full pass: None, the response's mask queries; w, the prompt's
        last w tokens (SnapKV's window)."""
        return None if self.voters == "mask" else self.window

    def compress_layer(self, layer, cache: KVCache, mass, plen, num_layers: int) -> KVCache:
        """One layer's prompt (cache with L = 1) cut to its budgets from its vote mass [1, B, Hkv,
        >= N]: the same cut `compress_prompt` makes of that layer, buffer sized for all layers."""
        _, _, hkv, n = cache.valid.shape
        return self.compress(cache, mass, plen, self.buffer_size(n, num_layers, hkv), layer=(layer, num_layers))

    def on_prompt(self, cache: KVCache, vote, plen) -> KVCache:
        """Bidirectional families: one vote at the first step, the prompt cut once."""
        return self.compress_prompt(cache, vote() if self.voters == "mask" else vote(self.window), plen)

    def stats_request(self, masked, active) -> Optional[StatsRequest]:
        """Block-causal families, mask voting: step 0 hands over the block's own K/V (block_vote)."""
        return StatsRequest(masked & active[:, None], mass=False, block_kv=True) if self.voters == "mask" else None

    def on_block(self, cache, ctx: StepContext) -> BlockResult:
        """Block-causal families: at step 0 of the first block, vote over the stored prompt
        prefix (cache.length = n_pre entries per row) and cut it once; later blocks only append."""
        if not ctx.first:
            return BlockResult(cache.resize(ctx.capacity), None, jnp.bool_(False), jnp.int32(0))
        n_pre = cache.length
        if self.voters == "window":
            from .probes import PromptWindow

            mass, pref = PromptWindow(self.window).mass(cache, ctx), None
        else:
            mass, pref = self.block_vote(cache, ctx)
        out = self.compress(cache, mass, n_pre, ctx.capacity, pref)
        return BlockResult(out, None, jnp.bool_(True), jnp.int32(1))

    def block_vote(self, cache, ctx: StepContext):
        """Mask voting on a block-causal model (Eq. 6 with the first block's mask queries): one
        probe forward of the step-0 block over [stored prompt | the block's own step-0 K/V]
        (ctx.block_kv), its own block masked out, so every query attends exactly as at step 0,
        with one softmax over prompt and block keys. Returns (mass over the cache slots
        [L, B, Hkv, N], prompt preference P_h [L, B, Hkv]: the mass on the stored prompt plus on
        the prompt tail that opens the block, Eq. 14)."""
        if ctx.block_kv is None:
            raise PolicyError(f"{self.name}: the engine gave no block K/V (StepContext.block_kv)")
        k, v = ctx.block_kv
        b, bs = ctx.tokens.shape
        pos = ctx.start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        n = cache.capacity
        aug = cache.resize(n + bs).append(k, v, pos, jnp.full((b,), bs, jnp.int32))
        rows = (ctx.tokens == ctx.mask_id) & ctx.active[:, None]
        m = ctx.forward(aug, ctx.tokens, pos, jnp.zeros((b, bs, bs), bool), rows)  # [L, B, Hkv, n + bs]
        prompt = jnp.where(aug.valid & (aug.pos < ctx.plen[None, :, None, None]), m, 0.0)
        return m[..., :n] * cache.valid, prompt.sum(-1)

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        # the protocol's plan knows no head count, so the decode buffer stays total_cap (the
        # memory stats count kept entries only, as for the bidirectional families)
        return total_cap, total_cap


@dataclasses.dataclass(frozen=True)
class PyramidKV(MaskKV):
    """PyramidKV as the MaskKV paper's baseline: SnapKV's window votes, pyramid layer budgets."""

    name = "pyramidkv"
    layer_alloc: str = "pyramid"
    head_alloc: str = "uniform"
    voters: str = "window"


@dataclasses.dataclass(frozen=True)
class AdaKV(MaskKV):
    """AdaKV as the MaskKV paper's baseline: SnapKV's window votes, adaptive head budgets."""

    name = "adakv"
    layer_alloc: str = "uniform"
    head_alloc: str = "adakv"
    voters: str = "window"


__all__ = ["MaskKV", "PyramidKV", "AdaKV", "layer_budgets", "head_budgets", "pyramid_budgets",
           "adakv_head_budgets", "boundary_layers", "window_mask", "window_scores"]
