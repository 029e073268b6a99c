"""jnp reference of the scored attention over a packed (QuantKV) context.

Same contract as `reference.attention`, except that the context is a `QuantKV` with leading
axes [B, Hkv] (one layer of the cache) and is dequantized inside the computation (float32).
This is what the packed Pallas kernels are tested against; it is in turn tested against
`reference.attention` on dequantize(quantize(.)) inputs.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import quant
from . import reference


def attention_quant(q: jax.Array, ctx: quant.QuantKV, ctx_valid: jax.Array, k_blk: jax.Array,
                    v_blk: jax.Array, blk_mask: jax.Array, stat_rows: Optional[jax.Array] = None,
                    pool: str = "mean"):
    """q [B, Hkv, G, T, D]; ctx QuantKV over [B, Hkv, S, D]; ctx_valid [B, Hkv, S].

    Returns (out [B, Hkv, G, T, D] in q.dtype, ScoredStats [B, Hkv, S] or None).
    """
    k_ctx, v_ctx = quant.dequantize_kv(ctx, jnp.float32)
    return reference.attention_any(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask, stat_rows, pool)
