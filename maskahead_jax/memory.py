"""KV memory accounting, the paper's metric (research/maskahead.md §4 "Memory accounting").

Method cost per batch row = (bytes per token per (layer, KV head) of the stored format) x
(layers x KV heads x the row's rectangular extent, i.e. its longest lane: padding slots count)
+ eviction state (10 bytes per kept entry per (layer, KV head): fp32 score, int16 age, int32
position) for policies that keep such state. Baseline = a bfloat16 K+V cache of every token the
row has seen: 2 * 2 B * D per token per (layer, KV head). All numbers come from the actual
arrays (their dtypes and validity masks), as float32 to avoid integer overflow.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

EVICTION_STATE_BYTES = 10


def bf16_dense_bytes(num_layers: int, kv_heads: int, head_dim: int, seen: jax.Array) -> jax.Array:
    """[B] bytes of a bf16 K+V cache holding every seen token."""
    return seen.astype(jnp.float32) * (4.0 * head_dim * num_layers * kv_heads)


def row_bytes(valid: jax.Array, bytes_per_token: float, with_state: bool,
              kept_only: bool = False) -> jax.Array:
    """[B] bytes held per row.  valid [L, B, Hkv, N]: kept entries.

    The rectangular extent is the highest occupied slot + 1 over the row's lanes. kept_only
    (ragged per-head budgets, MaskKV's flattened variable-length layout): count only the kept
    entries instead of the rectangular extent."""
    l, _, h, n = valid.shape
    if kept_only:
        out = valid.sum(axis=(0, 2, 3)).astype(jnp.float32) * bytes_per_token
    else:
        slot = jnp.arange(1, n + 1, dtype=jnp.int32)
        extent = jnp.max(jnp.where(valid, slot, 0), axis=(0, 2, 3)).astype(jnp.float32)  # [B]
        out = extent * (l * h * bytes_per_token)
    if with_state:
        out = out + valid.sum(axis=(0, 2, 3)).astype(jnp.float32) * EVICTION_STATE_BYTES
    return out


def float_bytes_per_token(head_dim: int, dtype) -> float:
    """K + V bytes per token per (layer, KV head) for a float cache of `dtype`."""
    return 2.0 * head_dim * jnp.dtype(dtype).itemsize


def reduction(dense_bytes, kv_bytes):
    """Memory reduction factor (dense-equivalent / held)."""
    return dense_bytes / jnp.maximum(kv_bytes, 1.0)
