"""Compile one sharded decode step (model_step of a block over [cache | block] + lm_head) and
report the collectives of its optimized HLO; prints one JSON line.

python tests/sharding_scripts/hlo_check.py --devices 8 --mesh data=2,model=4 --family sdar
--control forces a full all-gather of the cache's keys (a positive control for the detector).
"""
from __future__ import annotations

import argparse
import json
import math
import re

from common import setup

COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
    r"(-start)?\(")
SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo: str):
    """[(op, [element counts of its outputs])] for every collective instruction."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m:
            continue
        sizes = [math.prod(int(d) for d in s.split(",") if d) for s in SHAPE.findall(m.group(1))]
        out.append((m.group(2), sizes))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="data=2,model=4")
    ap.add_argument("--family", default="sdar")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--control", action="store_true")
    a = ap.parse_args()
    setup(a.devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from maskahead_jax import cache as kvc
    from maskahead_jax import sharding as shd
    from maskahead_jax.model import Segment, lm_head, model_step
    from tiny import tiny_model

    mesh = shd.make_mesh(a.mesh)
    m = tiny_model(a.family, num_heads=8, num_kv_heads=4)
    cfg = m.config
    b, n, t = a.batch, a.capacity, cfg.block_size
    c0 = kvc.empty(cfg.num_layers, b, cfg.num_kv_heads, n, cfg.head_dim, jnp.float32)

    def step(params, cache, x, pos):
        cache = shd.constrain_cache(cache)
        if a.control:
            cache = cache._replace(k=jax.lax.with_sharding_constraint(cache.k, P()))
        out = model_step(params, cfg, x, pos, jnp.ones((b, t, t), bool),
                         [Segment(0, cfg.num_layers, cache.context())])
        return lm_head(params, cfg, out.hidden), out.k

    params = shd.shard_params(m.params, mesh, cfg)
    cache = jax.device_put(c0, shd.cache_shardings(c0, mesh))
    x = jax.device_put(jnp.zeros((b, t), jnp.int32), shd.batch_sharding(mesh, (b, t)))
    with jax.set_mesh(mesh):
        hlo = jax.jit(step).lower(params, cache, x, x).compile().as_text()
    k_spec = shd.cache_spec(c0.k.shape, mesh)
    local_k = math.prod(jax.sharding.NamedSharding(mesh, k_spec).shard_shape(c0.k.shape))
    per_layer_local_k = local_k // cfg.num_layers
    cols = collectives(hlo)
    big = [(op, s) for op, s in cols if any(x >= per_layer_local_k for x in s)]
    print(json.dumps(dict(family=a.family, mesh=a.mesh, control=a.control, k_spec=str(k_spec),
                          local_k=local_k, global_k=math.prod(c0.k.shape),
                          per_layer_local_k=per_layer_local_k,
                          all_gathers=[s for op, s in cols if op == "all-gather"],
                          counts={op: sum(1 for o, _ in cols if o == op) for op in {o for o, _ in cols}},
                          cache_sized_gathers=big)), flush=True)


if __name__ == "__main__":
    main()
