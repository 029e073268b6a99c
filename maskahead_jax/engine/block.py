"""One block of block-causal decoding: step 0 -> the policy's hook -> denoising steps -> commit
-> the policy's end-of-block hook.

Step 0 forwards the block over the whole cache (exact attention) and answers the policy's
`stats_request` (every layer's pooled prefix mass and value score, the pre-RoPE query moments,
the block's own K/V: model/stats.py). The policy's `on_block` then updates its state, chooses what the
later steps read and evicts when due (its probes run through `ctx.forward`). The denoising
steps read that selection; the commit forward appends the finished block's K/V, the peak is
taken, and `after_commit` may evict (the baselines that evict at the end of a block).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..decoding import commit, shift_logits
from ..model import Segment, lm_head, model_step
from ..policies.protocol import BlockResult
from ..sharding import constrain_cache
from .state import BlockState, answer, dense_bytes, dense_segments, full_mask


def _segments(cache, selection, num_layers):
    if selection is None:
        return dense_segments(cache, num_layers)
    nd, ctx = selection
    return ([Segment(0, nd, cache.context(0, nd))] if nd else []) + [Segment(nd, num_layers, ctx)]


def _logits_of(params, cfg, prev, hidden):
    """A block's logits from its hidden states (shifted by the previous block's last logits)."""
    lg = lm_head(params, cfg, hidden)
    return shift_logits(lg, prev) if cfg.logits_shift else lg


def _step0(params, cfg, gen, policy, st: BlockState, x, pos, m0, active, ctx):
    """Step 0: exact dense attention over the whole cache (+ the policy's statistics) and the
    policy's `on_block`, or nothing for a plain policy (the denoising loop runs it). Returns
    (x, key, BlockResult, the loop's first step, ctx with the per-block fields)."""
    b, bs, L, mask_id = x.shape[0], gen.block_size, cfg.num_layers, cfg.mask_token_id
    cache, start = st.cache, st.start
    req = policy.stats_request(x == mask_id, active)
    ctx = ctx._replace(active=active, due=st.due, tokens=x, start=start, generated=st.out)
    # A policy that reads nothing at step 0 and does not act there (the dense cache) on a cache
    # that keeps its capacity: step 0 is the denoising loop's first iteration (one traced
    # forward per block instead of two; the same keys, commits and forwards).
    plain = req is None and not policy.acts_at_step0 and cache.capacity == ctx.capacity
    if plain:
        res = BlockResult(cache, None, jnp.bool_(False), jnp.int32(0))
        step0, key = jnp.int32(0), st.key
    else:
        key, k0 = jax.random.split(st.key)
        out0 = model_step(params, cfg, x, pos, full_mask(b, bs), dense_segments(cache, L), req)
        x = commit(x, _logits_of(params, cfg, st.prev, out0.hidden), jnp.int32(0), m0, active, gen, mask_id, k0)
        res = policy.on_block(cache, ctx._replace(**answer(cfg, req, out0, start + bs - 1)))
        step0 = jnp.int32(1)
    return x, key, res, step0, ctx


def _denoise(params, cfg, gen, prev, x, pos, m0, active, segs, step0, key):
    """Denoising steps over the selected context `segs`, then the commit forward: one traced
    forward (half of what XLA compiles per block). An iteration forwards x; while masks remain
    (and the step bound allows; step 0 always commits) it commits and loops, else that forward
    was the commit forward (the finished block's K/V, which go into the cache). Returns
    (x, key, the commit forward's output, denoising forwards after step 0)."""
    b, bs, mask_id = x.shape[0], gen.block_size, cfg.mask_token_id
    bound = bs + gen.steps_per_block

    def body(s):
        x, step, key, _, _ = s
        o = model_step(params, cfg, x, pos, full_mask(b, bs), segs)
        more = (jnp.any((x == mask_id) & active[:, None]) & (step < bound)) | (step == 0)
        key2, kk = jax.random.split(key)
        # the logits and the commit only when a step follows (the commit forward needs neither)
        x2 = jax.lax.cond(more, lambda: commit(x, _logits_of(params, cfg, prev, o.hidden), step, m0, active, gen,
                                               mask_id, kk),
                          lambda: x)
        return x2, step + more.astype(jnp.int32), jnp.where(more, key2, key), ~more, o

    out_shape = jax.eval_shape(lambda: model_step(params, cfg, x, pos, full_mask(b, bs), segs))
    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), out_shape)
    x, step, key, _, oc = jax.lax.while_loop(lambda s: ~s[3], body, (x, step0, key, jnp.bool_(False), zeros))
    n_steps = step - 1  # denoising forwards after step 0 (a plain step 0 is the loop's first)
    return x, key, oc, n_steps


def run_block(params, cfg, gen, policy, st: BlockState, x_init, ctx) -> BlockState:
    """Decode one block for every active row. ctx: the policy StepContext without the per-block
    fields (tokens, start, mass, score, due, active), which are filled in here."""
    bs, L, mask_id = gen.block_size, cfg.num_layers, cfg.mask_token_id
    cache, active, start = st.cache, ~st.done, st.start
    pos = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    x = x_init
    if cfg.logits_shift:
        first_tok = jnp.argmax(st.prev, axis=-1).astype(jnp.int32)
        x = x.at[:, 0].set(jnp.where(x[:, 0] == mask_id, first_tok, x[:, 0]))
    m0 = (x == mask_id).sum(-1)

    # ---- step 0 (or nothing for a plain policy), then the denoising steps and the commit forward
    x, key, res, step0, ctx = _step0(params, cfg, gen, policy, st, x, pos, m0, active, ctx)
    cache = res.cache
    segs = _segments(cache, res.selection, L)
    x, key, oc, n_steps = _denoise(params, cfg, gen, st.prev, x, pos, m0, active, segs, step0, key)

    # ---- the finished block's K/V into the cache
    appended = jnp.where(active, bs, 0)
    cache = cache.append(oc.k, oc.v, pos, appended)
    peak = jnp.maximum(st.peak, policy.held_bytes(cache))  # before an end-of-block eviction
    peak_dense = jnp.maximum(st.peak_dense, dense_bytes(cfg, cache))
    prev = jnp.where(active[:, None], lm_head(params, cfg, oc.hidden[:, -1]), st.prev)
    nfe_b = 1 + res.forwards + n_steps + 1

    old = jax.lax.dynamic_slice_in_dim(st.out, st.blk * bs, bs, axis=1)
    out = jax.lax.dynamic_update_slice_in_dim(st.out, jnp.where(active[:, None], x, old), st.blk * bs, axis=1)
    cache, evicted_end = policy.after_commit(cache, ctx._replace(appended=appended, blocks_done=st.blk + 1,
                                                                 generated=out))
    is_gen = pos >= ctx.plen[:, None]
    hit_eos = jnp.any(jnp.isin(x, jnp.asarray(cfg.eos_token_ids, jnp.int32)) & is_gen, axis=-1)
    done = st.done | (start + bs >= ctx.plen + gen.max_new_tokens) | (hit_eos & gen.stop_at_eos)
    blk = st.blk + 1
    due = (st.due & ~active) | (policy.due_after_block(blk, cache) & ~done)
    return BlockState(
        cache=constrain_cache(cache), prev=prev, start=start + bs, blk=blk, done=done, due=due, out=out, key=key,
        nfe=st.nfe + jnp.where(active, nfe_b, 0), nfe_batch=st.nfe_batch + nfe_b,
        peak=peak, peak_dense=peak_dense,
        evictions=st.evictions + res.evicted.astype(jnp.int32) + jnp.asarray(evicted_end, jnp.int32))
