"""Per-step token commit rules of the block-diffusion families (pure, jittable).

All rules see the current block x [B, Bs], float32 logits [B, Bs, V] already aligned to the
block's positions (token shift applied by the caller), and decide which masked positions to
fill this step:

  fast_dllm       inside the first sub-block that still has masks: every masked position with
                  confidence > threshold, plus always the single most confident one.
  dynamic         LLaDA2.0 / SDAR: all above the threshold if at least the scheduled count,
                  otherwise the scheduled top-k by confidence.
  dream_reasoner  as dynamic, and the last scheduled step accepts everything left.
  llada           top-k by confidence on the fixed per-block schedule.

The schedule splits the block's initial mask count M over S steps (M // S each, +1 for the first
M % S steps), never less than one token while masks remain. Ties break to the lowest index.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ResolvedGeneration


def scheduled_count(m0: jax.Array, step: jax.Array, steps: int) -> jax.Array:
    """Tokens to commit at `step` for a block that started with m0 [B] masks."""
    base, rem = m0 // steps, m0 % steps
    return base + (step < rem).astype(jnp.int32)


def propose(logits: jax.Array, gen: ResolvedGeneration, key, mask_id: int):
    """Candidate tokens and their confidence p(x̂) under softmax(logits).

    The mask token itself is never proposed (its logit is dropped), so every step that commits
    a position makes progress."""
    logits = logits.at[..., mask_id].set(-jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if gen.temperature <= 0.0:
        xhat = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        lg = logits / gen.temperature
        if gen.top_p < 1.0:
            sp = jnp.sort(jax.nn.softmax(lg, -1), axis=-1)[..., ::-1]
            cum = jnp.cumsum(sp, -1)
            # smallest prob kept: the first index where cumulative mass exceeds top_p
            cut_idx = jnp.sum(cum < gen.top_p, axis=-1, keepdims=True)
            cutoff = jnp.take_along_axis(sp, cut_idx, axis=-1)
            lg = jnp.where(jax.nn.softmax(lg, -1) < cutoff, -jnp.inf, lg)
        xhat = jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)
    conf = jnp.take_along_axis(probs, xhat[..., None], axis=-1)[..., 0]
    return xhat, conf


def commit(x, logits, step, m0, active, gen: ResolvedGeneration, mask_id: int, key):
    """One denoising step: returns the block with the chosen masked positions filled."""
    b, bs = x.shape
    masked = (x == mask_id) & active[:, None]
    xhat, conf = propose(logits, gen, key, mask_id)
    sub = gen.sub_block_size
    if sub < bs:
        has = masked.reshape(b, bs // sub, sub).any(-1)
        first = jnp.argmax(has, axis=1)
        cand = masked & ((jnp.arange(bs) // sub)[None, :] == first[:, None])
    else:
        cand = masked
    c = jnp.where(cand, conf, -jnp.inf)
    n_cand = cand.sum(-1)
    if gen.commit_rule == "fast_dllm":
        best = jax.nn.one_hot(jnp.argmax(c, axis=-1), bs, dtype=bool) & (n_cand > 0)[:, None]
        take = (cand & (conf > gen.threshold)) | best
    else:
        k = jnp.minimum(jnp.maximum(scheduled_count(m0, step, gen.steps_per_block), 1), n_cand)
        order = jnp.argsort(-c, axis=-1, stable=True)
        rank = jnp.argsort(order, axis=-1, stable=True)
        topk = cand & (rank < k[:, None])
        if gen.commit_rule == "llada":
            take = topk
        else:
            above = cand & (conf > gen.threshold)
            take = jnp.where((above.sum(-1) >= k)[:, None], above, topk)
            if gen.commit_rule == "dream_reasoner":
                take = jnp.where(step >= gen.steps_per_block - 1, cand, take)
    return jnp.where(take, xhat, x)


def shift_logits(logits: jax.Array, prev: jax.Array) -> jax.Array:
    """Token shift: block position j reads the output at j-1; position 0 reads `prev` [B, V]."""
    return jnp.concatenate([prev[:, None, :], logits[:, :-1]], axis=1)
