"""The decoder as pure functions over a params pytree, layers stacked and run with `lax.scan`.

Params pytree (all linear kernels are [in, out]; each stack has a leading layer axis):

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when embeddings are tied)
    layers:      layers [0, n_dense_mlp) with a dense SwiGLU MLP
        attn_norm [L, D], mlp_norm [L, D],
        wq [L, D, H, Dh], wk [L, D, Hkv, Dh], wv [L, D, Hkv, Dh], wo [L, H, Dh, D],
        bq [L, H, Dh], bk/bv [L, Hkv, Dh]        (qkv_bias)
        q_norm [L, Dh], k_norm [L, Dh]            (qk_norm)
        mlp {gate [L, D, F], up [L, D, F], down [L, F, D]}
    moe_layers:  layers [n_dense_mlp, L) (LLaDA2.0): the same attention keys plus
        moe {router [L, D, E], router_bias [L, E], experts {gate/up [L, E, D, Fe], down [L, E, Fe, D]},
             shared {gate, up, down}}

One forward (`model_step`) runs a block of T tokens at given positions against an optional
per-layer context (cached K/V with validity), and returns the final hidden states, the
block's own K/V per layer (after RoPE, ready to append to a cache) and, when asked, the
step-0 statistics of every layer (prefix-only mass and value-aware score over the context) and
the moments of the pre-RoPE queries of chosen rows (Expected Attention's query statistics).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..kernels import masks
from ..kernels.attention import attend
from .layers import apply_rope, rms_norm, rope_tables, swiglu
from .moe import moe_mlp
from .stats import StatsRequest


class Context(NamedTuple):
    """Keys/values a block reads besides itself, for a contiguous range of layers.

    k, v [Lr, B, Hkv, S, D] (post-RoPE); valid [Lr, B, Hkv, S] bool.  Or packed: k a QuantKV with
    leading axes [Lr, B, Hkv] and v None (cache.packed.QKVCache.context()).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array


class Segment(NamedTuple):
    """Layers [start, stop) read `ctx` (None: only the block itself)."""

    start: int
    stop: int
    ctx: Optional[Context]


class StepOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm
    k: jax.Array  # [L, B, Hkv, T, Dh] the block's keys (post-RoPE)
    v: jax.Array  # [L, B, Hkv, T, Dh]
    mass: Optional[jax.Array]  # [L, B, Hkv, S] when stats were requested
    score: Optional[jax.Array]  # [L, B, Hkv, S]
    # (mean q [L, B, Hkv, G, Dh], mean q q^T [L, B, Hkv, G, Dh, Dh]) of the pre-RoPE queries of
    # the StatsRequest's rows, per query head, when requested (float32)
    queries: Optional[tuple] = None


def _qkv_pre_rope(p, x, cfg: ModelConfig):
    """Pre-norm q/k/v of one layer before RoPE: q [B, T, H, Dh], k/v [B, T, Hkv, Dh]."""
    h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    return q, k, v


def query_moments(p, x, cfg: ModelConfig, rows):
    """First and second moments of one layer's pre-RoPE queries over `rows` [B, T] (bool), per
    query head: (mean q [B, Hkv, G, Dh], mean q q^T [B, Hkv, G, Dh, Dh]), float32."""
    b, t, _ = x.shape
    q = _qkv_pre_rope(p, x, cfg)[0].astype(jnp.float32)
    q = q.reshape(b, t, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
    w = rows.astype(jnp.float32)
    w = w / jnp.maximum(w.sum(-1, keepdims=True), 1.0)
    m1 = jnp.einsum("bt,bthgd->bhgd", w, q)
    m2 = jnp.einsum("bt,bthgd,bthge->bhgde", w, q, q)
    return m1, m2


def project_qkv(p, x, cos, sin, cfg: ModelConfig):
    """Pre-norm q/k/v of one layer, RoPE applied: q [B, Hkv, G, T, Dh], k/v [B, Hkv, T, Dh]."""
    b, t, _ = x.shape
    q, k, v = _qkv_pre_rope(p, x, cfg)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    qg = q.reshape(b, t, cfg.num_kv_heads, cfg.group_size, cfg.head_dim).transpose(0, 2, 3, 1, 4)
    return qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def output_projection(p, out, cfg: ModelConfig):
    """Attention output [B, Hkv, G, T, Dh] -> [B, T, D] through wo."""
    b, _, _, t, _ = out.shape
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads, cfg.head_dim)
    return jnp.einsum("bthk,hkd->btd", out, p["wo"])


def dense_layer(p, x, cos, sin, cfg: ModelConfig, attention):
    """One dense-MLP layer around a given attention(q, k, v) -> [B, Hkv, G, T, Dh]: for passes
    with their own attention pattern (two-copy training, a long prefix with gradient).
    Returns (the layer's output [B, T, D], its keys / values [B, Hkv, T, Dh] after RoPE)."""
    q, k, v = project_qkv(p, x, cos, sin, cfg)
    x = x + output_projection(p, attention(q, k, v), cfg)
    return x + swiglu(p["mlp"], rms_norm(x, p["mlp_norm"], cfg.rms_eps)), k, v


def attention_sublayer(p, x, cos, sin, cfg: ModelConfig, ctx, blk_mask, stat_rows=None, pool: str = "mean"):
    """The attention sub-layer of one layer (pre-norm, before the residual add).

    ctx: None, or (k, v, valid) float [B, Hkv, S, Dh], or a packed QuantKV context (v None).
    stat_rows [B, T] / pool: the statistics to pool (StatsRequest.rows / .pool), or None.
    Returns (output [B, T, D], the block's keys/values [B, Hkv, T, Dh] after RoPE, stats)."""
    qg, kb, vb = project_qkv(p, x, cos, sin, cfg)
    # the implementation (reference jnp / Pallas kernels) is the trace's choice: kernels.attention
    out, stats = attend(qg, ctx, kb, vb, blk_mask, stat_rows, pool)
    return output_projection(p, out, cfg), kb, vb, stats


def _attention_block(p, x, cos, sin, cfg: ModelConfig, ctx, blk_mask, stat_rows, pool):
    out, kb, vb, stats = attention_sublayer(p, x, cos, sin, cfg, ctx, blk_mask, stat_rows, pool)
    return x + out, kb, vb, stats


def _layer(cfg: ModelConfig, moe: bool, with_stats: bool, moments: bool, pool: str, layer_hook=None):
    def body(carry, xs):
        x, cos, sin, blk_mask, stat_rows = carry
        p, ctx, layer = xs
        x_in = x
        qm = query_moments(p, x, cfg, stat_rows) if moments else ()
        x, kb, vb, stats = _attention_block(p, x, cos, sin, cfg, ctx, blk_mask,
                                            stat_rows if with_stats else None, pool)
        h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
        x = x + (moe_mlp(p["moe"], h, cfg) if moe else swiglu(p["mlp"], h))
        # a layer hook keeps what it makes of the layer's K/V instead of the K/V themselves
        kv = (kb, vb) if layer_hook is None else (layer_hook(layer, p, x_in, cos, sin, kb, vb), None)
        ys = kv + ((stats.mass, stats.score) if with_stats else ()) + tuple(qm)
        return (x, cos, sin, blk_mask, stat_rows), ys

    return body


def _slice(tree, a, b):
    return jax.tree_util.tree_map(lambda x: x[a:b], tree)


def _pieces(cfg: ModelConfig, segments: Sequence[Segment]):
    """Split the segments further at the dense-MLP / MoE stack boundary."""
    nd = cfg.num_dense_mlp_layers
    for s in segments:
        cuts = sorted({s.start, s.stop} | ({nd} if s.start < nd < s.stop else set()))
        for a, b in zip(cuts[:-1], cuts[1:]):
            yield a, b, s


def run_layers(params, cfg: ModelConfig, x, positions, blk_mask, segments: Sequence[Segment],
               stats: Optional[StatsRequest] = None, layer_hook=None) -> StepOutput:
    """Run every layer over the block x [B, T, D]; segments cover [0, L) in order. stats: what
    the forward also reports (model/stats.py): every layer's pooled prefix mass and value score
    (StepOutput.mass / .score; every segment then needs a context), the pre-RoPE query moments
    of the rows (StepOutput.queries).

    layer_hook(layer, p, x_in, cos, sin, k, v) -> pytree: called inside each layer with its
    index (traced), parameters, input hidden state and the block's K/V [B, Hkv, T, Dh]; what it
    returns is stacked over the layers as StepOutput.k (v None) instead of the K/V, so a pass can
    shrink each layer's K/V before the next layer runs (MaskKV layer by layer)."""
    if segments[0].start != 0 or segments[-1].stop != cfg.num_layers or any(
            a.stop != b.start for a, b in zip(segments[:-1], segments[1:])):
        raise ValueError(f"segments must tile [0, {cfg.num_layers}) in order: {segments}")
    cos, sin = rope_tables(positions, cfg)
    nd = cfg.num_dense_mlp_layers
    with_stats = stats is not None and stats.mass
    moments = stats is not None and stats.moments
    pool = "mean" if stats is None else stats.pool
    stat_rows = jnp.zeros(x.shape[:2], bool) if stats is None else stats.rows
    ks, vs, ms, ss, q1, q2 = [], [], [], [], [], []
    for a, b, seg in _pieces(cfg, segments):
        moe = a >= nd
        stack = params["moe_layers"] if moe else params["layers"]
        off = nd if moe else 0
        p = _slice(stack, a - off, b - off)
        ctx = None if seg.ctx is None else Context(*_slice(tuple(seg.ctx), a - seg.start, b - seg.start))
        seg_stats = with_stats and ctx is not None
        body = _layer(cfg, moe, seg_stats, moments, pool, layer_hook)
        (x, *_), ys = jax.lax.scan(body, (x, cos, sin, blk_mask, stat_rows),
                                   (p, ctx, jnp.arange(a, b, dtype=jnp.int32)))
        ks.append(ys[0])
        vs.append(ys[1])
        if moments:
            q1.append(ys[-2])
            q2.append(ys[-1])
        if with_stats:
            if seg_stats:
                ms.append(ys[2])
                ss.append(ys[3])
            else:
                raise ValueError("statistics need a context in every segment")
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    cat = lambda xs: xs[0] if len(xs) == 1 else jax.tree_util.tree_map(
        lambda *a: jnp.concatenate(a, axis=0), *xs)
    queries = (cat(q1), cat(q2)) if moments else None
    k, v = cat(ks), (None if layer_hook is not None else cat(vs))
    if with_stats:
        return StepOutput(h, k, v, cat(ms), cat(ss), queries)
    return StepOutput(h, k, v, None, None, queries)


def embed(params, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def lm_head(params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Logits in float32."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def model_step(params, cfg: ModelConfig, tokens, positions, blk_mask, segments,
               stats: Optional[StatsRequest] = None, layer_hook=None) -> StepOutput:
    """Embed tokens [B, T] at positions [B, T] and run all layers (see run_layers)."""
    return run_layers(params, cfg, embed(params, tokens), positions, blk_mask, segments, stats, layer_hook)


def block_causal_mask(positions: jax.Array, block_size: int) -> jax.Array:
    """[B, T, T]: query may read key iff block(key) <= block(query) (absolute positions)."""
    bq = positions[:, :, None] // block_size
    bk = positions[:, None, :] // block_size
    return bk <= bq


def full_mask(positions: jax.Array, attention: str, block_size: int,
              key_valid: Optional[jax.Array] = None) -> masks.PositionMask:
    """The self-attention mask of a whole sequence at `positions` [B, T], as a predicate of the
    positions (kernels.masks): O(T), never a [B, T, T] boolean until a short pass asks for it."""
    if attention == "bidirectional":
        return masks.bidirectional(positions, key_valid)
    if attention == "block_causal":
        return masks.block_causal(positions, block_size, key_valid)
    raise ValueError(f"attention must be 'bidirectional' or 'block_causal', got {attention!r}")


def forward_hidden(params, cfg: ModelConfig, tokens, positions=None, attention=None,
                   mask=None) -> jax.Array:
    """Uncached forward, final hidden states [B, T, D]. `mask` ([B, T, T] or a PositionMask)
    overrides `attention`."""
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if mask is None:
        mask = full_mask(positions, attention or cfg.attention, cfg.block_size)
    return model_step(params, cfg, tokens, positions, mask, [Segment(0, cfg.num_layers, None)]).hidden


def forward_logits(params, cfg: ModelConfig, tokens, positions=None, attention=None, mask=None):
    """Uncached forward, float32 logits [B, T, V] (unshifted: position i's own output)."""
    return lm_head(params, cfg, forward_hidden(params, cfg, tokens, positions, attention, mask))
