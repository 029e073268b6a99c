"""MaskKV and its baselines on the bidirectional twin (issue 39 part 2), at an absolute budget of
KV pairs per head or at a share of the prompt, through the library's evaluation sweep.

`maskahead eval` gives every policy its budget as a percentage (--capacity); the absolute budget
(`kv_entries`, policies.make's knob: budget_per_head for MaskKV / PyramidKV / AdaKV,
capacity_entries for SnapKV) is not a CLI flag, hence this driver. At a percentage, SnapKV's
released 512-entry floor is lowered to 36 (its window + sinks, the least it accepts) so that every
policy keeps the same share of a 2048-token prompt (5%: 102 entries).

  python experiments/eval_twin_maskkv.py --entries 256 --lengths 2048 --n 4 --out runs/twin_maskkv_256
  python experiments/eval_twin_maskkv.py --pct 5 --lengths 2048 --n 4 --out runs/twin_maskkv_5pct

Past the twin's trained length (issue 53's table at 8192) give the RoPE knob the run needs, e.g.
`--rope-scaling dynamic_yarn:16:2048 --max-positions 33280` (docs/rope.md); it is part of the
run's fingerprint (the model config), so a resumed run refuses another one.
"""
from __future__ import annotations

import argparse
import os

from maskahead_jax.api import load_pretrained
from maskahead_jax.config import GenerationConfig
from maskahead_jax.evaluation import datasets as D
from maskahead_jax.evaluation.policies import make_policy
from maskahead_jax.evaluation.sweep import run_sweep, to_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed_bidir"))
    ap.add_argument("--policies", default="dense,maskkv,snapkv,pyramidkv,adakv")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--entries", type=int, help="KV pairs per head (absolute budget)")
    g.add_argument("--pct", type=float, help="percent of the prompt's tokens")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rope-scaling", default=None, help="replace the model's RoPE scaling (TYPE:FACTOR[:ORIGINAL])")
    ap.add_argument("--max-positions", type=int, default=None, help="the model's position limit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model = load_pretrained(args.model, rope_scaling=args.rope_scaling, max_position_embeddings=args.max_positions)
    tok = D.load_tokenizer(args.model)
    exs = D.testbed_suite(lengths=[int(x) for x in args.lengths.split(",")], n_per_cell=args.n, tokenizer=tok)
    policies = args.policies.split(",")

    def factory(name, cap):
        if name == "dense":
            return make_policy(name, None)
        if args.entries:
            return make_policy(name, None, kv_entries=args.entries)
        return make_policy(name, cap, **({"capacity_floor": 36} if name == "snapkv" else {}))

    caps = [None] if args.entries else [args.pct]
    res = run_sweep(model, exs, policies, caps, args.out, tok, gen=GenerationConfig(),
                    batch_size=args.batch_size, policy_factory=factory, progress=False, plots=False,
                    model_path=args.model, meta=dict(entries=args.entries, pct=args.pct))
    print(to_markdown(res.summary))
    for e in res.errors:
        print("ERROR", e)


if __name__ == "__main__":
    main()
