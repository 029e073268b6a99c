"""The `maskahead` command: parsing, errors, and short end-to-end runs on the testbed model."""
import json
import os

import pytest

from maskahead_jax import cli
from maskahead_jax.profile import serving_capacity, shape_config


def test_parser_subcommands():
    ap = cli.build_parser()
    a = ap.parse_args(["generate", "--ids", "5,6", "--policy", "maskahead", "--capacity", "5"])
    assert (a.cmd, a.ids, a.policy, a.capacity) == ("generate", "5,6", "maskahead", 5.0)
    a = ap.parse_args(["eval", "--suite", "--policies", "dense,maskahead", "--capacity", "5,10,20",
                       "--out", "x", "--preset", "sdar"])
    assert (a.cmd, a.suite, a.capacity, a.preset) == ("eval", True, "5,10,20", "sdar")
    a = ap.parse_args(["profile", "--shape", "fast-dllm-v2-7b", "--batch", "1,8,32"])
    assert (a.cmd, a.shape, a.batch) == ("profile", "fast-dllm-v2-7b", "1,8,32")
    assert ap.parse_args(["demo"]).cmd == "demo"
    with pytest.raises(SystemExit):
        ap.parse_args(["generate"])  # needs --prompt or --ids
    with pytest.raises(SystemExit):
        cli.main(["nosuch"])


def test_convert_delegates(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "maskahead convert: error" in capsys.readouterr().err


def test_clear_errors(tmp_path, capsys):
    assert cli.main(["generate", "--ids", "5,6,7", "--policy", "no-such-policy"]) == 2
    assert "no-such-policy" in capsys.readouterr().err
    assert cli.main(["generate", "--ids", "5,6", "--model", str(tmp_path / "nope")]) == 2
    assert "model folder not found" in capsys.readouterr().err
    assert cli.main(["generate", "--ids", "5,x"]) == 2
    assert cli.main(["eval", "--suite", "--capacity", "0", "--out", str(tmp_path)]) == 2
    assert "capacity" in capsys.readouterr().err
    assert cli.main(["eval", "--out", str(tmp_path)]) == 2
    assert "no examples" in capsys.readouterr().err
    assert cli.main(["eval", "--longbench", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert cli.main(["profile", "--shape", "gpt-5"]) == 2
    assert cli.main(["generate", "--ids", "5,6", "--preset", "nosuch"]) == 2


def test_generate_ids_and_text(capsys):
    assert cli.main(["generate", "--ids", "1,10,11,12", "--max-new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 4 and out["nfe"] > 0 and out["reduction_final"] == pytest.approx(1.0)
    assert cli.main(["generate", "--prompt", "what is the pass key ? the pass key is",
                     "--max-new-tokens", "8"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)["text"], str)
    # a variant label, as eval's --policies takes it: h2o on the packed 4-bit cache
    assert cli.main(["generate", "--ids", ",".join(["7"] * 200), "--max-new-tokens", "8", "--policy", "h2o[bits=4]",
                     "--policy-kw", "capacity_floor=64,recent=32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "h2o[bits=4]" and out["reduction_final"] > 2.5
    assert cli.main(["generate", "--ids", "5,6", "--policy", "h2o[bits=4"]) == 2


def test_eval_needle_cli(tmp_path, capsys):
    out = str(tmp_path / "ev")
    args = ["eval", "--needle", "--lengths", "64", "--depths", "0.5", "--n", "2", "--policies", "dense",
            "--out", out, "--no-progress", "--batch-size", "2"]
    assert cli.main(args) == 0
    assert "| dense | full | 2 |" in capsys.readouterr().out
    for f in ("results.jsonl", "summary.md", "summary.json", "pareto.png", "needle_niah.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    assert cli.main(args) == 0  # resume: nothing to redo, no duplicates
    with open(os.path.join(out, "results.jsonl")) as f:
        assert sum(1 for _ in f) == 2
    capsys.readouterr()
    # another threshold into the same --out: refused (exit 2, one line naming it), nothing rewritten
    files = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert cli.main(args + ["--threshold", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("maskahead eval: error: --out ") and "generation.threshold=0.95; this run has " \
        "generation.threshold=0.5: use another --out" in err
    assert files == {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}


def test_profile_testbed_dense(tmp_path, capsys):
    """A real (small) profile: a table on stdout, the JSON in --out."""
    dst = tmp_path / "profile.json"
    assert cli.main(["profile", "--policies", "dense", "--prompt-len", "64", "--out-len", "64",
                     "--batch", "1", "--kv-budget-gb", "1", "--out", str(dst)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("maskahead profile: ") and "prefill s" in table and f"JSON (every field): {dst}" in table
    res = json.loads(dst.read_text())
    (run,) = res["runs"]
    assert run["policy"] == "dense" and run["batch"] == 1 and run["speedup_e2e"] == 1.0
    assert run["e2e_s"] > 0 and run["kv_peak_bytes"] > 0
    # decode = e2e - prefill is only reported when timing noise leaves it positive (no timing asserts)
    assert (run["decode_s"] is None and "timing_note" in run) or run["decode_s"] > 0
    assert res["serving"]["dense"]["max_batch"] == int(2 ** 30 // res["serving"]["dense"]["per_row_peak_bytes"])


def test_serving_capacity_and_shapes():
    s = serving_capacity({"dense": 2 ** 30, "maskahead": 2 ** 27}, kv_budget_gb=10)
    assert s["dense"]["max_batch"] == 10 and s["maskahead"]["max_batch"] == 80
    assert s["maskahead"]["vs_dense"] == 8.0
    c = shape_config("fast-dllm-v2-7b", num_layers=2)
    assert (c.hidden_size, c.num_kv_heads, c.num_layers, c.logits_shift) == (3584, 4, 2, True)
    assert shape_config("llada2-mini").rotary_dim == 64


def test_demo_runs(capsys):
    assert cli.main(["demo", "--length", "128", "--depths", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "dense" in out and "KV reduction" in out and "answer" in out


def test_demo_tasks(capsys):
    """--tasks picks the prompts' tasks (one prompt per task and depth); an unknown task is named."""
    assert cli.main(["demo", "--tasks", "passkey,multikey", "--length", "128", "--depths", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "passkey  depth 0.50" in out and "multikey  depth 0.50" in out and "correct" in out
    assert cli.main(["demo", "--tasks", "sudoku", "--length", "128"]) != 0
    assert "sudoku" in capsys.readouterr().err


def test_demo_unknown_policy_is_refused(capsys):
    """A policy typo is an error (exit 2, one line) before the model loads, not a skipped note."""
    assert cli.main(["demo", "--length", "96", "--depths", "0.5", "--policy", "no-such-policy"]) == 2
    assert "unknown policy 'no-such-policy'" in capsys.readouterr().err
