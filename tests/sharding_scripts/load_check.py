"""Load a tiny HF checkpoint and its converted orbax folder straight into shards
(`converters.load.load_model(path, mesh=...)`); prints one JSON line per source with whether
every leaf has its rule sharding and equals the unsharded load.

python tests/sharding_scripts/load_check.py --devices 8 --mesh data=4,model=2 --tmp DIR
"""
from __future__ import annotations

import argparse
import json
import os

from common import setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="data=4,model=2")
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    setup(a.devices)
    import jax
    import numpy as np

    import hf_fixtures as hf
    from converters.load import convert, load_model
    from maskahead_jax import sharding as shd

    src = hf.qwen3(os.path.join(a.tmp, "hf")).path
    dst = convert(src, os.path.join(a.tmp, "orbax"), progress=False)
    mesh = shd.make_mesh(a.mesh)
    for name, path in (("hf", src), ("orbax", dst)):
        plain = load_model(path)
        sharded = load_model(path, mesh=mesh)
        want = shd.param_shardings(sharded.config, mesh)
        lp, ls, lw = (jax.tree_util.tree_leaves(t) for t in (plain.params, sharded.params, want))
        ok_shard = all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in zip(ls, lw))
        ok_vals = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(lp, ls))
        n_sharded = sum(1 for w in lw if any(ax is not None for ax in w.spec))
        print(json.dumps(dict(source=name, mesh=a.mesh, shardings_ok=ok_shard, values_equal=ok_vals,
                              sharded_leaves=n_sharded, leaves=len(lw),
                              max_bytes_per_device=shd.array_bytes_per_device(sharded.params),
                              full_bytes=sum(x.nbytes for x in lp))), flush=True)


if __name__ == "__main__":
    main()
