"""A sweep's rows as committed files: the per-example results trimmed to what the tables need
(docs/testbed_results/*.jsonl) and the summary table recomputed from them, also for a sweep
that is still running or was cut short (summary.md is only written when a sweep ends).

    python -m maskahead_jax.evaluation.export runs/sweep37 docs/testbed_results/sweep37.jsonl \
        --sweep testbed-policies --min-n 55
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Optional, Sequence

from . import atomic
from .sweep import load_rows, summarize, to_markdown

KEEP = ("policy", "capacity", "id", "dataset", "score", "prediction", "reduction_final", "reduction_peak",
        "kv_bytes_final", "kv_bytes_peak", "dense_bytes_final", "dense_bytes_peak", "nfe",
        "n_prompt_tokens", "n_gen_tokens", "length", "depth", "evictions")


def trim(rows: Sequence[dict]) -> list[dict]:
    """Rows with only the KEEP fields, sorted by (policy, capacity, id)."""
    out = [{k: r.get(k) for k in KEEP} for r in rows]
    return sorted(out, key=lambda r: (r["policy"], -1 if r["capacity"] is None else r["capacity"], r["id"]))


def export(run_dir: str, out_jsonl: str, score_datasets: Optional[Sequence[str]] = None,
           min_n: int = 0) -> str:
    """Write the trimmed rows of run_dir/results.jsonl to out_jsonl (atomically); return the
    Markdown summary of those rows (scores, KV reduction end / peak, NFE, sign tests).
    min_n: keep only the (policy, capacity) runs with at least this many rows (a sweep still
    running: its finished runs)."""
    rows = load_rows(os.path.join(run_dir, "results.jsonl"), repair=False)
    n = Counter((r["policy"], r.get("capacity")) for r in rows)
    rows = [r for r in rows if n[(r["policy"], r.get("capacity"))] >= min_n]
    if not rows:
        raise ValueError(f"{run_dir}: no result rows" + (f" in runs of >= {min_n} rows" if min_n else ""))
    t = trim(rows)
    atomic.write_text(out_jsonl, "".join(json.dumps(r, sort_keys=True) + "\n" for r in t))
    return to_markdown(summarize(t, score_datasets))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m maskahead_jax.evaluation.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("out_jsonl")
    ap.add_argument("--sweep", default=None, help="a sweep preset: its headline score datasets")
    ap.add_argument("--min-n", type=int, default=0, help="keep only runs with at least this many rows")
    a = ap.parse_args(argv)
    sd = None
    if a.sweep:
        from .presets import sweep_preset

        sd = sweep_preset(a.sweep).score_datasets
    print(export(a.run_dir, a.out_jsonl, sd, a.min_n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
