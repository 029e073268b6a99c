"""Probes: forwards that write nothing and tell an eviction which cache entries queries will want.

A probe builds its own tokens, positions and mask, runs them through `ctx.forward` over the
pre-eviction cache, and returns the pooled attention mass [L, B, Hkv, N]. Each costs one forward.

  Lookahead(blocks, fill)  MaskAhead (research/maskahead.md §3): [step-0 block | blocks - 1
                        probe blocks] at the next positions, block-causal among themselves; the
                        mass of the probe blocks' queries, scaled by blocks - 1. `fill` is what
                        the probe blocks hold (released `lookahead_probe`): "mask" (the default),
                        "random" (uniform tokens below the mask id) or "dapq" (released
                        "dapq_fill": the DapQ pattern below, tiled)
  DapQ()                DapQ (released `lookahead_probe: dapq`): one block of pseudo tokens, the
                        first 4 and the last block_size - 4 tokens of the committed context
                        (F4-L28), at the current block's positions; the mass of all its queries
  PromptWindow(window)  SnapKV: the last `window` prompt tokens at their own positions over the
                        whole stored prompt, i.e. the queries and the joint softmax of the final
                        prefill chunk's last `window` rows (exactly so for window <= block_size)
  Question(tokens, blocks)  ours (docs/results.md §2c): the prompt's last `tokens` tokens at their
                        real positions plus blocks - 1 mask blocks after the prompt, all attending
                        to each other; scaled by `blocks` (the lookahead's weighting). With
                        `draft`, the mask blocks open with a first pass's answer (ctx.draft)
  QuestionLookahead(tokens, blocks, weight)  ours (docs/results.md "Beyond the paper"): at any
                        block, Lookahead(blocks)'s mass plus `weight` x the mass of the question
                        alone (the prompt's last `tokens` tokens at their real positions, attending
                        to each other and to the cache); two forwards. Its span is the question's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..model import block_causal_mask
from .protocol import StatsRequest, StepContext

FILLS = ("mask", "random", "dapq")


def _full(b: int, t: int) -> jax.Array:
    return jnp.ones((b, t, t), bool)


def context_tokens(ctx: StepContext, positions) -> jax.Array:
    """The committed token at each position [B, T] (< ctx.start): prompt below n_pre, else the
    generated blocks (ctx.generated, the first at n_pre)."""
    gen = ctx.generated
    if gen is None:
        gen = jnp.zeros((positions.shape[0], 1), jnp.int32)
    p = jnp.maximum(positions, 0)
    from_prompt = jnp.take_along_axis(ctx.prompt, jnp.minimum(p, ctx.prompt.shape[1] - 1), axis=1)
    g = jnp.clip(p - ctx.n_pre[:, None], 0, gen.shape[1] - 1)
    return jnp.where(p < ctx.n_pre[:, None], from_prompt, jnp.take_along_axis(gen, g, axis=1))


def dapq_tokens(ctx: StepContext, n: int, first: int = 4) -> jax.Array:
    """[B, n] DapQ's F4-L(block-4) pattern of the committed context [0, start), tiled to n
    tokens (released runtime/generator._probe_tokens_impl: cat(ctx[:4], ctx[-(block - 4):]))."""
    bs, n_ctx = ctx.block_size, ctx.start[:, None]
    f = jnp.minimum(first, n_ctx)
    last = jnp.minimum(bs - first, n_ctx)
    period = jnp.maximum(f + last, 1)
    j = jnp.arange(n)[None, :] % period
    pos = jnp.where(j < f, j, n_ctx - last + (j - f))
    toks = context_tokens(ctx, pos)
    return jnp.where(n_ctx > 0, toks, ctx.mask_id).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Lookahead:
    blocks: int = 4
    fill: str = "mask"  # mask | random | dapq

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        b, bs = ctx.tokens.shape
        m = self.blocks
        n = (m - 1) * bs
        if self.fill == "random":  # released: torch.randint(0, mask_id); ours: a JAX key per block
            key = jax.random.fold_in(jax.random.PRNGKey(0), ctx.start[0])
            fill = jax.random.randint(key, (b, n), 0, ctx.mask_id, jnp.int32)
        elif self.fill == "dapq":
            fill = dapq_tokens(ctx, n)
        else:
            fill = jnp.full((b, n), ctx.mask_id, jnp.int32)
        toks = jnp.concatenate([ctx.tokens, fill], axis=1)
        pos = ctx.start[:, None] + jnp.arange(m * bs, dtype=jnp.int32)[None]
        mask = block_causal_mask(pos - ctx.start[:, None], bs)
        rows = (jnp.arange(m * bs) >= bs)[None, :] & ctx.active[:, None]
        return ctx.forward(cache, toks, pos, mask, rows) * (m - 1)


@dataclasses.dataclass(frozen=True)
class DapQ:
    def mass(self, cache, ctx: StepContext) -> jax.Array:
        b, bs = ctx.tokens.shape
        toks = dapq_tokens(ctx, bs)
        pos = ctx.start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        mask = block_causal_mask(pos, bs)
        rows = jnp.broadcast_to(ctx.active[:, None], (b, bs))
        return ctx.forward(cache, toks, pos, mask, rows)


@dataclasses.dataclass(frozen=True)
class PromptWindow:
    window: int = 32

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        """Run after the prompt's final chunk is stored: the window's queries read the whole
        stored prompt (their own keys included, through the cache) and nothing of themselves,
        so every window query inside the last block sees what it saw in the chunk's forward."""
        w = self.window
        b = ctx.prompt.shape[0]
        idx = jnp.maximum(ctx.n_pre[:, None] - w + jnp.arange(w)[None], 0)
        toks = jnp.take_along_axis(ctx.prompt, idx, axis=1)
        rows = (ctx.n_pre[:, None] - w + jnp.arange(w)[None] >= 0) & ctx.active[:, None]
        return ctx.forward(cache, toks, idx.astype(jnp.int32), jnp.zeros((b, w, w), bool), rows)


def _question(ctx: StepContext, q: int):
    """The prompt's last q tokens and their positions [B, q] (clipped at 0 for shorter prompts)."""
    qpos = jnp.maximum(ctx.plen[:, None] - q + jnp.arange(q)[None], 0).astype(jnp.int32)
    return jnp.take_along_axis(ctx.prompt, qpos, axis=1), qpos


@dataclasses.dataclass(frozen=True)
class Question:
    tokens: int = 64
    blocks: int = 4
    pool: str = "mean"  # how its rows' attention is pooled: reference.POOLS (pool_rows)
    draft: bool = False  # the answer blocks open with ctx.draft (a first pass's answer), if any

    def view(self, cache, ctx: StepContext):
        """The cache the probe reads (all of it; a lab variant hides the question's own entries)."""
        return cache

    def answers(self, answer: jax.Array, mask_id: int) -> list:
        """The answer blocks' tokens [B, n] of each forward (one: masks, or the draft then masks);
        the masses of several are averaged."""
        return [answer]

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        cache = self.view(cache, ctx)
        plen = ctx.plen
        b = plen.shape[0]
        q, bs, m = self.tokens, ctx.block_size, self.blocks
        qtok, qpos = _question(ctx, q)
        n_ans = (m - 1) * bs
        with_draft = self.draft and ctx.draft is not None
        if with_draft:  # the draft, then masks to a whole number of blocks (at least blocks - 1)
            n_ans = max(n_ans, -(-ctx.draft.shape[1] // bs) * bs)
        mpos = plen[:, None] + jnp.arange(n_ans, dtype=jnp.int32)[None]
        answer = jnp.full((b, n_ans), ctx.mask_id, jnp.int32)
        if with_draft:
            answer = answer.at[:, :ctx.draft.shape[1]].set(ctx.draft.astype(jnp.int32))
        pos = jnp.concatenate([qpos, mpos], 1)
        answers = self.answers(answer, ctx.mask_id) if with_draft else [answer]
        mass = 0.0
        for ans in answers:
            toks = jnp.concatenate([qtok, ans], 1)
            req = StatsRequest(jnp.ones(toks.shape, bool), pool=self.pool)
            mass = mass + ctx.forward(cache, toks, pos, _full(b, toks.shape[1]), req)
        return mass * (m / len(answers))

    def span(self, cache, ctx: StepContext) -> jax.Array:
        """[L, B, Hkv, N] the question's cache entries (the prompt's last `tokens` positions;
        not the generated ones after it)."""
        plen = ctx.plen[None, :, None, None]
        return (cache.pos >= plen - self.tokens) & (cache.pos < plen)


@dataclasses.dataclass(frozen=True)
class QuestionLookahead:
    """The question probe at every eviction (ours): what the next blocks' masks ask for
    (Lookahead) plus what the question asks for, so entries the answer needs later survive the
    evictions made while writing its first items."""

    tokens: int = 128
    blocks: int = 4
    weight: float = 4.0
    pool: str = "mean"  # how the question forward's rows are pooled (Question.pool)
    forwards: int = 2  # probe forwards per eviction (the engine's count)

    def question_mass(self, cache, ctx: StepContext) -> jax.Array:
        """[L, B, Hkv, N] the mass of the question's own queries (no mask blocks)."""
        q, b = self.tokens, ctx.plen.shape[0]
        qtok, qpos = _question(ctx, q)
        rows = jnp.broadcast_to(ctx.active[:, None], (b, q))
        return ctx.forward(cache, qtok, qpos, _full(b, q), StatsRequest(rows, pool=self.pool))

    def mass(self, cache, ctx: StepContext) -> jax.Array:
        return Lookahead(self.blocks).mass(cache, ctx) + self.weight * self.question_mass(cache, ctx)

    def span(self, cache, ctx: StepContext) -> jax.Array:
        return Question(self.tokens, self.blocks).span(cache, ctx)
