"""LLaDA2.0 / BailingMoeV2 mixture of experts: sigmoid router with expert bias for selection,
group-limited top-k, normalised weights times a routed scaling factor, plus a shared expert.

Dispatch computes only the selected experts: tokens are sorted by expert id and each expert's
slice runs through `jax.lax.ragged_dot`-free grouped matmuls (a gather of the chosen experts'
weights per (token, slot)), never a dense pass over all experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .layers import swiglu


def route(p: dict, x: jax.Array, cfg: ModelConfig):
    """Router.  x [N, D] -> (expert ids [N, k] int32, weights [N, k] float32)."""
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)  # [N, E]
    scores = jax.nn.sigmoid(logits)
    biased = scores + p["router_bias"].astype(jnp.float32)
    n, e = biased.shape
    if cfg.n_group > 1:
        per = e // cfg.n_group
        grouped = biased.reshape(n, cfg.n_group, per)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        gmask = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        biased = jnp.where(jnp.repeat(gmask, per, axis=1), biased, -jnp.inf)
    _, idx = jax.lax.top_k(biased, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.num_experts_per_tok > 1:  # as LLaDA2's gate: normalise iff top-k > 1 (norm_topk_prob unread)
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def moe_mlp(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [B, T, D] -> [B, T, D].  p: router [D, E], router_bias [E],
    experts {gate [E, D, F], up [E, D, F], down [E, F, D]}, shared {gate, up, down} (optional)."""
    b, t, d = x.shape
    xf = x.reshape(b * t, d)
    idx, w = route(p, xf, cfg)  # [N, k]
    n, k = idx.shape
    flat = idx.reshape(-1)  # [N*k]
    order = jnp.argsort(flat)
    tok = (jnp.arange(n * k) // k)[order]
    sorted_e = flat[order]
    xs = xf[tok]  # [N*k, D]
    group_sizes = jnp.bincount(sorted_e, length=cfg.num_experts).astype(jnp.int32)
    ex = p["experts"]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, ex["gate"], group_sizes)) * jax.lax.ragged_dot(
        xs, ex["up"], group_sizes)
    ys = jax.lax.ragged_dot(h.astype(x.dtype), ex["down"], group_sizes)  # [N*k, D]
    ws = w.reshape(-1)[order]  # float32
    # LLaDA2 moe_infer: weighted sum over the k experts in float32, cast to the model dtype,
    # then the shared expert is added in the model dtype.
    out = jnp.zeros((n, d), jnp.float32).at[tok].add(ys.astype(jnp.float32) * ws[:, None])
    out = out.astype(x.dtype)
    if "shared" in p:
        out = out + swiglu(p["shared"], xf)
    return out.reshape(b, t, d).astype(x.dtype)
