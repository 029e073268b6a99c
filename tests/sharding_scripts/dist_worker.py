"""One process of a localhost multi-process generate (or the single-process reference).

Sharded, N processes:  MASKAHEAD_COORDINATOR=localhost:PORT MASKAHEAD_NUM_PROCESSES=2
                       MASKAHEAD_PROCESS_ID=i python dist_worker.py --devices 4 --mesh data=2,model=4
Reference (1 process, unsharded): python dist_worker.py --devices 1 --single
Prints one JSON line: process index/count, global device count, tokens.
"""
from __future__ import annotations

import argparse
import json

from common import prompts, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4, help="CPU devices of this process")
    ap.add_argument("--mesh", default="data=2,model=4")
    ap.add_argument("--family", default="sdar")
    ap.add_argument("--lens", default="30,17,9,24")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--single", action="store_true", help="one process, no mesh (the reference)")
    a = ap.parse_args()
    setup(a.devices)
    import jax

    from maskahead_jax import distributed

    if not a.single:
        distributed.initialize()
    from maskahead_jax import sharding as shd
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.generate import generate
    from tiny import tiny_model

    m = tiny_model(a.family, num_heads=8, num_kv_heads=4)
    gc = GenerationConfig(max_new_tokens=a.new, prefill_chunk=16, stop_at_eos=False)
    ps = prompts([int(x) for x in a.lens.split(",")])
    mesh = None if a.single else shd.make_mesh(a.mesh)
    out = generate(m, ps, gc, mesh=mesh)
    print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(),
                          devices=jax.device_count(), local_devices=jax.local_device_count(),
                          tokens=out.tokens)), flush=True)
    if not a.single:
        distributed.shutdown()


if __name__ == "__main__":
    main()
