"""The block-diffusion generation loop: prefill, denoise, commit, select, evict.

Block-causal families (Fast-dLLM v2, SDAR, DreamReasoner, LLaDA2.0): the block-aligned part of
each prompt is prefilled in chunks into an exact KV cache; the prompt tail opens the first block.
Per block: step 0 forwards the all-mask block over the whole cache (and, for scoring policies,
returns every layer's prefix mass / value score); the policy selects what later steps read and,
when an eviction is pending, runs the lookahead probe and compacts the cache; denoising steps
commit tokens by the family's rule; a commit forward appends the finished block's K/V.

Bidirectional families (LLaDA, Dream): semi-autoregressive decoding of a fixed-length response;
the prompt's K/V are computed by a full forward at the first step (and every `prompt_refresh`
steps) and reused while the response positions are recomputed each step.

Everything between the host calls runs in one `jax.jit` (one compile per batch size, prompt
bucket, generation length, policy): `lax.fori_loop` for prefill chunks, `lax.while_loop` for
blocks and steps, no host round trips inside.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as kvc
from . import memory
from .config import GenerationConfig, ModelConfig, ResolvedGeneration
from .decoding import commit, shift_logits
from .model import Context, Segment, block_causal_mask, lm_head, model_step
from .policies.base import Dense
from .sharding import constrain_cache


class PromptTooLongError(ValueError):
    """A prompt exceeds GenerationConfig.max_prompt_len (or the model's position range)."""


@dataclasses.dataclass
class GenerateOutput:
    """tokens: generated ids per prompt (cut before the first EOS); stats: see `_stats`."""

    tokens: list[list[int]]
    stats: dict[str, Any]


# ----------------------------------------------------------------------------- helpers
def _mask_all(b, t):
    return jnp.ones((b, t, t), bool)


def _dense_segments(cache, num_layers):
    return [Segment(0, num_layers, cache.context())]


def _row_take(a, idx):
    """a [B, T, ...], idx [B] -> [B, ...]."""
    return jnp.take_along_axis(a, idx.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]


def _bucket(n: int, quantum: int) -> int:
    return max(quantum, int(math.ceil(n / quantum)) * quantum)


# ----------------------------------------------------------------------------- block-causal
def _probe_mass(params, cfg: ModelConfig, policy, cache, x0, start, active, padded, n_pre):
    """The eviction probe; writes nothing to the cache. Returns mass per layer [L, B, Hkv, N].

    lookahead (MaskAhead): [current block (step-0 state) | (M-1) mask blocks] at the next
        positions, dense over the pre-eviction cache, block-causal among the probe blocks; the
        mass of the M-1 lookahead blocks' queries, scaled by M-1.
    prompt_window (SnapKV): the last W prompt tokens at their own positions, all rows pooled.
    """
    b, bs = x0.shape
    if policy.probe_kind == "prompt_window":
        w = policy.window
        idx = jnp.maximum(n_pre[:, None] - w + jnp.arange(w)[None], 0)
        toks = jnp.take_along_axis(padded, idx, axis=1)
        rows = (n_pre[:, None] - w + jnp.arange(w)[None] >= 0) & active[:, None]
        out = model_step(params, cfg, toks, idx.astype(jnp.int32), _mask_all(b, w),
                         _dense_segments(cache, cfg.num_layers), rows)
        return out.mass
    m = policy.lookahead_blocks
    toks = jnp.concatenate([x0, jnp.full((b, (m - 1) * bs), cfg.mask_token_id, jnp.int32)], axis=1)
    pos = start[:, None] + jnp.arange(m * bs, dtype=jnp.int32)[None]
    mask = block_causal_mask(pos - start[:, None], bs)
    rows = (jnp.arange(m * bs) >= bs)[None, :] & active[:, None]
    out = model_step(params, cfg, toks, pos, mask, _dense_segments(cache, cfg.num_layers), rows)
    return out.mass * (m - 1)


def _question_pinned(policy, cache, plen):
    """[L, B, Hkv, N] the question span (the prompt's last `question_tokens` positions) when the
    policy pins it, else None."""
    if not policy.pin_question:
        return None
    return cache.pos >= (plen - policy.question_tokens)[None, :, None, None]


def _question_probe_mass(params, cfg: ModelConfig, policy, cache, padded, plen):
    """The question probe; writes nothing to the cache. The prompt's last `question_tokens`
    tokens at their real positions plus lookahead_blocks - 1 mask blocks after the prompt, all
    rows attending to each other and to the cache; their pooled mass, scaled by lookahead_blocks
    (the lookahead probe's weighting). Returns [L, B, Hkv, N]."""
    b = plen.shape[0]
    q, bs, m = policy.question_tokens, cfg.block_size, policy.lookahead_blocks
    qpos = jnp.maximum(plen[:, None] - q + jnp.arange(q)[None], 0).astype(jnp.int32)
    qtok = jnp.take_along_axis(padded, qpos, axis=1)
    mpos = plen[:, None] + jnp.arange((m - 1) * bs, dtype=jnp.int32)[None]
    toks = jnp.concatenate([qtok, jnp.full((b, (m - 1) * bs), cfg.mask_token_id, jnp.int32)], 1)
    pos = jnp.concatenate([qpos, mpos], 1)
    out = model_step(params, cfg, toks, pos, _mask_all(b, toks.shape[1]),
                     _dense_segments(cache, cfg.num_layers), jnp.ones(toks.shape, bool))
    return out.mass * m


def _evict_during_prefill(params, cfg: ModelConfig, policy, cache, padded, plen, over, capacity):
    """Bounded prefill: after a chunk is stored, score the cache with the question probe alone and
    evict rows over capacity down to C(seen), pinning the question span if asked. A policy whose
    ranking reads no queries (`needs_probe` false) is evicted without the probe forward."""
    keep = jnp.where(over, jnp.minimum(cache.length, policy.capacity(cache.seen)), cache.length)
    pinned = _question_pinned(policy, cache, plen)
    if not policy.needs_probe:  # a ranking that reads no queries (StreamingLLM): no probe forward
        return policy.evict(cache, None, None, keep, capacity, pinned=pinned)
    probe = _question_probe_mass(params, cfg, policy, cache, padded, plen)
    return policy.evict(cache, jnp.zeros_like(probe), probe, keep, capacity, pinned=pinned)


def _block_causal_core(params, prompt, plen, key, *, cfg: ModelConfig, gen: ResolvedGeneration,
                       policy, cache_dtype, phase: str = "all"):
    b, pb = prompt.shape
    bs, chunk = gen.block_size, gen.prefill_chunk
    L, hkv, dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    mask_id = cfg.mask_token_id
    n_chunks = max(1, math.ceil(pb / chunk))
    nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
    prompt_cap = n_chunks * chunk
    total_cap = max(prompt_cap, pb + (nblk + 1) * bs)
    cap0, cap1 = policy.plan(prompt_cap, total_cap, bs, chunk)
    per_tok = memory.float_bytes_per_token(dh, cache_dtype)
    dense_bytes = lambda c: memory.bf16_dense_bytes(L, hkv, dh, c.seen)
    held_bytes = lambda c: memory.row_bytes(  # a quantized cache states its own bytes per token
        c.valid, getattr(c, "bytes_per_token", per_tok), policy.with_state)

    n_pre = (plen // bs) * bs
    padded = jnp.pad(prompt, ((0, 0), (0, prompt_cap + bs - pb)), constant_values=mask_id)

    # ---- chunked block-causal prefill of the block-aligned prompt prefix
    def prefill_chunk(c, carry):
        cache, last_h, peak = carry
        start = c * chunk
        toks = jax.lax.dynamic_slice_in_dim(padded, start, chunk, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        n_valid = jnp.clip(n_pre - start, 0, chunk)
        mask = block_causal_mask(pos, bs) & (jnp.arange(chunk)[None, None, :] < n_valid[:, None, None])
        out = model_step(params, cfg, toks, pos, mask, _dense_segments(cache, L))
        cache = kvc.append(cache, out.k, out.v, pos, n_valid)
        peak = jnp.maximum(peak, held_bytes(cache))
        j = n_pre - 1 - start
        hit = (j >= 0) & (j < chunk)
        last_h = jnp.where(hit[:, None], _row_take(out.hidden, jnp.clip(j, 0, chunk - 1)), last_h)
        if policy.bounded_prefill:
            over = cache.length > policy.capacity(cache.seen)
            cache = jax.lax.cond(jnp.any(over), lambda cc: _evict_during_prefill(
                params, cfg, policy, cc, padded, plen, over, cap0), lambda cc: cc, cache)
        return cache, last_h, peak

    make_cache = getattr(policy, "empty_cache", kvc.empty)  # Q-MaskAhead: a packed cache
    cache = constrain_cache(make_cache(L, b, hkv, cap0, dh, cache_dtype))  # no-op without a mesh
    last_h = jnp.zeros((b, cfg.hidden_size), params["final_norm"].dtype)
    peak0 = jnp.zeros((b,), jnp.float32)
    cache, last_h, peak0 = jax.lax.fori_loop(0, n_chunks, prefill_chunk, (cache, last_h, peak0))
    prev_logits = lm_head(params, cfg, last_h)
    if phase == "prefill":  # timing runs: stop after the prompt is in the cache
        return dict(prev=prev_logits, kv_bytes=held_bytes(cache))

    # first block: prompt tail then masks
    idx = n_pre[:, None] + jnp.arange(bs)[None]
    tail = jnp.take_along_axis(padded, idx, axis=1)
    first_block = jnp.where(idx < plen[:, None], tail, mask_id).astype(jnp.int32)

    state = dict(
        cache=cache, prev=prev_logits, start=n_pre.astype(jnp.int32), blk=jnp.int32(0),
        done=jnp.zeros((b,), bool), pending=policy.pending_after_prefill(cache),
        out=jnp.full((b, nblk * bs), mask_id, jnp.int32), key=key,
        nfe=jnp.zeros((b,), jnp.int32), nfe_batch=jnp.int32(1 if pb else 0) * n_chunks,
        peak=jnp.maximum(peak0, held_bytes(cache)), peak_dense=dense_bytes(cache),
        evictions=jnp.int32(0),
    )

    # the released schedule with a question probe (MaskAhead.question_tokens > 0): the first
    # eviction after the prompt probes the question instead of the step-0 block's lookahead
    question_first = getattr(policy, "question_tokens", 0) > 0 and not policy.bounded_prefill

    def run_block(st, x_init, cap_out, first=False):
        cache, active = st["cache"], ~st["done"]
        start = st["start"]
        pos = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        x = x_init
        if cfg.logits_shift:
            first_tok = jnp.argmax(st["prev"], axis=-1).astype(jnp.int32)
            x = x.at[:, 0].set(jnp.where(x[:, 0] == mask_id, first_tok, x[:, 0]))
        m0 = (x == mask_id).sum(-1)
        key, k0 = jax.random.split(st["key"])
        # ---- step 0: exact dense attention over the whole cache (+ scoring stats)
        rows = policy.stat_rows(x == mask_id, active) if policy.needs_stats else None
        out0 = model_step(params, cfg, x, pos, _mask_all(b, bs), _dense_segments(cache, L), rows)
        logits = lm_head(params, cfg, out0.hidden)
        if cfg.logits_shift:
            logits = shift_logits(logits, st["prev"])
        x0 = x
        x = commit(x, logits, jnp.int32(0), m0, active, gen, mask_id, k0)
        cache = policy.observe(cache, out0.mass)
        sparse = policy.select(cache, L, out0.mass, out0.score)  # reads the pre-eviction set
        nfe_b = 1
        n_ev = st["evictions"]
        pending = st["pending"]
        if policy.evicts:
            do = jnp.any(pending & active)

            def evict(c):
                cap = policy.capacity(c.seen)
                keep = jnp.where(pending & active, jnp.minimum(c.length, cap), c.length)
                if first and question_first:
                    probe = _question_probe_mass(params, cfg, policy, c, padded, plen)
                    return policy.evict(c, out0.mass, probe, keep, cap_out,
                                        pinned=_question_pinned(policy, c, plen))
                probe = (_probe_mass(params, cfg, policy, c, x0, start, active, padded, n_pre)
                         if policy.needs_probe else None)
                return policy.evict(c, out0.mass, probe, keep, cap_out)

            cache = jax.lax.cond(do, evict, lambda c: kvc.resize(c, cap_out), cache)
            nfe_b = nfe_b + do.astype(jnp.int32) * int(policy.needs_probe)
            n_ev = n_ev + do.astype(jnp.int32)
            pending = pending & ~(pending & active)
        else:
            cache = kvc.resize(cache, cap_out)
        if sparse is None:
            segs = _dense_segments(cache, L)
        else:
            nd, ctx = sparse
            segs = ([Segment(0, nd, cache.context(0, nd))] if nd else []) + [Segment(nd, L, ctx)]

        # ---- denoising steps over the selected context
        def cond(s):
            x, step = s[0], s[1]
            return jnp.any((x == mask_id) & active[:, None]) & (step < bs + gen.steps_per_block)

        def body(s):
            x, step, key, nfe = s
            key, kk = jax.random.split(key)
            o = model_step(params, cfg, x, pos, _mask_all(b, bs), segs)
            lg = lm_head(params, cfg, o.hidden)
            if cfg.logits_shift:
                lg = shift_logits(lg, st["prev"])
            return commit(x, lg, step, m0, active, gen, mask_id, kk), step + 1, key, nfe + 1

        x, _, key, n_steps = jax.lax.while_loop(cond, body, (x, jnp.int32(1), key, jnp.int32(0)))
        # ---- commit forward: the finished block's K/V into the cache
        oc = model_step(params, cfg, x, pos, _mask_all(b, bs), segs)
        cache = kvc.append(cache, oc.k, oc.v, pos, jnp.where(active, bs, 0))
        prev = jnp.where(active[:, None], lm_head(params, cfg, oc.hidden[:, -1]), st["prev"])
        nfe_b = nfe_b + n_steps + 1

        old = jax.lax.dynamic_slice_in_dim(st["out"], st["blk"] * bs, bs, axis=1)
        out = jax.lax.dynamic_update_slice_in_dim(
            st["out"], jnp.where(active[:, None], x, old), st["blk"] * bs, axis=1)
        is_gen = pos >= plen[:, None]
        hit_eos = jnp.any(jnp.isin(x, jnp.asarray(cfg.eos_token_ids, jnp.int32)) & is_gen, axis=-1)
        finished = (start + bs >= plen + gen.max_new_tokens) | (hit_eos & gen.stop_at_eos)
        done = st["done"] | finished
        blk = st["blk"] + 1
        pending = pending | (policy.schedule(blk, cache) & ~done)
        return dict(
            cache=constrain_cache(cache), prev=prev, start=start + bs, blk=blk, done=done, pending=pending,
            out=out, key=key, nfe=st["nfe"] + jnp.where(active, nfe_b, 0),
            nfe_batch=st["nfe_batch"] + nfe_b,
            peak=jnp.maximum(st["peak"], held_bytes(cache)),
            peak_dense=jnp.maximum(st["peak_dense"], dense_bytes(cache)), evictions=n_ev)

    state = run_block(state, first_block, cap1, first=True)
    mask_block = jnp.full((b, bs), mask_id, jnp.int32)
    state = jax.lax.while_loop(
        lambda s: (s["blk"] < nblk) & ~jnp.all(s["done"]),
        lambda s: run_block(s, mask_block, cap1), state)
    c = state["cache"]
    return dict(out=state["out"], first_pos=n_pre, nfe=state["nfe"], nfe_batch=state["nfe_batch"],
                kv_bytes=held_bytes(c), dense_bytes=dense_bytes(c), kv_peak=state["peak"],
                dense_peak=state["peak_dense"], live=c.live().max(axis=(0, 2)),
                capacity=jnp.int32(c.capacity), evictions=state["evictions"], blocks=state["blk"])


# ----------------------------------------------------------------------------- bidirectional
def _bidirectional_core(params, prompt, plen, key, *, cfg: ModelConfig, gen: ResolvedGeneration,
                        policy, cache_dtype, phase: str = "all"):
    b, pb = prompt.shape
    bs = gen.block_size
    L, hkv, dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    mask_id = cfg.mask_token_id
    nblk = math.ceil(gen.max_new_tokens / bs)
    g = nblk * bs
    per_tok = memory.float_bytes_per_token(dh, cache_dtype)
    ppos = jnp.broadcast_to(jnp.arange(pb, dtype=jnp.int32), (b, pb))
    pvalid = ppos < plen[:, None]
    rpos = plen[:, None] + jnp.arange(g, dtype=jnp.int32)[None]
    all_pos = jnp.concatenate([ppos, rpos], axis=1)
    key_valid = jnp.concatenate([pvalid, jnp.ones((b, g), bool)], axis=1)
    full_mask = jnp.broadcast_to(key_valid[:, None, :], (b, pb + g, pb + g))
    refresh = gen.prompt_refresh if not policy.compresses_prompt else 0

    def full_pass(resp):
        """Forward of [prompt | response]: prompt K/V (the cache), response logits, last-prompt logits."""
        out = model_step(params, cfg, jnp.concatenate([prompt, resp], 1), all_pos, full_mask,
                         [Segment(0, L, None)])
        valid = jnp.broadcast_to(pvalid[None, :, None, :], (L, b, hkv, pb))
        cache = kvc.KVCache(k=out.k[:, :, :, :pb].astype(cache_dtype), v=out.v[:, :, :, :pb].astype(cache_dtype),
                            pos=jnp.where(valid, ppos[None, :, None, :], -1), valid=valid,
                            acc=jnp.zeros(valid.shape, jnp.float32), length=plen.astype(jnp.int32),
                            seen=plen.astype(jnp.int32))
        cache = constrain_cache(cache)  # no-op without a mesh
        last = lm_head(params, cfg, _row_take(out.hidden, plen - 1))
        return cache, lm_head(params, cfg, out.hidden[:, pb:]), last

    def resp_pass(cache, resp, rows=None):
        out = model_step(params, cfg, resp, rpos, _mask_all(b, g), _dense_segments(cache, L), rows)
        return out, lm_head(params, cfg, out.hidden)

    resp0 = jnp.full((b, g), mask_id, jnp.int32)
    cache, logits, last = full_pass(resp0)
    if phase == "prefill":  # timing runs: the first full pass builds the prompt cache
        return dict(prev=last, kv_bytes=memory.row_bytes(cache.valid, per_tok, policy.with_state))
    nfe = jnp.int32(1)
    peak_bytes = memory.row_bytes(cache.valid, per_tok, policy.with_state)
    if policy.compresses_prompt:  # MaskKV: one-shot compression with the response's mask queries
        # mask voting (maskkv.md Eq. 6): one softmax over [prompt | response] keys = the response's
        # own K/V passed as context with the block masked out; mass [L, B, Hkv, Pb + G]
        o, _ = resp_pass(cache, resp0)
        ctx = Context(*(jnp.concatenate([a, n.astype(a.dtype)], 3) for a, n in
                        ((cache.k, o.k), (cache.v, o.v), (cache.valid, jnp.ones(o.k.shape[:4], bool)))))
        vote = model_step(params, cfg, resp0, rpos, jnp.zeros((b, g, g), bool), [Segment(0, L, ctx)],
                          jnp.ones((b, g), bool))
        cache = policy.compress_prompt(cache, vote.mass, plen)
        nfe = nfe + 1
    active = jnp.ones((b,), bool)

    def body(s):
        resp, blk, step, bstep, cache, logits, last, key, nfe, m0 = s
        key, kk = jax.random.split(key)
        lg = shift_logits(logits, last) if cfg.logits_shift else logits
        # commit inside the current block only: view the block as [B, bs]
        xb = jax.lax.dynamic_slice_in_dim(resp, blk * bs, bs, axis=1)
        lb = jax.lax.dynamic_slice_in_dim(lg, blk * bs, bs, axis=1)
        xb = commit(xb, lb, bstep, m0, active, gen, mask_id, kk)
        resp = jax.lax.dynamic_update_slice_in_dim(resp, xb, blk * bs, axis=1)
        blk_done = ~jnp.any(xb == mask_id)
        nblk_ = jnp.where(blk_done, blk + 1, blk)
        m0n = jnp.where(blk_done, jnp.sum(jax.lax.dynamic_slice_in_dim(
            resp, jnp.minimum(nblk_, nblk - 1) * bs, bs, axis=1) == mask_id, -1), m0)
        step = step + 1

        def refresh_fn(args):
            c, r = args
            c2, lg2, last2 = full_pass(r)
            return c2, lg2, last2

        def reuse_fn(args):
            c, r = args
            _, lg2 = resp_pass(c, r)
            return c, lg2, last

        more = nblk_ < nblk
        if refresh:
            cache, logits, last = jax.lax.cond(step % refresh == 0, refresh_fn, reuse_fn, (cache, resp))
        else:
            cache, logits, last = reuse_fn((cache, resp))
        return (resp, nblk_, step, jnp.where(blk_done, 0, bstep + 1), cache, logits, last, key,
                nfe + more.astype(jnp.int32), m0n)

    m0 = jnp.sum(resp0[:, :bs] == mask_id, -1)
    s = (resp0, jnp.int32(0), jnp.int32(0), jnp.int32(0), cache, logits, last, key, nfe, m0)
    max_steps = nblk * (bs + gen.steps_per_block)  # a hard bound: every step commits >= 1 token
    s = jax.lax.while_loop(lambda s: (s[1] < nblk) & (s[2] < max_steps), body, s)
    resp, cache, nfe = s[0], s[4], s[8]
    kvb = memory.row_bytes(cache.valid, per_tok, policy.with_state,
                           getattr(policy, "count_kept_only", False))
    dense = memory.bf16_dense_bytes(L, hkv, dh, plen)
    return dict(out=resp, first_pos=plen, nfe=jnp.broadcast_to(nfe, (b,)), nfe_batch=nfe,
                kv_bytes=kvb, dense_bytes=dense, kv_peak=jnp.maximum(kvb, peak_bytes),
                dense_peak=dense, live=cache.live().max(axis=(0, 2)),
                capacity=jnp.int32(cache.capacity), evictions=jnp.int32(0), blocks=s[1])


# ----------------------------------------------------------------------------- public API
_CORES = {}


def _core_fn(cfg: ModelConfig, jit: bool):
    fn = _bidirectional_core if cfg.attention == "bidirectional" else _block_causal_core
    if not jit:
        return fn
    if fn not in _CORES:
        _CORES[fn] = jax.jit(fn, static_argnames=("cfg", "gen", "policy", "cache_dtype", "phase"))
    return _CORES[fn]


def _validate_prompts(prompts, cfg: ModelConfig, gen: ResolvedGeneration):
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = [list(map(int, p)) for p in np.asarray(prompts).reshape(len(prompts), -1)]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    for i, p in enumerate(prompts):
        if len(p) > gen.max_prompt_len:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens, more than max_prompt_len={gen.max_prompt_len}")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    total = max(len(p) for p in prompts) + gen.max_new_tokens + gen.block_size
    if total > cfg.max_position_embeddings:
        raise PromptTooLongError(
            f"prompt + max_new_tokens needs {total} positions, the model has "
            f"{cfg.max_position_embeddings}")
    return [list(map(int, p)) for p in prompts]


def prompt_bucket(n: int, quantum: int = 64) -> int:
    """Prompt-length bucket: the next multiple of `quantum`, so nearby lengths share a compile."""
    return _bucket(n, quantum)


def generate(model, prompts: Sequence[Sequence[int]], config: GenerationConfig = GenerationConfig(),
             policy=None, *, jit: bool = True, cache_dtype=None, bucket: int = 64,
             mesh=None) -> GenerateOutput:
    """Generate for a ragged batch of token-id prompts with a KV-cache policy (None = Dense).

    jit=False runs the very same functions eagerly (a plain-Python debug loop).
    cache_dtype defaults to the params' dtype.
    mesh: a jax.sharding.Mesh (see maskahead_jax.sharding.make_mesh, e.g. "data=2,model=4"):
    params / prompts are placed by the sharding rules and the same core runs under the mesh.
    """
    cfg: ModelConfig = model.config
    gen = config.resolve(cfg)
    policy = policy if policy is not None else Dense()
    if hasattr(policy, "validate"):
        policy.validate(cfg, gen)
    prompts = _validate_prompts(prompts, cfg, gen)
    dtype = jnp.dtype(cache_dtype or model.params["embed"].dtype)
    b = len(prompts)
    pb = prompt_bucket(max(len(p) for p in prompts), max(bucket, gen.block_size))
    arr = np.full((b, pb), cfg.mask_token_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    fn = _core_fn(cfg, jit)
    key = jax.random.PRNGKey(config.seed)
    args = (model.params, jnp.asarray(arr), jnp.asarray(plen), key)
    static = dict(cfg=cfg, gen=gen, policy=policy, cache_dtype=dtype)
    timings = {}
    if config.timings and jit and mesh is None:
        res, timings = _timed_run(fn, args, static)
    else:
        t0 = time.perf_counter()
        if mesh is not None:  # sharded run: see maskahead_jax/sharding.py
            from .sharding import run_sharded
            res = run_sharded(mesh, fn, model.params, arr, plen, key, jit=jit, **static)
        elif jit:
            res = fn(*args, **static)
        else:
            with jax.disable_jit():
                res = fn(*args, **static)
        res = jax.block_until_ready(res)
        timings = dict(total_s=time.perf_counter() - t0)
    res = jax.tree_util.tree_map(np.asarray, res)
    wall = timings["total_s"]
    out = _finish(res, prompts, cfg, gen, wall, policy)
    out.stats["timings"] = timings
    return out


def _timed_run(fn, args, static):
    """Per-phase wall times: compile (ahead of time), prefill (a prefill-only program of the same
    shapes), end to end, and decode = end to end - prefill. Each phase is compiled before timing."""
    t0 = time.perf_counter()
    full = fn.lower(*args, **static).compile()
    compile_s = time.perf_counter() - t0
    pre = fn.lower(*args, phase="prefill", **static).compile()
    jax.block_until_ready(pre(*args))  # warm
    t0 = time.perf_counter()
    jax.block_until_ready(pre(*args))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = jax.block_until_ready(full(*args))
    total_s = time.perf_counter() - t0
    return res, dict(compile_s=compile_s, prefill_s=prefill_s, total_s=total_s,
                     decode_s=max(total_s - prefill_s, 0.0))


def _finish(res, prompts, cfg: ModelConfig, gen: ResolvedGeneration, wall, policy) -> GenerateOutput:
    eos = set(cfg.eos_token_ids)
    toks = []
    n_gen = 0
    for i, p in enumerate(prompts):
        off = len(p) - int(res["first_pos"][i])  # generated tokens start after the prompt tail
        row = [int(t) for t in res["out"][i, off:off + gen.max_new_tokens]]
        if gen.stop_at_eos:
            for j, t in enumerate(row):
                if t in eos:
                    row = row[:j]
                    break
        n_gen += len(row)
        toks.append(row)
    kvb, dense = res["kv_bytes"], res["dense_bytes"]
    stats = dict(
        policy=getattr(policy, "name", type(policy).__name__),
        nfe=res["nfe"].tolist(), nfe_batch=int(res["nfe_batch"]),
        tokens_per_forward=n_gen / max(1, int(res["nfe_batch"])),
        kv_bytes_final=kvb.tolist(), kv_bytes_peak=res["kv_peak"].tolist(),
        dense_bytes_final=dense.tolist(), dense_bytes_peak=res["dense_peak"].tolist(),
        reduction_final=(dense / np.maximum(kvb, 1)).tolist(),
        reduction_peak=(res["dense_peak"] / np.maximum(res["kv_peak"], 1)).tolist(),
        live_entries=res["live"].tolist(), cache_capacity=int(res["capacity"]),
        evictions=int(res["evictions"]), blocks=int(res["blocks"]), wall_s=wall,
    )
    return GenerateOutput(tokens=toks, stats=stats)
