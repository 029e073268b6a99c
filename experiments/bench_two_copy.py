"""Side-by-side time of one training step (forward + backward) of the testbed in the two-copy
layout: the dense 2L x 2L mask through forward_hidden vs the chunked model.two_copy_hidden.

  python experiments/bench_two_copy.py --lengths 512,2048 --batch-tokens 4096

Prints one JSON line per length with both times and their ratio (same numbers: tests/test_two_copy.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maskahead_jax import load_pretrained  # noqa: E402
from maskahead_jax.model.decoder import forward_hidden  # noqa: E402
from maskahead_jax.model.two_copy import two_copy_hidden, two_copy_mask  # noqa: E402


def _timed(fn, *a, reps: int):
    jax.block_until_ready(fn(*a))  # compile
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*a))
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed"),
                    help="a model folder whose shape and weights to time (default: the shipped testbed)")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="B = this // L")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    model = load_pretrained(args.model, dtype="float32")  # training runs in float32
    cfg, params, V = model.config, model.params, model.config.vocab_size
    for L in [int(x) for x in args.lengths.split(",")]:
        B = max(1, args.batch_tokens // L)
        xt = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, V)
        x0 = jax.random.randint(jax.random.PRNGKey(2), (B, L), 0, V)
        pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(L), jnp.arange(L)]), (B, 2 * L))
        mask = jnp.broadcast_to(jnp.asarray(two_copy_mask(L, cfg.block_size)), (B, 2 * L, 2 * L))

        def dense(p):
            return forward_hidden(p, cfg, jnp.concatenate([xt, x0], 1), pos, mask=mask).sum()

        def chunked(p):
            return two_copy_hidden(p, cfg, xt, x0, args.chunk).sum()

        td = _timed(jax.jit(jax.grad(dense)), params, reps=args.reps)
        tc = _timed(jax.jit(jax.grad(chunked)), params, reps=args.reps)
        print(json.dumps({"L": L, "B": B, "chunk": args.chunk, "dense_mask_s": round(td, 3),
                          "chunked_s": round(tc, 3), "speedup": round(td / tc, 2),
                          "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
    main()
