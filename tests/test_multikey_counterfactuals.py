"""experiments/multikey_counterfactuals.py: each variant changes the one thing it names and keeps
the asked fact, its answer and the question; the script's JSON counts misses and repairs."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import multikey_counterfactuals as mc  # noqa: E402
from maskahead_jax import tasks as T  # noqa: E402
from maskahead_jax.tasks.suite import MULTIKEY_PHRASE, multikey_fact, multikey_question  # noqa: E402


def _facts(text: str) -> list[str]:
    return [s for s in mc.split_sentences(text) if MULTIKEY_PHRASE in s and "?" not in s]


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_variants_change_one_thing(depth):
    ex = T.generate("multikey", 512, depth, 3, T.get_tokenizer())
    key, fact = ex.meta["key"], multikey_fact(ex.meta["key"], ex.answer)
    question = multikey_question(key)
    sents, i, q = mc._parts(ex)
    assert " ".join(sents + [q]) == ex.prompt  # the split gives the prompt back
    assert i == (0 if depth == 0 else len(sents) - 1)  # the asked fact sits at the end it was put
    other = next(s for s in _facts(ex.prompt) if s != fact)
    wrong = other.split(" is ")[-1].rstrip(" .")
    v = mc.counterfactuals(ex, wrong)
    assert set(v) == set(mc.VARIANTS)
    for name in ("pad_front", "drop_front", "fact_inward", "no_copied"):
        assert v[name].endswith(" " + question) and v[name].count(fact) == 1, name
    # pad_front: the prompt itself after filler with no fact in it
    assert v["pad_front"].endswith(ex.prompt) and _facts(v["pad_front"]) == _facts(ex.prompt)
    # drop_front: a quarter of the sentences gone, the asked fact kept
    assert len(mc.split_sentences(v["drop_front"])) < len(mc.split_sentences(ex.prompt))
    # fact_inward: the same sentences, the asked fact SHIFT sentences towards the middle
    moved = mc.split_sentences(v["fact_inward"][: -len(question) - 1])
    assert sorted(moved) == sorted(sents) and moved.index(fact) == (mc.SHIFT if depth == 0
                                                                    else len(sents) - 1 - mc.SHIFT)
    # no_copied: only the fact holding the wrong value is gone
    assert set(_facts(ex.prompt)) - set(_facts(v["no_copied"])) == {other}
    # renamed_key: one new key in the fact and the question, the answer unchanged
    renamed = v["renamed_key"]
    assert key not in renamed and renamed.count(f" is {ex.answer} .") == ex.prompt.count(f" is {ex.answer} .")
    assert len(_facts(renamed)) == len(_facts(ex.prompt))


def test_copied_from_names_the_fact():
    ex = T.generate("multikey", 512, 1.0, 3, T.get_tokenizer(), n_sharing=1)
    asked = ex.meta["key"]
    other = next(s for s in _facts(ex.prompt) if asked.split()[0] + " " in s and asked not in s
                 or " " + asked.split()[1] + " is" in s and asked not in s)
    value = other.split(" is ")[-1].rstrip(" .")
    link = mc.copied_from(ex, value)
    assert link["copied_key"] in other and link["shares_word"] is True
    assert mc.copied_from(ex, "not-a-value") == {"copied_key": None}
    assert mc.copied_from(ex, ex.answer) == {"copied_key": None}


def test_no_copied_needs_a_copied_fact():
    ex = T.generate("multikey", 256, 1.0, 0, T.get_tokenizer())
    assert "no_copied" not in mc.counterfactuals(ex, "not-a-value")
    assert "no_copied" not in mc.counterfactuals(ex, None)


def test_script_json(capsys):
    """--every re-asks every example (the shipped model misses few at 160 tokens): each row has
    its first answer and one verdict per variant, and "repaired" counts them."""
    mc.main(["--lengths", "160", "--depths", "1", "--n", "2", "--every"])
    out = json.loads(capsys.readouterr().out)
    assert out["examples"] == 2 and len(out["rows"]) == 2
    assert out["missed"] == sum(not r["right"] for r in out["rows"])
    assert 0 <= out["copied_shares_word"] + out["copied_word_before"] <= out["copied_located"] <= out["missed"]
    for r in out["rows"]:
        assert {"pad_front", "drop_front", "fact_inward", "renamed_key"} <= set(r)
    for v in ("pad_front", "drop_front", "fact_inward", "renamed_key"):
        assert out["repaired"][v] == f"{sum(r[v] for r in out['rows'])}/2"
