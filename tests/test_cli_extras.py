"""Small things users asked for (issue 35, item 12): the demo's progress lines while it compiles,
a human table from `maskahead profile` (JSON to --out / --json), no negative or clamped decode
times, no large constants for XLA to fold, policy names in --help, --version, and the README's
Python API example (token ids from `load_tokenizer`) run as written. No timing assertions."""
import importlib
import json
import math
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskahead_jax as mj
from maskahead_jax import cli
from maskahead_jax import profile as PR
from maskahead_jax.engine.stats import GenerateOutput
from maskahead_jax.policies import make, names

G = importlib.import_module("maskahead_jax.generate")
EG = importlib.import_module("maskahead_jax.engine.generate")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stats(b, **over):
    one = [1.0] * b
    st = dict(reduction_final=one, reduction_peak=one, kv_bytes_final=[100.0] * b, kv_bytes_peak=[100.0] * b,
              dense_bytes_final=[100.0] * b, dense_bytes_peak=[100.0] * b, nfe=[3] * b, nfe_batch=3,
              wall_s=0.01, evictions=0)
    st.update(over)
    return st


# ----------------------------------------------------------------------------- (a) demo progress
def test_demo_says_it_is_compiling(monkeypatch, capsys):
    """Before each policy's first (compiling) call the demo prints a line on stderr."""
    seen = []

    def fake(model, prompts, cfg, policy=None, **kw):
        seen.append((getattr(policy, "name", "dense"), capsys.readouterr().err))
        return GenerateOutput(tokens=[[10, 11] for _ in prompts], stats=_stats(len(prompts)))

    monkeypatch.setattr(G, "generate", fake)
    assert cli.main(["demo", "--tasks", "passkey", "--length", "96", "--depths", "0.5"]) == 0
    assert [name for name, _ in seen] == ["dense", "dense", "maskahead", "maskahead"]  # compile + timed
    assert re.search(r"\[demo\] compiling dense for 1 prompt of 96 tokens \(first call; .+\)\.\.\.", seen[0][1])
    assert "[demo] dense: compiled and ran in" in seen[1][1]
    assert "[demo] compiling maskahead" in seen[2][1]
    assert "KV reduction" in capsys.readouterr().out


def test_demo_defaults_show_the_budget(monkeypatch, capsys):
    """Issue 50: the demo runs MaskAhead with the testbed preset's floors (eval --preset testbed)
    on prompts long enough that no floor overrides the 10% budget (no BudgetWarning on the first
    screen), evicting at every block, and prints the end and peak reductions. The numbers this
    gives (8.2x at the end, 4/4 answers) are in README.md; here: the settings, with the real
    budget arithmetic the warning comes from."""
    from maskahead_jax.evaluation.presets import preset_policy_knobs

    seen = []

    def fake(model, prompts, cfg, policy=None, **kw):
        seen.append((policy, [len(p) for p in prompts]))
        return GenerateOutput(tokens=[[10, 11] for _ in prompts], stats=_stats(len(prompts)))

    monkeypatch.setattr(G, "generate", fake)
    assert cli.main(["demo"]) == 0
    pol, lens = seen[-1]
    assert pol.name == "maskahead" and pol.capacity_pct == 10.0 and pol.interval_blocks == 1
    assert {k: getattr(pol, k) for k in preset_policy_knobs("testbed")} == preset_policy_knobs("testbed")
    assert len(lens) == 4 and min(lens) >= 2000
    assert pol.budget_note(lens) is None  # what generate's BudgetWarning says: nothing
    out = capsys.readouterr().out
    assert "2048-token prompts" in out and "KV reduction end" in out and "peak" in out
    assert "end: after the answer, peak: the most held at any time" in out


# ----------------------------------------------------------------------------- (b) profile table
def _canned(**run_over):
    run = dict(policy="maskahead", batch=1, prefill_s=0.5, decode_s=0.25, e2e_s=0.75, forwards=20,
               decode_forwards=10, decode_ms_per_forward=25.0, decode_tok_s=900.0, e2e_tok_s=300.0,
               kv_peak_bytes=3 * 2 ** 20, dense_peak_bytes=4 * 2 ** 20, kv_final_bytes=2 ** 19,
               reduction_peak=1.3, reduction_final=6.3, speedup_decode=1.5, speedup_e2e=1.2, speedup_prefill=1.0)
    run.update(run_over)
    dense = dict(run, policy="dense", decode_s=0.375, kv_peak_bytes=4 * 2 ** 20, kv_final_bytes=4 * 2 ** 20,
                 reduction_final=1.0, speedup_decode=1.0, speedup_e2e=1.0)
    return dict(prompt_len=64, out_len=64, batch_sizes=[1], capacity_pct=10.0, repeats=1, backend="cpu",
                device="TFRT_CPU_0", dtype="float32", block_size=32, runs=[dense, run], skipped=[],
                serving=PR.serving_capacity({"dense": 4 * 2 ** 20, "maskahead": 3 * 2 ** 20}, 1.0))


def test_profile_prints_a_table_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(PR, "profile", lambda *a, **k: _canned())
    base = ["profile", "--policies", "dense,maskahead", "--prompt-len", "64", "--out-len", "64"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert out.startswith("maskahead profile: ") and "decode tok/s" in out and "serving capacity in 1 GiB" in out
    assert re.search(r"maskahead 10%\s+1\s+0\.500\s+0\.250\s+0\.750", out)
    assert "--out FILE.json writes it, --json prints it" in out
    with pytest.raises(ValueError):
        json.loads(out)
    dst = tmp_path / "p.json"
    assert cli.main(base + ["--out", str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"JSON (every field): {dst}" in out and "decode s" in out
    res = json.loads(dst.read_text())
    assert [r["policy"] for r in res["runs"]] == ["dense", "maskahead"] and res["model"] == cli.TESTBED
    assert cli.main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][1]["decode_tok_s"] == 900.0


def test_profile_table_shows_unmeasured_decode_as_dash():
    res = _canned(decode_s=None, decode_ms_per_forward=None, decode_tok_s=None, speedup_decode=None,
                  timing_note="e2e time 0.7000s <= prefill-run time 0.7500s: timing noise")
    text = PR.format_table(res)
    row = next(x for x in text.splitlines() if x.startswith("maskahead 10%"))
    assert row.split()[4] == "-" and "note: maskahead batch 1: e2e time" in text
    assert not re.search(r"(?<![\w.])-\d", text)  # no negative number anywhere


# ----------------------------------------------------------------------------- (c) no negative decode times
def test_profile_reports_no_decode_time_when_noise_exceeds_it(monkeypatch, capsys):
    """A full run timed faster than its prefill-only run: decode fields None, a timing_note, no
    negative number in the JSON or in the progress line (the runs are faked)."""
    from tiny import tiny_model

    model = tiny_model("fast_dllm_v2")
    times = iter([0.30, 0.20])  # prefill run, then the full run: "faster" than its prefill

    def fake_timed(model, prompts, gen, policy, repeats, mesh=None):
        n = len(prompts)
        st = _stats(n, nfe_batch=2 if gen.max_new_tokens <= 8 else 6)
        return next(times), GenerateOutput(tokens=[[5] * gen.max_new_tokens for _ in prompts], stats=st)

    monkeypatch.setattr(PR, "_timed", fake_timed)
    res = PR.profile(model, prompt_len=16, out_len=16, batch_sizes=[1], policies=["dense"])
    (run,) = res["runs"]
    assert run["decode_s"] is None and run["decode_ms_per_forward"] is None and run["decode_tok_s"] is None
    assert run["speedup_decode"] is None and "timing noise" in run["timing_note"]
    assert run["e2e_s"] == 0.20 and run["prefill_s"] == 0.30
    assert "decode n/a (timing noise)" in capsys.readouterr().err


def test_profile_runs_attention_implementations_side_by_side(monkeypatch):
    """"dense@reference" runs dense with GenerationConfig(attention="reference"); speedups are
    against the plain "dense" run even when it comes later; unknown implementations are refused
    before any run (runs faked: the attention each was asked for is recorded)."""
    from tiny import tiny_model

    model = tiny_model("fast_dllm_v2")
    asked = []
    times = {"reference": (0.2, 0.8), "auto": (0.2, 0.5)}

    def fake_timed(model, prompts, gen, policy, repeats, mesh=None):
        asked.append(gen.attention)
        pre = gen.max_new_tokens <= 8
        st = _stats(len(prompts), nfe_batch=2 if pre else 6)
        t = times[gen.attention][0 if pre else 1]
        return t, GenerateOutput(tokens=[[5] * gen.max_new_tokens for _ in prompts], stats=st)

    monkeypatch.setattr(PR, "_timed", fake_timed)
    res = PR.profile(model, prompt_len=16, out_len=16, batch_sizes=[1], policies=["dense@reference", "dense"])
    assert asked == ["reference", "reference", "auto", "auto"]
    ref, dense = res["runs"]
    assert ref["attention"] == "reference" and dense["speedup_decode"] == 1.0
    assert ref["speedup_decode"] == pytest.approx(0.3 / 0.6)  # decode 0.6 s vs the plain dense's 0.3 s
    assert "dense@reference [reference]" in PR.format_table(res)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        PR.profile(model, prompt_len=16, out_len=16, batch_sizes=[1], policies=["dense@flash"])


def test_timed_run_never_reports_a_negative_or_clamped_decode(monkeypatch):
    """engine/generate._timed_run: end to end <= prefill (noise) -> decode_s None + timing_note."""
    class Compiled:
        def __call__(self, *a):
            return np.zeros(2)

    class Fn:
        def lower(self, *a, **k):
            return types.SimpleNamespace(compile=Compiled, as_text=lambda: "module {}")

    # ticks: start, lowered, compiled, prefill start / end, end-to-end start / end
    for clock, decode in [([0.0, 0.5, 1.0, 2.0, 2.5, 3.0, 3.2], None),  # prefill 0.5 s, e2e 0.2 s
                          ([0.0, 0.5, 1.0, 2.0, 2.5, 3.0, 4.0], 0.5)]:  # prefill 0.5 s, e2e 1.0 s
        ticks = iter(clock)
        monkeypatch.setattr(EG, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
        _, t = EG._timed_run(Fn(), (), {})
        assert t["decode_s"] == decode
        assert ("timing_note" in t) == (decode is None)
        assert t["total_s"] > 0 and t["prefill_s"] > 0
        assert t["trace_lower_s"] == 0.5 and t["xla_compile_s"] == 0.5 and t["stablehlo_chars"] == 9


# ----------------------------------------------------------------------------- (d) no big constants
def _largest_baked_in(jitted, *args, **kwargs) -> int:
    """The largest array baked into a jitted program: a constant left in its optimised HLO, or an
    array closed over at trace time (jax >= 0.12.1 hoists those to program arguments instead of
    HLO constants, so the trace's consts are what shows them on every version)."""
    traced = jitted.trace(*args, **kwargs)
    text = traced.lower().compile().as_text()
    sizes = [math.prod(int(x) for x in dims.split(",") if x)
             for dims in re.findall(r"= \w+\[([\d,]*)\]\S* constant\(", text)]
    sizes += [math.prod(np.shape(c)) for c in traced.jaxpr.consts]
    return max(sizes, default=0)


def test_no_large_constants_for_xla_to_fold():
    """Masks and positions are built from iota / runtime values inside the computation, so XLA has
    no [B, T, T]-sized constant to fold (its 'constant folding took 22 s' alarm). Checked on the
    optimised programs of the demo's policies and of `forward`; the control, a mask closed over
    from numpy, is found by the same check."""
    from maskahead_jax.model import forward_logits

    model = mj.load_pretrained(cli.TESTBED)
    cfg = model.config
    b, p = 2, 128
    prompt, plen = jnp.full((b, p), 5, jnp.int32), jnp.full((b,), p - 3, jnp.int32)
    gen = mj.GenerationConfig(max_new_tokens=32).resolve(cfg)
    for pol in (make("dense"), make("maskahead", 10, capacity_floor=64, topk_floor=16)):
        assert _largest_baked_in(EG._core_fn(cfg, True), model.params, prompt, plen,
                                 jax.random.PRNGKey(0), cfg=cfg, gen=gen, policy=pol,
                                 cache_dtype=jnp.float32) < b * p, pol
    assert _largest_baked_in(mj.api._forward_jit, model.params, cfg, prompt, attention=None) < b * p
    mask = np.tril(np.ones((b, p, p), bool))
    control = jax.jit(lambda params, t: forward_logits(params, cfg, t, mask=jnp.asarray(mask)))
    assert _largest_baked_in(control, model.params, prompt) == b * p * p


# ----------------------------------------------------------------------------- (e), (f) help and version
@pytest.mark.parametrize("cmd", ["generate", "eval", "profile", "demo"])
def test_help_lists_the_policies(cmd, capsys):
    with pytest.raises(SystemExit) as ex:
        cli.main([cmd, "--help"])
    assert ex.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines (also at hyphens)
    missing = [n for n in names() if n not in text]
    assert not missing and len(names()) > 5


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as ex:
        cli.main(["--version"])
    assert ex.value.code == 0
    assert capsys.readouterr().out.strip() == f"maskahead-jax {version('maskahead-jax')} (jax {jax.__version__})"


# ----------------------------------------------------------------------------- (g) README's API example
@pytest.mark.filterwarnings("ignore::maskahead_jax.engine.generate.BudgetWarning")  # the 7B floors
def test_readme_python_api_example_runs_on_the_testbed(capsys):
    """The README's example, as written, with the shipped testbed as its path and fewer tokens."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    code = text.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert "mj.load_tokenizer(" in code and "tok.encode" in code and "tok.decode(" in code
    code = code.replace('"path/to/Fast_dLLM_v2_7B"', repr(cli.TESTBED), 1)
    code = code.replace('dtype="bfloat16"', 'dtype="float32"').replace("max_new_tokens=256", "max_new_tokens=8")
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert all(isinstance(i, int) for p in ns["prompts"] for i in p) and len(ns["prompts"]) == 2
    assert len(ns["out"].tokens) == 2 and ns["logits"].shape[:2] == (1, len(ns["prompts"][0]))
    printed = capsys.readouterr().out.strip()
    assert printed == ns["tok"].decode(ns["out"].tokens[0]).strip()
    assert ns["tok"].decode(ns["prompts"][1]) == "the pass key is 7. what is the pass key?"
