"""Tile loaders shared by the Pallas kernels: read one KV tile, return channel planes.

A loader turns the refs of one context tile into `cpb` arrays [tile, D/cpb] (float32 values
that the caller casts to its compute dtype).  The float loader returns the tile itself
(cpb = 1).  The packed loaders unpack 4-bit / 2-bit codes with shifts and masks (no int4
dtype, no lane interleave) and dequantize with the fp16 scale / zero of the tile:

* keys, per channel over 32 tokens: metadata [cpb, tile/32, Dp] (already in planes),
  expanded over the 32 tokens of each group with a sublane broadcast;
* values, per token over 32 channels: metadata [tile, D/32], expanded over the channels of
  each group with lane broadcasts (plane lane j is channel j*cpb + p, in group j // (32/cpb)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 32


def unpack_tile(codes: jax.Array, bits: int) -> list[jax.Array]:
    """uint8 codes [n, Dp] -> cpb float32 planes [n, Dp]."""
    c = codes.astype(jnp.int32)
    mask = (1 << bits) - 1
    return [((c >> (bits * p)) & mask).astype(jnp.float32) for p in range(8 // bits)]


def dequant_key_tile(codes, scale, zero, bits: int) -> list[jax.Array]:
    """codes [tile, Dp] uint8; scale, zero [cpb, tile/32, Dp] -> cpb planes [tile, Dp] f32."""
    planes = unpack_tile(codes, bits)
    tile, dp = codes.shape
    ng = tile // GROUP

    def expand(x):  # [ng, Dp] -> [tile, Dp]: each group row repeated over its 32 tokens
        return jnp.broadcast_to(x[:, None, :], (ng, GROUP, dp)).reshape(tile, dp)

    return [pl_ * expand(scale[p].astype(jnp.float32)) + expand(zero[p].astype(jnp.float32))
            for p, pl_ in enumerate(planes)]


def expand_value_meta(x: jax.Array, dp: int, cpb: int) -> jax.Array:
    """Per (token, channel group) metadata [tile, D/32] -> per plane lane [tile, Dp]."""
    tile, ng = x.shape
    x = x.astype(jnp.float32)
    lane_group = lax.broadcasted_iota(jnp.int32, (tile, dp), 1) // (GROUP // cpb)
    out = jnp.zeros((tile, dp), jnp.float32)
    for g in range(ng):
        out = jnp.where(lane_group == g, x[:, g:g + 1], out)
    return out


def dequant_value_tile(codes, scale, zero, bits: int) -> list[jax.Array]:
    """codes [tile, Dp] uint8; scale, zero [tile, D/32] -> cpb planes [tile, Dp] f32."""
    planes = unpack_tile(codes, bits)
    cpb = len(planes)
    dp = codes.shape[1]
    s = expand_value_meta(scale, dp, cpb)
    z = expand_value_meta(zero, dp, cpb)
    return [p * s + z for p in planes]
