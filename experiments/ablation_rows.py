"""One markdown row per (policy, capacity) of `maskahead eval` runs, with paired sign tests
against named reference rows: the ablation tables of docs/results.md "Beyond the paper".

    python experiments/ablation_rows.py runs/beyond40_q4qa runs/beyond40_7 \
        --ref dense=runs/beyond40:dense --ref maskahead=runs/beyond40:maskahead@10

Each run folder's results.jsonl is read (every row of it); a reference is FOLDER:POLICY[@CAPACITY].
Scores are percentages (x 100); the suite mean is the mean over tasks of the task means (as the
eval's summary); KV reduction end / peak are the means over examples of the per-example ratios;
sign tests pair by example id, ties dropped (evaluation.stats.paired_sign_test). Prints JSON
with --json.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from maskahead_jax.evaluation.stats import paired_sign_test


def load(folder: str) -> dict:
    """{(policy, capacity): {id: row}} of one run folder."""
    rows: dict = defaultdict(dict)
    path = Path(folder) / "results.jsonl"
    if not path.exists():
        raise SystemExit(f"no results.jsonl in {folder}")
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["policy"], r["capacity"])][r["id"]] = r
    return rows


def parse_ref(spec: str):
    """NAME=FOLDER:POLICY[@CAPACITY] -> (name, folder, policy, capacity or None)."""
    name, _, rest = spec.partition("=")
    folder, _, pol = rest.rpartition(":")
    if not (name and folder and pol):
        raise SystemExit(f"--ref {spec!r}: expected NAME=FOLDER:POLICY[@CAPACITY]")
    pol, _, cap = pol.partition("@")
    return name, folder, pol, (float(cap) if cap else None)


def summarize(rows: dict) -> dict:
    by_task = defaultdict(list)
    for r in rows.values():
        by_task[r["dataset"]].append(100 * r["score"])
    tasks = {t: float(np.mean(v)) for t, v in sorted(by_task.items())}
    return dict(n=len(rows), mean=float(np.mean(list(tasks.values()))), tasks=tasks,
                red_end=float(np.mean([r["reduction_final"] for r in rows.values()])),
                red_peak=float(np.mean([r["reduction_peak"] for r in rows.values()])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (results.jsonl)")
    ap.add_argument("--ref", action="append", default=[], help="NAME=FOLDER:POLICY[@CAPACITY]")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    refs = {}
    for spec in a.ref:
        name, folder, pol, cap = parse_ref(spec)
        got = load(folder).get((pol, cap))
        if got is None:
            raise SystemExit(f"--ref {spec!r}: no rows of {pol} at capacity {cap} in {folder}")
        refs[name] = {i: r["score"] for i, r in got.items()}
    out = []
    for folder in a.runs:
        for (pol, cap), rows in sorted(load(folder).items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            s = summarize(rows)
            scores = {i: r["score"] for i, r in rows.items()}
            s.update(run=folder, policy=pol, capacity=cap,
                     tests={n: paired_sign_test(scores, ref) for n, ref in refs.items()})
            out.append(s)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for s in out:
        tasks = " | ".join(f"{v:.1f}" for v in s["tasks"].values())
        tests = " | ".join(f"+{t['wins']}/-{t['losses']} (p = {t['p']:.2g})" for t in s["tests"].values())
        print(f"| {s['policy']} | {s['capacity']} | {s['mean']:.1f} | {tasks} | {s['red_end']:.2f}x | "
              f"{s['red_peak']:.2f}x | {tests} |  n={s['n']} {s['run']}")
    if out:
        print("tasks:", ", ".join(out[0]["tasks"]), "| tests:", ", ".join(refs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
