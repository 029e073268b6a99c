"""The `maskahead` command on bad input (issue 35, items 5-7): every policy, knob, output path
and option is checked before a model is loaded or a forward runs; errors are one line on stderr
(`maskahead <cmd>: error: ...`) with one exit-status convention: 0 ok, 1 a run failed, 2 bad
input / usage, 130 interrupted. Forwards are faked where a test needs a sweep to run, so each
test takes a second or two."""
import importlib
import json
import os
import subprocess
import sys

import pytest

from maskahead_jax import cli
from maskahead_jax.engine.stats import GenerateOutput

G = importlib.import_module("maskahead_jax.generate")  # the package exports the function too
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _err(capsys) -> str:
    """The stderr of the call, which must be exactly one `maskahead ...` line (no traceback)."""
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("[eval]")]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the weights are loaded or a forward runs."""
    def boom(*a, **k):
        raise AssertionError("loaded the model / ran a forward before refusing the input")

    for command in cli.COMMANDS:  # each subcommand module loads through its own name
        if hasattr(command, "load_model"):
            monkeypatch.setattr(command, "load_model", boom)
    monkeypatch.setattr(G, "generate", boom)


def fake_generate(fail=None, interrupt_after=None):
    """A stand-in for maskahead_jax.generate.generate: answers '7' per prompt with plausible
    stats; raises for policy names in `fail`, KeyboardInterrupt after `interrupt_after` calls."""
    calls = []

    def gen(model, prompts, cfg, policy=None, **kw):
        if interrupt_after is not None and len(calls) >= interrupt_after:
            raise KeyboardInterrupt
        calls.append(policy)
        if fail and getattr(policy, "name", "dense") in fail:
            raise RuntimeError("out of memory (simulated)")
        b = len(prompts)
        one = [1.0] * b
        st = dict(reduction_final=one, reduction_peak=one, kv_bytes_final=[100.0] * b,
                  kv_bytes_peak=[100.0] * b, dense_bytes_final=[100.0] * b, dense_bytes_peak=[100.0] * b,
                  nfe=[3] * b, nfe_batch=3, wall_s=0.01, evictions=0)
        return GenerateOutput(tokens=[[10, 11] for _ in prompts], stats=st)

    gen.calls = calls
    return gen


EVAL = ["eval", "--needle", "--lengths", "64", "--depths", "0,1", "--n", "2", "--no-progress", "--no-plots",
        "--batch-size", "2"]


# ----------------------------------------------------------------------------- item 5: policies
def test_policies_and_knobs_refused_before_the_model_loads(tmp_path, capsys, no_load):
    out = str(tmp_path / "ev")
    base = EVAL + ["--out", out, "--policies", "dense,maskahead"]
    cases = [
        (["--policies", "dense,maskahed"], "unknown policy 'maskahed'"),
        (["--policy-kw", "windw=16"], "no policy of this run (dense, maskahead) has the knob windw"),
        (["--policy-kw", "snapkv:window=16"], "policy 'snapkv' is not in this run"),
        (["--policy-kw", "maskahead:window=16"], "policy 'maskahead' has no knob window; its knobs: capacity_pct"),
        (["--policy-kw", "topk_pct=abc"], "knob topk_pct expects a number, got 'abc'"),
        (["--policy-kw", "recent=1.5"], "knob recent expects an integer, got 1.5"),
        (["--policy-kw", "capacity_pct=5"], "its budget capacity_pct comes from the capacity"),
        # inconsistent floors: only policy.validate knows (capacity_floor below recent + sinks)
        (["--policy-kw", "maskahead:capacity_floor=16"], "maskahead@10: capacity_floor=16 is below recent + sinks"),
        (["--policies", "dense,maskkv"], "maskkv@10: maskkv compresses the prompt of bidirectional families"),
    ]
    for extra, msg in cases:
        args = base + extra if extra[0] != "--policies" else [a for a in base if a not in ("--policies",
                                                                                         "dense,maskahead")] + extra
        assert cli.main(args) == 2, extra
        err = _err(capsys)
        assert err.startswith("maskahead eval: error: ") and msg in err, (extra, err)
    assert not os.path.exists(out)  # nothing written either
    # generate and profile refuse the same way, before the load
    assert cli.main(["generate", "--ids", "5,6", "--policy", "maskahead", "--policy-kw", "topk_pct=abc"]) == 2
    assert "knob topk_pct expects a number" in _err(capsys)
    assert cli.main(["generate", "--ids", "5,6", "--policy", "snapkv", "--policy-kw",
                     "capacity_floor=8,window=16"]) == 2
    assert "snapkv@10: capacity_floor=8 is below window + sinks" in _err(capsys)
    assert cli.main(["profile", "--policies", "dense,maskahead", "--policy-kw", "maskahead:sinks=-1"]) == 2
    assert "maskahead@10: " in _err(capsys)
    assert cli.main(["demo", "--policy", "no-such-policy"]) == 2
    assert "unknown policy 'no-such-policy'" in _err(capsys)
    assert cli.main(["demo", "--policy", "snapkv", "--policy-kw", "recent=8"]) == 2
    assert "no policy of this run (snapkv) has the knob recent" in _err(capsys)


def test_per_policy_knobs_reach_their_policy(tmp_path, capsys, monkeypatch):
    """maskahead:...,snapkv:...,topk_floor=32: prefixed knobs go to their policy, unprefixed ones
    to every policy that has them (recorded in run.json's policy reprs)."""
    fake = fake_generate()
    monkeypatch.setattr(G, "generate", fake)
    out = str(tmp_path / "ev")
    args = EVAL + ["--out", out, "--policies", "dense,maskahead,snapkv", "--capacity", "20", "--policy-kw",
                   "maskahead:capacity_floor=128,snapkv:window=16,topk_floor=32,capacity_floor=64"]
    assert cli.main(args) == 0
    pols = json.load(open(os.path.join(out, "run.json")))["policies"]
    assert set(pols) == {"dense@full", "maskahead@20", "snapkv@20"}
    assert "capacity_floor=128" in pols["maskahead@20"] and "topk_floor=32" in pols["maskahead@20"]
    assert "window=16" in pols["snapkv@20"] and "capacity_floor=64" in pols["snapkv@20"]
    assert "topk_floor=32" in pols["snapkv@20"]
    assert len(fake.calls) == 3 * 2  # 3 runs x (4 examples / batch 2)


def test_prefill_chunk_reaches_the_run_and_is_checked_before_the_load(tmp_path, capsys, monkeypatch):
    """--prefill-chunk (issue 40: the bounded-prefill peak is the budget plus one chunk) lands in
    the resolved generation config of run.json; one that is not a multiple of the block size is
    a one-line error before the model loads."""
    monkeypatch.setattr(G, "generate", fake_generate())
    out = str(tmp_path / "ev")
    assert cli.main(EVAL + ["--out", out, "--policies", "dense", "--prefill-chunk", "128"]) == 0
    assert json.load(open(os.path.join(out, "run.json")))["generation"]["prefill_chunk"] == 128
    assert cli.main(["generate", "--ids", "5,6", "--prefill-chunk", "100"]) == 2
    assert "prefill_chunk 100 must be a positive multiple of block_size" in _err(capsys)


def test_a_failed_run_exits_1_and_keeps_the_others(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "generate", fake_generate(fail={"maskahead"}))
    out = str(tmp_path / "ev")
    args = EVAL + ["--out", out, "--policies", "dense,maskahead"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "maskahead eval: run maskahead@10 failed: RuntimeError: out of memory (simulated)" in err
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert [e["policy"] for e in summary["errors"]] == ["maskahead"]
    rows = [json.loads(x) for x in open(os.path.join(out, "results.jsonl"))]
    assert {r["policy"] for r in rows} == {"dense"} and len(rows) == 4
    # --strict stops at the failure: exit 1 too, one line
    assert cli.main(args + ["--strict"]) == 1
    assert "maskahead eval: error: run maskahead@10: RuntimeError: out of memory" in _err(capsys)


# ----------------------------------------------------------------------------- item 6: output paths
def test_output_paths_checked_before_the_model_loads(tmp_path, capsys, no_load, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    d = tmp_path / "adir"
    d.mkdir()
    assert cli.main(EVAL + ["--out", str(f)]) == 2
    assert f"maskahead eval: error: --out {f} is a file; expected a folder" == _err(capsys)
    assert cli.main(EVAL + ["--out", str(f / "sub")]) == 2
    assert f"--out {f / 'sub'} cannot be created: {f} is a file, not a folder" in _err(capsys)
    assert cli.main(["profile", "--out", str(d)]) == 2
    assert f"--out {d} is a folder; expected a file path" in _err(capsys)
    assert cli.main(["profile", "--out", str(f / "p.json")]) == 2
    assert f"{f} is a file, not a folder" in _err(capsys)
    # a folder we may not write in (as root os.access lets everything through: pretend)
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if os.path.abspath(p) == str(ro) else real(p, m, **k))
    assert cli.main(EVAL + ["--out", str(ro / "ev")]) == 2
    assert f"cannot be created: {ro} is not writable" in _err(capsys)
    assert cli.main(EVAL + ["--out", str(ro)]) == 2
    assert f"--out {ro}: {ro} is not writable" in _err(capsys)
    assert cli.main(["profile", "--out", str(ro / "p.json")]) == 2
    assert f"{ro} is not writable" in _err(capsys)
    # convert: DST checked before SRC is read (a missing SRC would be reported otherwise)
    assert cli.main(["convert", str(tmp_path / "missing"), str(f / "dst")]) == 2
    assert f"maskahead convert: error: destination {f / 'dst'}: {f} is a file, not a folder" == _err(capsys)
    assert cli.main(["convert", str(tmp_path / "missing"), str(ro / "dst")]) == 2
    assert f"{ro} is not writable" in _err(capsys)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_folder(tmp_path, capsys, no_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert cli.main(EVAL + ["--out", str(ro / "ev")]) == 2
        assert "is not writable" in _err(capsys)
    finally:
        ro.chmod(0o755)


def test_atomic_writes_leave_no_truncated_file(tmp_path, monkeypatch):
    """A write that fails midway (a full disk) leaves the previous file whole and no temp file."""
    import errno

    from maskahead_jax.evaluation import atomic
    from maskahead_jax.evaluation import plots as PL
    from maskahead_jax.evaluation.sweep import write_summary

    summary = {"datasets": ["niah"], "runs": [dict(policy="dense", capacity=None, n=1, score=50.0,
                                                   per_dataset={"niah": 50.0}, reduction_final=1.0,
                                                   reduction_peak=1.0, nfe=3.0)], "errors": []}
    paths = write_summary(summary, str(tmp_path))
    png = PL.pareto(summary, str(tmp_path / "pareto.png"))
    before = {p: open(p, "rb").read() for p in [paths["summary_json"], paths["summary_md"], png]}
    assert before[png].startswith(b"\x89PNG")

    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    summary["runs"][0]["score"] = 99.0
    with pytest.raises(OSError, match="No space left"):
        write_summary(summary, str(tmp_path))
    with pytest.raises(OSError, match="No space left"):
        PL.pareto(summary, png)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_json(str(tmp_path / "new.json"), {"a": 1})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert {p: open(p, "rb").read() for p in before} == before
    assert sorted(os.listdir(tmp_path)) == ["pareto.png", "summary.json", "summary.md"]  # no temp files
    # the profile JSON goes through the same writer (cli.profile.run): a fresh file gets the usual mode
    p = atomic.write_text(str(tmp_path / "profile.json"), "{}")
    assert oct(os.stat(p).st_mode & 0o777) == oct(0o666 & ~atomic._umask())


# ----------------------------------------------------------------------------- item 7: one-line errors
def _model_copy(tmp_path, name, **config_over):
    """The testbed folder (weights linked) with config.json fields replaced."""
    src = cli.TESTBED
    dst = tmp_path / name
    dst.mkdir()
    for f in ("tokenizer.json", "model.safetensors"):
        os.symlink(os.path.join(src, f), dst / f)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(config_over)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_model_folders_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "generate", lambda *a, **k: pytest.fail("ran a forward"))
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers"):
        m = _model_copy(tmp_path, f"null_{field}", **{field: None})
        assert cli.main(["generate", "--ids", "5,6", "--model", str(m)]) == 2
        err = _err(capsys)
        assert err.startswith(f"maskahead generate: error: cannot load {m}: ") and f"null {field}" in err, err
    # a bad maskahead.json (a converted folder's marker)
    m = _model_copy(tmp_path, "badmarker")
    (m / "maskahead.json").write_text('{"format": ')
    assert cli.main(["eval", "--suite", "--out", str(tmp_path / "ev"), "--model", str(m)]) == 2
    assert f"cannot load {m}: {m}/maskahead.json is not valid JSON" in _err(capsys)


def test_corrupt_orbax_folder_is_one_line(tmp_path, capsys):
    from converters.load import convert

    dst = str(tmp_path / "conv")
    convert(cli.TESTBED, dst, progress=False)
    data = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(dst, "params")) for f in fs
            if os.sep + "d" + os.sep in os.path.join(r, f)]
    assert data
    for f in data:  # truncated array data, as a copy cut short leaves it
        with open(f, "r+b") as fh:
            fh.truncate(100)
    assert cli.main(["generate", "--ids", "5,6", "--model", dst]) == 2
    err = _err(capsys)
    assert err.startswith(f"maskahead generate: error: cannot load {dst}: ") and len(err) < 700, err


def test_longbench_v2_data_json(tmp_path, capsys, monkeypatch):
    """LongBench v2's data.json (a JSON array of multiple-choice records) loads as dataset
    longbench_v2; a file in neither LongBench format is refused naming both."""
    recs = [dict(_id=f"q{i}", domain="Single-Document QA", sub_domain="x", difficulty="easy", length="short",
                 question=f"which {i} ?", choice_A="one", choice_B="two", choice_C="three", choice_D="four",
                 answer="B", context="the pass key is 7 . " * 5) for i in range(2)]
    (tmp_path / "data.json").write_text(json.dumps(recs))
    monkeypatch.setattr(G, "generate", fake_generate())
    out = str(tmp_path / "ev")
    assert cli.main(["eval", "--longbench", str(tmp_path), "--policies", "dense", "--out", out,
                     "--no-progress", "--no-plots"]) == 0
    rows = [json.loads(x) for x in open(os.path.join(out, "results.jsonl"))]
    assert {r["id"] for r in rows} == {"longbench_v2/q0", "longbench_v2/q1"}
    assert {r["dataset"] for r in rows} == {"longbench_v2"} and all(r["answers"] == ["B"] for r in rows)
    capsys.readouterr()
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps([{"prompt": "x", "label": 1}]))
    assert cli.main(["eval", "--longbench", str(bad), "--out", str(tmp_path / "ev2")]) == 2
    err = _err(capsys)
    assert "records are in neither LongBench format" in err and "choice_A..choice_D" in err


def test_ctrl_c_during_eval_saves_rows_and_resumes(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "ev")
    args = EVAL + ["--out", out, "--policies", "dense"]
    monkeypatch.setattr(G, "generate", fake_generate(interrupt_after=1))
    assert cli.main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"maskahead eval: interrupted; 2 rows saved in {out}/results.jsonl, rerun the same "
                   f"command to resume")
    fake = fake_generate()
    monkeypatch.setattr(G, "generate", fake)
    assert cli.main(args) == 0
    assert len(fake.calls) == 1  # only the second batch ran
    assert sum(1 for _ in open(os.path.join(out, "results.jsonl"))) == 4


def test_range_checks(tmp_path, capsys, no_load):
    out = str(tmp_path / "ev")
    for extra, msg in [(["--threshold", "0"], "argument --threshold: a commit threshold in (0, 1], got 0"),
                       (["--threshold", "1.5"], "a commit threshold in (0, 1], got 1.5"),
                       (["--threshold", "nan"], "a commit threshold in (0, 1]"),
                       (["--max-new-tokens", "0"], "argument --max-new-tokens: must be positive, got 0"),
                       (["--max-new-tokens", "-3"], "must be positive, got -3"),
                       (["--batch-size", "0"], "argument --batch-size: must be positive")]:
        with pytest.raises(SystemExit) as ex:
            cli.main(EVAL + ["--out", out] + extra)
        assert ex.value.code == 2
        assert msg in _err(capsys), extra
    for depths in ("0,1.5", "-0.1"):
        assert cli.main(EVAL + ["--out", out, "--depths", depths]) == 2
        assert "--depths " + depths + ": depths are fractions of the context in [0, 1]" in _err(capsys)
    assert cli.main(EVAL + ["--out", out, "--lengths", "64,0"]) == 2
    assert "--lengths 64,0: expected positive integers" in _err(capsys)
    with pytest.raises(SystemExit) as ex:
        cli.main(["generate", "--ids", "5", "--max-new-tokens", "0"])
    assert ex.value.code == 2
    assert _err(capsys) == ("maskahead generate: error: argument --max-new-tokens: must be positive, got 0 "
                            "(see `maskahead generate -h`)")
    assert cli.main(["demo", "--depths", "2"]) == 2
    assert "depths are fractions" in _err(capsys)
    assert cli.main(["profile", "--out-len", "16"]) == 2
    assert "--out-len 16 must exceed one block (32)" in _err(capsys)


def test_help_documents_exit_status(capsys):
    with pytest.raises(SystemExit) as ex:
        cli.main(["--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert "exit status" in out and "130  interrupted" in out and "2    bad input or usage" in out


# ----------------------------------------------------------------------------- import cycle
def test_profile_is_a_library_module():
    """maskahead_jax.profile does not import the command line; `python -m maskahead_jax.profile`
    still runs `maskahead profile` (experiments/gpu_session.sh uses it)."""
    code = ("import sys, maskahead_jax.profile; "
            "assert 'maskahead_jax.cli' not in sys.modules, 'profile imported cli'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    src = open(os.path.join(ROOT, "maskahead_jax", "profile.py")).read()
    assert "from .cli" not in src and "import cli" not in src and "maskahead_jax.cli import" not in src
    r = subprocess.run([sys.executable, "-m", "maskahead_jax.profile", "--shape", "gpt-5"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "maskahead profile: error: unknown model shape 'gpt-5'; choose one of "
        "['fast-dllm-v2-7b', 'llada-8b', 'llada2-mini', 'sdar-8b']")


# ----------------------------------------------------------------------------- issue 50: misc inputs
def test_too_short_suite_lengths_are_refused_with_the_minimum(tmp_path, capsys, no_load):
    """`--lengths 16` built 26-token prompts labelled 16: a length below what a task's needles and
    question take is refused, naming the shortest that fits (and that length then runs)."""
    out = str(tmp_path / "ev")
    assert cli.main(["eval", "--suite", "--tasks", "passkey", "--lengths", "16", "--out", out]) == 2
    err = _err(capsys)
    assert err.startswith("maskahead eval: error: length 16 too short for the passkey task: the needles and "
                          "question alone take up to ")
    need = int(err.rsplit("at least ", 1)[1])
    from maskahead_jax.evaluation.datasets import testbed_suite

    exs = testbed_suite(["passkey"], [need], [0, 0.25, 0.5, 0.75, 1], n_per_cell=2)
    assert all(e.meta["n_tokens"] <= e.meta["length"] == need for e in exs)
    assert cli.main(["eval", "--needle", "--lengths", "8", "--out", out]) == 2
    assert "length 8 too short for the passkey task" in _err(capsys)
    assert not os.path.exists(out)


def test_lengths_past_the_model_positions_are_refused_up_front(tmp_path, capsys, no_load):
    """Suite / needle lengths beyond the model's positions (8192 on the testbed) fail before the
    load, as RULER's do, not at run time."""
    out = str(tmp_path / "ev")
    assert cli.main(["eval", "--suite", "--tasks", "passkey", "--lengths", "1024,8192", "--depths", "0",
                     "--n", "1", "--out", out]) == 2
    err = _err(capsys)
    assert err.startswith("maskahead eval: error: --lengths 8192: 1 example beyond the model's 8192 positions")
    assert not os.path.exists(out)


def test_chat_without_a_chat_template_is_refused(capsys, no_load):
    assert cli.main(["generate", "--prompt", "what is the pass key ?", "--chat"]) == 2
    assert _err(capsys) == (f"maskahead generate: error: --chat: the tokenizer of {cli.TESTBED} has no chat "
                            f"template (drop --chat to encode the prompt as it is)")


@pytest.mark.parametrize("template, msg", [
    ("{% if %}", "has a syntax error (line 1): "),
    ('{{ raise_exception("a system message is required") }}', "failed: a system message is required"),
    ("{{ ''.__class__.__mro__ }}", "does something the sandbox forbids: access to attribute '__class__'"),
])
def test_chat_template_errors_are_one_line(tmp_path, capsys, no_load, template, msg):
    m = _model_copy(tmp_path, "chat")
    (m / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "chat_template": template}))
    assert cli.main(["generate", "--model", str(m), "--prompt", "hello", "--chat"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines()  # transformers without torch says so on import
           if x.strip() and not x.startswith("[transformers] PyTorch was not found")]
    assert len(err) == 1 and err[0].startswith(f"maskahead generate: error: the chat template of {m} {msg}"), err


def test_truncated_tokenizer_json_is_one_line(tmp_path, capsys, no_load):
    m = _model_copy(tmp_path, "trunc")
    data = open(m / "tokenizer.json", "rb").read()
    os.unlink(m / "tokenizer.json")
    (m / "tokenizer.json").write_bytes(data[: len(data) // 2])
    assert cli.main(["generate", "--model", str(m), "--prompt", "hello"]) == 2
    err = _err(capsys)
    assert err.startswith(f"maskahead generate: error: cannot read the tokenizer {m / 'tokenizer.json'}: ")
    assert err.endswith("(a truncated or corrupt tokenizer.json?)")


def test_missing_local_path_that_looks_like_a_hub_id_says_so(tmp_path, capsys, monkeypatch, no_load):
    """`--model runs/modle` (a typo'd local path of the hub-id form): the error says the local
    folder is missing (and which part exists), not only that the hub has no such model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert cli.main(["generate", "--model", "runs/modle", "--ids", "5,6"]) == 2
    err = _err(capsys)
    assert err.startswith("maskahead generate: error: model 'runs/modle' is not in the Hugging Face cache")
    assert err.endswith("(no local folder runs/modle either: runs exists but holds no modle)")
    assert cli.main(["generate", "--model", "nosuch/model", "--ids", "5,6"]) == 2
    assert _err(capsys).endswith("(no local folder nosuch/model either)")


def test_convert_bad_input_exits_2_as_its_help_says(tmp_path, capsys):
    from converters.load import cli_convert

    with pytest.raises(SystemExit):
        cli_convert(["-h"])
    assert "2 bad input" in capsys.readouterr().out
    assert cli.main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert _err(capsys) == f"maskahead convert: error: no such checkpoint folder: {tmp_path / 'missing'}"
