"""The CPU cost of batch-invariant programs (maskahead_jax/numerics.py), side by side in one run.

The testbed's uncached forward (batch 4 x 1024 tokens, bfloat16 and float32) compiled with
XLA's default CPU fusions (YNNPACK on) and with the library's batch-invariant options (YNNPACK
off); prints JSON: the YNNPACK fusions in each program, the median of --repeats timed calls
(interleaved), and the ratio invariant / default.

    python experiments/bench_batch_invariance.py --repeats 5
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from maskahead_jax import load_pretrained, numerics
from maskahead_jax.model import forward_logits


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="maskahead_jax/testbed")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    variants = {"default": None, "batch_invariant": numerics.CPU_BATCH_INVARIANT}
    out = dict(backend=jax.default_backend(), jax=jax.__version__, batch=args.batch, length=args.length)
    for dtype in ("bfloat16", "float32"):
        m = load_pretrained(args.model, dtype=dtype)
        toks = jnp.asarray(np.random.default_rng(0).integers(0, m.config.vocab_size, (args.batch, args.length)),
                           jnp.int32)
        fns = {n: jax.jit(forward_logits, static_argnums=(1,), compiler_options=o) for n, o in variants.items()}
        ynn = {n: f.lower(m.params, m.config, toks).compile().as_text().count('"__ynn_fusion"')
               for n, f in fns.items()}
        for f in fns.values():  # compile + warm
            f(m.params, m.config, toks).block_until_ready()
        times = {n: [] for n in fns}
        for _ in range(args.repeats):
            for n, f in fns.items():
                t0 = time.perf_counter()
                f(m.params, m.config, toks).block_until_ready()
                times[n].append(time.perf_counter() - t0)
        med = {n: float(np.median(v)) for n, v in times.items()}
        out[dtype] = dict(ynn_fusions=ynn, median_s=med, ratio_invariant_over_default=med["batch_invariant"] / med["default"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
