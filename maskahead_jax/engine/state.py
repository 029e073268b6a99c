"""Typed loop state of the block-causal engine, and the small helpers every core shares."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import memory
from ..model import Segment, StatsRequest, model_step
from ..model.layers import rope_tables


class BlockState(NamedTuple):
    """Carried through the block loop (lax.while_loop)."""

    cache: Any  # the policy's cache (cache.Cache)
    prev: jax.Array  # [B, V] logits at the last committed position (shifted-logits families)
    start: jax.Array  # [B] int32 first position of the next block
    blk: jax.Array  # int32 blocks run
    done: jax.Array  # [B] bool rows finished (EOS or max_new_tokens)
    due: jax.Array  # [B] bool a compression is due at the next block's step 0
    out: jax.Array  # [B, nblk * bs] int32 committed blocks
    key: jax.Array  # PRNG key
    nfe: jax.Array  # [B] int32 forwards that included the row
    nfe_batch: jax.Array  # int32 forwards of the batch
    peak: jax.Array  # [B] float32 peak bytes held
    peak_dense: jax.Array  # [B] float32 peak bytes of a bf16 cache of every seen token
    evictions: jax.Array  # int32 evictions run


def full_mask(b: int, t: int) -> jax.Array:
    return jnp.ones((b, t, t), bool)


def dense_segments(cache, num_layers: int) -> list[Segment]:
    """Every layer reads the whole cache."""
    return [Segment(0, num_layers, cache.context())]


def row_take(a, idx):
    """a [B, T, ...], idx [B] -> [B, ...]."""
    return jnp.take_along_axis(a, idx.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]


def probe_forward(params, cfg):
    """The narrow forward a policy's probes call: (cache, tokens, positions, mask, stats) -> the
    attention mass [L, B, Hkv, N] over the whole cache pooled as the StatsRequest `stats` says
    (or over rows [B, T] by the mean); nothing is written."""
    def forward(cache, tokens, positions, mask, stats):
        req = stats if isinstance(stats, StatsRequest) else StatsRequest(stats)
        return model_step(params, cfg, tokens, positions, mask,
                          dense_segments(cache, cfg.num_layers), req._replace(mass=True, moments=False)).mass
    return forward


def answer(cfg, req, out, last) -> dict:
    """The StepContext fields answering `req` (a StatsRequest or None) from the forward's
    output `out` (model.StepOutput) whose last position is `last` [B]: rows, mass and score,
    query moments with the RoPE phase (ctx.rope), the block's own K/V."""
    if req is None:
        return {}
    got = dict(rows=req.rows)
    if req.mass:
        got.update(mass=out.mass, score=out.score)
    if req.moments:
        got.update(queries=out.queries, rope=rope_last(cfg, last))
    if req.block_kv:
        got.update(block_kv=(out.k, out.v))
    return got


def rope_last(cfg, last) -> tuple:
    """(cos, sin) [B, 2, rope_dim] at positions (last - 1, last) of each row: the RoPE phase and
    per-position step of a forward whose last position is last [B] (ctx.rope)."""
    pos = jnp.stack([last - 1, last], axis=-1).astype(jnp.int32)
    return rope_tables(pos, cfg)


def dense_bytes(cfg, cache) -> jax.Array:
    """[B] bytes of a bf16 cache of every token the row has seen (the reduction's baseline)."""
    return memory.bf16_dense_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.seen)
