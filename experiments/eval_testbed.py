"""Greedy evaluation of an exported testbed folder on the task suite, per (task, length, depth)
cell; prints JSON.

  python experiments/eval_testbed.py --lengths 512,1024 --depths 0,0.25,0.5,0.75,1 --n 20
  python experiments/eval_testbed.py --tasks passkey --lengths 2048 --policy streaming --capacity 10

Decoding: threshold decoding (commit every masked position of the current block whose top
probability >= --threshold, at least the most confident one per step), block by block; the
threshold defaults to the model's own (config.json `threshold`). The default
engine is the library's cached, jitted `generate` with a KV-cache policy (dense by default);
`--engine reference` is the library's uncached reference decoder (maskahead_jax/engine/reference.py:
a full forward per step, one prompt at a time; the ground truth `generate` is tested against). Held-out seeds start at
--seed (training draws its seeds from [1e7, 2^31)).

With --results FILE.jsonl every finished cell is appended to FILE (its per-example scores and the
run's settings) and a rerun with the same settings skips the cells already there, so an
interrupted evaluation resumes; a FILE written with other settings is refused. Two or more such
files (e.g. dense and a policy on the same examples) compare with a paired sign test, over
all shared examples and per cell that changed:

  python experiments/eval_testbed.py --compare dense.jsonl maskahead.jsonl

This script reports the model card's per-cell table; policies x budgets sweeps of the same suite
(resumable JSONL results, tables, sign tests, plots) are `maskahead eval --suite`
(maskahead_jax/evaluation; docs/evaluation.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from maskahead_jax import GenerationConfig, generate, load_pretrained
from maskahead_jax import tasks as T
from maskahead_jax.engine.reference import reference_generate
from maskahead_jax.evaluation.datasets import TESTBED_MAX_NEW as MAX_NEW  # (the suite's budgets)
from maskahead_jax.evaluation.policies import make_policy, parse_policy_kw
from maskahead_jax.evaluation.stats import paired_sign_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per-task diagnostics recorded beside the score (a --results field, and "<task>_<field>" in the
# JSON): did two-hop's chain name the asked case's unit; was document QA's first word right.
DIAGNOSTICS = {"twohop": ("first_hop", T.twohop_first_hop),
               "docqa": ("first_word", T.docqa_first_word)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--tasks", default=",".join(T.TASKS))
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--n", type=int, default=20, help="examples per (task, length, depth) cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threshold", type=float, default=None,
                    help="commit threshold (default: the model's config.json `threshold`)")
    ap.add_argument("--engine", choices=("cached", "reference"), default="cached",
                    help="cached: the library's jitted generate with a KV-cache policy; reference: "
                         "the library's uncached reference decoder (a full forward per step)")
    ap.add_argument("--policy", default="dense", help="cached engine: a policy name (dense, streaming, ...)")
    ap.add_argument("--capacity", type=float, default=10.0, help="cached engine: capacity %% for --policy")
    ap.add_argument("--policy-kw", default="", help="policy knobs key=value,... (e.g. capacity_floor=64)")
    ap.add_argument("--show", type=int, default=0,
                    help="print the first N predictions of every cell (reference | prediction) to stderr")
    ap.add_argument("--results", default=None,
                    help="append each finished cell to this JSONL file and skip the cells it already holds")
    ap.add_argument("--compare", nargs="+", default=None, metavar="RESULTS",
                    help="compare --results files on the examples they share (paired sign test of "
                         "each file against the first, overall and per changed cell) and exit")
    ap.add_argument("--rope-scaling", default=None,
                    help="replace the model's RoPE scaling, e.g. yarn:4:2048 (TYPE:FACTOR[:ORIGINAL]; none: plain)")
    ap.add_argument("--max-positions", type=int, default=None,
                    help="the model's position limit (with --rope-scaling: default factor x original)")
    ap.add_argument("--update-readme", action="store_true",
                    help="write the results into the '## Measured scores' section of the model's README.md")
    args = ap.parse_args(argv)
    if args.compare:
        print(json.dumps(compare_results(args.compare), indent=1))
        return
    rope = dict(rope_scaling=args.rope_scaling, max_position_embeddings=args.max_positions)
    if args.engine == "reference":
        model_or_ref = load_pretrained(args.model, dtype="float32", **rope)
        cfg = model_or_ref.config
    else:
        model = load_pretrained(args.model, **rope)
        cfg = model.config
        model_or_ref = (model,
                        make_policy(args.policy, None if args.policy == "dense" else args.capacity,
                                    **({} if args.policy == "dense" else parse_policy_kw(args.policy_kw))))
    if args.threshold is None:  # the model's own decoding setting, recorded in the results
        args.threshold = cfg.threshold
    tok = T.get_tokenizer(os.path.join(args.model, "tokenizer.json"))
    out = {"model": args.model, "engine": args.engine, "policy": args.policy,
           "capacity": None if args.policy == "dense" else args.capacity,
           "n_per_cell": args.n, "cells": {}, "summary": {}}
    settings = {k: out[k] for k in ("model", "engine", "policy", "capacity", "n_per_cell")}
    settings.update(policy_kw=args.policy_kw, threshold=args.threshold, seed=args.seed)
    if cfg.rope_scaling is not None or args.max_positions:  # (absent: results written before the flag)
        out["rope_scaling"] = settings["rope_scaling"] = repr(cfg.rope_scaling)
    done = load_results(args.results, settings)
    for task in args.tasks.split(","):
        tot = []
        field = DIAGNOSTICS[task][0] if task in DIAGNOSTICS else None
        for n in [int(x) for x in args.lengths.split(",")]:
            for d in [float(x) for x in args.depths.split(",")]:
                key = f"{task}/{n}/{d}"
                t0 = time.time()
                if key in done:
                    scores, diag = done[key]["scores"], done[key].get(field, []) if field else []
                else:
                    scores, diag = evaluate_cell(args, model_or_ref, tok, task, n, d)
                    append_result(args.results, dict(settings, cell=key, scores=scores,
                                                     **({field: diag} if diag else {})))
                out["cells"][key] = float(np.mean(scores))
                if diag:
                    out.setdefault(f"{task}_{field}", {})[f"{n}/{d}"] = float(np.mean(diag))
                tot += scores
                print(f"{task} len={n} depth={d}: {np.mean(scores):.3f}"
                      + (f" ({field.replace('_', ' ')} {np.mean(diag):.3f})" if diag else "")
                      + (" (from --results)" if key in done else f" ({time.time() - t0:.0f}s)"),
                      file=sys.stderr, flush=True)
        out["summary"][task] = float(np.mean(tot))
    print(json.dumps(out, indent=1))
    if args.update_readme:
        update_readme(args, out, argv)


def evaluate_cell(args, model_or_ref, tok, task: str, n: int, depth: float):
    """Scores of one (task, length, depth) cell's args.n held-out examples, and the task's
    DIAGNOSTICS value of each (empty for a task without one)."""
    exs = [T.generate(task, n, depth, args.seed + i, tok) for i in range(args.n)]
    scores, diag = [], []
    for b in range(0, len(exs), args.batch):
        chunk = exs[b:b + args.batch]
        ids = [tok.encode(e.prompt).ids for e in chunk]
        gen = GenerationConfig(max_new_tokens=MAX_NEW[task], threshold=args.threshold)
        if args.engine == "reference":  # the library's uncached decoder, one prompt at a time
            outs = [reference_generate(model_or_ref, p, gen) for p in ids]
        else:
            model, policy = model_or_ref
            outs = generate(model, ids, gen, policy).tokens
        texts = [tok.decode(o) for o in outs]
        scores += [float(e.score(t)) for e, t in zip(chunk, texts)]
        if task in DIAGNOSTICS:
            diag += [float(DIAGNOSTICS[task][1](e, t)) for e, t in zip(chunk, texts)]
        for e, t in list(zip(chunk, texts))[:max(0, args.show - b)]:
            print(f"  {e.target!r} | {t!r}", file=sys.stderr)
    return scores, diag


def read_results(path):
    """The records of a --results file, skipping (with a note) a line an interruption cut short."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # that cell reruns (load_results) or is left out (--compare)
                print(f"--results {path}: line {i} is not JSON, ignored", file=sys.stderr)


def load_results(path, settings: dict) -> dict:
    """Cells already in the --results file, by key; refuses a file written with other settings."""
    if not path or not os.path.exists(path):
        return {}
    done = {}
    for rec in read_results(path):
        other = {k: rec.get(k) for k in settings if rec.get(k) != settings[k]}
        if other:
            raise SystemExit(f"--results {path} holds a run with other settings ({other}; this run: "
                             f"{ {k: settings[k] for k in other} }): use another file")
        done[rec["cell"]] = rec
    return done


def append_result(path, rec: dict) -> None:
    """One finished cell as a JSON line (after a newline if an interruption cut the last one)."""
    if not path:
        return
    cut = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)  # only the last byte, not the whole file per cell
            cut = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if cut else "") + json.dumps(rec) + "\n")


def changed_cells(base: dict, run: dict, shared) -> dict:
    """Per cell where any paired example differs: both means and the sign test over the cell
    (the cells left out score the same, example by example)."""
    cells = {}
    for c in sorted({c for c, _ in shared}):
        keys = [k for k in shared if k[0] == c]
        t = paired_sign_test({k: run[k] for k in keys}, {k: base[k] for k in keys})
        if t["wins"] or t["losses"]:
            cells[c] = dict(base_mean=round(float(np.mean([base[k] for k in keys])), 4),
                            mean=round(float(np.mean([run[k] for k in keys])), 4),
                            wins=t["wins"], losses=t["losses"], p=t["p"])
    return cells


def compare_results(paths) -> dict:
    """Per-example scores of several --results files, paired by (cell, example index): each
    file's mean and a two-sided sign test of it against the first file, overall and per cell
    that changed ("changed_cells"); "missed_by_all" lists
    the examples ("cell#index") that no file answers fully right (persistent misses point at
    the examples, not at one run's noise)."""
    if len(paths) < 2:
        raise SystemExit("--compare needs two or more --results files")
    runs = []
    for path in paths:
        if not os.path.exists(path):
            raise SystemExit(f"--compare: no such file {path}")
        runs.append({(r["cell"], i): x for r in read_results(path) for i, x in enumerate(r["scores"])})
    base = runs[0]
    out = {"base": paths[0], "base_mean": float(np.mean(list(base.values()))) if base else None, "against": []}
    for path, run in zip(paths[1:], runs[1:]):
        shared = sorted(set(base) & set(run))
        if not shared:
            raise SystemExit(f"--compare: {path} shares no (cell, example) with {paths[0]}")
        t = paired_sign_test(run, base)  # wins: this file scored higher than the base
        out["against"].append(dict(file=path, mean=float(np.mean([run[k] for k in shared])),
                                   base_mean=float(np.mean([base[k] for k in shared])), **t,
                                   changed_cells=changed_cells(base, run, shared)))
    common = set(base).intersection(*runs[1:])
    out["missed_by_all"] = [f"{c}#{i}" for c, i in sorted(common) if all(r[(c, i)] < 1 for r in runs)]
    return out


def update_readme(args, out, argv):
    path = os.path.join(args.model, "README.md")
    text = open(path).read() if os.path.exists(path) else "# testbed\n"
    head = text.split("## Measured scores")[0].rstrip() + "\n\n## Measured scores\n\n"
    cmd = "python experiments/eval_testbed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    engine = ("no cache (a full forward per step)" if args.engine == "reference"
              else f"the library's cached generate, policy {args.policy}")
    lines = [f"Threshold decoding ({args.threshold}), {engine}, {args.n} held-out examples per "
             f"cell (seeds {args.seed}..{args.seed + args.n - 1}). Command:", "", "    " + cmd, "",
             "| task | " + " | ".join(["length", "depth", "score"]) + " |", "|---|---|---|---|"]
    for k, v in out["cells"].items():
        t, n, d = k.split("/")
        lines.append(f"| {t} | {n} | {d} | {v:.3f} |")
    lines += ["", "Per task (mean over cells): " + ", ".join(f"{k} {v:.3f}" for k, v in out["summary"].items()),
              "", "Scores: exact match of the number for passkey / multikey / twohop, LongBench QA F1 of the first "
              "sentence for docqa, "
              "fraction of facts for longanswer.", ""]
    with open(path, "w") as f:
        f.write(head + "\n".join(lines))


if __name__ == "__main__":
    main()
