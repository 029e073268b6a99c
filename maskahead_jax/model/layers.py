"""Small building blocks: RMSNorm, rotary embeddings (NeoX rotate-half, full or partial), SwiGLU."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .rope import RopeScaling
from .rope_frequencies import frequencies


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """y = w * (x / sqrt(mean(x^2) + eps)), computed in float32, cast back before the weight."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_tables(positions: jax.Array, cfg_or_dim, theta: Optional[float] = None,
                scaling: Optional[RopeScaling] = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, rot_dim] float32 for integer positions [B, T].

    `rope_tables(positions, cfg)` reads rope_dim / rope_theta / rope_scaling from a ModelConfig;
    `rope_tables(positions, rot_dim, theta, scaling=None)` takes them as given. A scaling's
    attention factor (yarn, longrope) multiplies cos and sin, as transformers does."""
    if theta is None:
        rot_dim, theta, scaling = cfg_or_dim.rope_dim, cfg_or_dim.rope_theta, cfg_or_dim.rope_scaling
    else:
        rot_dim = cfg_or_dim
    inv, att = frequencies(positions, rot_dim, theta, scaling)
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, rot/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if not (isinstance(att, float) and att == 1.0):  # (traced for dynamic_yarn at its own length)
        cos, sin = cos * jnp.asarray(att, jnp.float32), sin * jnp.asarray(att, jnp.float32)
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rot_dim dims of x [B, T, H, D] (NeoX rotate-half); the rest pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = (xr.astype(jnp.float32) * c + rotated.astype(jnp.float32) * s).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)); p = {gate [D, F], up [D, F], down [F, D]}."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
