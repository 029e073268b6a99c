"""No T x T array in any policy's generate program: trace (not run) the jitted core of every
registered policy at a long prompt on tiny block-causal (SDAR layout) and bidirectional (LLaDA)
models, and list every intermediate with two axes at least as long as the prompt.

    python experiments/check_long_programs.py --prompt-len 4096      # JSON lines; exit 1 on any

The test suite runs the same check for a representative set (tests/test_long_context.py).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]


def long_intermediates(jaxpr, t: int) -> list:
    """(primitive, shape) of every intermediate of a (nested) jaxpr with two axes >= t."""
    found = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if sum(n >= t for n in shape) >= 2:
                found.append((eqn.primitive.name, tuple(shape)))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += long_intermediates(inner, t)
    return found


def trace_core(model, policy, t: int, gen):
    """The jaxpr of the generate core for one prompt of t tokens (nothing compiled or run)."""
    import jax
    import jax.numpy as jnp

    eng = importlib.import_module("maskahead_jax.engine.generate")
    fn = eng._core_fn(model.config, False)
    return jax.make_jaxpr(lambda p, a, n, k: fn(p, a, n, k, cfg=model.config, gen=gen, policy=policy,
                                                cache_dtype=jnp.float32))(
        model.params, jnp.zeros((1, t), jnp.int32), jnp.asarray([t - 3], jnp.int32), jax.random.PRNGKey(0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=4096)
    a = ap.parse_args(argv)
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.policies import PolicyError, make
    from maskahead_jax.policies.registry import names, takes_budget
    from tiny import tiny_model

    t, bad = a.prompt_len, 0
    for fam in ("sdar", "llada"):
        m = tiny_model(fam, max_position_embeddings=2 * t, head_dim=32)  # packed caches: 32-wide groups
        gen = GenerationConfig(max_new_tokens=32, block_size=32, prefill_chunk=512).resolve(m.config)
        for name in names():
            t0 = time.time()
            try:
                pol = make(name, 10) if takes_budget(name) else make(name)
                pol.check_run(m.config, gen)
            except (PolicyError, ValueError) as e:
                print(json.dumps(dict(family=fam, policy=name, refused=str(e).splitlines()[0])))
                continue
            big = long_intermediates(trace_core(m, pol, t, gen).jaxpr, t)
            bad += bool(big)
            print(json.dumps(dict(family=fam, policy=name, prompt_len=t, long_intermediates=big[:5],
                                  trace_s=round(time.time() - t0, 2))), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
