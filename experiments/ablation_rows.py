"""One markdown row per (policy, capacity) of `maskahead eval` runs, with paired sign tests
against named reference rows: the ablation tables of docs/results.md "Beyond the paper".

    python experiments/ablation_rows.py runs/beyond40_q4qa runs/beyond40_7 \
        --ref dense=runs/beyond40:dense --ref maskahead=runs/beyond40:maskahead@10

Each run folder's results.jsonl is read (every row of it); a reference is FOLDER:POLICY[@CAPACITY].
A run (or a reference's folder) spelled A+B is the rows of A and B together: one row of the table
whose tasks ran in two folders (`--tasks longanswer,twohop` into A, the others into B).
Scores are percentages (x 100); the suite mean is the mean over tasks of the task means (as the
eval's summary); KV reduction end / peak are the means over examples of the per-example ratios;
sign tests pair by example id, ties dropped (evaluation.stats.paired_sign_test). The scores and
reductions are `maskahead eval`'s own summary (evaluation.sweep.summarize). `--gap NAME` adds a
column: the suite-mean gap to reference NAME in points with its 95% paired bootstrap interval
(evaluation.stats.paired_bootstrap_gap, resampled within tasks). `--by-task NAME` adds one line
per row: the sign test against reference NAME within each task (issue 40 compares candidates with
the released MaskAhead per task). Prints JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from maskahead_jax.evaluation.stats import paired_bootstrap_gap, paired_sign_test
from maskahead_jax.evaluation.sweep import load_rows, row_key, summarize


def load(folder: str) -> list[dict]:
    """The rows of one run folder's results.jsonl (read only); A+B: A's rows, then B's (an
    example of the same policy and capacity in both is an error, not counted twice)."""
    rows, seen = [], set()
    for part in folder.split("+"):
        got = load_rows(os.path.join(part, "results.jsonl"), repair=False)
        if not got:
            raise SystemExit(f"no result rows in {part}")
        keys = {row_key(r) for r in got}
        if keys & seen:
            raise SystemExit(f"{folder}: {part} repeats {len(keys & seen)} examples of the folders before it")
        seen |= keys
        rows += got
    return rows


def scores_of(rows, policy: str, capacity) -> dict:
    """{example id: score} of one (policy, capacity) run."""
    return {r["id"]: r["score"] for r in rows if r["policy"] == policy and r.get("capacity") == capacity}


def tasks_of(rows) -> dict:
    """{example id: task} (the row's dataset)."""
    return {r["id"]: r["dataset"] for r in rows}


def by_task(scores: dict, ref: dict, task: dict) -> dict:
    """{task: sign test of scores against ref on that task's examples}, tasks in first-seen order."""
    out = {}
    for t in dict.fromkeys(task[i] for i in scores):
        mine = {i: s for i, s in scores.items() if task[i] == t}
        out[t] = paired_sign_test(mine, ref)
    return out


def parse_ref(spec: str):
    """NAME=FOLDER:POLICY[@CAPACITY] -> (name, folder, policy, capacity or None)."""
    name, _, rest = spec.partition("=")
    folder, _, pol = rest.rpartition(":")
    if not (name and folder and pol):
        raise SystemExit(f"--ref {spec!r}: expected NAME=FOLDER:POLICY[@CAPACITY]")
    pol, _, cap = pol.partition("@")
    return name, folder, pol, (float(cap) if cap else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (results.jsonl)")
    ap.add_argument("--ref", action="append", default=[], help="NAME=FOLDER:POLICY[@CAPACITY]")
    ap.add_argument("--gap", action="append", default=[], metavar="NAME",
                    help="add the suite-mean gap to reference NAME with a 95%% bootstrap interval")
    ap.add_argument("--by-task", action="append", default=[], metavar="NAME",
                    help="add the per-task sign tests against reference NAME")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    refs = {}
    for spec in a.ref:
        name, folder, pol, cap = parse_ref(spec)
        refs[name] = scores_of(load(folder), pol, cap)
        if not refs[name]:
            raise SystemExit(f"--ref {spec!r}: no rows of {pol} at capacity {cap} in {folder}")
    for flag, names in (("--gap", a.gap), ("--by-task", a.by_task)):
        unknown = [g for g in names if g not in refs]
        if unknown:
            raise SystemExit(f"{flag} {unknown[0]!r}: no --ref of that name (have: {', '.join(refs) or 'none'})")
    out = []
    for folder in a.runs:
        rows = load(folder)
        task = tasks_of(rows)
        for run in summarize(rows)["runs"]:  # the eval's own summary: scores, reductions
            scores = scores_of(rows, run["policy"], run["capacity"])
            out.append(dict(run=folder, policy=run["policy"], capacity=run["capacity"], n=run["n"],
                            floor_over_budget=run.get("floor_over_budget", 0),
                            mean=run["score"], tasks=run["per_dataset"], red_end=run["reduction_final_mean"],
                            red_peak=run["reduction_peak_mean"],
                            tests={n: paired_sign_test(scores, ref) for n, ref in refs.items()},
                            gaps={g: {k: (100 * v if k != "n" else v)
                                      for k, v in paired_bootstrap_gap(scores, refs[g]).items()}
                                  for g in a.gap},
                            by_task={n: by_task(scores, refs[n], task) for n in a.by_task}))
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for s in out:
        tasks = " | ".join(f"{v:.1f}" for v in s["tasks"].values())
        tests = " | ".join([f"+{t['wins']}/-{t['losses']} (p = {t['p']:.2g})" for t in s["tests"].values()]
                           + [f"{g['gap']:+.1f} [{g['lo']:+.1f}, {g['hi']:+.1f}]" for g in s["gaps"].values()])
        star = "*" if s["floor_over_budget"] else ""  # a floor, not the budget, set what was kept
        print(f"| {s['policy']} | {s['capacity']}{star} | {s['mean']:.1f} | {tasks} | {s['red_end']:.2f}x | "
              f"{s['red_peak']:.2f}x | {tests} |  n={s['n']} {s['run']}")
        for n, per in s["by_task"].items():
            print(f"    vs {n} by task: " + ", ".join(f"{t} +{r['wins']}/-{r['losses']} (p = {r['p']:.2g})"
                                                 for t, r in per.items()))
    if any(s["floor_over_budget"] for s in out):
        print("capacity*: a policy floor, not the budget, set what was kept (floor > budget) in "
              + ", ".join(f"{s['policy']}@{s['capacity']} {s['floor_over_budget']}/{s['n']}"
                          for s in out if s["floor_over_budget"]), file=sys.stderr)
    if out:
        print("tasks:", ", ".join(out[0]["tasks"]), "| tests:", ", ".join(refs),
              "| gaps to:", ", ".join(a.gap) or "-", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
