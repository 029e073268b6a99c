"""experiments/eval_testbed.py: the card's per-cell evaluation prints its JSON and the per-task
diagnostics (two-hop's first hop, document QA's first word), scored by the task's own scorer;
--results appends cells and resumes."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_eval_testbed_json(capsys):
    from experiments.eval_testbed import main

    main(["--tasks", "docqa,twohop", "--lengths", "160", "--depths", "0.5", "--n", "2", "--show", "1"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert set(out["cells"]) == {"docqa/160/0.5", "twohop/160/0.5"}
    assert all(0.0 <= v <= 1.0 for v in out["cells"].values())
    assert set(out["twohop_first_hop"]) == {"160/0.5"}
    assert set(out["docqa_first_word"]) == {"160/0.5"}
    assert all(0.0 <= v <= 1.0 for v in out["docqa_first_word"].values())
    assert set(out["summary"]) == {"docqa", "twohop"}
    # --show prints the reference completion beside the prediction (two-hop: the chain)
    assert "holds code" in cap.err and " | " in cap.err


def test_eval_testbed_results_append_and_resume(tmp_path, capsys):
    from experiments.eval_testbed import main

    res = tmp_path / "cells.jsonl"
    base = ["--tasks", "passkey", "--lengths", "160", "--n", "2", "--results", str(res)]
    main(base + ["--depths", "0.5"])
    first = json.loads(capsys.readouterr().out)
    recs = [json.loads(l) for l in res.read_text().splitlines()]
    assert [r["cell"] for r in recs] == ["passkey/160/0.5"] and len(recs[0]["scores"]) == 2
    # no --threshold: the model's own decoding threshold, recorded with the results
    with open(os.path.join(ROOT, "maskahead_jax", "testbed", "config.json")) as f:
        assert recs[0]["threshold"] == json.load(f)["threshold"]
    with open(res, "a") as f:  # an interruption cut a line short: ignored, the cell reruns
        f.write('{"cell": "passkey/160/1.0", "sco')
    main(base + ["--depths", "0.5,1"])
    cap = capsys.readouterr()
    second = json.loads(cap.out)
    assert "(from --results)" in cap.err and "line 2 is not JSON" in cap.err
    assert second["cells"]["passkey/160/0.5"] == first["cells"]["passkey/160/0.5"]
    assert set(second["cells"]) == {"passkey/160/0.5", "passkey/160/1.0"}
    cells = [json.loads(l)["cell"] for l in res.read_text().splitlines()[2:]]
    assert cells == ["passkey/160/1.0"]  # only the new cell was appended, on a line of its own
    with pytest.raises(SystemExit, match="other settings"):
        main(base + ["--depths", "0.5", "--threshold", "0.9"])
    # --compare: the same examples under another setting, paired by (cell, example)
    other = tmp_path / "other.jsonl"
    recs = [json.loads(l) for l in res.read_text().splitlines() if l.endswith("}")]
    for r in recs:
        r["scores"] = [1.0 - x for x in r["scores"]]
    other.write_text("".join(json.dumps(r) + "\n" for r in recs))
    main(["--compare", str(res), str(other)])
    (cmp,) = json.loads(capsys.readouterr().out)["against"]
    assert cmp["n"] == 4 and cmp["wins"] + cmp["losses"] == 4 and cmp["ties"] == 0
    assert cmp["mean"] == pytest.approx(1 - cmp["base_mean"]) and 0 < cmp["p"] <= 1
    per_cell = cmp["changed_cells"]  # every example flipped, so every cell changed
    assert set(per_cell) == {r["cell"] for r in recs}
    assert sum(c["wins"] + c["losses"] for c in per_cell.values()) == 4
    for r in recs:  # r holds the flipped scores (the compared file's)
        mean = sum(r["scores"]) / len(r["scores"])
        assert per_cell[r["cell"]]["mean"] == pytest.approx(mean, abs=1e-4)
        assert per_cell[r["cell"]]["base_mean"] == pytest.approx(1 - mean, abs=1e-4)
    # missed_by_all: the examples no file answers fully right
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(dict(recs[0], scores=[1.0, 0.0, 0.5])) + "\n")
    b.write_text(json.dumps(dict(recs[0], scores=[0.0, 0.0, 0.0])) + "\n")
    main(["--compare", str(a), str(b)])
    cell = recs[0]["cell"]
    out = json.loads(capsys.readouterr().out)
    assert out["missed_by_all"] == [f"{cell}#1", f"{cell}#2"]
    assert out["against"][0]["changed_cells"] == {
        cell: dict(base_mean=0.5, mean=0.0, wins=0, losses=2, p=0.5)}
    with pytest.raises(SystemExit, match="two or more"):
        main(["--compare", str(res)])


def test_reference_engine_is_the_library_reference_decoder(capsys):
    """--engine reference decodes with the library's uncached reference decoder
    (engine.reference.reference_generate) and scores what the cached engine scores."""
    from experiments import eval_testbed

    cells = {}
    for engine in ("reference", "cached"):
        eval_testbed.main(["--tasks", "passkey,twohop", "--lengths", "160", "--depths", "0.5", "--n", "2",
                           "--engine", engine])
        cells[engine] = json.loads(capsys.readouterr().out)["cells"]
    assert cells["reference"] == cells["cached"]
    assert "greedy_answers" not in vars(eval_testbed)  # no decoder of its own


def test_rope_scaling_flag_evaluates_the_export_under_that_scaling(tmp_path, capsys):
    """--rope-scaling yarn:F:ORIG (and --max-positions) load the export with that RoPE scaling: it
    is recorded in the JSON and in --results' settings (a file written without it is refused),
    and it changes what the model reads (YaRN x4 over 64 positions differs from plain RoPE at 160)."""
    from experiments.eval_testbed import main

    res = tmp_path / "cells.jsonl"
    base = ["--tasks", "passkey", "--lengths", "160", "--depths", "0.5", "--n", "2", "--show", "2"]
    main(base + ["--results", str(res)])
    plain = capsys.readouterr()
    main(base + ["--rope-scaling", "yarn:4:64", "--max-positions", "8192", "--results", str(tmp_path / "y.jsonl")])
    yarn = capsys.readouterr()
    out = json.loads(yarn.out)
    assert "type='yarn'" in out["rope_scaling"] and "factor=4.0" in out["rope_scaling"]
    assert json.loads((tmp_path / "y.jsonl").read_text().splitlines()[0])["rope_scaling"] == out["rope_scaling"]
    assert "rope_scaling" not in json.loads(plain.out)
    shown = lambda err: [l for l in err.splitlines() if " | " in l]  # --show's reference | prediction
    assert shown(plain.err) and shown(plain.err) != shown(yarn.err)
    with pytest.raises(SystemExit, match="other settings"):
        main(base + ["--rope-scaling", "yarn:4:64", "--max-positions", "8192", "--results", str(res)])
