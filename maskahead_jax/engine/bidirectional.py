"""The bidirectional core (LLaDA, Dream): semi-autoregressive decoding of a fixed-length
response. A full forward of [prompt | response] builds the prompt's K/V (the cache) at the
first step and every `prompt_refresh` steps; the steps between recompute only the response
against that cache. The policy's `on_prompt` may compress the prompt once, voted by the
response's mask queries (MaskKV) or the prompt's last tokens (SnapKV's window: SnapKV,
PyramidKV, AdaKV); a compressed prompt is never refreshed.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import memory
from ..cache import KVCache
from ..decoding import commit, shift_logits
from ..kernels import masks, reference
from ..model import Context, Segment, StatsRequest, lm_head, model_step
from ..model.decoder import project_qkv
from ..sharding import constrain_cache
from .state import dense_segments, full_mask, row_take


class BidirState(NamedTuple):
    resp: jax.Array  # [B, G] response tokens
    blk: jax.Array  # int32 current block
    step: jax.Array  # int32 steps run
    bstep: jax.Array  # int32 steps run in the current block
    cache: KVCache  # the prompt's K/V
    logits: jax.Array  # [B, G, V] response logits of the last forward
    last: jax.Array  # [B, V] logits at the last prompt position (shifted-logits families)
    key: jax.Array
    nfe: jax.Array  # int32 forwards
    m0: jax.Array  # [B] masks at the start of the current block


def bidirectional_core(params, prompt, plen, key, draft=None, prefilled=None, *, cfg, gen, policy, cache_dtype,
                       phase: str = "all"):
    """Decode a fixed-length response block by block against the prompt's cache (module
    docstring); phase "prefill" stops after the first full pass (timing runs) and also returns
    its `state`; phase "decode" starts from such a `prefilled` state (the decode alone, timed)."""
    b, pb = prompt.shape
    bs, hkv, mask_id = gen.block_size, cfg.num_kv_heads, cfg.mask_token_id
    nblk = math.ceil(gen.max_new_tokens / bs)
    g = nblk * bs
    ppos = jnp.broadcast_to(jnp.arange(pb, dtype=jnp.int32), (b, pb))
    pvalid = ppos < plen[:, None]
    rpos = plen[:, None] + jnp.arange(g, dtype=jnp.int32)[None]
    all_pos = jnp.concatenate([ppos, rpos], axis=1)
    key_valid = jnp.concatenate([pvalid, jnp.ones((b, g), bool)], axis=1)
    both_mask = masks.bidirectional(all_pos, key_valid)  # O(T): no [B, P+G, P+G] boolean
    full_pass = _full_pass_fn(params, cfg, prompt, plen, ppos, pvalid, all_pos, both_mask, cache_dtype)

    resp0 = jnp.full((b, g), mask_id, jnp.int32)
    layerwise = policy.prompt_layerwise
    if phase == "decode":
        cache, logits, last = prefilled
    elif layerwise:  # MaskKV's offline-budget mode: the prompt is cut inside the first full pass
        cache, logits, last = full_pass_layerwise(params, cfg, prompt, resp0, plen, all_pos, key_valid,
                                                  both_mask, policy, cache_dtype)
    else:
        cache, logits, last = full_pass(resp0)
    if phase == "prefill":  # timing runs: the first full pass builds the prompt cache
        return dict(prev=last, kv_bytes=policy.held_bytes(cache), state=(cache, logits, last))
    # the layer-by-layer pass held the others' cut prompts plus one layer's whole prompt
    peak_bytes = policy.held_bytes(cache) + (plen * hkv * cache.bytes_per_token if layerwise else 0.0)

    vote = _vote_fn(params, cfg, prompt, plen, rpos, resp0, cache)
    compressed = None if layerwise else policy.on_prompt(cache, vote, plen)
    nfe = jnp.int32(1)
    refresh = 0 if layerwise else gen.prompt_refresh
    if compressed is not None:
        cache, nfe, refresh = compressed, nfe + 1, 0  # a compressed prompt is never refreshed
    active = jnp.ones((b,), bool)
    body = _step_fn(cfg, gen, nblk, refresh, active, full_pass, _resp_logits_fn(params, cfg, rpos, b, g))

    s = BidirState(resp0, jnp.int32(0), jnp.int32(0), jnp.int32(0), cache, logits, last, key, nfe,
                   jnp.sum(resp0[:, :bs] == mask_id, -1))
    max_steps = nblk * (bs + gen.steps_per_block)  # a hard bound: every step commits >= 1 token
    s = jax.lax.while_loop(lambda s: (s.blk < nblk) & (s.step < max_steps), body, s)
    return _outputs(s, cfg, policy, plen, peak_bytes)


def _full_pass_fn(params, cfg, prompt, plen, ppos, pvalid, all_pos, both_mask, cache_dtype):
    """The full forward of [prompt | response] as a function of the response (the first step
    and every prompt refresh): the prompt cache, response logits, last-prompt logits."""
    b, pb = prompt.shape
    L, hkv = cfg.num_layers, cfg.num_kv_heads

    def full_pass(resp):
        """Forward of [prompt | response]: the prompt cache, response logits, last-prompt logits."""
        out = model_step(params, cfg, jnp.concatenate([prompt, resp], 1), all_pos, both_mask,
                         [Segment(0, L, None)])
        valid = jnp.broadcast_to(pvalid[None, :, None, :], (L, b, hkv, pb))
        cache = KVCache(k=out.k[:, :, :, :pb].astype(cache_dtype), v=out.v[:, :, :, :pb].astype(cache_dtype),
                        pos=jnp.where(valid, ppos[None, :, None, :], -1), valid=valid,
                        acc=jnp.zeros(valid.shape, jnp.float32), length=plen.astype(jnp.int32),
                        seen=plen.astype(jnp.int32))
        last = lm_head(params, cfg, row_take(out.hidden, plen - 1))
        return constrain_cache(cache), lm_head(params, cfg, out.hidden[:, pb:]), last

    return full_pass


def _resp_logits_fn(params, cfg, rpos, b, g):
    """The steps between refreshes: the response alone forwarded against the prompt cache."""
    L = cfg.num_layers

    def resp_logits(cache, resp):
        o = model_step(params, cfg, resp, rpos, full_mask(b, g), dense_segments(cache, L))
        return lm_head(params, cfg, o.hidden)

    return resp_logits


def _vote_fn(params, cfg, prompt, plen, rpos, resp0, cache):
    """The `vote` that the policy's on_prompt calls on the first full pass's prompt cache."""
    b, g = resp0.shape
    L = cfg.num_layers

    def vote(window=None):
        """Voting at the first step, in one softmax over [prompt | response] keys (the response's
        own K/V passed as context, the queries' own block masked out), as the full pass attends;
        mass [L, B, Hkv, Pb + G] pooled over the voters: window None, the response's mask
        queries (MaskKV, maskkv.md Eq. 6); window w, the prompt's last w tokens at their
        positions (SnapKV's observation window; rows of shorter prompts vote with fewer)."""
        o = model_step(params, cfg, resp0, rpos, full_mask(b, g), dense_segments(cache, L))
        ctx = Context(*(jnp.concatenate([a, n.astype(a.dtype)], 3) for a, n in
                        ((cache.k, o.k), (cache.v, o.v), (cache.valid, jnp.ones(o.k.shape[:4], bool)))))
        toks, pos, rows = resp0, rpos, jnp.ones((b, g), bool)
        if window is not None:
            wpos = plen[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
            rows, pos = wpos >= 0, jnp.maximum(wpos, 0)
            toks = jnp.take_along_axis(prompt, pos, axis=1)
        t = toks.shape[1]
        return model_step(params, cfg, toks, pos, jnp.zeros((b, t, t), bool), [Segment(0, L, ctx)],
                          StatsRequest(rows)).mass

    return vote


def _step_fn(cfg, gen, nblk, refresh, active, full_pass, resp_logits):
    """The while-loop body: commit inside the current block, then refresh the prompt cache
    (every `refresh` steps; 0: never) or forward the response alone."""
    bs, mask_id = gen.block_size, cfg.mask_token_id

    def body(s: BidirState) -> BidirState:
        key, kk = jax.random.split(s.key)
        lg = shift_logits(s.logits, s.last) if cfg.logits_shift else s.logits
        # commit inside the current block only: view the block as [B, bs]
        xb = jax.lax.dynamic_slice_in_dim(s.resp, s.blk * bs, bs, axis=1)
        lb = jax.lax.dynamic_slice_in_dim(lg, s.blk * bs, bs, axis=1)
        xb = commit(xb, lb, s.bstep, s.m0, active, gen, mask_id, kk)
        resp = jax.lax.dynamic_update_slice_in_dim(s.resp, xb, s.blk * bs, axis=1)
        blk_done = ~jnp.any(xb == mask_id)
        blk = jnp.where(blk_done, s.blk + 1, s.blk)
        m0 = jnp.where(blk_done, jnp.sum(jax.lax.dynamic_slice_in_dim(
            resp, jnp.minimum(blk, nblk - 1) * bs, bs, axis=1) == mask_id, -1), s.m0)
        step = s.step + 1
        reuse = lambda args: (args[0], resp_logits(*args), s.last)
        if refresh:
            cache, logits, last = jax.lax.cond(step % refresh == 0, lambda a: full_pass(a[1]), reuse,
                                               (s.cache, resp))
        else:
            cache, logits, last = reuse((s.cache, resp))
        return BidirState(resp, blk, step, jnp.where(blk_done, 0, s.bstep + 1), cache, logits, last, key,
                          s.nfe + (blk < nblk).astype(jnp.int32), m0)

    return body


def _outputs(s: BidirState, cfg, policy, plen, peak_bytes) -> dict:
    """The core's result dict from the final loop state (the engine's common keys)."""
    b = s.resp.shape[0]
    L, hkv = cfg.num_layers, cfg.num_kv_heads
    kvb = policy.held_bytes(s.cache)
    dense = memory.bf16_dense_bytes(L, hkv, cfg.head_dim, plen)
    return dict(out=s.resp, first_pos=plen, nfe=jnp.broadcast_to(s.nfe, (b,)), nfe_batch=s.nfe,
                kv_bytes=kvb, dense_bytes=dense, kv_peak=jnp.maximum(kvb, peak_bytes),
                dense_peak=dense, live=s.cache.live().max(axis=(0, 2)), seen=s.cache.seen,
                capacity=jnp.int32(s.cache.capacity), evictions=jnp.int32(0), blocks=s.blk,
                nonfinite=~(jnp.all(jnp.isfinite(s.logits), axis=(1, 2)) & jnp.all(jnp.isfinite(s.last), axis=-1)))


def layer_vote(p, cfg, x_in, cos, sin, k, v, key_valid, rows, rows_ok):
    """One layer's vote inside the full pass: the rows `rows` [B, R] (their hidden states
    x_in [B, P+G, D] at this layer's input) attend over all keys k/v [B, Hkv, P+G, Dh] of the pass
    in one softmax, exactly as they do in it; their mass pooled by the mean over the voting rows
    `rows_ok` [B, R] and the group -> [B, Hkv, P+G]. Chunked for long passes (reference.attention_any)."""
    take = lambda a: jnp.take_along_axis(a, rows.reshape(rows.shape + (1,) * (a.ndim - 2)), axis=1)
    q, _, _ = project_qkv(p, take(x_in), take(cos), take(sin), cfg)
    b, hkv, _, r, dh = q.shape
    valid = jnp.broadcast_to(key_valid[:, None, :], (b, hkv, key_valid.shape[1]))
    nothing = jnp.zeros((b, hkv, r, dh), k.dtype)  # no block keys: the whole pass is the context
    _, stats = reference.attention_any(q, k, v, valid, nothing, nothing, jnp.zeros((b, r, r), bool),
                                       rows_ok, "mean")
    return stats.mass


def full_pass_layerwise(params, cfg, prompt, resp, plen, all_pos, key_valid, mask, policy, cache_dtype):
    """The first full forward of [prompt | response] with the prompt compressed layer by layer
    (MaskKV with budgets known offline, maskkv.md §8): right after layer l runs, its voters'
    attention ranks its prompt K/V, and only the kept entries leave the layer, so the pass holds
    one layer's whole prompt K/V at a time plus the other layers' budgets. Same cache, logits and
    last-prompt logits as the online variant (a full pass, a vote forward, then the cut)."""
    b, pb = prompt.shape
    g, L, hkv = resp.shape[1], cfg.num_layers, cfg.num_kv_heads
    ppos = all_pos[:, :pb]
    pvalid = key_valid[:, :pb]
    window = policy.prompt_voters
    if window is None:  # the response's mask queries vote
        rows, rows_ok = pb + jnp.arange(g, dtype=jnp.int32)[None].repeat(b, 0), jnp.ones((b, g), bool)
    else:  # the prompt's last `window` tokens (rows of shorter prompts vote with fewer)
        wpos = plen[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
        rows, rows_ok = jnp.maximum(wpos, 0), wpos >= 0

    def hook(layer, p, x_in, cos, sin, k, v):
        mass = layer_vote(p, cfg, x_in, cos, sin, k, v, key_valid, rows, rows_ok)
        valid = jnp.broadcast_to(pvalid[None, :, None, :], (1, b, hkv, pb))
        one = KVCache(k=k[None, :, :, :pb].astype(cache_dtype), v=v[None, :, :, :pb].astype(cache_dtype),
                      pos=jnp.where(valid, ppos[None, :, None, :], -1), valid=valid,
                      acc=jnp.zeros(valid.shape, jnp.float32), length=plen.astype(jnp.int32),
                      seen=plen.astype(jnp.int32))
        cut = policy.compress_layer(layer, one, mass[None], plen, L)
        return cut.k[0], cut.v[0], cut.pos[0], cut.valid[0], cut.acc[0]

    out = model_step(params, cfg, jnp.concatenate([prompt, resp], 1), all_pos, mask,
                     [Segment(0, L, None)], layer_hook=hook)
    k, v, pos, valid, acc = out.k
    cache = KVCache(k=k, v=v, pos=pos, valid=valid, acc=acc,
                    length=valid.sum(-1).max(axis=(0, 2)).astype(jnp.int32), seen=plen.astype(jnp.int32))
    last = lm_head(params, cfg, row_take(out.hidden, plen - 1))
    return constrain_cache(cache), lm_head(params, cfg, out.hidden[:, pb:]), last
