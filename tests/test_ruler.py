"""RULER generated offline (evaluation/ruler.py): sizing, answers in context, determinism,
RULER's metrics, the up-front refusals and one small `maskahead eval --ruler` run."""
import collections
import json
import os
import random
import re
import sys

import pytest

from maskahead_jax import cli
from maskahead_jax.evaluation import ruler as R
from maskahead_jax.evaluation.datasets import EvalExample, load_tokenizer, score_example

pytest.importorskip("wonderwords")  # the [ruler] extra (in the test extra too)

LENGTH = 2048  # the testbed tokenizer splits words finely: cwe needs ~2k tokens to hold its prompt


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A plain-text essay, a SQuAD-shaped and a HotpotQA-shaped JSON file."""
    d = tmp_path_factory.mktemp("ruler")
    rng = random.Random(0)
    vocab = "the of and a to in is was startup founders money work think people good make time".split()
    essay = " ".join(" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 15))).capitalize() + "."
                     for _ in range(2000))
    (d / "essay.txt").write_text(essay)
    squad = {"version": "v2.0", "data": [
        {"title": f"article{a}", "paragraphs": [
            {"context": f"Paragraph {a}-{p}: " + " ".join(rng.choice(vocab) for _ in range(20)),
             "qas": [{"id": f"{a}{p}", "question": f"Which code belongs to paragraph {a}-{p}?",
                      "answers": [{"text": f"code{a}x{p}", "answer_start": 0}], "is_impossible": False},
                     {"id": f"{a}{p}i", "question": "unanswerable?", "answers": [], "is_impossible": True}]}
            for p in range(4)]} for a in range(40)]}
    (d / "squad.json").write_text(json.dumps(squad))
    hotpot = [{"_id": str(q), "question": f"Which city links {q}?", "answer": f"city{q}", "type": "bridge",
               "context": [[f"Title {q}-{k}", [f"Sentence {q} {k} one. ", "Sentence two."]] for k in range(10)]}
              for q in range(30)]
    (d / "hotpot.json").write_text(json.dumps(hotpot))
    return d


@pytest.fixture(scope="module")
def sources(files):
    return R.load_sources(str(files / "essay.txt"), [str(files / "squad.json"), str(files / "hotpot.json")])


@pytest.fixture(scope="module")
def prompts(tok, sources):
    """Two examples of every task at LENGTH."""
    out = {}
    for task in R.TASK_NAMES:
        size = R.haystack_size(task, LENGTH, tok, sources)
        out[task] = [R.generate_prompt(task, LENGTH, i, size, tok, sources) for i in range(2)]
    return out


def test_task_table_matches_ruler():
    assert len(R.TASK_NAMES) == 13 and set(R.OFFLINE_TASKS) == {
        "niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"}
    assert [R.tokens_to_generate(t) for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")] == [128, 30, 120, 50, 32]
    assert R.DEPTHS[:4] == [0, 3, 5, 8] and R.DEPTHS[-1] == 100 and len(R.DEPTHS) == 40


def test_prompts_fill_the_budget(prompts):
    """Every prompt fits length - tokens_to_generate and uses most of it (RULER's sizing)."""
    for task, ps in prompts.items():
        budget = LENGTH - R.tokens_to_generate(task)
        for p in ps:
            assert 0.85 * budget < len(p.ids) <= budget, (task, len(p.ids), budget)


def test_niah_answers_in_context(prompts):
    for task in [t for t in R.TASK_NAMES if t.startswith("niah")]:
        a = R.TASKS[task][1]
        for p in prompts[task]:
            assert len(p.answers) == a["num_needle_v"] * a["num_needle_q"]
            question = p.body.rsplit("\n", 1)[-1]
            for v in p.answers:
                m = re.search(r"One of the special magic \w+ for (\S+) is: " + re.escape(v) + r"\.", p.body)
                assert m and m.group(1) in question and m.group(1) in p.prefix, (task, v)
            if a["num_needle_q"] * a["num_needle_v"] == 1:
                assert p.body.startswith("A special magic") and p.prefix.endswith("is")
            else:
                assert p.body.startswith("Some special magic") and p.prefix.endswith("are")


def test_vt_chain_in_context(prompts):
    for p in prompts["vt"]:
        names = p.answers
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        task = p.body[p.body.rindex("Memorize and track"):]  # after the solved example
        value = re.search(r"assigned the value (\d+)", p.prefix).group(1)
        assert f"VAR {names[0]} = {value}" in task
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a}" in task
        assert task.index(f"VAR {names[0]} =") < task.index(f"VAR {names[-1]} =")
        assert p.body.count("Memorize and track") == 2  # the in-context example first


def test_cwe_answers_are_the_most_common(prompts):
    for p in prompts["cwe"]:
        listing = p.body.rsplit("\n", 2)[-2]  # the last numbered list (after the solved example)
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", listing))
        top = sorted(counts, key=counts.get, reverse=True)[:10]
        assert set(top) == set(p.answers) and len(p.answers) == 10
        assert min(counts[w] for w in p.answers) > max(c for w, c in counts.items() if w not in p.answers)


def test_fwe_answers_are_the_most_frequent_coded_words(prompts):
    for p in prompts["fwe"]:
        context = p.body.split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
        counts = collections.Counter(w for w in context.split() if w != "...")
        assert [w for w, _ in counts.most_common(3)] == p.answers
        assert counts.most_common(3)[2][1] > counts.most_common(4)[3][1]
        assert context.split().count("...") > counts.most_common(1)[0][1]  # rank 1 is the noise


def test_qa_gold_documents_in_context(prompts, sources):
    for task, name in R.QA_TASKS.items():
        qa = sources.qa[name]
        for p in prompts[task]:
            q = qa.qas[p.index]
            assert p.answers == q["outputs"] and q["query"] in p.body
            for i in q["context"]:
                assert qa.docs[i] in p.body
            assert "Document 1:\n" in p.body and p.prefix == " Answer:"


def test_read_qa_tells_squad_from_hotpot(files, tmp_path):
    sq, hp = R.read_qa(str(files / "squad.json")), R.read_qa(str(files / "hotpot.json"))
    assert (sq.name, len(sq.qas), len(sq.docs)) == ("squad", 160, 160)  # unanswerable questions dropped
    assert len(sq.qas[0]["more"]) == 3  # the article's other paragraphs
    assert (hp.name, len(hp.qas)) == ("hotpotqa", 30) and hp.docs[0].startswith("Title ")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="neither SQuAD JSON"):
        R.read_qa(str(bad))
    with pytest.raises(ValueError, match="two squad files"):
        R.load_sources(None, [str(files / "squad.json")] * 2)


def test_deterministic_ids_and_prompts(tok, sources):
    kw = dict(tasks=["niah_multikey_2", "fwe"], lengths=[512, 1024], tokenizer=tok, n=2, sources=sources)
    a, b = R.ruler_examples(seed=3, **kw), R.ruler_examples(seed=3, **kw)
    assert [e.id for e in a] == [e.id for e in b] and [e.ids for e in a] == [e.ids for e in b]
    assert a[0].id == "ruler/niah_multikey_2/512/0" and a[0].dataset == "niah_multikey_2"
    assert a[0].kind == "ruler" and a[0].meta["length"] == 512 and a[0].max_new_tokens == 128
    assert a[0].ids != a[1].ids  # examples differ from each other
    assert [e.ids for e in R.ruler_examples(seed=4, **kw)] != [e.ids for e in a]


def test_metrics_hand_worked():
    assert R.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert R.string_match_all("abcde fghij", ["ABCDE", "FGHIJ"]) == 1.0  # case-insensitive
    assert R.string_match_part("it was Paris", ["London", "paris"]) == 1.0
    assert R.string_match_part("it was Rome", ["London", "paris"]) == 0.0
    assert R.postprocess_pred("  \x00 7821945\x01 \n") == "7821945"
    # metrics.ruler_score tells QA tasks by name: the same set as the generator's qa family
    assert {t for t, (fam, _) in R.TASKS.items() if fam == "qa"} == {t for t in R.TASK_NAMES if t.startswith("qa_")}
    ex = EvalExample(id="ruler/vt/512/0", dataset="vt", ids=[1], answers=["AAAAA", "BBBBB"],
                     max_new_tokens=30, kind="ruler")
    assert score_example(ex, " aaaaa, BBBBB") == 1.0 and score_example(ex, "AAAAA") == 0.5
    qa = EvalExample(id="ruler/qa_1/512/0", dataset="qa_1", ids=[1], answers=["Denver Broncos", "Broncos"],
                     max_new_tokens=32, kind="ruler")
    assert score_example(qa, "the broncos") == 1.0 and score_example(qa, "Panthers") == 0.0


def test_refusals(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown RULER task\(s\) vt_x; choose from niah_single_1"):
        R.check_tasks(["niah_single_1", "vt_x"], R.Sources())
    with pytest.raises(ValueError, match=r"niah_single_2, niah_multivalue need an essay haystack: "
                                         r"pass --ruler-haystack"):
        R.check_tasks(["niah_single_2", "niah_multivalue", "vt"], R.Sources())
    with pytest.raises(ValueError, match=r"qa_2 \(HotpotQA dev distractor JSON\) need --ruler-qa"):
        R.check_tasks(["qa_2"], R.Sources())
    with pytest.raises(FileNotFoundError, match="--ruler-haystack"):
        R.read_haystack(str(tmp_path / "none.txt"))
    with pytest.raises(ValueError, match="cannot hold its prompt"):
        R.haystack_size("cwe", 512, load_tokenizer(), R.Sources())
    R.word_lists.cache_clear()
    monkeypatch.setitem(sys.modules, "wonderwords", None)  # import fails
    try:
        with pytest.raises(ValueError, match=r"pip install 'maskahead-jax\[ruler\]'"):
            R.check_tasks(["niah_single_1"], R.Sources())
        R.check_tasks(["fwe"], R.Sources())  # fwe needs no word list
    finally:
        R.word_lists.cache_clear()


def test_cli_refusals(tmp_path, capsys):
    out = str(tmp_path / "ev")
    assert cli.main(["eval", "--ruler", "4096,9000", "--out", out]) == 2
    assert "--ruler 9000: beyond the model's 8192 positions" in capsys.readouterr().err
    assert cli.main(["eval", "--ruler", "1024", "--ruler-tasks", "qa_1,niah_single_1", "--out", out]) == 2
    assert "qa_1 (SQuAD v2 dev JSON) need --ruler-qa" in capsys.readouterr().err
    assert cli.main(["eval", "--ruler", "1024", "--ruler-tasks", "nope", "--out", out]) == 2
    assert "unknown RULER task(s) nope" in capsys.readouterr().err


def test_cli_eval_ruler_end_to_end(tmp_path, capsys):
    """A tiny real run on the testbed model: one example, dense, scored with RULER's metric."""
    out = str(tmp_path / "ev")
    args = ["eval", "--ruler", "512", "--ruler-tasks", "niah_single_1", "--ruler-n", "1", "--policies", "dense",
            "--out", out, "--no-progress", "--no-plots", "--batch-size", "1"]
    assert cli.main(args) == 0
    capsys.readouterr()
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1 and rows[0]["id"] == "ruler/niah_single_1/512/0" and 0.0 <= rows[0]["score"] <= 1.0
    with open(os.path.join(out, "run.json")) as f:
        assert '"ruler"' in f.read()


def test_chat_template_wraps_the_task_and_the_prefix_follows(sources):
    """With a chat template: the task is the user turn, RULER's answer prefix comes after the
    generation prompt, and the budget counts the template's tokens too; chat=False: plain text."""
    from maskahead_jax.evaluation.datasets import Tokenizer
    from maskahead_jax.tasks import get_tokenizer

    template = ("{{ bos_token }}{% for m in messages %}question : {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}answer :{% endif %}")
    chat = Tokenizer(get_tokenizer(), chat_template=template, special_tokens={"bos_token": "[BOS]"})
    (ex,) = R.ruler_examples(["niah_single_1"], [1024], chat, 1, sources)
    text = chat.decode(ex.ids)
    assert text.startswith("question : a special magic number") and "answer : the special magic number for" in text
    assert text.endswith("mentioned in the provided text is") and len(ex.ids) <= 1024 - 128
    (plain,) = R.ruler_examples(["niah_single_1"], [1024], chat, 1, sources, chat=False)
    assert chat.decode(plain.ids).startswith("a special magic number")
