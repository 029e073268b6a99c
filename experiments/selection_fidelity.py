"""Do low-bit keys/values pick the same entries as bfloat16 ones?  (Q-MaskAhead's "largely
preserving the selected entries".)

For a synthetic cache (KIVI-like keys: per-channel offsets and a few outlier channels, then
RoPE; per-token value scales) and the same queries, we rank the context twice, once from the
bf16 K/V and once from quantize -> dequantize K/V at the given bit widths, and report the
overlap of the chosen sets per (batch, KV head) lane, averaged:

* selection (step 0 of a block): top-k of mass * ||v - c|| (MaskAhead) and of mass alone
  (MAGE), with queries = the block's G x T mask rows;
* eviction: keep = sinks (pos < 4) + newest W + top (C - W) of A * ||v - c'||, where
  A = mass of the block rows + 3 x mean mass of the probe rows (research/maskahead.md s.3);
  overlap of the whole keep set and of the contested part (keep minus sinks and window).

jaccard = |A & B| / |A | B|;  recall = |A & B| / |A| (A = the bf16 set).  Prints JSON.

    python experiments/selection_fidelity.py --tokens 2048 --bits 4,2 --k 256
"""
from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from maskahead_jax import quant
from maskahead_jax.cache import packed_layout
from maskahead_jax.kernels import quant_reference, reference


def rope(x, pos, theta=10000.0):
    """Rotate-half RoPE on the last axis.  x [..., S, D], pos [S]."""
    d = x.shape[-1]
    inv = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = pos[:, None].astype(jnp.float32) * inv[None]  # [S, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def synthetic_cache(key, b, h, g, t, n, d, probe_blocks):
    """Keys/values [B, H, N, D] (bf16), block queries [B, H, G, T, D], probe queries
    [B, H, G, probe*T, D] and the block's own keys/values; a few 'relevant' tokens share a
    direction with the queries so attention is peaked, as in real models."""
    ks = jax.random.split(key, 10)
    chan_scale = jnp.exp(0.5 * jax.random.normal(ks[0], (h, 1, d)))
    chan_scale = chan_scale.at[:, :, :4].multiply(8.0)  # outlier channels
    chan_off = 2.0 * jax.random.normal(ks[1], (h, 1, d))
    k0 = chan_off + chan_scale * jax.random.normal(ks[2], (b, h, n, d))
    topic = jax.random.normal(ks[3], (b, h, 1, d))
    relevant = jax.random.uniform(ks[4], (b, h, n, 1)) < 0.05
    k0 = k0 + jnp.where(relevant, 3.0, 0.0) * topic
    k = rope(k0, jnp.arange(n))
    v = jax.random.normal(ks[5], (b, h, n, d)) * jnp.exp(0.5 * jax.random.normal(ks[6], (b, h, n, 1)))

    def queries(kk, rows, start):
        q0 = 0.6 * topic[:, :, None] + jax.random.normal(kk, (b, h, g, rows, d))
        return rope(q0, jnp.arange(start, start + rows))

    q_blk = queries(ks[7], t, n)
    q_probe = queries(ks[8], probe_blocks * t, n + t)
    kb = rope(jax.random.normal(ks[9], (b, h, t, d)), jnp.arange(n, n + t))
    bf = lambda x: x.astype(jnp.bfloat16)
    return bf(k), bf(v), bf(q_blk), bf(q_probe), bf(kb), bf(kb)


def topk_sets(score, k):
    """Boolean membership [..., N] of the top-k entries of score [..., N]."""
    _, idx = jax.lax.top_k(score, k)
    return jax.nn.one_hot(idx, score.shape[-1], dtype=jnp.int8).max(-2) > 0


def overlap(a, b):
    """Mean Jaccard and recall of membership masks a (reference), b [..., N]."""
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    return {"jaccard": float(jnp.mean(inter / jnp.maximum(union, 1))),
            "recall": float(jnp.mean(inter / jnp.maximum(a.sum(-1), 1))),
            "min_recall": float(jnp.min(inter / jnp.maximum(a.sum(-1), 1)))}


def stats_for(ctx_k, ctx_v, qctx, q, kb, vb, rows):
    """Prefix mass and value score of the context for the rows of q (block keys excluded)."""
    t = q.shape[3]
    blk = jnp.ones((q.shape[0], t, t), bool)
    valid = jnp.ones(q.shape[:2] + (ctx_k.shape[2] if qctx is None else qctx.num_tokens,), bool)
    if qctx is None:
        _, st = reference.attention(q, ctx_k, ctx_v, valid, kb[:, :, :t], vb[:, :, :t], blk, rows)
    else:
        _, st = quant_reference.attention_quant(q, qctx, valid, kb[:, :, :t], vb[:, :, :t], blk, rows)
    return st


def eviction_keep(mass_blk, mass_probe, v, capacity, window, sinks, probe_blocks):
    """Keep mask [B, H, N]: sinks + newest `window` + top (capacity - window) by A*||v - c'||."""
    a = mass_blk + probe_blocks * mass_probe
    centre = jnp.einsum("bhn,bhnd->bhd", a, v) / a.sum(-1)[..., None]
    score = a * jnp.linalg.norm(v - centre[:, :, None], axis=-1)
    n = v.shape[2]
    pos = jnp.arange(n)
    recent = pos >= n - window
    score = jnp.where(pos < sinks, jnp.inf, score)
    score = jnp.where(recent, -jnp.inf, score)  # the window is kept anyway, not contested
    keep = topk_sets(score, capacity - window) | recent
    return keep, keep & ~recent & ~(pos < sinks)


def run(args) -> dict:
    t0 = time.time()
    b, h, g, t, n, d = args.batch, args.kv_heads, args.group, args.block, args.tokens, args.head_dim
    k, v, q, q_probe, kb, vb = synthetic_cache(jax.random.key(args.seed), b, h, g, t, n, d, args.probe_blocks)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    sel_k = args.k or min(n, max(256, math.ceil(0.05 * n)))
    cap = args.capacity or max(int(args.capacity_percent / 100 * n), 512)
    cap = min(cap, n)
    rows_blk = jnp.ones((b, t), bool)
    rows_probe = jnp.ones((b, args.probe_blocks * t), bool)
    kbp = jnp.concatenate([kb] * (args.probe_blocks + 1), axis=2)
    vbp = jnp.concatenate([vb] * (args.probe_blocks + 1), axis=2)

    def rank(qctx, kk, vv):
        st = stats_for(kk, vv, qctx, q, kbp, vbp, rows_blk)
        stp = stats_for(kk, vv, qctx, q_probe, kbp, vbp, rows_probe)
        if qctx is not None:  # eviction reads the low-bit values too
            vv = quant.dequantize_kv(qctx, jnp.float32)[1]
        keep, contested = eviction_keep(st.mass, stp.mass, vv, cap, args.window, args.sinks,
                                        args.probe_blocks)
        return {"value": topk_sets(st.score, sel_k), "mass": topk_sets(st.mass, sel_k),
                "keep": keep, "contested": contested}

    ref = jax.jit(lambda kk, vv: rank(None, kk, vv))(k32, v32)
    out = {"config": {"batch": b, "kv_heads": h, "group": g, "block": t, "tokens": n,
                      "head_dim": d, "k": sel_k, "capacity": cap, "window": args.window,
                      "sinks": args.sinks, "probe_blocks": args.probe_blocks, "seed": args.seed,
                      "cache": "synthetic (outlier key channels, RoPE, peaked queries)"},
           "results": {}}
    for bits in args.bits:
        qctx = quant.quantize_kv(k, v, bits)
        got = jax.jit(lambda qc: rank(qc, None, None))(qctx)
        kd, vd = quant.dequantize_kv(qctx, jnp.float32)
        out["results"][f"int{bits}"] = {
            "selection_value_score": overlap(ref["value"], got["value"]),
            "selection_mass_only": overlap(ref["mass"], got["mass"]),
            "eviction_keep_set": overlap(ref["keep"], got["keep"]),
            "eviction_contested": overlap(ref["contested"], got["contested"]),
            "key_rel_error": float(jnp.linalg.norm(kd - k32) / jnp.linalg.norm(k32)),
            "value_rel_error": float(jnp.linalg.norm(vd - v32) / jnp.linalg.norm(v32)),
            "bytes_per_token": packed_layout.bytes_per_token(qctx),
        }
    out["bf16_bytes_per_token"] = packed_layout.dense_bytes_per_token(d)
    out["seconds"] = round(time.time() - t0, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=7, help="query heads per KV head")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2048, help="context length N (multiple of 32)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bits", type=lambda s: [int(x) for x in s.split(",")], default=[4, 2])
    p.add_argument("--k", type=int, default=0, help="selection budget (0: max(256, 5%% of N))")
    p.add_argument("--capacity", type=int, default=0, help="eviction capacity C (0: from percent)")
    p.add_argument("--capacity-percent", type=float, default=10.0)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--probe-blocks", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
