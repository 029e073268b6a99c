"""Issue 50: an eval's output folder never loses or mixes rows silently. Unusable lines of
results.jsonl are moved to a side file with a message; two evals cannot write one --out at once
(a lock; a dead owner's lock is taken over); a resume keeps the recorded --batch-size; and the
summary tables flag the rows whose floors, not the budget, set what was kept. Forwards are faked
(test_cli_errors.fake_generate): each test takes a second or two."""
import json
import os
import subprocess

import pytest

from maskahead_jax import cli
from maskahead_jax.evaluation.outlock import LOCK_NAME, out_lock
from test_cli_errors import G, _err, fake_generate

EVAL = ["eval", "--needle", "--lengths", "64", "--depths", "0,1", "--n", "2", "--no-progress", "--no-plots",
        "--policies", "dense", "--batch-size", "2"]


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [x for x in f.read().split("\n") if x]


def test_unusable_result_lines_move_to_a_side_file_with_a_message(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "ev")
    res = os.path.join(out, "results.jsonl")
    monkeypatch.setattr(G, "generate", fake_generate())
    assert cli.main(EVAL + ["--out", out]) == 0
    good = _lines(res)
    assert len(good) == 4
    bad = ['{"policy": "dense", "capacity": null, "id": "cut', '{"score": 1.0}', good[1]]
    with open(res, "a", encoding="utf-8") as f:
        f.write("\n".join(bad) + "\n")  # a line cut by a crash, a row without keys, a repeated row
    capsys.readouterr()
    fake = fake_generate()
    monkeypatch.setattr(G, "generate", fake)
    assert cli.main(EVAL + ["--out", out]) == 0
    side = os.path.join(out, "results.rejected.jsonl")
    err = capsys.readouterr().err
    assert (f"[eval] {res}: moved 3 lines it cannot use (1 malformed, 1 without the row keys, 1 duplicate) "
            f"to {side}") in err
    assert _lines(side) == bad  # as they were, nothing dropped
    assert _lines(res) == good and fake.calls == []  # the rows kept; nothing to redo
    assert cli.main(EVAL + ["--out", out]) == 0  # a clean file: no message, the side file as it was
    assert "moved" not in capsys.readouterr().err and _lines(side) == bad


def test_a_second_eval_into_the_same_out_is_refused(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "ev")
    monkeypatch.setattr(G, "generate", fake_generate())
    with out_lock(out):  # another eval holds --out (its own open file: a real flock conflict)
        assert cli.main(EVAL + ["--out", out]) == 2
        err = _err(capsys)
        assert err.startswith(f"maskahead eval: error: --out {out} is in use by another eval (pid {os.getpid()} on ")
        assert err.endswith("wait for it to end or use another --out")
        assert not os.path.exists(os.path.join(out, "results.jsonl"))
    assert not os.path.exists(os.path.join(out, LOCK_NAME))
    # a lock file left by a process that is gone is taken over
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(os.path.join(out, LOCK_NAME), "w") as f:
        json.dump(dict(pid=dead.pid, host=os.uname().nodename, started="yesterday"), f)
    assert cli.main(EVAL + ["--out", out]) == 0
    assert len(_lines(os.path.join(out, "results.jsonl"))) == 4
    assert not os.path.exists(os.path.join(out, LOCK_NAME))


def test_resume_refuses_another_batch_size(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "ev")
    monkeypatch.setattr(G, "generate", fake_generate(interrupt_after=1))
    assert cli.main(EVAL + ["--out", out]) == 130  # 2 of 4 rows
    assert json.load(open(os.path.join(out, "run.json")))["batch_size"] == 2
    capsys.readouterr()
    monkeypatch.setattr(G, "generate", fake_generate())
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert cli.main(EVAL[:-1] + ["1", "--out", out]) == 2
    assert _err(capsys) == (f"maskahead eval: error: --out {out} holds a run at --batch-size 2; this run has "
                            f"--batch-size 1, which can change bfloat16 results (docs/evaluation.md, \"Batch "
                            f"invariance\"): resume with --batch-size 2 or use another --out")
    assert before == {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert cli.main(EVAL + ["--out", out]) == 0
    assert len(_lines(os.path.join(out, "results.jsonl"))) == 4


def test_summary_tables_flag_floors_over_the_budget(tmp_path, capsys, monkeypatch):
    """maskahead's floor (capacity_floor=512) holds a whole 64-token prompt at 10%: the row is
    marked `10*` with a note naming how many examples and why; at 100% the budget holds."""
    from experiments import ablation_rows

    out = str(tmp_path / "ev")
    monkeypatch.setattr(G, "generate", fake_generate())
    args = EVAL[:EVAL.index("--policies")] + ["--policies", "dense,maskahead", "--capacity", "10,100", "--out", out]
    assert cli.main(args) == 0
    md = open(os.path.join(out, "summary.md")).read()
    assert "| maskahead | 10* | 4 |" in md and "| maskahead | 100 | 4 |" in md and "| dense | full | 4 |" in md
    assert "- maskahead@10: 4 of 4 examples, e.g. maskahead: capacity_floor=512 keeps " in md
    assert "-token prompt (100%), not capacity_pct=10%" in md and "maskahead@100:" not in md
    runs = {(r["policy"], r["capacity"]): r for r in json.load(open(os.path.join(out, "summary.json")))["runs"]}
    assert runs[("maskahead", 10.0)]["floor_over_budget"] == 4 and runs[("maskahead", 100.0)]["floor_over_budget"] == 0
    rows = [json.loads(x) for x in _lines(os.path.join(out, "results.jsonl"))]
    assert all(bool(r["budget_note"]) == (r["capacity"] == 10.0 and r["policy"] == "maskahead") for r in rows)
    capsys.readouterr()
    ablation_rows.main([out])
    cap = capsys.readouterr()
    assert "| maskahead | 10.0* |" in cap.out and "| maskahead | 100.0 |" in cap.out
    assert "capacity*: a policy floor, not the budget, set what was kept (floor > budget) in maskahead@10.0 4/4" in cap.err
