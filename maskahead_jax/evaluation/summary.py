"""A sweep's summary: per (policy, capacity) scores, per-dataset and per-length-group scores, KV
reductions, NFE and paired sign tests (`summarize`), as summary.json and the summary.md table."""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Optional, Sequence

import numpy as np

from . import atomic
from .loaders import LONGBENCH_PROMPTS
from .resume import cap_label
from .stats import paired_sign_test

REFERENCE = "maskahead"


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


# LongBench-E's length buckets (LongBench eval.py `scorer_e`: the record's `length`, in words)
LONGBENCH_E_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"), (math.inf, "8k+"))


def length_group(row: dict) -> Optional[str]:
    """The length group a result row is reported under: LongBench v1 rows by LongBench-E's
    buckets of the record's word count (0-4k / 4-8k / 8k+), LongBench v2 rows by their own
    short / medium / long label, every other row (testbed, needle grids, RULER) by its context
    length in tokens; None when the row has no length."""
    length = row.get("length")
    if length is None or (isinstance(length, float) and math.isnan(length)):
        return None
    if isinstance(length, str):
        return length
    if row.get("dataset") in LONGBENCH_PROMPTS:
        return next(label for bound, label in LONGBENCH_E_BUCKETS if length < bound)
    return str(int(length))


def _group_order(label: str) -> tuple:
    """0-4k < 4-8k < 8k+, short < medium < long, numbers by value, anything else by name."""
    fixed = [b for _, b in LONGBENCH_E_BUCKETS] + ["short", "medium", "long"]
    if label in fixed:
        return (0, fixed.index(label), "")
    return (1, int(label), "") if label.isdigit() else (2, 0, label)


def _per_length(rs: Sequence[dict], score_ds: Sequence[str]) -> dict:
    """{length group: macro mean over the scored datasets of the group's rows, x100}."""
    groups = defaultdict(lambda: defaultdict(list))
    for r in rs:
        g = length_group(r)
        if g is not None and r["dataset"] in score_ds:
            groups[g][r["dataset"]].append(r["score"])
    return {g: _mean([100 * _mean(v) for v in groups[g].values()])
            for g in sorted(groups, key=_group_order)}


def summarize(rows: Sequence[dict], score_datasets: Optional[Sequence[str]] = None) -> dict:
    """Per run (policy, capacity): n, score (macro mean over `score_datasets`, default all the
    datasets, x100), per-dataset scores, per-length-group scores (`length_group`: LongBench-E's
    buckets for LongBench, context length otherwise; each the macro mean over the group's datasets),
    KV reduction at the end / peak (sum of dense-equivalent bytes / sum of held bytes over the
    examples, and the mean of per-example ratios), mean NFE, and paired sign tests against dense
    and against MaskAhead at the same capacity."""
    by = defaultdict(list)
    for r in rows:
        by[(r["policy"], cap_label(r.get("capacity")))].append(r)
    datasets = sorted({r["dataset"] for r in rows})
    score_ds = list(score_datasets) if score_datasets else datasets
    runs = []
    scores = {k: {r["id"]: r["score"] for r in v} for k, v in by.items()}
    dense_key = next((k for k in by if k[0] == "dense"), None)
    for (p, c), rs in sorted(by.items(), key=lambda kv: (kv[0][0] != "dense", kv[0][0], _capf(kv[0][1]))):
        per_ds = {d: 100 * _mean([r["score"] for r in rs if r["dataset"] == d]) for d in datasets
                  if any(r["dataset"] == d for r in rs)}
        run = dict(
            policy=p, capacity=None if c == "full" else float(c), n=len(rs),
            score=_mean([v for d, v in per_ds.items() if d in score_ds]), per_dataset=per_ds,
            per_length=_per_length(rs, score_ds),
            reduction_final=sum(r["dense_bytes_final"] for r in rs) / max(1.0, sum(r["kv_bytes_final"] for r in rs)),
            reduction_peak=sum(r["dense_bytes_peak"] for r in rs) / max(1.0, sum(r["kv_bytes_peak"] for r in rs)),
            reduction_final_mean=_mean([r["reduction_final"] for r in rs]),
            reduction_peak_mean=_mean([r["reduction_peak"] for r in rs]),
            nfe=_mean([r["nfe"] for r in rs]),
            # examples where a policy floor, not the budget, set what was kept (BudgetWarning)
            floor_over_budget=sum(1 for r in rs if r.get("budget_note")),
            budget_note=next((r["budget_note"] for r in rs if r.get("budget_note")), None))
        if dense_key and (p, c) != dense_key:
            run["vs_dense"] = paired_sign_test(scores[(p, c)], scores[dense_key])
        ref = (REFERENCE, c)
        if p != REFERENCE and ref in scores:
            run["vs_maskahead"] = paired_sign_test(scores[(p, c)], scores[ref])
        runs.append(run)
    return dict(datasets=datasets, runs=runs, score_datasets=score_ds)


def _capf(c: str) -> float:
    return -1.0 if c == "full" else float(c)


def _fmt_test(t: Optional[dict]) -> str:
    if not t:
        return "-"
    return f"+{t['wins']}/-{t['losses']} (p={t['p']:.3g})"


def cap_cell(run: dict) -> str:
    """A summary run's capacity for a table: "full", "10", or "10*" when a policy floor, not the
    budget, set what was kept in any of its examples (`floor_over_budget`)."""
    c = "full" if run["capacity"] is None else f"{run['capacity']:g}"
    return c + ("*" if run.get("floor_over_budget") else "")


def to_markdown(summary: dict) -> str:
    """summary.md: the runs table, the per-length table (when rows span several length groups),
    then notes on the scores, floor-set capacities and errors."""
    ds = summary["datasets"]
    head = ["policy", "capacity %", "n", "score"] + ds + ["KV red. end", "KV red. peak", "NFE",
                                                         "vs dense (W/L, p)", "vs MaskAhead (W/L, p)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["runs"]:
        cells = [r["policy"], cap_cell(r), str(r["n"]),
                 f"{r['score']:.2f}"] + [f"{r['per_dataset'][d]:.2f}" if d in r["per_dataset"] else "-" for d in ds]
        cells += [f"{r['reduction_final']:.2f}x", f"{r['reduction_peak']:.2f}x", f"{r['nfe']:.1f}",
                  _fmt_test(r.get("vs_dense")), _fmt_test(r.get("vs_maskahead"))]
        lines.append("| " + " | ".join(cells) + " |")
    groups = sorted({g for r in summary["runs"] for g in r.get("per_length", {})}, key=_group_order)
    if len(groups) > 1:
        lines += ["", "Score by length (LongBench: LongBench-E's buckets of the context's word count; "
                  "LongBench v2: its length label; others: context tokens), the macro mean over each "
                  "group's datasets:", "",
                  "| policy | capacity % | " + " | ".join(groups) + " |", "|" + "---|" * (len(groups) + 2)]
        for r in summary["runs"]:
            pl = r.get("per_length", {})
            lines.append("| " + " | ".join([r["policy"], cap_cell(r)]
                                           + [f"{pl[g]:.2f}" if g in pl else "-" for g in groups]) + " |")
    sd = summary.get("score_datasets")
    over = f" over {', '.join(sd)}" if sd and sd != ds else ""
    notes = ["", f"Scores x100 (score: dataset macro mean{over}). KV reduction = dense-equivalent bf16 bytes / held bytes, "
                 "summed over examples. Sign tests: paired by example, ties dropped, exact two-sided binomial."]
    floored = [r for r in summary["runs"] if r.get("floor_over_budget")]
    if floored:
        notes.append("")
        notes.append("`*` (capacity): a policy floor, not the budget, sets what is kept (floor > budget), so the "
                     "row is not a run at that budget:")
        for r in floored:
            notes.append(f"- {r['policy']}@{cap_label(r['capacity'])}: {r['floor_over_budget']} of {r['n']} examples, "
                         f"e.g. {r['budget_note']}")
    for e in summary.get("errors", []):
        notes.append(f"- error: {e['policy']}@{cap_label(e['capacity'])}: {e['error']}")
    return "\n".join(lines + notes) + "\n"


def write_summary(summary: dict, out_dir: str) -> dict:
    """summary.json and summary.md in out_dir, each written atomically."""
    js = os.path.join(out_dir, "summary.json")
    md = os.path.join(out_dir, "summary.md")
    atomic.write_json(js, summary, indent=1, default=float)
    atomic.write_text(md, to_markdown(summary))
    return dict(summary_json=js, summary_md=md)
