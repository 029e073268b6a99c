"""`maskahead demo`: testbed needle prompts, dense vs MaskAhead side by side."""
from __future__ import annotations

import argparse
import sys
import time

from .args import capacity_arg, csv_list, parse_depths, pos_int
from .common import (POLICY_KW_HELP, gen_config, jax_backend, load_model, model_config, model_path,
                     policy_kw_arg)
from .errors import EXIT_OK

# evaluation.presets' testbed floors, where a policy has the knob
DEMO_KW = "capacity_floor=64,topk_floor=32,recent=32,interval_blocks=1"


def add_parser(sub, known: str) -> None:
    """`maskahead demo`'s options (known: the registered policy names, for --help)."""
    p = sub.add_parser("demo", help="testbed needle prompts: dense vs MaskAhead side by side")
    p.add_argument("--tasks", default="passkey,multikey",
                   help="testbed tasks to draw the prompts from (one per depth each), comma-separated")
    p.add_argument("--length", type=pos_int, default=2048,
                   help="prompt length in tokens (default 2048: long enough that the testbed floors stay below "
                        "the 10%% budget)")
    p.add_argument("--depths", default="0.25,0.75", help="needle depths, fractions in [0, 1]")
    p.add_argument("--capacity", type=capacity_arg, default=10.0)
    p.add_argument("--policy", default="maskahead",
                   help=f"the policies to compare with dense, comma-separated, from: {known}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-kw", default=None,
                   help=POLICY_KW_HELP + f". Default: {DEMO_KW} where a policy has the knob (the testbed "
                        "preset's floors, as `maskahead eval --preset testbed`: the paper's 512 / 256 exceed 10%% of "
                        "the testbed's prompts; and an eviction at every block, so the end shows the budget)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Dense and the chosen policies side by side on testbed needle prompts."""
    from ..evaluation.datasets import load_tokenizer, score_example, testbed_suite
    from ..evaluation.policies import (knobs, make_policy, parse_policy_kw, policy_key, resolve_policy_kw,
                                      run_label, takes_budget, validate_policy)
    from ..generate import generate

    t_start = time.perf_counter()
    depths = parse_depths(args.depths)
    names = [n for n in dict.fromkeys(policy_key(x) for x in csv_list(args.policy)) if n != "dense"]
    if args.policy_kw is None:  # the demo's floors, where a policy has them
        per = {n: {k: v for k, v in parse_policy_kw(DEMO_KW).items() if k in knobs(n)} for n in names}
    else:
        per = resolve_policy_kw(names, policy_kw_arg(args.policy_kw))
    path = model_path(None)
    cfg = model_config(path)
    tok = load_tokenizer(path)
    exs = testbed_suite(csv_list(args.tasks), [args.length], depths, n_per_cell=1, seed=args.seed, tokenizer=tok)
    gen = gen_config(argparse.Namespace(preset=None), max_new=max(e.max_new_tokens for e in exs))
    resolved = gen.resolve(cfg)
    runs = [("dense", make_policy("dense"))]
    for name in names:
        cap = args.capacity if takes_budget(name) else None
        pol = make_policy(name, cap, **per[name])
        validate_policy(pol, cfg, resolved, run_label(name, cap))
        runs.append((name, pol))
    model, path = load_model(path)
    print(f"MaskAhead demo: testbed model ({path}), tasks {args.tasks}, {args.length}-token prompts, "
          f"depths {args.depths}, capacity {args.capacity:g}%")
    if len(runs) == 1:
        print("note: showing the dense cache only.")
    results = {}
    ids = [e.ids for e in exs]
    where = ("up to a minute on a few CPU cores" if jax_backend() == "cpu" else "seconds on an accelerator")
    for name, pol in runs:
        # the first call compiles (jit, once per policy and shape) and prints nothing for a while
        print(f"[demo] compiling {name} for {len(ids)} prompt{'' if len(ids) == 1 else 's'} of {args.length} "
              f"tokens (first call; {where})...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        for timed in (False, True):  # one call site: a policy's BudgetWarning is shown once
            out = generate(model, ids, gen, pol)
            if not timed:
                print(f"[demo] {name}: compiled and ran in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                      flush=True)
        results[name] = out
    w = max(len(n) for n, _ in runs) + 2
    for i, e in enumerate(exs):
        print(f"\n {e.meta['task']}  depth {e.meta['depth']:.2f}  answer {e.answers[0]}")
        for name, _ in runs:
            pred = tok.decode(results[name].tokens[i])
            ok = score_example(e, pred) >= 1.0
            print(f"   {name:<{w}} {'OK ' if ok else 'XX '} {pred!r}")
    print()
    for name, _ in runs:
        st = results[name].stats
        n_ok = sum(score_example(e, tok.decode(t)) >= 1.0 for e, t in zip(exs, results[name].tokens))
        print(f" {name:<{w}} correct {n_ok}/{len(exs)}  KV reduction end {min(st['reduction_final']):.2f}x "
              f"peak {min(st['reduction_peak']):.2f}x  forwards {st['nfe_batch']}  "
              f"{st['wall_s'] * 1e3:.0f} ms (after compile)")
    print("\n KV reduction: a bf16 cache of every token seen / the bytes the policy holds (its eviction "
          "state included),\n the least over the prompts; end: after the answer, peak: the most held at "
          "any time. MaskAhead\n evicts once the whole prompt is in, so its peak is the prompt "
          "(maskahead-bounded bounds the prefill too).")
    print(f"\n total {time.perf_counter() - t_start:.1f}s")
    return EXIT_OK
