"""experiments/ablation_rows.py: the rows of docs/results.md's ablation tables."""
from __future__ import annotations

import json

import pytest

from experiments import ablation_rows


def test_ablation_rows_joins_split_task_folders(tmp_path):
    """experiments/ablation_rows.py: A+B is one row's examples from two folders; an example in
    both is refused rather than counted twice."""
    def folder(name, ids):
        d = tmp_path / name
        d.mkdir()
        (d / "results.jsonl").write_text("".join(
            json.dumps(dict(policy="p", capacity=20.0, id=i, dataset=i.split("/")[0], score=1.0)) + "\n" for i in ids))
        return str(d)

    a = folder("a", ["longanswer/x/1", "twohop/x/1"])
    b = folder("b", ["docqa/x/1"])
    c = folder("c", ["twohop/x/1"])
    assert [r["id"] for r in ablation_rows.load(f"{a}+{b}")] == ["longanswer/x/1", "twohop/x/1", "docqa/x/1"]
    with pytest.raises(SystemExit, match="repeats 1 examples"):
        ablation_rows.load(f"{a}+{c}")


def _write_results(d, rows):
    """A run folder's results.jsonl: the given rows with unit memory / NFE fields (summarize reads them)."""
    mem = dict(dense_bytes_final=1.0, kv_bytes_final=1.0, dense_bytes_peak=1.0, kv_bytes_peak=1.0,
               reduction_final=1.0, reduction_peak=1.0, nfe=1)
    (d / "results.jsonl").write_text("".join(json.dumps(dict(r, **mem)) + "\n" for r in rows))


def test_ablation_rows_gap_column_is_the_bootstrap_gap_in_points(tmp_path, capsys):
    """--gap NAME: the suite-mean gap to a reference in points with its 95% interval; a name
    that is no --ref is refused."""
    d = tmp_path / "r"
    d.mkdir()
    ids = [f"{t}/x/{k}" for t in ("docqa", "twohop") for k in range(4)]
    rows = [dict(policy="dense", capacity=None, id=i, dataset=i.split("/")[0], score=1.0) for i in ids]
    rows += [dict(policy="p", capacity=20.0, id=i, dataset=i.split("/")[0], score=0.5 if i == "twohop/x/0" else 1.0)
             for i in ids]
    _write_results(d, rows)
    ablation_rows.main([str(d), "--ref", f"dense={d}:dense", "--gap", "dense", "--json"])
    out = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    g = out["p"]["gaps"]["dense"]
    assert g["gap"] == pytest.approx(-100 * 0.5 / 4 / 2) and g["lo"] <= g["gap"] <= g["hi"] <= 0
    assert out["dense"]["gaps"]["dense"] == dict(n=8, gap=0.0, lo=0.0, hi=0.0)
    with pytest.raises(SystemExit, match="--gap 'x': no --ref"):
        ablation_rows.main([str(d), "--ref", f"dense={d}:dense", "--gap", "x"])


def test_ablation_rows_by_task_is_the_sign_test_within_each_task(tmp_path, capsys):
    """--by-task NAME: the paired sign test against a reference within each task's examples."""
    d = tmp_path / "r"
    d.mkdir()
    ids = [f"{t}/x/{k}" for t in ("longanswer", "twohop") for k in range(3)]
    rows = [dict(policy="ref", capacity=20.0, id=i, dataset=i.split("/")[0], score=0.5) for i in ids]
    # the candidate wins every long answer and loses one two-hop example
    rows += [dict(policy="p", capacity=20.0, id=i, dataset=i.split("/")[0],
                  score=1.0 if i.startswith("longanswer") else (0.0 if i == "twohop/x/0" else 0.5)) for i in ids]
    _write_results(d, rows)
    ablation_rows.main([str(d), "--ref", f"ref={d}:ref@20", "--by-task", "ref", "--json"])
    per = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}["p"]["by_task"]["ref"]
    assert list(per) == ["longanswer", "twohop"]
    assert (per["longanswer"]["wins"], per["longanswer"]["losses"]) == (3, 0)
    assert (per["twohop"]["wins"], per["twohop"]["losses"]) == (0, 1)
    ablation_rows.main([str(d), "--ref", f"ref={d}:ref@20", "--by-task", "ref"])
    assert "vs ref by task: longanswer +3/-0" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--by-task 'x': no --ref"):
        ablation_rows.main([str(d), "--ref", f"ref={d}:ref@20", "--by-task", "x"])
