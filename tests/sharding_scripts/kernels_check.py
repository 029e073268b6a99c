"""The attention kernels under a mesh (kernels/sharded.py) against the unsharded reference: one JSON
line per (mesh, impl, context kind, pooling), with the largest differences and whether the traced
program holds the shard_map (and, with the context split over "seq", the merge's all_gather).

python tests/sharding_scripts/kernels_check.py --devices 8
"""
from __future__ import annotations

import argparse
import json

from common import setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--meshes", default="data=2,model=4;data=2,seq=4;seq=8")
    ap.add_argument("--impls", default="pallas_triton,pallas_tpu")
    a = ap.parse_args()
    setup(a.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maskahead_jax import quant
    from maskahead_jax import sharding as shd
    from maskahead_jax.kernels import attention, quant_reference, reference

    b, h, g, t, s, d = 2, 4, 2, 8, 256, 32
    ks = jax.random.split(jax.random.key(0), 7)
    n = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
    q = n(ks[0], (b, h, g, t, d))
    k, v = n(ks[1], (b, h, s, d)), n(ks[2], (b, h, s, d))
    kb, vb = n(ks[3], (b, h, t, d)), n(ks[4], (b, h, t, d))
    valid = jax.random.uniform(ks[5], (b, h, s)) < 0.8
    blk = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    rows = jnp.broadcast_to(jnp.arange(t) % 3 != 0, (b, t))
    qkv = quant.quantize_kv(k, v, 4)
    cases = [("float", "mean", (k, v, valid)), ("float", "max", (k, v, valid)), ("packed", "mean", (qkv, None, valid))]
    for spec in a.meshes.split(";"):
        mesh = shd.make_mesh(spec)
        for impl in a.impls.split(","):
            for kind, pool, ctx in cases:
                if kind == "packed":
                    want = quant_reference.attention_quant(q, ctx[0], valid, kb, vb, blk, rows, pool)
                else:
                    want = reference.attention(q, k, v, valid, kb, vb, blk, rows, pool)

                def f(q, ctx, kb, vb, blk, rows):
                    with attention.use(impl, interpret=True):
                        return attention.attend(q, ctx, kb, vb, blk, rows, pool=pool)

                with jax.set_mesh(mesh):
                    fn = jax.jit(f)
                    text = str(jax.make_jaxpr(f)(q, ctx, kb, vb, blk, rows))
                    out, st = fn(q, ctx, kb, vb, blk, rows)
                diff = lambda x, y: float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
                print(json.dumps(dict(mesh=spec, impl=impl, kind=kind, pool=pool, out=diff(out, want[0]),
                                      mass=diff(st.mass, want[1].mass), score=diff(st.score, want[1].score),
                                      shard_map="shard_map" in text, all_gather="all_gather" in text)),
                      flush=True)


if __name__ == "__main__":
    main()
