"""Evaluation harness: sign tests, LongBench formatting / truncation, math loader, presets, and a
tiny policy x budget sweep that resumes after an interruption and writes its table and plots."""
import json
import os

import numpy as np
import pytest

from maskahead_jax.evaluation import datasets as D
from maskahead_jax.evaluation import plots as PL
from maskahead_jax.evaluation import policies as PO
from maskahead_jax.evaluation.presets import preset_config
from maskahead_jax.evaluation.stats import paired_bootstrap_gap, paired_sign_test, sign_test
from maskahead_jax.config import GenerationConfig
from maskahead_jax.evaluation.sweep import RunMismatch, auto_bucket, load_rows, run_sweep, to_markdown
from maskahead_jax.policies import Dense
from tiny import tiny_model


# ----------------------------------------------------------------------------- sign test
def test_sign_test_hand_values():
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)  # 2 * 0.5^5
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 0.021484375
    assert sign_test(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    assert sign_test(3, 3) == 1.0  # clipped at 1
    assert sign_test(10, 0) == pytest.approx(2 / 1024)
    with pytest.raises(ValueError):
        sign_test(-1, 2)


def test_paired_sign_test_drops_ties_and_unpaired():
    a = {"x": 1.0, "y": 0.0, "z": 0.5, "w": 1.0, "only_a": 1.0}
    b = {"x": 0.0, "y": 0.0, "z": 0.0, "w": 0.0, "only_b": 0.0}
    t = paired_sign_test(a, b)
    assert (t["n"], t["wins"], t["losses"], t["ties"]) == (4, 3, 0, 1)
    assert t["p"] == pytest.approx(2 / 8)


def test_paired_bootstrap_gap_is_the_suite_mean_difference_with_a_stratified_interval():
    """gap = mean over tasks of the task's mean paired difference (the suite mean's weighting, not
    the pooled examples'); the interval resamples within tasks, so a task whose differences are
    all equal contributes no width and identical runs give [0, 0]."""
    rng = np.random.RandomState(0)
    ids = [f"{t}/{t}/2048/{k}" for t in ("docqa", "twohop") for k in range(30)] + ["passkey/p/1"]
    a = {i: float(rng.rand() < 0.8) for i in ids}
    b = {i: float(rng.rand() < 0.7) for i in ids}
    b["unpaired"] = 1.0
    g = paired_bootstrap_gap(a, b, n_boot=4000)
    want = np.mean([np.mean([a[i] - b[i] for i in ids if i.startswith(t)]) for t in ("docqa", "twohop", "passkey")])
    assert g["n"] == len(ids) and g["gap"] == pytest.approx(want)
    assert g["lo"] < g["gap"] < g["hi"] and g["hi"] - g["lo"] > 0.05
    assert paired_bootstrap_gap(a, a) == dict(n=len(ids), gap=0.0, lo=0.0, hi=0.0)
    shifted = {i: (a[i] - 0.5 if i.startswith("twohop") else a[i]) for i in ids}  # one task, a fixed shift
    s = paired_bootstrap_gap(shifted, a, n_boot=500)
    assert (s["gap"], s["lo"], s["hi"]) == pytest.approx((-0.5 / 3,) * 3)
    with pytest.raises(ValueError, match="no example id"):
        paired_bootstrap_gap({"x": 1.0}, {"y": 1.0})


# ----------------------------------------------------------------------------- LongBench
class WordTok(D.Tokenizer):
    """Whitespace tokenizer (exact round trip) with an optional fake chat template."""

    def __init__(self, chat=True):
        super().__init__(None, hf=False, name="word")
        self.vocab, self.inv, self._chat = {}, {}, chat

    @property
    def has_chat_template(self):
        return self._chat

    def encode(self, text, add_special_tokens=True):
        out = []
        for w in text.split(" "):
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab) + 10
                self.inv[self.vocab[w]] = w
            out.append(self.vocab[w])
        return ([1] if add_special_tokens else []) + out

    def decode(self, ids):
        return " ".join(self.inv[i] for i in ids if i in self.inv)

    def chat(self, text):
        return "<user> " + text + " <assistant>"


def _write_jsonl(path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_parse_policy_kw():
    assert PO.parse_policy_kw("capacity_floor=64, topk_floor=32,layer_alloc=pyramid,exact_total=false") == {
        "capacity_floor": 64, "topk_floor": 32, "layer_alloc": "pyramid", "exact_total": False}
    assert PO.parse_policy_kw(None) == {} and PO.parse_policy_kw("") == {}
    with pytest.raises(ValueError, match="bad policy knob 'recent'"):
        PO.parse_policy_kw("recent")


def test_middle_truncate():
    ids = list(range(10))
    assert D.middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert D.middle_truncate(ids, 5) == [0, 1, 8, 9]  # int(5 / 2) per side, as LongBench
    assert D.middle_truncate(ids, 10) == ids
    with pytest.raises(ValueError):
        D.middle_truncate(ids, 0)


def test_longbench_prompt_truncation_chat_and_metric(tmp_path):
    ctx = " ".join(f"w{i}" for i in range(200))
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [
        {"input": "who won ?", "context": ctx, "answers": ["the red team"], "_id": "h1", "all_classes": None},
        {"input": "short ?", "context": "tiny context", "answers": ["yes"], "_id": "h2"}])
    _write_jsonl(tmp_path / "trec_e.jsonl", [
        {"input": "What is X ?", "context": "Q: a\nType: b", "answers": ["Entity"], "_id": "t1",
         "all_classes": ["Entity", "Location"]}])
    tok = WordTok()
    exs = D.load_longbench(str(tmp_path), tok, max_length=64)
    by = {e.id: e for e in exs}
    assert set(by) == {"hotpotqa/h1", "hotpotqa/h2", "trec/t1"}
    h1, h2, t1 = by["hotpotqa/h1"], by["hotpotqa/h2"], by["trec/t1"]
    assert h1.max_new_tokens == 32 and t1.max_new_tokens == 64
    # h1: template words > 64 -> first 32 + last 32 words, then the chat template
    full = D.LONGBENCH_PROMPTS["hotpotqa"].format(context=ctx, input="who won ?")
    words = full.split(" ")
    assert h1.meta["truncated"] and h1.meta["n_prompt_raw"] == len(words)
    text = tok.decode(h1.ids)
    assert text.startswith("<user> " + " ".join(words[:32]))
    assert text.endswith(" ".join(words[-32:]) + " <assistant>")
    # the two decoded halves are joined as strings (pred.py), so with this whitespace tokenizer
    # the two words at the seam fuse into one token: 63 + the two chat markers
    assert len(h1.ids) == 63 + 2
    # h2: short, kept whole; the template is the official one
    assert tok.decode(h2.ids) == "<user> " + D.LONGBENCH_PROMPTS["hotpotqa"].format(
        context="tiny context", input="short ?") + " <assistant>"
    assert not h2.meta["truncated"]
    # trec: no chat template (LongBench pred.py), [BOS] from encode
    assert t1.ids[0] == 1 and "<user>" not in tok.decode(t1.ids)
    # metric dispatch: QA F1 and classification
    assert D.score_example(h1, "The red team.") == pytest.approx(1.0)
    assert D.score_example(h1, "red") == pytest.approx(2 * 1 * 0.5 / 1.5)  # P=1, R=1/2
    assert D.score_example(t1, "Entity") == 1.0
    with pytest.raises(ValueError):
        D.longbench_examples([{"context": "x", "answers": ["y"]}], "nosuch", tok, 10)
    bad = tmp_path / "bad" / "hotpotqa.jsonl"
    bad.parent.mkdir()
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        D.load_longbench(str(bad), tok, 64)


def test_math_loader_boxed(tmp_path):
    _write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "2 + 2 ?", "answer": "two and two\n#### 1,234"},
        {"problem": "x ?", "solution": "so \\boxed{\\frac{1}{2}}", "unique_id": "m/1"}])
    exs = D.load_math(str(tmp_path / "gsm8k.jsonl"), WordTok(chat=False), max_new_tokens=16)
    assert [e.answers[0] for e in exs] == ["1234", "\\frac{1}{2}"]
    assert exs[1].id == "gsm8k/m/1" and exs[0].max_new_tokens == 16
    assert D.score_example(exs[0], "the answer is \\boxed{1234}.") == 1.0
    assert D.score_example(exs[0], "\\boxed{1235}") == 0.0
    assert D.score_example(exs[1], "\\boxed{\\dfrac{1}{2}}") == 1.0


def test_presets():
    m = tiny_model("fast_dllm_v2", block_size=32)
    r = preset_config("fast-dllm-v2", max_new_tokens=64).resolve(m.config)
    assert (r.block_size, r.sub_block_size, r.threshold, r.commit_rule) == (32, 8, 0.95, "fast_dllm")
    r = preset_config("dream-reasoner", 32).resolve(m.config)
    assert (r.threshold, r.steps_per_block, r.commit_rule) == (0.9, 32, "dream_reasoner")
    assert preset_config("sdar").threshold == 0.85 and preset_config("LLaDA2.0-mini").threshold == 0.95
    assert preset_config("sdar", threshold=0.7).threshold == 0.7
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("gpt")


def test_policy_errors():
    with pytest.raises(PO.PolicyError):
        PO.make_policy("no-such-policy", 10)
    with pytest.raises(PO.PolicyError):
        PO.make_policy("dense", 0)
    with pytest.raises(PO.PolicyError):
        PO.parse_capacities("5,abc")
    with pytest.raises(PO.PolicyError):
        PO.parse_capacities("150")
    assert PO.parse_capacities("5,10") == [5.0, 10.0]
    assert isinstance(PO.make_policy("dense"), Dense)
    assert "dense" in PO.available()


# ----------------------------------------------------------------------------- sweep
class NumTok:
    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def _examples(n_per=1):
    r = np.random.default_rng(0)
    out = []
    for length in (40, 56):  # one prompt bucket (64): one compile per policy
        for depth in (0.0, 1.0):
            for s in range(n_per):
                ids = [int(x) for x in r.integers(0, 45, size=length)]
                out.append(D.EvalExample(
                    id=f"niah/{length}/{depth}/{s}", dataset="niah", ids=ids, answers=["7"],
                    max_new_tokens=8, kind="testbed",
                    meta=dict(task="passkey", length=length, depth=depth, seed=s)))
    return out


def _second_policy():
    """MaskAhead with floors small enough to evict on tiny prompts, if the registry has it."""
    try:
        kw = dict(capacity_floor=12, topk_floor=4, recent=8, sinks=2, interval_blocks=1, lookahead_blocks=2)
        PO.make_policy("maskahead", 10, **kw)
        return "maskahead", lambda p, c: PO.make_policy(p, c, **({} if p == "dense" else kw))
    except Exception:
        return "dense2", lambda p, c: Dense()


def test_sweep_resumes_and_reports(tmp_path):
    model = tiny_model("sdar")
    exs = _examples()
    second, factory = _second_policy()
    out = str(tmp_path / "sweep")
    kw = dict(batch_size=2, policy_factory=factory, progress=False, strict=True)
    # "interrupted" run: half of the examples
    r1 = run_sweep(model, exs[:2], ["dense", second], [5, 20], out, NumTok(), **kw)
    assert len(r1.rows) == 3 * 2 and not r1.errors
    # a write cut midway leaves a partial line behind
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write('{"policy": "dense", "capa')
    r2 = run_sweep(model, exs, ["dense", second], [5, 20], out, NumTok(), **kw)
    rows = load_rows(os.path.join(out, "results.jsonl"))
    keys = [(r["policy"], r["capacity"], r["id"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * len(exs)
    with open(os.path.join(out, "results.jsonl")) as f:
        assert sum(1 for line in f if line.strip()) == 3 * len(exs)
    # rows of the first run are kept unchanged (not recomputed)
    first = {(r["policy"], r["capacity"], r["id"]): r["batch_wall_s"] for r in r1.rows}
    assert all(r["batch_wall_s"] == first[k] for r, k in zip(rows, keys) if k in first)
    for r in rows:
        assert {"prediction", "score", "reduction_final", "reduction_peak", "nfe"} <= set(r)
        assert 0.0 <= r["score"] <= 1.0 and r["nfe"] > 0
    s = r2.summary
    assert [(x["policy"], x["capacity"]) for x in s["runs"]][0] == ("dense", None)
    assert len(s["runs"]) == 3
    for x in s["runs"][1:]:
        assert x["vs_dense"]["n"] == len(exs)
        if second == "maskahead":
            assert x["reduction_final"] > 1.0
    for k in ("summary_md", "summary_json", "pareto", "needle_niah"):
        assert os.path.getsize(r2.paths[k]) > 0, k
    md = open(r2.paths["summary_md"]).read()
    assert "| dense | full | 4 |" in md and "KV red. end" in md
    json.load(open(r2.paths["summary_json"]))
    # a third run has nothing left to do
    r3 = run_sweep(model, exs, ["dense", second], [5, 20], out, NumTok(), **kw)
    assert len(r3.rows) == 3 * len(exs)


def _snapshot(out):
    return {f: open(os.path.join(out, f), "rb").read() for f in sorted(os.listdir(out))}


def test_sweep_resume_checks_run_fingerprint(tmp_path, monkeypatch):
    """Rows are reused only by a run with the same settings: another threshold, policy knob or
    example content under the same id is refused before anything in --out is touched; the same
    settings resume with no forward at all, and another policy adds its rows to the run."""
    import importlib

    G = importlib.import_module("maskahead_jax.generate")  # the package exports the function too
    model = tiny_model("sdar")
    exs = _examples()[:2]
    out = str(tmp_path / "sweep")
    kw = dict(batch_size=2, progress=False, strict=True, plots=False)
    try:
        PO.make_policy("maskahead", 10, recent=8)
    except PO.PolicyError:
        pytest.skip("no maskahead policy in the registry")

    def factory(recent):
        knobs = dict(capacity_floor=20, topk_floor=4, recent=recent, sinks=2)  # floor >= recent + sinks
        return lambda p, c: PO.make_policy(p, c, **({} if p == "dense" else knobs))

    r1 = run_sweep(model, exs, ["maskahead"], [20], out, NumTok(), policy_factory=factory(8), **kw)
    assert len(r1.rows) == 2
    run = json.load(open(os.path.join(out, "run.json")))
    assert run["generation"]["threshold"] == 0.85 and run["model"]["config"]["num_layers"] == 3
    assert "recent=8" in run["policies"]["maskahead@20"]
    assert all(r["run"] == run["fingerprint"] and r["example_digest"] for r in r1.rows)
    assert r1.summary["run"]["fingerprint"] == run["fingerprint"]
    before = _snapshot(out)
    assert {"results.jsonl", "run.json", "summary.json", "summary.md"} <= set(before)

    calls = []
    real = G.generate
    monkeypatch.setattr(G, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    # (a) another threshold: refused, naming the setting on both sides; nothing rewritten
    with pytest.raises(RunMismatch, match=r"holds a run with generation\.threshold=0\.85; this run has "
                                          r"generation\.threshold=0\.95: use another --out"):
        run_sweep(model, exs, ["maskahead"], [20], out, NumTok(), policy_factory=factory(8),
                  gen=GenerationConfig(threshold=0.95), **kw)
    # (c) another policy knob: refused, naming the knob
    with pytest.raises(RunMismatch, match=r"maskahead@20 rows of a policy with recent=8; this run's has recent=16"):
        run_sweep(model, exs, ["maskahead"], [20], out, NumTok(), policy_factory=factory(16), **kw)
    # same ids, other prompts (e.g. another seed or tokenizer): refused
    changed = [D.EvalExample(**{**e.__dict__, "ids": e.ids[:-1]}) for e in exs]
    with pytest.raises(RunMismatch, match=r"example niah/40/0\.0/0 \(and 1 more\) whose prompt"):
        run_sweep(model, changed, ["maskahead"], [20], out, NumTok(), policy_factory=factory(8), **kw)
    assert calls == [] and _snapshot(out) == before
    # (b) the same settings resume: no forward, the rows reused as they are
    r2 = run_sweep(model, exs, ["maskahead"], [20], out, NumTok(), policy_factory=factory(8), **kw)
    assert calls == [] and r2.rows == r1.rows
    assert open(os.path.join(out, "results.jsonl"), "rb").read() == before["results.jsonl"]
    # another policy adds its rows under the same fingerprint
    r3 = run_sweep(model, exs, ["dense", "maskahead"], [20], out, NumTok(), policy_factory=factory(8), **kw)
    assert len(r3.rows) == 4 and calls and r3.rows[:2] == r1.rows
    assert set(json.load(open(os.path.join(out, "run.json")))["policies"]) == {"dense@full", "maskahead@20"}
    # rows from before fingerprints: refused, files untouched
    legacy = str(tmp_path / "legacy")
    os.makedirs(legacy)
    rows = [{k: v for k, v in r.items() if k not in ("run", "policy_repr", "example_digest")} for r in r1.rows]
    _write_jsonl(os.path.join(legacy, "results.jsonl"), rows)
    before = _snapshot(legacy)
    with pytest.raises(RunMismatch, match="predate run fingerprints"):
        run_sweep(model, exs, ["maskahead"], [20], legacy, NumTok(), policy_factory=factory(8), **kw)
    assert _snapshot(legacy) == before


def test_sweep_rejects_bad_input(tmp_path):
    model = tiny_model("sdar")
    exs = _examples()
    with pytest.raises(ValueError):
        run_sweep(model, [], ["dense"], [None], str(tmp_path), NumTok())
    with pytest.raises(ValueError):
        run_sweep(model, exs + exs[:1], ["dense"], [None], str(tmp_path), NumTok())
    # an unknown policy is refused before anything runs (dense would run first otherwise)
    with pytest.raises(PO.PolicyError, match="unknown policy 'no-such-policy'"):
        run_sweep(model, exs[:1], ["dense", "no-such-policy"], [10], str(tmp_path), NumTok(),
                  progress=False, plots=False)
    assert not os.path.exists(os.path.join(str(tmp_path), "results.jsonl"))


def test_budget_plot_when_exposed(tmp_path):
    class Fake:
        layer_budgets = [4, 8, 2]
        head_budgets = [[1, 3], [4, 4], [1, 1]]

    b = PO.policy_budgets(Fake(), {})
    assert b["layer"] == [4.0, 8.0, 2.0] and np.asarray(b["head"]).shape == (3, 2)
    assert PO.policy_budgets(Dense(), {"nfe": [1]}) is None
    try:  # MaskKV's offline layer allocation, when the registry has it
        mk = PO.make_policy("maskkv", 10)
    except PO.PolicyError:
        mk = None
    if mk is not None:
        lb = PO.policy_budgets(mk, {}, num_layers=4, prompt_lens=[400, 400])
        assert len(lb["layer"]) == 4 and sum(lb["layer"]) == pytest.approx(4 * 40)
    paths = PL.budget_plots({"maskkv@5": b}, str(tmp_path))
    assert os.path.getsize(paths["budgets_maskkv_5"]) > 0


def test_auto_bucket():
    assert auto_bucket(1) == 64 and auto_bucket(500) == 64 and auto_bucket(600) == 128
    assert auto_bucket(8000) == 1024 and auto_bucket(30000) == 4096
    for n in (1500, 3000, 8193, 31000):  # above 512 the 64-token floor no longer applies
        q = auto_bucket(n)
        assert (-(-n // q) * q - n) <= 0.125 * 2 ** (n - 1).bit_length()


def test_hf_tokenizer_with_chat_template(tmp_path):
    """A folder with tokenizer_config.json loads through transformers and applies its template."""
    import shutil

    from maskahead_jax.tasks import TOKENIZER_PATH

    shutil.copy(TOKENIZER_PATH, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]", "mask_token": "[MASK]", "unk_token": "[UNK]",
        "chat_template": "{% for m in messages %}question : {{ m['content'] }} {% endfor %}answer :"}))
    tok = D.load_tokenizer(str(tmp_path))
    assert tok.hf and tok.has_chat_template
    ids = tok.encode_prompt("the pass key is 42")
    assert tok.decode(ids) == "question : the pass key is 42 answer :"
    plain = D.load_tokenizer(os.path.dirname(TOKENIZER_PATH))
    assert not plain.has_chat_template and plain.encode_prompt("the pass key")[0] == 1  # [BOS]


def test_one_registry_one_policy_error():
    """The evaluation front end is the registry's: one PolicyError class, one list of names; a
    sweep's budget list is dropped for a policy without a budget, which `make` itself refuses."""
    import maskahead_jax.policies as P

    assert PO.PolicyError is P.PolicyError and PO.available() == P.names()
    assert isinstance(PO.make_policy("dense", 10), Dense)
    assert PO.make_policy("mage", 10) == P.make("mage")
    with pytest.raises(P.PolicyError, match="takes no budget"):
        P.make("mage", 10)


# ----------------------------------------------------------------------------- issue 35 items 5, 7
def test_sweep_validates_every_policy_before_the_first_forward(tmp_path, monkeypatch):
    """A typo, an unknown knob or inconsistent floors in any run of a sweep is a PolicyError before
    dense (or anything) runs, naming the run; nothing is written."""
    import importlib

    G = importlib.import_module("maskahead_jax.generate")
    monkeypatch.setattr(G, "generate", lambda *a, **k: pytest.fail("a forward ran before validation"))
    model = tiny_model("sdar")
    exs = _examples()[:2]
    out = str(tmp_path / "sweep")
    kw = dict(progress=False, plots=False)

    def factory(knobs):
        return lambda p, c: PO.make_policy(p, c, **({} if p == "dense" else knobs))

    with pytest.raises(PO.PolicyError, match=r"maskahead@5: capacity_floor=8 is below recent \+ sinks"):
        run_sweep(model, exs, ["dense", "maskahead"], [5, 20], out, NumTok(),
                  policy_factory=factory(dict(capacity_floor=8)), **kw)
    with pytest.raises(PO.PolicyError, match="maskahead@5: .*has no knob windw"):
        run_sweep(model, exs, ["dense", "maskahead"], [5], out, NumTok(), policy_factory=factory(dict(windw=3)), **kw)
    with pytest.raises(PO.PolicyError, match="maskahead@5: .*knob topk_pct expects a number, got 'abc'"):
        run_sweep(model, exs, ["dense", "maskahead"], [5], out, NumTok(),
                  policy_factory=factory(dict(topk_pct="abc")), **kw)
    with pytest.raises(PO.PolicyError, match="maskkv@5: maskkv compresses the prompt of bidirectional"):
        run_sweep(model, exs, ["dense", "maskkv"], [5], out, NumTok(), **kw)
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        run_sweep(model, exs, ["dense"], [None], out, NumTok(), max_new_tokens=-1, **kw)
    assert not os.path.exists(out)


def test_resolve_policy_kw_per_policy_and_types():
    r = PO.resolve_policy_kw(["dense", "maskahead", "snapkv"], PO.parse_policy_kw(
        "maskahead:capacity_floor=128,snapkv:window=16,topk_floor=32,capacity_floor=64"))
    assert r == {"dense": {}, "maskahead": {"capacity_floor": 128, "topk_floor": 32},
                 "snapkv": {"capacity_floor": 64, "topk_floor": 32, "window": 16}}
    assert PO.resolve_policy_kw(["q_maskahead"], {"q-maskahead:bits": 8}) == {"q-maskahead": {"bits": 8}}
    # lists keep their commas; types come from the dataclass fields
    assert PO.parse_policy_kw("layer_importance=[1,2,3],beta=0.5") == {"layer_importance": [1, 2, 3], "beta": 0.5}
    assert PO.resolve_policy_kw(["maskkv"], {"budget_per_head": None, "beta": 1}) == \
        {"maskkv": {"budget_per_head": None, "beta": 1}}
    for kw, msg in [({"windw": 1}, "no policy of this run"), ({"snapkv:window": 1}, "not in this run"),
                    ({"maskahead:window": 1}, "has no knob window"), ({"topk_pct": "abc"}, "expects a number"),
                    ({"recent": 2.5}, "expects an integer"), ({"pin_question": 1}, "expects true or false"),
                    ({"select_ranking": 3}, "expects a string"), ({"recent": None}, "expects an integer")]:
        with pytest.raises(PO.PolicyError, match=msg):
            PO.resolve_policy_kw(["dense", "maskahead"], kw)
    with pytest.raises(PO.PolicyError, match="layer_importance expects a list"):
        PO.make_policy("maskkv", 5, layer_importance="abc")
    with pytest.raises(ValueError, match="bad policy knob 'maskahead:=3'"):
        PO.parse_policy_kw("maskahead:=3")


def _v2(i, **over):
    r = dict(_id=f"id{i}", domain="Code Repository Understanding", sub_domain="s", difficulty="hard",
             length="long", question=f" which one {i} ? ", choice_A="alpha", choice_B="beta", choice_C="gamma",
             choice_D="delta", answer="C", context=" ".join(f"w{j}" for j in range(100)))
    r.update(over)
    return r


def test_longbench_v2_multiple_choice(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([_v2(0), _v2(1, answer="a")], indent=2))  # pretty-printed
    tok = WordTok()
    exs = D.load_longbench(str(tmp_path), tok, max_length=1000)
    assert [e.id for e in exs] == ["longbench_v2/id0", "longbench_v2/id1"]
    e = exs[0]
    assert (e.dataset, e.kind, e.max_new_tokens, e.answers) == ("longbench_v2", "longbench_v2", 128, ["C"])
    assert exs[1].answers == ["A"] and e.meta["domain"] == "Code Repository Understanding"
    text = tok.decode(e.ids)
    ctx = " ".join(f"w{j}" for j in range(100))
    assert text == "<user> " + (
        f"Please read the following text and answer the question below.\n\n<text>\n{ctx}\n</text>\n\n"
        "What is the correct answer to this question: which one 0 ?\nChoices:\n(A) alpha\n(B) beta\n"
        "(C) gamma\n(D) delta\n\nFormat your response as follows: \"The correct answer is (insert answer "
        "here)\".") + " <assistant>"
    # pred.py's answer extraction
    assert D.score_example(e, "The correct answer is (C)") == 1.0
    assert D.score_example(e, "**The correct answer is C**") == 1.0
    assert D.score_example(e, "The correct answer is (B)") == 0.0 and D.score_example(e, "C") == 0.0
    # middle truncation: first and last max_length // 2 tokens
    t = D.load_longbench(str(tmp_path / "data.json"), tok, max_length=20)[0]
    assert t.meta["truncated"] and len(t.ids) <= 20 + 2
    # --longbench-datasets keeps v2 only when named; a malformed record is named
    assert D.load_longbench(str(tmp_path), tok, 1000, datasets=["hotpotqa"]) == []
    assert len(D.load_longbench(str(tmp_path), tok, 1000, datasets=["longbench_v2"], limit=1)) == 1
    (tmp_path / "bad.json").write_text(json.dumps([_v2(0, answer="E")]))
    with pytest.raises(ValueError, match="has answer 'E', expected A, B, C or D"):
        D.load_longbench(str(tmp_path / "bad.json"), tok, 1000)
    (tmp_path / "bad2.json").write_text(json.dumps([{k: v for k, v in _v2(0).items() if k != "choice_D"}]))
    with pytest.raises(ValueError, match="lacks LongBench v2 field"):
        D.load_longbench(str(tmp_path / "bad2.json"), tok, 1000)
    (tmp_path / "lines.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="record 0 is a int, not a JSON object"):
        D.load_longbench(str(tmp_path / "lines.json"), tok, 1000)


def test_sweep_variants_and_capacity_order():
    from maskahead_jax.evaluation.presets import parse_variant, sweep_factory, sweep_preset
    from maskahead_jax.evaluation.sweep import _runs

    assert parse_variant("q-maskahead[bits=2,compaction=lazy]") == ("q-maskahead", {"bits": 2, "compaction": "lazy"})
    assert parse_variant("maskahead") == ("maskahead", {})
    with pytest.raises(ValueError, match="variant"):
        parse_variant("q-maskahead[bits=2")
    runs = _runs(["maskahead", "dense", "q-maskahead[bits=2]"], [10.0, 5.0], order="capacity")
    assert runs == [("dense", None), ("maskahead", 10.0), ("q-maskahead[bits=2]", 10.0), ("maskahead", 5.0),
                    ("q-maskahead[bits=2]", 5.0)]
    sp = sweep_preset("testbed-policies")
    pol = sweep_factory(sp)("q-maskahead[bits=2]", 5.0)
    assert (pol.storage.bits, pol.capacity_pct, pol.capacity_floor, pol.topk_floor, pol.recent) == (2, 5.0, 64, 32, 32)
    assert sweep_factory(sp)("h2o[bits=4]", 10.0).label == "q-h2o"
    assert sweep_factory(sp)("pyramidkv[block_causal=true]", 5.0).block_causal is True
    long = sweep_preset("testbed-8192")  # issue 53: the released knobs, unchanged
    ma = sweep_factory(long)("maskahead", 10.0)
    assert (ma.capacity_floor, ma.topk_floor, ma.recent) == (512, 256, 64)
    assert sweep_factory(long)("q-maskahead[bits=2]", 5.0).storage.bits == 2
    assert {ln for _, ln, _, _ in long.cells} == {8192}


def test_eval_sweep_preset_runs_resumes_and_exports(tmp_path, monkeypatch, capsys):
    """`maskahead eval --sweep NAME` on a small preset: rows under the variant labels, the
    suffixed cell as its own dataset outside the headline score, a rerun adds nothing, clashing
    flags are refused, and the export writes the trimmed rows and the same table."""
    from maskahead_jax import cli
    from maskahead_jax.evaluation import export as EX, presets as P

    sp = P.SweepPreset(note="test", preset="testbed", cells=((("passkey",), 256, 1, ""), (("passkey",), 320, 1, "@320")),
                       depths=(0.5,), policies=("dense", "q-maskahead[bits=2]"), capacities=(50.0,),
                       batch_size=2, score_datasets=("passkey",))
    monkeypatch.setitem(P.SWEEPS, "tiny", sp)
    out = str(tmp_path / "sw")
    assert cli.main(["eval", "--sweep", "tiny", "--out", out, "--no-plots", "--no-progress"]) == 0
    rows = load_rows(os.path.join(out, "results.jsonl"))
    assert sorted({(r["policy"], r["capacity"]) for r in rows}) == [("dense", None), ("q-maskahead[bits=2]", 50.0)]
    assert sorted({r["dataset"] for r in rows}) == ["passkey", "passkey@320"]
    with open(os.path.join(out, "summary.json")) as f:
        summ = json.load(f)
    for run in summ["runs"]:
        assert run["score"] == pytest.approx(run["per_dataset"]["passkey"])
    assert cli.main(["eval", "--sweep", "tiny", "--out", out, "--no-plots", "--no-progress"]) == 0
    assert len(load_rows(os.path.join(out, "results.jsonl"))) == len(rows)
    assert cli.main(["eval", "--sweep", "tiny", "--out", out, "--policies", "dense"]) == 2
    md = EX.export(out, str(tmp_path / "x.jsonl"), sp.score_datasets)
    with open(os.path.join(out, "summary.md")) as f:
        assert f.read().split("\n")[:4] == md.split("\n")[:4]
    with open(tmp_path / "x.jsonl") as f:
        trimmed = [json.loads(x) for x in f]
    assert len(trimmed) == len(rows) and set(trimmed[0]) == set(EX.KEEP)


def test_default_attention_is_not_part_of_the_run_fingerprint():
    """GenerationConfig(attention="auto") is an execution setting: runs started before the field
    existed still resume (their fingerprint has no attention key); a forced one is recorded."""
    from maskahead_jax.evaluation.sweep import run_fingerprint

    model = tiny_model("sdar")
    auto = run_fingerprint(model, GenerationConfig())
    assert "attention" not in auto["generation"] and "attention_interpret" not in auto["generation"]
    forced = run_fingerprint(model, GenerationConfig(attention="reference"))
    assert forced["generation"]["attention"] == "reference"
    assert forced["fingerprint"] != auto["fingerprint"]


def test_summary_scores_by_length_group_longbench_e_buckets():
    """LongBench rows are grouped by LongBench-E's word-count buckets (scorer_e: < 4000, < 8000,
    else 8k+), LongBench v2 rows by their own label, other rows by context tokens; each group's
    score is the macro mean over its datasets, and summary.md gets a by-length table."""
    from maskahead_jax.evaluation.sweep import length_group, summarize

    def row(ds, length, score, i):
        return dict(policy="dense", capacity=None, id=f"{ds}/{i}", dataset=ds, score=score, length=length,
                    reduction_final=1.0, reduction_peak=1.0, kv_bytes_final=1.0, kv_bytes_peak=1.0,
                    dense_bytes_final=1.0, dense_bytes_peak=1.0, nfe=1)

    assert [length_group(dict(dataset="qasper", length=n)) for n in (0, 3999, 4000, 7999, 8000, 20000)] == \
        ["0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]
    assert length_group(dict(dataset="longbench_v2", length="medium")) == "medium"
    assert length_group(dict(dataset="passkey", length=2048)) == "2048"
    assert length_group(dict(dataset="passkey", length=None)) is None
    rows = [row("qasper", 1000, 1.0, 0), row("qasper", 5000, 0.0, 1), row("qasper", 9000, 0.5, 2),
            row("hotpotqa", 2000, 0.0, 3), row("hotpotqa", 3000, 0.0, 4), row("hotpotqa", 12000, 1.0, 5)]
    run = summarize(rows)["runs"][0]
    # 0-4k: qasper 100, hotpotqa 0 -> 50; 4-8k: qasper only -> 0; 8k+: (50 + 100) / 2
    assert run["per_length"] == {"0-4k": 50.0, "4-8k": 0.0, "8k+": 75.0}
    assert list(run["per_length"]) == ["0-4k", "4-8k", "8k+"]
    md = to_markdown(summarize(rows))
    assert "| policy | capacity % | 0-4k | 4-8k | 8k+ |" in md and "| dense | full | 50.00 | 0.00 | 75.00 |" in md
    # one group only: no by-length table; token lengths sort by value
    assert "capacity % | 0-4k" not in to_markdown(summarize(rows[:1]))
    toks = summarize([row("passkey", 8192, 1.0, 0), row("passkey", 512, 0.0, 1)])["runs"][0]
    assert list(toks["per_length"]) == ["512", "8192"]
