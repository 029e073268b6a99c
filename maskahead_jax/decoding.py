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

The schedule splits a count N over the S = steps_per_block steps (N // S each, +1 for the first
N % S steps); a step never commits less than one token while masks remain, nor more than the
masks left. N is the rule's own (`SCHEDULE_BASIS`):

  "block"  N = block size: SDAR's `get_num_transfer_tokens(block_length, steps)`, LLaDA2.0's
           `_get_num_transfer_tokens(block_length, steps)`, and the released MaskAhead drivers of
           SDAR / DreamReasoner (`get_num_transfer_tokens(block, steps)`). Rules dynamic and
           dream_reasoner.
  "masks"  N = the block's masks at its first step: LLaDA's `get_num_transfer_tokens(mask_index,
           steps)`. Rule llada.

They agree when S = block size (one token per step) and differ when S < block size and the
block starts with prompt tokens: block 8, S 4 and 3 prompt tokens, nothing above the threshold,
commit 2, 2, 1 (then done) under "block" and 2, 1, 1, 1 under "masks". Not reproduced from SDAR's own generate.py: when the top-k
fallback asks for more tokens than masks are left, its unclipped `torch.topk` also picks
unmasked positions and overwrites them (prompt tail included) with the model's guess; LLaDA2.0
and the released MaskAhead drivers clip the count to the masks left, as we do.
Ties break to the lowest index.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ResolvedGeneration

# the count each scheduled rule splits over the steps: the block size, or the block's initial masks
SCHEDULE_BASIS = {"dynamic": "block", "dream_reasoner": "block", "llada": "masks"}


def scheduled_count(n: jax.Array, step: jax.Array, steps: int) -> jax.Array:
    """Tokens to commit at `step` when n [B] tokens are split over `steps` steps."""
    base, rem = n // steps, n % steps
    return base + (step < rem).astype(jnp.int32)


def schedule_total(rule: str, m0: jax.Array, block_size: int) -> jax.Array:
    """The count N [B] that `rule` splits over the steps (see SCHEDULE_BASIS)."""
    if SCHEDULE_BASIS[rule] == "block":
        return jnp.full_like(m0, block_size)
    return m0


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
    """One denoising step: returns the block with the chosen masked positions filled.

    x [B, Bs] the block, logits [B, Bs, V] aligned to it, step the block's step index (0 first),
    m0 [B] the block's masks at step 0 (read by the "masks" schedule), active [B] rows still
    decoding."""
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
        n = schedule_total(gen.commit_rule, m0, bs)
        k = jnp.minimum(jnp.maximum(scheduled_count(n, step, gen.steps_per_block), 1), n_cand)
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
