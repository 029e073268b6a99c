"""Issue 53's goals for a long-context testbed export, measured and checked in one command.

    python experiments/long_context_goals.py --model EXPORT --out runs/goals_stage34
    python experiments/long_context_goals.py --model maskahead_jax/testbed \
        --rope-scaling dynamic_yarn:16:2048 --max-positions 33280 --out runs/goals_29dyn
    python experiments/long_context_goals.py --twin --model maskahead_jax/testbed_bidir \
        --rope-scaling dynamic_yarn:16:2048 --max-positions 33280 --out runs/goals_twin
    python experiments/long_context_goals.py --out runs/goals_stage34 --summary   # no new runs

Each group of cells is one `eval_testbed.py` run (dense, cached generate, held-out seed 0) with
its own `--results` file under --out, so an interrupted check resumes where it stopped, and the
rows are the per-example results a card or docs/testbed_history.md cites. Groups (--only picks):

  retrieval  pass key, multi-key at 4096 and 8192   (--n per depth x 5 depths: 100 per cell)
  long16k    pass key, multi-key at 16384
  long32k    pass key at 32768
  tasks8k    two-hop, document QA, long answer at 8192
  short      the Status table's 1,500 examples (five tasks at 512 / 1024 / 2048, 20 per depth),
             paired against stage 29's rows (docs/testbed_results/stage29_main.jsonl): a sign test
  twin8k     (--twin) pass key, multi-key at 8192 on the bidirectional twin

Prints one JSON object (also written to OUT/goals.json): each goal's measured mean, its n and
whether it is met; a goal whose cells are not all measured yet is "pending".
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT]

from experiments import eval_testbed as E  # noqa: E402

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
STAGE29_MAIN = os.path.join(_ROOT, "docs", "testbed_results", "stage29_main.jsonl")

# group -> (tasks, lengths, batch)
GROUPS = {
    "retrieval": (("passkey", "multikey"), (4096, 8192), 10),
    "long16k": (("passkey", "multikey"), (16384,), 5),
    "long32k": (("passkey",), (32768,), 2),
    "tasks8k": (("twohop", "docqa", "longanswer"), (8192,), 10),
    "short": (("passkey", "multikey", "twohop", "docqa", "longanswer"), (512, 1024, 2048), 16),
    "twin8k": (("passkey", "multikey"), (8192,), 5),
}
# (group, task, length, the mean it must reach): issue 53's goals
GOALS = [("retrieval", t, n, g) for n in (4096, 8192) for t, g in (("passkey", 0.95), ("multikey", 0.90))] + [
    ("long16k", "passkey", 16384, 0.95), ("long16k", "multikey", 16384, 0.90), ("long32k", "passkey", 32768, 0.90),
    ("tasks8k", "twohop", 8192, 0.80), ("tasks8k", "docqa", 8192, 0.85), ("tasks8k", "longanswer", 8192, 0.85)]
TWIN_GOALS = [("twin8k", "passkey", 8192, 0.95), ("twin8k", "multikey", 8192, 0.90)]


def group_argv(group: str, args) -> list[str]:
    """eval_testbed.py's arguments for one group (its --results file under args.out)."""
    tasks, lengths, batch = GROUPS[group]
    n = 20 if group == "short" else args.n
    argv = ["--model", args.model, "--tasks", ",".join(tasks), "--lengths", ",".join(map(str, lengths)),
            "--depths", ",".join(map(str, DEPTHS)), "--n", str(n), "--batch", str(batch),
            "--results", os.path.join(args.out, f"{group}.jsonl")]
    if args.rope_scaling:
        argv += ["--rope-scaling", args.rope_scaling]
    if args.max_positions:
        argv += ["--max-positions", str(args.max_positions)]
    return argv


def cell_scores(path: str, task: str, length: int) -> tuple[list[float], int]:
    """(every example score of the task at that length, how many of its depths are measured)."""
    if not os.path.exists(path):
        return [], 0
    scores, depths = [], set()
    for rec in E.read_results(path):
        t, n, d = rec["cell"].split("/")
        if t == task and int(n) == length:
            scores += rec["scores"]
            depths.add(float(d))
    return scores, len(depths)


def goal_rows(out: str, goals) -> list[dict]:
    rows = []
    for group, task, length, need in goals:
        scores, depths = cell_scores(os.path.join(out, f"{group}.jsonl"), task, length)
        mean = float(np.mean(scores)) if scores else None
        status = "pending" if depths < len(DEPTHS) else ("met" if mean >= need else "not met")
        rows.append(dict(task=task, length=length, goal=need, mean=None if mean is None else round(mean, 4),
                         n=len(scores), status=status))
    return rows


def short_row(out: str, base: str = STAGE29_MAIN) -> dict:
    """The 512-2048 goal: no significant loss against stage 29 on the examples both files hold."""
    path = os.path.join(out, "short.jsonl")
    tasks, lengths, _ = GROUPS["short"]
    measured = sum(cell_scores(path, t, n)[1] for t in tasks for n in lengths)
    if measured < len(tasks) * len(lengths) * len(DEPTHS):
        return dict(goal="no significant loss at 512-2048 against stage 29", status="pending",
                    cells=measured)
    with contextlib.redirect_stderr(io.StringIO()):
        c = E.compare_results([base, path])["against"][0]
    lost = c["losses"] > c["wins"] and c["p"] < 0.05
    return dict(goal="no significant loss at 512-2048 against stage 29", mean=round(c["mean"], 4),
                base_mean=round(c["base_mean"], 4), wins=c["wins"], losses=c["losses"], p=c["p"],
                status="not met" if lost else "met")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(_ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--rope-scaling", default=None, help="TYPE:FACTOR[:ORIGINAL] (docs/rope.md)")
    ap.add_argument("--max-positions", type=int, default=None)
    ap.add_argument("--out", required=True, help="folder of the groups' --results files and goals.json")
    ap.add_argument("--n", type=int, default=20, help="examples per (task, length, depth): 20 = 100 per cell")
    ap.add_argument("--only", default=None, help=f"comma-separated groups, from: {', '.join(GROUPS)}")
    ap.add_argument("--twin", action="store_true", help="the bidirectional twin's goals (group twin8k)")
    ap.add_argument("--summary", action="store_true", help="only summarise what --out already holds")
    args = ap.parse_args(argv)
    default = ["twin8k"] if args.twin else ["retrieval", "tasks8k", "short", "long16k", "long32k"]
    groups = args.only.split(",") if args.only else default
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise SystemExit(f"--only: unknown group(s) {', '.join(bad)}; choose from {', '.join(GROUPS)}")
    os.makedirs(args.out, exist_ok=True)
    if not args.summary:
        for g in groups:
            print(f"[goals] {g}", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(io.StringIO()):  # eval_testbed's own JSON: the rows are kept
                E.main(group_argv(g, args))
    res = dict(model=args.model, rope_scaling=args.rope_scaling,
               goals=goal_rows(args.out, TWIN_GOALS if args.twin else GOALS))
    if not args.twin:
        res["short"] = short_row(args.out)
    with open(os.path.join(args.out, "goals.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
