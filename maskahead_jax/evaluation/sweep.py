"""Policies x budgets sweeps: batched generation with length bucketing, per-example JSONL results
that resume without loss or duplicates, summary table (Markdown + JSON), paired sign tests, plots.

Files written under `out_dir`:
  results.jsonl   one line per (policy, capacity, example id)
  summary.json    per run: score, per-dataset scores, KV reduction end / peak, NFE, sign tests
  summary.md      the same as a Markdown table
  budgets.json    per-layer / per-head budgets of policies that expose them (MaskKV)
  *.png           pareto.png, needle_<dataset>.png, budgets_<policy>_<cap>.png
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

import numpy as np

from ..config import GenerationConfig
from .datasets import EvalExample, Tokenizer, score_example
from .policies import NO_CAPACITY, make_policy, policy_budgets
from .stats import paired_sign_test

REFERENCE = "maskahead"


def cap_label(cap: Optional[float]) -> str:
    return "full" if cap is None else f"{cap:g}"


def row_key(row: dict) -> tuple:
    return (row["policy"], cap_label(row.get("capacity")), row["id"])


def load_rows(path: str, repair: bool = True) -> list[dict]:
    """Rows of a results file, first occurrence per key; malformed lines (a write cut by an
    interruption) are skipped, and with `repair` the file is rewritten atomically without them."""
    if not os.path.exists(path):
        return []
    rows, seen, bad = [], set(), 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for line in lines:
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            k = row_key(r)
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
            continue
        if k in seen:
            bad += 1
            continue
        seen.add(k)
        rows.append(r)
    if repair and (bad or (lines and lines[-1] != "")):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return rows


def _runs(policies: Sequence[str], capacities: Sequence[Optional[float]]) -> list[tuple[str, Optional[float]]]:
    runs = []
    for p in policies:
        p = p.strip().lower()
        caps = [None] if p in NO_CAPACITY else [c for c in capacities if c is not None] or [None]
        for c in caps:
            if (p, c) not in runs:
                runs.append((p, c))
    return runs


def _batches(exs: list[EvalExample], batch_size: int) -> list[list[EvalExample]]:
    """Bucket by max_new_tokens, sort by prompt length, cut into batches of `batch_size`."""
    groups = defaultdict(list)
    for e in exs:
        groups[e.max_new_tokens].append(e)
    out = []
    for mnt in sorted(groups):
        g = sorted(groups[mnt], key=lambda e: (len(e.ids), e.id))
        out += [g[i:i + batch_size] for i in range(0, len(g), batch_size)]
    return out


def auto_bucket(n: int) -> int:
    """Prompt-bucket quantum for a batch whose longest prompt has n tokens: 64, or 1/8 of the
    enclosing power of two (at most 8 buckets per octave, <= 12.5% padding), so a sweep over
    long ragged prompts compiles a handful of shapes instead of one per batch."""
    return max(64, 2 ** max(0, math.ceil(math.log2(max(n, 1))) - 3))


@dataclasses.dataclass
class SweepResult:
    rows: list
    summary: dict
    paths: dict
    errors: list


def run_sweep(model, examples: Sequence[EvalExample], policies: Sequence[str],
              capacities: Sequence[Optional[float]], out_dir: str, tokenizer: Tokenizer, *,
              gen: GenerationConfig = GenerationConfig(), batch_size: int = 8,
              max_new_tokens: Optional[int] = None, policy_factory: Callable = make_policy,
              progress: bool = True, strict: bool = False, plots: bool = True,
              meta: Optional[dict] = None, bucket="auto", pad_batches: bool = True,
              mesh=None) -> SweepResult:
    """Run every (policy, capacity) on every example, appending to out_dir/results.jsonl.

    Rows already in the file are skipped (resume). Capacity-free policies (dense) run once.
    `gen` is the base GenerationConfig (a preset); max_new_tokens comes from each example unless
    given. A failing run is reported in `errors` (and re-raised when strict).
    bucket: prompt-length bucket quantum ("auto": `auto_bucket`); pad_batches: fill a short last
    batch with copies of its last prompt (outputs dropped) so it reuses the full batch's compile."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not examples:
        raise ValueError("no examples to evaluate")
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids are not unique")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.jsonl")
    rows = load_rows(path)
    done = {row_key(r) for r in rows}
    runs = _runs(policies, capacities)
    todo = {(p, c): [e for e in examples if (p, cap_label(c), e.id) not in done] for p, c in runs}
    total = sum(len(v) for v in todo.values())
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, disable=not progress, desc="eval", file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = None
    from ..generate import generate

    errors, budgets = [], {}
    with open(path, "a", encoding="utf-8") as fout:
        for (p, c), exs in todo.items():
            try:
                policy = policy_factory(p, c)
            except Exception as e:
                errors.append(dict(policy=p, capacity=c, error=f"{type(e).__name__}: {e}"))
                if strict:
                    raise
                continue
            if bar is not None:
                bar.set_description(f"{p}@{cap_label(c)}")
            for batch in _batches(exs, batch_size):
                cfg = dataclasses.replace(gen, max_new_tokens=int(max_new_tokens or batch[0].max_new_tokens))
                prompts = [e.ids for e in batch]
                if pad_batches and len(prompts) < batch_size and len(exs) > len(batch):
                    prompts = prompts + [prompts[-1]] * (batch_size - len(prompts))
                q = auto_bucket(max(len(x) for x in prompts)) if bucket == "auto" else int(bucket)
                try:
                    out = generate(model, prompts, cfg, policy, bucket=q, mesh=mesh)
                except Exception as e:
                    errors.append(dict(policy=p, capacity=c, error=f"{type(e).__name__}: {e}"))
                    if strict:
                        raise
                    break
                st = out.stats
                b = policy_budgets(policy, st, model.config.num_layers, [len(e.ids) for e in batch])
                if b is not None:
                    budgets.setdefault(f"{p}@{cap_label(c)}", []).append((b, len(batch)))
                lines = []
                for i, e in enumerate(batch):
                    pred = tokenizer.decode(out.tokens[i])
                    row = dict(
                        policy=p, capacity=c, id=e.id, dataset=e.dataset, prediction=pred,
                        answers=e.answers, score=score_example(e, pred),
                        reduction_final=float(st["reduction_final"][i]),
                        reduction_peak=float(st["reduction_peak"][i]),
                        kv_bytes_final=float(st["kv_bytes_final"][i]), kv_bytes_peak=float(st["kv_bytes_peak"][i]),
                        dense_bytes_final=float(st["dense_bytes_final"][i]),
                        dense_bytes_peak=float(st["dense_bytes_peak"][i]),
                        nfe=int(st["nfe"][i]), n_prompt_tokens=len(e.ids), n_gen_tokens=len(out.tokens[i]),
                        length=e.meta.get("length"), depth=e.meta.get("depth"),
                        batch_size=len(prompts), batch_wall_s=float(st["wall_s"]),
                        evictions=int(st.get("evictions", 0)))
                    lines.append(json.dumps(row))
                    rows.append(row)
                fout.write("\n".join(lines) + "\n")
                fout.flush()
                os.fsync(fout.fileno())
                if bar is not None:
                    bar.update(len(batch))
    if bar is not None:
        bar.close()
    if budgets:
        budgets = {k: _avg_budgets(v) for k, v in budgets.items()}
        old = {}
        bpath = os.path.join(out_dir, "budgets.json")
        if os.path.exists(bpath):
            try:
                old = json.load(open(bpath))
            except json.JSONDecodeError:
                old = {}
        old.update(budgets)
        json.dump(old, open(bpath, "w"), indent=1)
    keys = {(p, cap_label(c), e) for p, c in runs for e in ids}
    mine = [r for r in rows if row_key(r) in keys]
    summary = summarize(mine)
    summary["errors"] = errors
    if meta:
        summary["meta"] = meta
    paths = write_summary(summary, out_dir)
    paths["results"] = path
    if plots:
        from . import plots as P
        paths.update(P.make_plots(mine, summary, out_dir))
    return SweepResult(rows=mine, summary=summary, paths=paths, errors=errors)


def _avg_budgets(items) -> dict:
    """Example-weighted mean of per-batch budgets (entries whose shapes differ are dropped)."""
    out = {}
    for name in ("layer", "head"):
        arrs = [(np.asarray(b[name], float), n) for b, n in items if b.get(name) is not None]
        arrs = [(a, n) for a, n in arrs if a.shape == arrs[0][0].shape]
        out[name] = (sum(a * n for a, n in arrs) / sum(n for _, n in arrs)).tolist() if arrs else None
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


def summarize(rows: Sequence[dict]) -> dict:
    """Per run (policy, capacity): n, score (macro mean over datasets, x100), per-dataset scores,
    KV reduction at the end / peak (sum of dense-equivalent bytes / sum of held bytes over the
    examples, and the mean of per-example ratios), mean NFE, and paired sign tests against dense
    and against MaskAhead at the same capacity."""
    by = defaultdict(list)
    for r in rows:
        by[(r["policy"], cap_label(r.get("capacity")))].append(r)
    datasets = sorted({r["dataset"] for r in rows})
    runs = []
    scores = {k: {r["id"]: r["score"] for r in v} for k, v in by.items()}
    dense_key = next((k for k in by if k[0] == "dense"), None)
    for (p, c), rs in sorted(by.items(), key=lambda kv: (kv[0][0] != "dense", kv[0][0], _capf(kv[0][1]))):
        per_ds = {d: 100 * _mean([r["score"] for r in rs if r["dataset"] == d]) for d in datasets
                  if any(r["dataset"] == d for r in rs)}
        run = dict(
            policy=p, capacity=None if c == "full" else float(c), n=len(rs),
            score=_mean(list(per_ds.values())), per_dataset=per_ds,
            reduction_final=sum(r["dense_bytes_final"] for r in rs) / max(1.0, sum(r["kv_bytes_final"] for r in rs)),
            reduction_peak=sum(r["dense_bytes_peak"] for r in rs) / max(1.0, sum(r["kv_bytes_peak"] for r in rs)),
            reduction_final_mean=_mean([r["reduction_final"] for r in rs]),
            reduction_peak_mean=_mean([r["reduction_peak"] for r in rs]),
            nfe=_mean([r["nfe"] for r in rs]))
        if dense_key and (p, c) != dense_key:
            run["vs_dense"] = paired_sign_test(scores[(p, c)], scores[dense_key])
        ref = (REFERENCE, c)
        if p != REFERENCE and ref in scores:
            run["vs_maskahead"] = paired_sign_test(scores[(p, c)], scores[ref])
        runs.append(run)
    return dict(datasets=datasets, runs=runs)


def _capf(c: str) -> float:
    return -1.0 if c == "full" else float(c)


def _fmt_test(t: Optional[dict]) -> str:
    if not t:
        return "-"
    return f"+{t['wins']}/-{t['losses']} (p={t['p']:.3g})"


def to_markdown(summary: dict) -> str:
    ds = summary["datasets"]
    head = ["policy", "capacity %", "n", "score"] + ds + ["KV red. end", "KV red. peak", "NFE",
                                                         "vs dense (W/L, p)", "vs MaskAhead (W/L, p)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["runs"]:
        cells = [r["policy"], "full" if r["capacity"] is None else f"{r['capacity']:g}", str(r["n"]),
                 f"{r['score']:.2f}"] + [f"{r['per_dataset'][d]:.2f}" if d in r["per_dataset"] else "-" for d in ds]
        cells += [f"{r['reduction_final']:.2f}x", f"{r['reduction_peak']:.2f}x", f"{r['nfe']:.1f}",
                  _fmt_test(r.get("vs_dense")), _fmt_test(r.get("vs_maskahead"))]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "Scores x100 (dataset macro mean). KV reduction = dense-equivalent bf16 bytes / held bytes, "
                 "summed over examples. Sign tests: paired by example, ties dropped, exact two-sided binomial."]
    for e in summary.get("errors", []):
        notes.append(f"- error: {e['policy']}@{cap_label(e['capacity'])}: {e['error']}")
    return "\n".join(lines + notes) + "\n"


def write_summary(summary: dict, out_dir: str) -> dict:
    js = os.path.join(out_dir, "summary.json")
    md = os.path.join(out_dir, "summary.md")
    with open(js, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    with open(md, "w") as f:
        f.write(to_markdown(summary))
    return dict(summary_json=js, summary_md=md)
