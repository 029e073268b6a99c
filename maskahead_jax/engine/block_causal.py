"""The block-causal core (Fast-dLLM v2, SDAR, DreamReasoner, LLaDA2.0): chunked prefill of the
block-aligned prompt prefix, then blocks until every row is done. The prompt tail opens the
first block. Everything here is traced once per (batch, prompt bucket, policy) shape.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..model import lm_head
from ..policies.protocol import StepContext
from ..sharding import constrain_cache
from .block import run_block
from .prefill import prefill
from .state import BlockState, dense_bytes, probe_forward


def block_causal_core(params, prompt, plen, key, draft=None, prefilled=None, *, cfg, gen, policy, cache_dtype,
                      phase: str = "all"):
    """Prefill, then blocks until every row is done. phase "prefill" stops after the prefill and
    also returns its `state` (cache, logits, peak); phase "decode" starts from such a `prefilled`
    state (timing the decode alone: experiments/bench_long_context.py)."""
    policy = policy.for_run(cfg, gen)  # automatic knobs fixed (a static, hashable policy)
    b, pb = prompt.shape
    bs, chunk, mask_id = gen.block_size, gen.prefill_chunk, cfg.mask_token_id
    n_chunks = max(1, math.ceil(pb / chunk))
    nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
    prompt_cap = n_chunks * chunk
    total_cap = max(prompt_cap, pb + (nblk + 1) * bs)
    cap0, cap1 = policy.plan(prompt_cap, total_cap, bs, chunk)

    n_pre = (plen // bs) * bs
    padded = jnp.pad(prompt, ((0, 0), (0, prompt_cap + bs - pb)), constant_values=mask_id)
    ctx = StepContext(forward=probe_forward(params, cfg), prompt=padded, plen=plen, n_pre=n_pre,
                      block_size=bs, mask_id=mask_id, capacity=cap0, active=jnp.ones((b,), bool),
                      draft=draft)
    if phase == "decode":
        cache, prev_logits, peak0 = prefilled
    else:
        cache = policy.empty_cache(cfg.num_layers, b, cfg.num_kv_heads, cap0, cfg.head_dim, cache_dtype,
                                   group_size=cfg.group_size)
        cache, last_h, peak0 = prefill(params, cfg, gen, policy, constrain_cache(cache), ctx, n_chunks)
        prev_logits = lm_head(params, cfg, last_h)
    if phase == "prefill":  # timing runs: stop after the prompt is in the cache
        return dict(prev=prev_logits, kv_bytes=policy.held_bytes(cache), state=(cache, prev_logits, peak0))

    # first block: the prompt tail, then masks
    idx = n_pre[:, None] + jnp.arange(bs)[None]
    tail = jnp.take_along_axis(padded, idx, axis=1)
    first_block = jnp.where(idx < plen[:, None], tail, mask_id).astype(jnp.int32)
    st = BlockState(
        cache=cache, prev=prev_logits, start=n_pre.astype(jnp.int32), blk=jnp.int32(0),
        done=jnp.zeros((b,), bool), due=policy.due_after_prefill(cache),
        out=jnp.full((b, nblk * bs), mask_id, jnp.int32), key=key,
        nfe=jnp.zeros((b,), jnp.int32), nfe_batch=jnp.int32(1 if pb else 0) * n_chunks,
        peak=jnp.maximum(peak0, policy.held_bytes(cache)), peak_dense=dense_bytes(cfg, cache),
        evictions=jnp.int32(0))

    ctx = ctx._replace(capacity=cap1)
    mask_block = jnp.full((b, bs), mask_id, jnp.int32)
    more = lambda s: (s.blk < nblk) & ~jnp.all(s.done)
    if cap0 != cap1 or policy.first_block_special:
        # the first block changes the cache's shape (or the policy treats it apart): run it
        # before the loop, which then traces the block a second time
        st = run_block(params, cfg, gen, policy, st, first_block, ctx._replace(first=True))
        st = jax.lax.while_loop(more, lambda s: run_block(params, cfg, gen, policy, s, mask_block, ctx), st)
    else:  # one traced block (half the compile): the first iteration opens with the prompt tail
        st = jax.lax.while_loop(more, lambda s: run_block(
            params, cfg, gen, policy, s, jnp.where(s.blk == 0, first_block, mask_block), ctx), st)
    c = st.cache
    return dict(out=st.out, first_pos=n_pre, nfe=st.nfe, nfe_batch=st.nfe_batch,
                kv_bytes=policy.held_bytes(c), dense_bytes=dense_bytes(cfg, c), kv_peak=st.peak,
                dense_peak=st.peak_dense, live=c.live().max(axis=(0, 2)),
                seen=c.seen, capacity=jnp.int32(c.capacity), evictions=st.evictions, blocks=st.blk,
                # NaN / inf reach every later forward through the cache: the last logits tell
                nonfinite=~jnp.all(jnp.isfinite(st.prev), axis=-1))
