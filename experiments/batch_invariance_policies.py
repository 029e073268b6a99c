"""Batch invariance per policy and dtype (docs/evaluation.md "Batch invariance", issue 50): each
of ten testbed suite prompts (512 tokens, the five tasks x depths 0.25 / 0.75) generated alone, in
a batch of 2 with a copy of itself, and in a batch of 2 with the next prompt (greedy, 32 new
tokens; evicting policies at capacity 20 with floors 128 / 32). Prints one JSON line per (dtype,
policy): how many prompts' tokens differ from the run alone.

    python experiments/batch_invariance_policies.py --dtypes bfloat16,float32 --policies dense,maskahead,q-maskahead
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import maskahead_jax as mj
from maskahead_jax.cli import TESTBED
from maskahead_jax.evaluation.datasets import load_tokenizer, testbed_suite
from maskahead_jax.evaluation.policies import make_policy
from maskahead_jax.generate import generate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--policies", default="dense,maskahead,q-maskahead")
    ap.add_argument("--capacity", type=float, default=20.0)
    ap.add_argument("--policy-kw", default="capacity_floor=128,topk_floor=32")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # BudgetWarnings: the floors are the issue's
    kw = dict(kv.split("=") for kv in args.policy_kw.split(",") if kv)
    kw = {k: int(v) for k, v in kw.items()}
    tok = load_tokenizer(TESTBED)
    exs = testbed_suite(["passkey", "multikey", "twohop", "docqa", "longanswer"], [512], [0.25, 0.75],
                        n_per_cell=1, tokenizer=tok)
    ids = [e.ids for e in exs]
    gen = mj.GenerationConfig(max_new_tokens=args.max_new_tokens)
    res = {}
    for dt in args.dtypes.split(","):
        m = mj.load_pretrained(TESTBED, dtype=dt)
        for pn in args.policies.split(","):
            pol = make_policy(pn) if pn == "dense" else make_policy(pn, args.capacity, **kw)
            t = time.time()
            alone = [generate(m, [p], gen, pol).tokens[0] for p in ids]
            copy = [generate(m, [p, p], gen, pol).tokens for p in ids]
            other = [generate(m, [p, ids[(i + 1) % len(ids)]], gen, pol).tokens[0] for i, p in enumerate(ids)]
            res[f"{dt}/{pn}"] = r = dict(
                prompts=len(ids), differ_with_copy=sum(a != c[0] or a != c[1] for a, c in zip(alone, copy)),
                differ_with_other=sum(a != o for a, o in zip(alone, other)), seconds=round(time.time() - t))
            print(json.dumps({f"{dt}/{pn}": r}), flush=True)
    return res


if __name__ == "__main__":
    main()
