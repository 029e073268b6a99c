"""Sharded vs unsharded generate: prints one JSON line per (family, policy).

python tests/sharding_scripts/parity.py --devices 8 --mesh data=2,model=4 \
    --families sdar,llada2 --policies dense,maskahead [--lens 70,45,33,20] [--new 24]
"""
from __future__ import annotations

import argparse
import json
import time

from common import Q_MODEL, is_quantized, make_policy, prompts, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="data=2,model=4")
    ap.add_argument("--families", default="sdar")
    ap.add_argument("--policies", default="dense")
    ap.add_argument("--lens", default="70,45,33,20")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--kv-bytes", action="store_true", help="also report per-device KV bytes")
    a = ap.parse_args()
    setup(a.devices)
    import jax

    from maskahead_jax import sharding as shd
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.generate import generate
    from tiny import tiny_model

    mesh = shd.make_mesh(a.mesh)
    ps = prompts([int(x) for x in a.lens.split(",")])
    for fam in a.families.split(","):
        for pname in a.policies.split(","):
            q = is_quantized(pname)
            m = tiny_model(fam, num_heads=8, num_kv_heads=4, **(Q_MODEL if q else {}))
            gc = GenerationConfig(max_new_tokens=a.new, prefill_chunk=max(a.chunk, 64) if q else a.chunk,
                                  stop_at_eos=False)
            pol, why = make_policy(pname)
            rec = dict(family=fam, policy=pname, mesh=a.mesh, devices=jax.device_count())
            if why:
                rec.update(skipped=why)
            else:
                t = time.perf_counter()
                ref = generate(m, ps, gc, policy=pol)
                t1 = time.perf_counter()
                out = generate(m, ps, gc, policy=pol, mesh=mesh)
                t2 = time.perf_counter()
                rec.update(equal=out.tokens == ref.tokens, ref=ref.tokens, out=out.tokens,
                           evictions=out.stats["evictions"], ref_evictions=ref.stats["evictions"],
                           s_ref=round(t1 - t, 2), s_sharded=round(t2 - t1, 2))
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
