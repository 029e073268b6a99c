"""Seq-sharded slot ops: `sharding.top_k` (two-stage) and `sharding.take_slots` (explicit
psum gather) against `lax.top_k` / `take_along_axis` (values, indices, bits, ties), and the
collectives of a compiled `cache.keep_top` (the policies' compaction) on a cache sharded
data=2 x seq=4, versus the plain jnp ops under the same mesh. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import re

from common import setup

COLL = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                  r"(-start)?\(")
SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def slot_collectives(hlo: str, n: int):
    """Collectives whose output has a dimension of the full slot count n."""
    bad = []
    for line in hlo.splitlines():
        m = COLL.search(line)
        if m:
            for s in SHAPE.findall(m.group(1)):
                if n in [int(d) for d in s.split(",") if d]:
                    bad.append((m.group(2), s))
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="data=2,seq=4")
    a = ap.parse_args()
    setup(a.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from maskahead_jax import cache as kvc
    from maskahead_jax import sharding as shd

    mesh = shd.make_mesh(a.mesh)
    L, B, H, N, D, K = 3, 4, 2, 512, 8, 40
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, shd.cache_spec(x.shape, mesh)))
    scores = jnp.round(jax.random.normal(ks[0], (L, B, H, N)) * 4) / 4  # many ties
    fields = dict(k=jax.random.normal(ks[1], (L, B, H, N, D)).astype(jnp.bfloat16),
                  pos=jax.random.randint(ks[2], (L, B, H, N), -1, 1000),
                  valid=jax.random.bernoulli(ks[3], 0.7, (L, B, H, N)),
                  acc=jax.random.normal(ks[4], (L, B, H, N)))
    idx = jax.random.randint(ks[5], (L, B, H, K), 0, N)
    res = {}
    with jax.set_mesh(mesh):
        for k in (K, 200):  # 200 > N / 4: shards contribute all their slots
            v, i = jax.jit(lambda x: shd.top_k(x, k))(put(scores))
            v0, i0 = jax.lax.top_k(scores, k)
            res[f"top_k_{k}_equal"] = bool(np.array_equal(v, v0) and np.array_equal(i, i0))
        for name, x in fields.items():
            r = jax.jit(lambda x, i: shd.take_slots(x, i))(put(x), idx)
            r0 = jnp.take_along_axis(x, idx if x.ndim == 4 else idx[..., None], axis=3)
            res[f"take_{name}_equal"] = bool(np.array_equal(np.asarray(r), np.asarray(r0)))
        cache = kvc.empty(L, B, H, N, D, jnp.bfloat16)
        cache = cache._replace(k=fields["k"], v=fields["k"], pos=fields["pos"], valid=fields["valid"],
                               acc=fields["acc"], length=jnp.full((B,), N, jnp.int32))
        keep = jnp.full((B,), 48, jnp.int32)
        cache_s = jax.tree_util.tree_map(put, cache)
        f = jax.jit(lambda c, s: kvc.keep_top(c, s, keep, 64))
        out = f(cache_s, put(scores))
        ref = kvc.keep_top(cache, scores, keep, 64)
        res["keep_top_equal"] = all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)))
        hlo = f.lower(cache_s, put(scores)).compile().as_text()

        def plain(c, s):  # control: the same compaction with plain jnp ops
            _, top = jax.lax.top_k(s, 64)
            return jnp.take_along_axis(c.k, top[..., None], axis=3), jnp.take_along_axis(c.pos, top, axis=3)

        hlo0 = jax.jit(plain).lower(cache_s, put(scores)).compile().as_text()
    res["keep_top_slot_collectives"] = slot_collectives(hlo, N)
    res["plain_slot_collectives"] = slot_collectives(hlo0, N)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
