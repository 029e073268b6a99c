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
