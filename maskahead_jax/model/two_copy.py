"""The block-diffusion training forward in the two-copy layout, without a dense 2L x 2L mask.

The sequence is [x_t | x_0] (noisy copy, then clean copy, positions arange(L) twice):
x_t block b reads itself (bidirectionally) and x_0 blocks < b; x_0 is block-causal. A dense
mask over the 2L tokens computes 4 L^2 logits of which about L^2 are read. Here each copy's
queries are taken in chunks of `chunk` rows that score only the clean keys up to the chunk's
end, and a noisy block scores its own block's keys separately, with one joint softmax over both
parts: about 2 (C + 1) / (2 C) L^2 logits for C chunks (1.2 L^2 at C = 5). Same numbers as
`forward_hidden` with the dense two-copy mask (tests/test_two_copy.py); forward + backward
of the testbed 5.1x faster at 2048 x 2 on a 2-core CPU (experiments/bench_two_copy.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..kernels.reference import NEG_INF
from .decoder import dense_layer, embed
from .layers import rms_norm, rope_tables


def two_copy_mask(L: int, block: int) -> np.ndarray:
    """[2L, 2L] bool, the dense reference layout: query i may read key j (rows / keys [0, L) x_t,
    [L, 2L) x_0). `forward_hidden(..., mask=)` with it gives what two_copy_hidden computes."""
    i = np.arange(2 * L)
    clean, blk = i >= L, (i % L) // block
    qc, kc = clean[:, None], clean[None, :]
    qb, kb = blk[:, None], blk[None, :]
    return ((~qc & ~kc & (qb == kb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb)))


def two_copy_attention(q, k, v, L: int, block: int, chunk: int):
    """q [B, Hkv, G, 2L, D], k/v [B, Hkv, 2L, D] (rows / keys [0, L) are x_t, [L, 2L) x_0).

    Returns the attention output [B, Hkv, G, 2L, D] in q's dtype."""
    if L % block or chunk % block:
        raise ValueError(f"L ({L}) and chunk ({chunk}) must be multiples of the block ({block})")
    bsz, hk, g, _, d = q.shape
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qn, qc = q[..., :L, :], q[..., L:, :]
    kn, kc = k[..., :L, :], k[..., L:, :]
    vn, vc = v[..., :L, :], v[..., L:, :]
    nb = L // block
    # x_t's own-block logits: [B, Hkv, G, nb, block (query), block (key)]
    own = jnp.einsum("bhgnqd,bhnkd->bhgnqk", qn.reshape(bsz, hk, g, nb, block, d),
                     kn.reshape(bsz, hk, nb, block, d), preferred_element_type=jnp.float32) * scale
    own = own.reshape(bsz, hk, g, L, block)
    vn_blocks = vn.reshape(bsz, hk, nb, block, d)

    def over(qrows, keys, a, e, strict):
        lg = jnp.einsum("bhgtd,bhsd->bhgts", qrows, keys, preferred_element_type=jnp.float32) * scale
        qb = jnp.arange(a, e) // block
        kb = jnp.arange(keys.shape[2]) // block
        ok = (kb[None, :] < qb[:, None]) if strict else (kb[None, :] <= qb[:, None])
        return jnp.where(ok, lg, NEG_INF)

    out_n, out_c = [], []
    for a in range(0, L, chunk):
        e = min(a + chunk, L)
        # clean rows: block-causal over the clean keys [0, e)
        p = jax.nn.softmax(over(qc[..., a:e, :], kc[..., :e, :], a, e, False), axis=-1)
        out_c.append(jnp.einsum("bhgts,bhsd->bhgtd", p.astype(vc.dtype), vc[..., :e, :],
                                preferred_element_type=jnp.float32))
        # noisy rows: the clean keys of earlier blocks [0, e - block) and their own block
        ctx = e - block
        parts = [own[..., a:e, :]]
        if ctx > 0:
            parts.insert(0, over(qn[..., a:e, :], kc[..., :ctx, :], a, e, True))
        p = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
        n = (e - a) // block
        po = p[..., -block:].reshape(bsz, hk, g, n, block, block)
        o = jnp.einsum("bhgnqk,bhnkd->bhgnqd", po.astype(vn.dtype), vn_blocks[:, :, a // block:e // block],
                       preferred_element_type=jnp.float32).reshape(bsz, hk, g, e - a, d)
        if ctx > 0:
            o = o + jnp.einsum("bhgts,bhsd->bhgtd", p[..., :ctx].astype(vc.dtype), vc[..., :ctx, :],
                               preferred_element_type=jnp.float32)
        out_n.append(o)
    return jnp.concatenate(out_n + out_c, axis=3).astype(q.dtype)


def two_copy_hidden(params, cfg: ModelConfig, xt, x0, chunk: int = 512, positions=None) -> jax.Array:
    """Final hidden states [B, 2L, D] of [x_t | x_0] (x_t, x_0 [B, L] token ids). positions
    [B, L]: the position ids of both copies (default arange(L); e.g. skip-wise PoSE ids, whose
    chunks must start on block boundaries: the mask is over token indices)."""
    if "moe_layers" in params:
        raise ValueError("two_copy_hidden covers dense-MLP models (the testbed); use forward_hidden "
                         "with two_copy_mask for MoE")
    bsz, L = xt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (bsz, L))
    positions = jnp.asarray(positions, jnp.int32)
    pos = jnp.concatenate([positions, positions], axis=1)
    cos, sin = rope_tables(pos, cfg)
    chunk = min(chunk, L)

    def layer(x, p):
        attention = lambda q, k, v: two_copy_attention(q, k, v, L, cfg.block_size, chunk)
        return dense_layer(p, x, cos, sin, cfg, attention)[0], None

    x, _ = jax.lax.scan(layer, embed(params, jnp.concatenate([xt, x0], axis=1)), params["layers"])
    return rms_norm(x, params["final_norm"], cfg.rms_eps)
