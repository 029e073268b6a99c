"""Per-device KV memory under seq sharding: for each mesh, the planned per-device cache bytes
(from the rule shardings' shard shapes) and the compiled generate core's per-device temp
memory (XLA memory_analysis), for one long prompt; prints one JSON line per mesh.

python tests/sharding_scripts/kv_memory.py --devices 8 --meshes "data=1;seq=2;seq=4;seq=8"
"""
from __future__ import annotations

import argparse
import json

from common import setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--meshes", default="seq=1;seq=2;seq=4;seq=8")
    ap.add_argument("--family", default="sdar")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=8)
    a = ap.parse_args()
    setup(a.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maskahead_jax import sharding as shd
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.engine.generate import _core_fn
    from maskahead_jax.policies import Dense
    from tiny import tiny_model

    m = tiny_model(a.family, num_heads=8, num_kv_heads=4, num_layers=2, head_dim=32)
    cfg = m.config
    gen = GenerationConfig(max_new_tokens=a.new, prefill_chunk=256, stop_at_eos=False).resolve(cfg)
    prompt = np.zeros((1, a.prompt), np.int32)
    plen = np.array([a.prompt], np.int32)
    fn = _core_fn(cfg, True)
    for spec in a.meshes.split(";"):
        mesh = shd.make_mesh(spec)
        params, p, pl, key, ctx = shd.prepare_generate(mesh, cfg, m.params, prompt, plen,
                                                      jax.random.PRNGKey(0))
        with ctx:
            comp = fn.lower(params, p, pl, key, cfg=cfg, gen=gen, policy=Dense(),
                            cache_dtype=jnp.dtype(jnp.float32)).compile()
        ma = comp.memory_analysis()
        cap = a.prompt + 3 * cfg.block_size  # >= the decode buffer's capacity (total_cap)
        plan = shd.kv_bytes_per_device(cfg, 1, a.prompt, mesh, jnp.float32)
        print(json.dumps(dict(mesh=spec, seq=shd.mesh_sizes(mesh)["seq"],
                              temp_bytes=int(getattr(ma, "temp_size_in_bytes", -1)),
                              planned_kv_per_device=plan["per_device"], planned_kv_global=plan["global"],
                              capacity_hint=cap)), flush=True)


if __name__ == "__main__":
    main()
