"""experiments/long_context_goals.py: issue 53's goals read from eval_testbed.py --results rows
(pending until every depth of a cell is measured; met / not met against the goal's mean), the
512-2048 goal as a sign test against stage 29's rows, and each group's eval_testbed command."""
from __future__ import annotations

import json
import os

import pytest

from experiments import eval_testbed as E
from experiments import long_context_goals as G


def _write(path, cells: dict) -> None:
    """cells: 'task/length/depth' -> scores, as eval_testbed.py --results writes them."""
    with open(path, "w") as f:
        for cell, scores in cells.items():
            f.write(json.dumps(dict(model="m", engine="cached", policy="dense", capacity=None, n_per_cell=len(scores),
                                    policy_kw="", threshold=0.95, seed=0, cell=cell, scores=scores)) + "\n")


def test_goal_rows_are_pending_until_every_depth_is_measured_then_met_or_not(tmp_path):
    cells = {f"passkey/4096/{d}": [1.0] * 4 for d in G.DEPTHS}
    cells.update({f"multikey/4096/{d}": [1.0, 1.0, 1.0, 0.0] for d in G.DEPTHS})  # 0.75 < 0.90
    cells.update({f"passkey/8192/{d}": [1.0] * 4 for d in G.DEPTHS[:3]})  # two depths missing
    _write(tmp_path / "retrieval.jsonl", cells)
    rows = {(r["task"], r["length"]): r for r in G.goal_rows(str(tmp_path), G.GOALS)}
    assert rows[("passkey", 4096)]["status"] == "met" and rows[("passkey", 4096)]["n"] == 20
    assert rows[("multikey", 4096)]["status"] == "not met" and rows[("multikey", 4096)]["mean"] == 0.75
    assert rows[("passkey", 8192)]["status"] == "pending"
    assert rows[("longanswer", 8192)]["status"] == "pending" and rows[("longanswer", 8192)]["n"] == 0


def test_short_goal_is_a_sign_test_against_stage_29s_rows(tmp_path):
    base = {r["cell"]: r["scores"] for r in E.read_results(G.STAGE29_MAIN)}
    assert len(base) == 75  # five tasks x three lengths x five depths
    _write(tmp_path / "short.jsonl", dict(list(base.items())[:10]))
    assert G.short_row(str(tmp_path))["status"] == "pending"
    _write(tmp_path / "short.jsonl", base)
    same = G.short_row(str(tmp_path))
    assert same["status"] == "met" and same["wins"] == same["losses"] == 0
    worse = {c: [0.0 if i < 2 else x for i, x in enumerate(s)] for c, s in base.items()}  # 2 per cell lost
    _write(tmp_path / "short.jsonl", worse)
    lost = G.short_row(str(tmp_path))
    assert lost["status"] == "not met" and lost["losses"] > lost["wins"] and lost["p"] < 0.05


def test_group_commands_parse_and_unknown_groups_are_refused(tmp_path):
    args = G.argparse.Namespace(model="M", rope_scaling="dynamic_yarn:16:2048", max_positions=33280,
                                out=str(tmp_path), n=20)
    argv = G.group_argv("long16k", args)
    assert argv[argv.index("--lengths") + 1] == "16384" and argv[argv.index("--n") + 1] == "20"
    assert argv[argv.index("--rope-scaling") + 1] == "dynamic_yarn:16:2048"
    assert argv[argv.index("--results") + 1] == os.path.join(str(tmp_path), "long16k.jsonl")
    short = G.group_argv("short", G.argparse.Namespace(**{**vars(args), "n": 4}))
    assert short[short.index("--n") + 1] == "20"  # the Status table's examples, whatever --n
    with pytest.raises(SystemExit, match="unknown group"):
        G.main(["--out", str(tmp_path), "--only", "retrieval,bogus"])
    res = G.main(["--out", str(tmp_path), "--summary"])  # nothing measured: every goal pending
    assert {r["status"] for r in res["goals"]} == {"pending"} and res["short"]["status"] == "pending"
