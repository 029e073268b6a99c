"""Probes: forwards that write nothing and tell an eviction which cache entries queries will want.

A probe builds its own tokens, positions and mask, runs them through `ctx.forward` over the
pre-eviction cache, and returns the pooled attention mass [L, B, Hkv, N]. Each costs one forward.

  Lookahead(blocks)     MaskAhead (research/maskahead.md §3): [step-0 block | blocks - 1 mask
                        blocks] at the next positions, block-causal among themselves; the mass of
                        the lookahead blocks' queries, scaled by blocks - 1
  PromptWindow(window)  SnapKV: the last `window` prompt tokens at their own positions, all pooled
  Question(tokens, blocks)  ours (docs/results.md §2d): the prompt's last `tokens` tokens at their
                        real positions plus blocks - 1 mask blocks after the prompt, all attending
                        to each other; scaled by `blocks` (the lookahead's weighting)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..model import block_causal_mask
from .protocol import StepContext


def _full(b: int, t: int) -> jax.Array:
    return jnp.ones((b, t, t), bool)


@dataclasses.dataclass(frozen=True)
class Lookahead:
    blocks: int = 4

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        b, bs = ctx.tokens.shape
        m = self.blocks
        toks = jnp.concatenate([ctx.tokens, jnp.full((b, (m - 1) * bs), ctx.mask_id, jnp.int32)], axis=1)
        pos = ctx.start[:, None] + jnp.arange(m * bs, dtype=jnp.int32)[None]
        mask = block_causal_mask(pos - ctx.start[:, None], bs)
        rows = (jnp.arange(m * bs) >= bs)[None, :] & ctx.active[:, None]
        return ctx.forward(cache, toks, pos, mask, rows) * (m - 1)


@dataclasses.dataclass(frozen=True)
class PromptWindow:
    window: int = 32

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        w = self.window
        b = ctx.prompt.shape[0]
        idx = jnp.maximum(ctx.n_pre[:, None] - w + jnp.arange(w)[None], 0)
        toks = jnp.take_along_axis(ctx.prompt, idx, axis=1)
        rows = (ctx.n_pre[:, None] - w + jnp.arange(w)[None] >= 0) & ctx.active[:, None]
        return ctx.forward(cache, toks, idx.astype(jnp.int32), _full(b, w), rows)


@dataclasses.dataclass(frozen=True)
class Question:
    tokens: int = 64
    blocks: int = 4

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        plen = ctx.plen
        b = plen.shape[0]
        q, bs, m = self.tokens, ctx.block_size, self.blocks
        qpos = jnp.maximum(plen[:, None] - q + jnp.arange(q)[None], 0).astype(jnp.int32)
        qtok = jnp.take_along_axis(ctx.prompt, qpos, axis=1)
        mpos = plen[:, None] + jnp.arange((m - 1) * bs, dtype=jnp.int32)[None]
        toks = jnp.concatenate([qtok, jnp.full((b, (m - 1) * bs), ctx.mask_id, jnp.int32)], 1)
        pos = jnp.concatenate([qpos, mpos], 1)
        return ctx.forward(cache, toks, pos, _full(b, toks.shape[1]), jnp.ones(toks.shape, bool)) * m

    def span(self, cache, ctx: StepContext) -> jax.Array:
        """[L, B, Hkv, N] the question's cache entries (the prompt's last `tokens` positions)."""
        return cache.pos >= (ctx.plen - self.tokens)[None, :, None, None]
