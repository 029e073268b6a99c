"""Sharded vs unsharded generate: prints one JSON line per (family, policy).

python tests/sharding_scripts/parity.py --devices 8 --mesh data=2,model=4 \
    --families sdar,llada2 --policies dense,maskahead [--lens 70,45,33,20] [--new 24]
"""
from __future__ import annotations

import argparse
import json
import time

from common import Q_MODEL, is_quantized, make_policy, prompts, setup

# a few float32 ulps: a sum over hundreds of terms, reordered by sharding, errs by several ulps (1e-7,
# one ulp, stopped flagging a row that a data=2,model=4 run flips under jax 0.12.1's CPU compiler)
NOISE_REL = 3e-7


def float_sensitive_rows(generate, model, ps, gc, policy, ref_tokens, seeds=(0, 1, 2)):
    """Rows whose unsharded tokens change when every parameter moves by a few ulps (random signs).

    A sharded run sums in another order, so its floats differ from the unsharded run's by this
    much; a row that flips under such noise (a 4-bit rounding or a commit threshold on a knife
    edge) has no exact answer for the sharded run to match."""
    import jax
    import jax.numpy as jnp

    from maskahead_jax.api import Model

    leaves, tree = jax.tree_util.tree_flatten(model.params)
    rows = set()
    for seed in seeds:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
        noisy = [x * (1 + NOISE_REL * jax.random.rademacher(k, x.shape, x.dtype))
                 if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]
        out = generate(Model(model.config, jax.tree_util.tree_unflatten(tree, noisy)), ps, gc,
                       policy=policy).tokens
        rows |= {i for i, (a, b) in enumerate(zip(ref_tokens, out)) if a != b}
    return sorted(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="data=2,model=4")
    ap.add_argument("--families", default="sdar")
    ap.add_argument("--policies", default="dense")
    ap.add_argument("--lens", default="70,45,33,20")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="steps_per_block (default: the block size)")
    ap.add_argument("--kv-bytes", action="store_true", help="also report per-device KV bytes")
    ap.add_argument("--attention", default="reference",
                    help="GenerationConfig.attention; a kernel backend runs in interpret mode")
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
                                  steps_per_block=a.steps, stop_at_eos=False, attention=a.attention,
                                  attention_interpret=a.attention not in ("reference", "auto"))
            pol, why = make_policy(pname)
            rec = dict(family=fam, policy=pname, mesh=a.mesh, devices=jax.device_count(), attention=a.attention)
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
                if not rec["equal"]:  # only then: is the unsharded answer itself float-stable?
                    rec["float_sensitive_rows"] = float_sensitive_rows(generate, m, ps, gc, pol,
                                                                       ref.tokens)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
