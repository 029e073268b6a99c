"""The policy protocol: the hooks the engine calls, the read-only context it hands them, and
the one `PolicyError`.

A policy is a frozen, hashable dataclass (a static jit argument). The engine
(maskahead_jax/engine) knows none of its fields; it calls these hooks and nothing else:

  check_run(cfg, gen)                    refuse settings that cannot run (PolicyError): the
                                         policy's own `validate`, then its storage part's checks
  for_run(cfg, gen) -> Policy            this policy with its automatic knobs decided for the run
                                         (the core runs the returned one; default: its storage's)
  plan(prompt_cap, total_cap, block, chunk) -> (prefill capacity, decode capacity), static
  empty_cache(L, B, Hkv, N, D, dtype, group_size=1)  the cache this policy stores into (its
                                         `storage` part's: policies/storage.py, Float or Packed)
  stats_request(masked, active)          what step 0's forward reports (model.StatsRequest: the
                                         rows pooled, mass and score, pooled how, pre-RoPE query
                                         moments, the block's own K/V), or None: none
  prefill_stats_request(valid)           the same for each prefill chunk's forward over the cache
                                         before the chunk (ctx.mass, ctx.queries), or None
  acts_at_step0                          (property) on_block does more than keep the whole cache:
                                         step 0 is a forward of its own (False: Dense, whose step 0
                                         is the denoising loop's first iteration)
  on_prefill_chunk(cache, ctx)           after each stored prefill chunk (ctx.appended entries)
  due_after_prefill(cache)               [B] a compression is due at the first block's step 0
  on_block(cache, ctx) -> BlockResult    at step 0 of every block: update state, choose what the
                                         block reads, evict when `ctx.due`, with probes it builds
                                         itself through `ctx.forward`; ctx carries what its
                                         `stats_request` asked for
  after_commit(cache, ctx) -> (cache, evicted)  after the commit forward's append (baselines
                                         that evict at the end of a block)
  due_after_block(blocks_done, cache)    [B] a compression is due at the next block's step 0
  on_prompt(cache, vote, plen)           bidirectional families: compress the prompt once
                                         (MaskKV, SnapKV, PyramidKV, AdaKV), or None to keep it;
                                         vote() = the response's mask queries' mass, vote(w) =
                                         the prompt's last w queries' (SnapKV's window)
  held_bytes(cache)                      [B] bytes this policy holds (memory stats)
  budget_note(prompt_lens)               a warning when a floor, not the requested budget,
                                         sets what is kept for these prompts (or None)
  first_block_special                    (property) on_block reads ctx.first: the engine traces
                                         the first block apart (default True; Dense: False)
  draft_pass(max_new_tokens)             None, or (n, policy): generate first runs `policy` for n
                                         new tokens, and this run's hooks read them as ctx.draft
                                         (a drafted answer for probes; block-causal models);
                                         max_new_tokens: the run's answer limit (None: unknown)

`Policy` below implements every hook as the exact full cache does (nothing selected, nothing
evicted), so a policy overrides only what it changes. Most policies are compositions of a
selection part and an eviction part (policies/composed.py); a new one can also be a few lines
that override `on_block` (docs/extending.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp

from .. import memory
from ..cache import Cache, KVCache
from ..model.stats import StatsRequest
from .errors import PolicyError
from .storage import Float, Storage




# (cache, tokens [B, T], positions [B, T], mask [B, T, T] bool, stats: StatsRequest or rows [B, T]
#   bool) -> mass [L, B, Hkv, N]: a forward over the whole (dense) cache that writes nothing and
#   returns each cache entry's softmax mass pooled over the request's rows and the GQA group, by
#   its `pool` (rows alone: by the mean) (the probes' primitive)
Forward = Callable[..., jax.Array]


class StepContext(NamedTuple):
    """What the engine tells a hook (read-only). Fields a call has nothing for are None."""

    forward: Forward
    prompt: jax.Array  # [B, P] padded prompt tokens
    plen: jax.Array  # [B] prompt lengths
    n_pre: jax.Array  # [B] block-aligned prompt prefix stored by prefill
    block_size: int
    mask_id: int
    capacity: int  # static slots the returned cache must have
    active: jax.Array  # [B] rows still generating
    due: Optional[jax.Array] = None  # [B] a compression is due (on_block)
    first: bool = False  # static: the first block after the prompt
    tokens: Optional[jax.Array] = None  # [B, bs] the block at step 0
    start: Optional[jax.Array] = None  # [B] the block's first position
    mass: Optional[jax.Array] = None  # [L, B, Hkv, N] step-0 prefix mass (the request's rows pooled)
    score: Optional[jax.Array] = None  # [L, B, Hkv, N] step-0 value score a_i * ||v_i - c||
    rows: Optional[jax.Array] = None  # [B, T] the queries pooled into `mass` (and `queries`)
    queries: Optional[tuple] = None  # (m1 [L,B,Hkv,G,D], m2 [L,B,Hkv,G,D,D]) pre-RoPE query moments
    rope: Optional[tuple] = None  # (cos, sin) [B, 2, rope_dim] at the forward's last two positions
    appended: Optional[jax.Array] = None  # [B] entries the chunk / commit just appended
    blocks_done: Optional[jax.Array] = None  # int32 blocks committed so far (after_commit)
    generated: Optional[jax.Array] = None  # [B, G] committed blocks, the first at position n_pre
    block_kv: Optional[tuple] = None  # (k, v) [L, B, Hkv, bs, D] the block's own K/V at step 0 (post-RoPE)
    draft: Optional[jax.Array] = None  # [B, H] a first pass's answer (draft_pass), mask_id where none


class BlockResult(NamedTuple):
    """on_block's answer: the cache (in ctx.capacity slots), what later steps read, and counts."""

    cache: Any
    selection: Optional[tuple]  # None: read the whole cache; else (n_dense, model.Context of layers n_dense..L)
    evicted: jax.Array  # scalar bool: an eviction ran
    forwards: jax.Array  # scalar int32: probe forwards it ran


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base of every policy: the exact full cache. Subclasses override the hooks they change."""

    name: ClassVar[str] = "dense"
    takes_budget: ClassVar[bool] = False  # make(name, capacity_pct) applies; sweeps fan it out
    keeps_state: ClassVar[bool] = False  # memory: 10 B of eviction state per kept entry
    # where the KV entries live (policies/storage.py): Float(), or Packed(bits) for low bits;
    # keyword-only, so subclasses' own fields keep their positions
    storage: Storage = dataclasses.field(default=Float(), kw_only=True)

    @property
    def label(self) -> str:
        """The name results report: `name`, with a `q-` prefix on the packed cache."""
        return self.storage.prefix + self.name

    def check_run(self, cfg, gen) -> None:
        """Everything that must hold before a run: `validate` (this policy's knobs against the
        model and generation config), then the storage part's checks against this policy."""
        self.validate(cfg, gen)
        self.storage.check(self, cfg, gen)

    @property
    def first_block_special(self) -> bool:
        """Whether on_block treats the first block apart (reads ctx.first). The engine then
        traces the first block on its own, before the block loop; when this is False and the
        cache keeps one capacity (plan), every block is the same traced loop body."""
        return True

    def validate(self, cfg, gen) -> None:
        return None

    def for_run(self, cfg, gen) -> "Policy":
        """The policy the core runs for this model and generation config: itself, or a copy
        with its automatic knobs fixed (the packed storage's open group for blocks of any size)."""
        storage = self.storage.for_run(gen)
        return self if storage == self.storage else dataclasses.replace(self, storage=storage)

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512):
        """(capacity while prefilling, capacity while decoding); total_cap holds everything."""
        return total_cap, total_cap

    def empty_cache(self, num_layers, batch, kv_heads, capacity, head_dim, dtype=jnp.bfloat16,
                    group_size: int = 1) -> Cache:
        return self.storage.empty(num_layers, batch, kv_heads, capacity, head_dim, dtype)

    def stats_request(self, masked, active) -> Optional[StatsRequest]:
        return None

    def prefill_stats_request(self, valid) -> Optional[StatsRequest]:
        return None

    @property
    def acts_at_step0(self) -> bool:
        """Whether on_block needs step 0 as a forward of its own (a policy that keeps the whole
        cache and reads nothing says False: its step 0 joins the denoising loop)."""
        return True

    def on_prefill_chunk(self, cache, ctx: StepContext):
        return cache

    def due_after_prefill(self, cache) -> jax.Array:
        return jnp.zeros(cache.length.shape, bool)

    def on_block(self, cache, ctx: StepContext) -> BlockResult:
        return BlockResult(cache.resize(ctx.capacity), None, jnp.bool_(False), jnp.int32(0))

    def after_commit(self, cache, ctx: StepContext):
        return cache, jnp.bool_(False)

    def due_after_block(self, blocks_done, cache) -> jax.Array:
        return jnp.zeros(cache.length.shape, bool)

    def on_prompt(self, cache: KVCache, vote: Callable[..., jax.Array], plen) -> Optional[KVCache]:
        return None

    # Bidirectional families, compressing inside the first full pass (layer by layer): a policy
    # whose budgets are known before any layer runs says so, names its voters, and cuts one layer
    prompt_layerwise = False
    prompt_voters = None  # (a class attribute, not a field)

    def compress_layer(self, layer, cache: KVCache, mass, plen, num_layers: int) -> KVCache:
        raise NotImplementedError(f"{self.name} does not compress layer by layer")

    def held_bytes(self, cache) -> jax.Array:
        return memory.row_bytes(cache.valid, cache.bytes_per_token, self.keeps_state)

    def budget_note(self, prompt_lens) -> Optional[str]:
        return None

    def draft_pass(self, max_new_tokens: Optional[int] = None) -> Optional[tuple]:
        return None


@dataclasses.dataclass(frozen=True)
class Dense(Policy):
    """Full exact cache: every block reads everything; nothing is evicted."""

    @property
    def first_block_special(self) -> bool:
        return False

    @property
    def acts_at_step0(self) -> bool:
        return False

    name = "dense"


__all__ = ["BlockResult", "Dense", "Forward", "Policy", "PolicyError", "StatsRequest", "StepContext"]
