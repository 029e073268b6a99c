"""Chunked block-causal prefill of the block-aligned prompt prefix into the policy's cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..model import block_causal_mask, model_step
from .state import answer, dense_segments, row_take


def prefill(params, cfg, gen, policy, cache, ctx, n_chunks: int):
    """Store the first n_pre[b] prompt tokens of each row, `gen.prefill_chunk` at a time, calling
    the policy's `on_prefill_chunk` after each chunk (bounded prefill evicts there; the baselines
    that evict at the end of a block compress the prompt at its final chunk).

    Each chunk's forward also answers the policy's `prefill_stats_request`: e.g. the prefix mass
    of the chunk's queries over the cache before the chunk (H2O's observation), their pre-RoPE
    query moments (Expected Attention); the hook reads them as ctx.mass / ctx.queries, with
    ctx.rows, ctx.start (the chunk's first position), ctx.tokens, ctx.appended (entries stored
    per row) and ctx.rope.

    ctx: the policy StepContext (prompt, plen, n_pre, capacity = the prefill buffer); the
    prompt is padded to n_chunks * chunk + one block.
    Returns (cache, hidden state at the last stored position [B, H], peak bytes held [B]).
    """
    b = ctx.prompt.shape[0]
    chunk, bs, L = gen.prefill_chunk, gen.block_size, cfg.num_layers

    def step(c, carry):
        cache, last_h, peak = carry
        start = c * chunk
        toks = jax.lax.dynamic_slice_in_dim(ctx.prompt, start, chunk, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        n_valid = jnp.clip(ctx.n_pre - start, 0, chunk)
        valid = jnp.arange(chunk)[None, :] < n_valid[:, None]
        mask = block_causal_mask(pos, bs) & valid[:, None, :]
        req = policy.prefill_stats_request(valid)
        out = model_step(params, cfg, toks, pos, mask, dense_segments(cache, L), req)
        cache = cache.append(out.k, out.v, pos, n_valid)
        peak = jnp.maximum(peak, policy.held_bytes(cache))
        j = ctx.n_pre - 1 - start
        hit = (j >= 0) & (j < chunk)
        last_h = jnp.where(hit[:, None], row_take(out.hidden, jnp.clip(j, 0, chunk - 1)), last_h)
        cctx = ctx._replace(tokens=toks, start=pos[:, 0], appended=n_valid,
                            **answer(cfg, req, out, start + jnp.maximum(n_valid, 2) - 1))
        return policy.on_prefill_chunk(cache, cctx), last_h, peak

    last_h = jnp.zeros((b, cfg.hidden_size), params["final_norm"].dtype)
    peak = jnp.zeros((b,), jnp.float32)
    return jax.lax.fori_loop(0, n_chunks, step, (cache, last_h, peak))
