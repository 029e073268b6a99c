"""Small building blocks: RMSNorm, rotary embeddings (NeoX rotate-half, full or partial), SwiGLU."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """y = w * (x / sqrt(mean(x^2) + eps)), computed in float32, cast back before the weight."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_tables(positions: jax.Array, rot_dim: int, theta: float):
    """cos/sin [B, T, rot_dim] for integer positions [B, T] (float32)."""
    inv = 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, rot/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


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
