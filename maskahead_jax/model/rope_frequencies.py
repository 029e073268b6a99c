"""RoPE frequencies of a RopeScaling (model/rope.py): the inverse frequencies [rot_dim / 2] and
the attention factor that multiplies cos and sin, for each type as transformers'
`modeling_rope_utils.py` computes them (float32 where it uses float32), and for dynamic_yarn
(ours) as YaRN of the factor the length needs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ConfigError
from .rope import RopeScaling


def _arange_f32(n: int, step: int = 1) -> np.ndarray:
    return np.arange(0, n, step).astype(np.float32)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def static_frequencies(rot_dim: int, theta: float, s: Optional[RopeScaling],
                       seq_len: Optional[int] = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rot_dim / 2] float32, attention factor) for a known sequence length
    (dynamic / longrope: seq_len, else s.seq_len, else the original length)."""
    dim = rot_dim
    base_f = np.float32(theta) ** (_arange_f32(dim, 2) / np.float32(dim))
    plain = (np.float32(1.0) / base_f).astype(np.float32)
    if s is None:
        return plain, 1.0
    t = s.type
    n = seq_len if seq_len is not None else (s.seq_len or None)
    if t == "linear":
        return (plain / np.float32(s.factor)).astype(np.float32), 1.0
    if t == "dynamic":
        orig = s.original_max_position_embeddings
        length = np.float32(max(n or orig, orig))
        grow = (np.float32(s.factor) * length / np.float32(orig)) - np.float32(s.factor - 1)
        base = np.float32(theta) * grow ** np.float32(dim / (dim - 2))
        inv = np.float32(1.0) / (base ** (_arange_f32(dim, 2) / np.float32(dim)))
        return inv.astype(np.float32), 1.0
    if t == "yarn":
        return _yarn(dim, theta, s, base_f)
    if t == "dynamic_yarn":  # the factor this length needs, at most s.factor
        orig = s.original_max_position_embeddings
        return _yarn(dim, theta, dataclasses.replace(s, factor=min(s.factor, max(1.0, (n or orig) / orig))), base_f)
    if t == "llama3":
        return _llama3(s, plain), 1.0
    # longrope
    ext = s.long_factor if (n is not None and n > s.original_max_position_embeddings) else s.short_factor
    if len(ext) != dim // 2:
        raise ConfigError(f"rope_scaling (longrope): short_factor / long_factor need {dim // 2} entries "
                          f"(rotary dim {dim} / 2), got {len(ext)}")
    inv = np.float32(1.0) / (np.asarray(ext, np.float32) * base_f)
    return inv.astype(np.float32), _longrope_attention(s)


def _longrope_attention(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def _yarn_attention(s: RopeScaling, f: float) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return float(_mscale(f, s.mscale) / _mscale(f, s.mscale_all_dim))
    return _mscale(f)


def _yarn_keep(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """[dim / 2] YaRN's ramp: 1 where a frequency keeps its original value, 0 where it is divided by
    the factor (independent of the factor)."""
    orig = s.original_max_position_embeddings
    # the dimension whose wavelength makes `rot` turns over the original length
    corr = lambda rot: (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
    low, high = corr(s.beta_fast), corr(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    return (np.float32(1) - ramp).astype(np.float32)


def _yarn(dim: int, theta: float, s: RopeScaling, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    f = s.factor
    extrap = _yarn_keep(dim, theta, s)  # 1: keep the original frequency
    inv_ext = np.float32(1.0) / pos_freqs
    inv_int = np.float32(1.0) / (np.float32(f) * pos_freqs)
    return (inv_int * (np.float32(1) - extrap) + inv_ext * extrap).astype(np.float32), _yarn_attention(s, f)


def _dynamic_yarn(dim: int, theta: float, s: RopeScaling, f: jax.Array) -> tuple[jax.Array, jax.Array]:
    """_yarn with a traced factor f (any shape S): inverse frequencies [*S, dim / 2] (for S = [B, 1]:
    [B, dim / 2]) and the attention factor, an array of shape S."""
    plain = 1.0 / jnp.asarray(np.float32(theta) ** (_arange_f32(dim, 2) / np.float32(dim)))
    keep = jnp.asarray(_yarn_keep(dim, theta, s))
    inv = plain / f * (1.0 - keep) + plain * keep
    if s.attention_factor is not None:
        return inv, jnp.full(jnp.shape(f), s.attention_factor, jnp.float32)
    ms = lambda m: jnp.where(f <= 1.0, 1.0, 0.1 * m * jnp.log(f) + 1.0)
    att = ms(s.mscale) / ms(s.mscale_all_dim) if (s.mscale and s.mscale_all_dim) else ms(1.0)
    return inv, att.astype(jnp.float32)


def _llama3(s: RopeScaling, inv: np.ndarray) -> np.ndarray:
    old = s.original_max_position_embeddings
    low_wl, high_wl = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wl, inv / np.float32(s.factor), inv).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(s.low_freq_factor))
              / np.float32(s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = (np.float32(1) - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def frequencies(positions: jax.Array, rot_dim: int, theta: float,
                s: Optional[RopeScaling]) -> tuple[jax.Array, float]:
    """(inverse frequencies [rot_dim / 2] float32, attention factor) for a forward at positions
    [B, T]: a length-dependent type with seq_len 0 reads the forward's largest position + 1
    (transformers' rule), except dynamic_yarn (ours), which reads each row's own largest position
    + 1 and returns inv [B, 1, rot_dim / 2], att [B, 1, 1]: a training batch mixes plain windows
    with skip-wise ones up to 32k, and each row must see the factor its length gets at inference."""
    if s is None:
        return 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)), 1.0
    if not s.length_dependent or s.seq_len:
        inv, att = static_frequencies(rot_dim, theta, s)
        return jnp.asarray(inv), att
    orig = s.original_max_position_embeddings
    if s.type == "dynamic_yarn":  # each row's own factor (traced): inv [B, 1, rot/2], att [B, 1, 1]
        rows = jnp.max(positions, axis=-1).astype(jnp.float32) + 1.0  # [B]
        inv, att = _dynamic_yarn(rot_dim, theta, s, jnp.clip(rows / orig, 1.0, s.factor)[:, None])
        return inv[:, None, :], att[:, None]
    length = jnp.max(positions).astype(jnp.int32) + 1
    if s.type == "longrope":
        short, att = static_frequencies(rot_dim, theta, s, seq_len=orig)
        long, _ = static_frequencies(rot_dim, theta, s, seq_len=orig + 1)
        return jnp.where(length > orig, jnp.asarray(long), jnp.asarray(short)), att
    # dynamic NTK, in float32 as transformers computes it from a tensor length
    dim = rot_dim
    n = jnp.maximum(length, orig).astype(jnp.float32)
    base = jnp.float32(theta) * ((jnp.float32(s.factor) * n / jnp.float32(orig)) - jnp.float32(s.factor - 1)) \
        ** jnp.float32(dim / (dim - 2))
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / jnp.float32(dim))), 1.0
