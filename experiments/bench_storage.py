"""Every evicting policy on the float and on the packed 4-bit cache, side by side (issue 54).

    python experiments/bench_storage.py --pct 10 --length 2048 --n 2 > docs/storage_memory.json

For each evicting policy of the registry (the MaskKV family aside: its per-head budgets are not
whole key groups, and its prompt compression is the bidirectional core's), on the shipped testbed
with the testbed preset's decoding and floors, the same suite examples run twice in one batch
each: `make(name, pct)` and `make(name, pct, bits=4)`. One JSON line per policy: the KV bytes
held at the end and at the peak (per row, summed over the examples) of both runs, their ratios,
and each run's score on these examples (the suite's own scoring) (a memory benchmark, not an accuracy table:
docs/results.md has the accuracy rows).

    python experiments/bench_storage.py --head-dim 128 --n 2    # the same shapes at head_dim 128

--head-dim N runs a random model of the testbed's shape but N-wide heads (its answers are noise:
the rows measure memory only, their scores are not accuracy): the packed format's advantage
grows with the head width, because the 10 B of eviction state per entry weigh less.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT]

PROMPT_COMPRESSORS = ("maskkv", "maskkv-online", "maskkv-blockcausal", "pyramidkv", "adakv")


def evicting_policies() -> list[str]:
    from maskahead_jax import policies as P

    return [n for n in P.names() if P.takes_budget(n) and n not in PROMPT_COMPRESSORS
            and not P.make(n).storage.prefix]


def _run(model, tok, exs, gen, name, pct, **kw):
    from maskahead_jax import policies as P
    from maskahead_jax.evaluation.example import score_example
    from maskahead_jax.evaluation.presets import preset_policy_knobs
    from maskahead_jax.generate import generate

    knobs = {k: v for k, v in preset_policy_knobs("testbed").items() if k in P.knobs(name)}
    pol = P.make(name, pct, **knobs, **kw)
    t = time.perf_counter()
    out = generate(model, [e.ids for e in exs], gen, pol)
    wall = time.perf_counter() - t
    score = [score_example(e, tok.decode(t)) for t, e in zip(out.tokens, exs)]
    return dict(label=out.stats["policy"], kv_end=sum(out.stats["kv_bytes_final"]),
                kv_peak=sum(out.stats["kv_bytes_peak"]), live=out.stats["live_entries"],
                score=round(100 * sum(score) / len(score), 2), wall_s=round(wall, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pct", type=float, default=10.0)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2, help="suite examples (tasks in turn, depth 0.5)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--policies", default="", help="comma-separated (default: every evicting policy)")
    ap.add_argument("--head-dim", type=int, default=0,
                    help="a random model of the testbed's shape with this head width (memory only)")
    a = ap.parse_args(argv)

    import maskahead_jax as mj
    from maskahead_jax.evaluation.datasets import testbed_suite
    from maskahead_jax.evaluation.tokenizer import load_tokenizer

    path = os.path.join(_ROOT, "maskahead_jax", "testbed")
    model, tok = mj.load_pretrained(path), load_tokenizer(path)
    randomized = bool(a.head_dim) and a.head_dim != model.config.head_dim
    if randomized:
        import dataclasses

        from maskahead_jax.profile import random_model

        model = random_model(dataclasses.replace(model.config, head_dim=a.head_dim), seed=0)
    tasks = ["docqa", "multikey", "longanswer", "twohop", "passkey"]
    exs = testbed_suite(tasks, [a.length], [0.5], n_per_cell=1, seed=0)[:a.n]
    gen = mj.GenerationConfig(max_new_tokens=max(e.max_new_tokens for e in exs))
    names = [p for p in a.policies.split(",") if p] or evicting_policies()
    for name in names:
        flt = _run(model, tok, exs, gen, name, a.pct)
        low = _run(model, tok, exs, gen, name, a.pct, bits=a.bits)
        print(json.dumps(dict(policy=name, pct=a.pct, bits=a.bits, length=a.length, n=len(exs),
                              head_dim=model.config.head_dim, random_weights=randomized,
                              float=flt, packed=low, ratio_end=round(flt["kv_end"] / low["kv_end"], 3),
                              ratio_peak=round(flt["kv_peak"] / low["kv_peak"], 3),
                              load=os.getloadavg()[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
