"""experiments/eval_testbed.py: the card's per-cell evaluation prints its JSON and the two-hop
first-hop diagnostic, scored by the task's own scorer."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_eval_testbed_json(capsys):
    from experiments.eval_testbed import main

    main(["--tasks", "passkey,twohop", "--lengths", "160", "--depths", "0.5", "--n", "2", "--show", "1"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert set(out["cells"]) == {"passkey/160/0.5", "twohop/160/0.5"}
    assert all(0.0 <= v <= 1.0 for v in out["cells"].values())
    assert set(out["twohop_first_hop"]) == {"160/0.5"}
    assert set(out["summary"]) == {"passkey", "twohop"}
    # --show prints the reference completion beside the prediction (two-hop: the chain)
    assert "holds code" in cap.err and " | " in cap.err
