"""Behaviour lock for refactors: the generated tokens and every deterministic `stats` entry of
every registered policy, recorded once and compared after each change.

    python experiments/golden_policies.py record runs/golden.json   # before a refactor
    python experiments/golden_policies.py compare runs/golden.json  # after each step: exit 1 on any difference
    python experiments/golden_policies.py record runs/golden_lab.json --lab   # the lab plugin's knobs

Cases: the shipped testbed (block-causal, shifted logits) on two suite prompts, every policy
that runs there at two budgets (knobs scaled to the prompt, as docs/results.md §2), and tiny
random LLaDA / Dream models (bidirectional) for the prompt compressors. A policy that refuses a
model is recorded with its error message, so a refusal that changes is a difference too.
Wall times are left out (they are not behaviour). With --lab the cases are instead the
experiments plugin's knobs (experiments/qa_lab.py), each set alone on the testbed, so moving a
mechanism between the core and the plugin is checked too.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

BUDGETS = (10.0, 30.0)
# floors scaled to 512-token prompts (docs/results.md §2); a knob a policy lacks is left out
KNOBS = dict(capacity_floor=64, topk_floor=32, recent=32, interval_blocks=2)
TIMING_KEYS = ("wall_s", "timings")


# (lab policy, knobs) each run on the testbed at 30%: every knob of experiments/qa_lab.py off its default
LAB_CASES = (
    ("maskahead-qa-lab", {}), ("maskahead-qa-lab", dict(prefill_slack=2.0)),
    ("maskahead-qa-lab", dict(defer_final_chunk=True)), ("maskahead-qa-lab", dict(prefill_budget="prompt")),
    ("maskahead-qa-lab", dict(hide_question="blocks")), ("maskahead-qa-lab", dict(hide_question="all")),
    ("maskahead-qa-lab", dict(question_masks=True)), ("maskahead-qa-lab", dict(step0_weight=0.5)),
    ("maskahead-qa-lab", dict(first_block_probe="question")),
    ("q-maskahead-draft-lab", {}), ("q-maskahead-draft-lab", dict(draft_probe="interleaved")),
    ("q-maskahead-draft-lab", dict(draft_past_answer=True)), ("q-maskahead-draft-lab", dict(draft_capacity_pct=20.0)),
    ("q-maskahead-draft-lab", dict(first_block_probe="question", hide_question="all", question_masks=True)),
)


def _policy(name, pct, extra=None):
    from maskahead_jax import policies as P

    if pct is not None and hasattr(P, "takes_budget") and not P.takes_budget(name):
        pct = None  # recorded when make() ignored a budget such policies do not have
    probe = P.make(name, None) if pct is None else P.make(name, pct)
    fields = {f.name for f in dataclasses.fields(probe)}
    kw = {k: v for k, v in KNOBS.items() if k in fields}
    if name in ("snapkv",):
        kw.pop("recent", None)
    kw.update(extra or {})
    return P.make(name, pct, **kw) if pct is not None else P.make(name, None, **kw)


def _record_one(model, prompts, gen, name, pct, extra=None):
    from maskahead_jax.generate import generate
    from maskahead_jax.policies import PolicyError

    try:
        pol = _policy(name, pct, extra)
        out = generate(model, prompts, gen, pol)
    except (PolicyError, ValueError) as e:
        return dict(error=f"{type(e).__name__}: {e}")
    return dict(policy=repr(pol), tokens=out.tokens, stats=_without_timings(out.stats))


def _without_timings(stats):
    """The stats with every wall time removed, nested ones too (a drafted run's stats["draft"])."""
    if isinstance(stats, dict):
        return {k: _without_timings(v) for k, v in stats.items() if k not in TIMING_KEYS}
    return stats


def cases():
    """(case name, model, prompts, GenerationConfig, [(policy name, pct)])."""
    import maskahead_jax as mj
    from maskahead_jax import policies as P
    from maskahead_jax.evaluation.datasets import testbed_suite
    from tiny import tiny_model

    names = P.names()
    model = mj.load_pretrained(os.path.join(_ROOT, "maskahead_jax", "testbed"))
    exs = testbed_suite(["multikey", "longanswer"], [512], [0.5], n_per_cell=1, seed=3)
    gen = mj.GenerationConfig(max_new_tokens=96, stop_at_eos=False)
    runs = [(n, None) for n in names if n in ("dense",)]
    runs += [(n, p) for n in names if n != "dense" for p in BUDGETS]
    yield "testbed", model, [e.ids for e in exs], gen, runs
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(0, 40, size=n))) for n in (70, 45)]
    bgen = mj.GenerationConfig(max_new_tokens=16, stop_at_eos=False, prompt_refresh=0)
    for fam in ("llada", "dream"):
        runs = [("dense", None)] + [(n, p) for n in ("maskkv", "pyramidkv", "adakv") for p in BUDGETS]
        yield fam, tiny_model(fam), prompts, bgen, runs
    fgen = mj.GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    prompts = [list(map(int, rng.randint(0, 40, size=n))) for n in (150, 97)]
    tiny_knobs = [("maskahead", 30.0), ("h2o", 30.0), ("snapkv", 30.0), ("herald", 30.0)]
    yield "fast_dllm_v2", tiny_model("fast_dllm_v2"), prompts, fgen, [("dense", None)] + tiny_knobs


def lab_cases():
    """The --lab cases: (case name, model, prompts, GenerationConfig, [(policy, pct, knobs)])."""
    importlib.import_module("experiments.qa_lab")  # registers the lab policies
    import maskahead_jax as mj
    from maskahead_jax.evaluation.datasets import testbed_suite

    model = mj.load_pretrained(os.path.join(_ROOT, "maskahead_jax", "testbed"))
    exs = testbed_suite(["multikey", "longanswer"], [512], [0.5], n_per_cell=1, seed=3)
    gen = mj.GenerationConfig(max_new_tokens=96, stop_at_eos=False)
    return [("testbed-lab", model, [e.ids for e in exs], gen, [(n, 30.0, kw) for n, kw in LAB_CASES])]


def record(lab: bool = False) -> dict:
    global KNOBS
    out = {}
    if lab:
        for case, model, prompts, gen, runs in lab_cases():
            for name, pct, kw in runs:
                key = f"{case}/{name}/{pct}/" + ",".join(f"{k}={v}" for k, v in sorted(kw.items()))
                out[key] = _record_one(model, prompts, gen, name, pct, kw)
                print(key, "error" if "error" in out[key] else "ok", flush=True)
        return out
    for case, model, prompts, gen, runs in cases():
        knobs = KNOBS
        if case != "testbed":  # tiny models: 8-token blocks, ~100-token prompts
            KNOBS = dict(capacity_floor=24, topk_floor=8, recent=8, interval_blocks=2, window=8)
        for name, pct in runs:
            key = f"{case}/{name}/{pct}"
            out[key] = _record_one(model, prompts, gen, name, pct)
            print(key, "error" if "error" in out[key] else "ok", flush=True)
        KNOBS = knobs
    return out


def diff(old: dict, new: dict) -> list[str]:
    msgs = []
    for k in sorted(set(old) | set(new)):
        if k not in new or k not in old:
            msgs.append(f"{k}: only in {'recorded' if k in old else 'new'}")
            continue
        a, b = old[k], new[k]
        for f in sorted(set(a) | set(b)):
            if f == "policy":  # its repr may change with the class layout; behaviour may not
                continue
            if f == "stats":
                for s in sorted(set(a.get(f, {})) | set(b.get(f, {}))):
                    if a[f].get(s) != b[f].get(s):
                        msgs.append(f"{k}: stats[{s}] {a[f].get(s)} -> {b[f].get(s)}")
            elif a.get(f) != b.get(f):
                msgs.append(f"{k}: {f} differs" + (f" ({a.get(f)} -> {b.get(f)})" if f != "tokens" else ""))
    return msgs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "compare"))
    ap.add_argument("path")
    ap.add_argument("--lab", action="store_true", help="the experiments plugin's knobs (experiments/qa_lab.py)")
    args = ap.parse_args(argv)
    new = json.loads(json.dumps(record(args.lab)))
    if args.mode == "record":
        os.makedirs(os.path.dirname(os.path.abspath(args.path)), exist_ok=True)
        with open(args.path, "w") as f:
            json.dump(new, f, indent=1, sort_keys=True)
        print(f"recorded {len(new)} runs to {args.path}")
        return 0
    with open(args.path) as f:
        old = json.load(f)
    msgs = diff(old, new)
    print("\n".join(msgs) if msgs else f"identical: {len(new)} runs")
    return 1 if msgs else 0


if __name__ == "__main__":
    sys.exit(main())
