"""Random parameter initialisation for any ModelConfig (tests, the testbed, profiling shapes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig


def _attn_shapes(cfg: ModelConfig, n: int) -> dict:
    d, h, hk, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = {"attn_norm": (n, d), "mlp_norm": (n, d), "wq": (n, d, h, dh), "wk": (n, d, hk, dh),
         "wv": (n, d, hk, dh), "wo": (n, h, dh, d)}
    if cfg.qkv_bias:
        s.update(bq=(n, h, dh), bk=(n, hk, dh), bv=(n, hk, dh))
    if cfg.qk_norm:
        s.update(q_norm=(n, dh), k_norm=(n, dh))
    return s


def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree as nested dicts of shapes (the converters validate against this)."""
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    nd = cfg.num_dense_mlp_layers
    out = {"embed": (v, d), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (d, v)
    if nd:
        layers = _attn_shapes(cfg, nd)
        layers["mlp"] = {"gate": (nd, d, f), "up": (nd, d, f), "down": (nd, f, d)}
        out["layers"] = layers
    nm = cfg.num_layers - nd
    if nm:
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        moe = {"router": (nm, d, e), "router_bias": (nm, e),
               "experts": {"gate": (nm, e, d, fe), "up": (nm, e, d, fe), "down": (nm, e, fe, d)}}
        if cfg.num_shared_experts:
            fs = fe * cfg.num_shared_experts
            moe["shared"] = {"gate": (nm, d, fs), "up": (nm, d, fs), "down": (nm, fs, d)}
        layers = _attn_shapes(cfg, nm)
        layers["moe"] = moe
        out["moe_layers"] = layers
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Normal(0, scale) weights, ones for norms, small random router bias."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    arrs = []
    for path, shp, k in zip(paths, leaves, keys):
        if "norm" in path:
            a = 1.0 + 0.1 * jax.random.normal(k, shp)
        elif "router_bias" in path:
            a = 0.1 * jax.random.normal(k, shp)
        else:
            a = scale * jax.random.normal(k, shp)
        arrs.append(a.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, arrs)
