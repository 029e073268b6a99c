"""Task suite: deterministic generators, self-consistent scorers, lengths and depths as asked."""
import pytest

from maskahead_jax import tasks as T


@pytest.fixture(scope="module")
def tok():
    return T.get_tokenizer()


def test_tokenizer_specials_and_digits(tok):
    assert tok.get_vocab_size() <= 1536
    for name, i in [("[PAD]", T.PAD_ID), ("[BOS]", T.BOS_ID), ("[EOS]", T.EOS_ID), ("[MASK]", T.MASK_ID)]:
        assert tok.token_to_id(name) == i
    enc = tok.encode("the pass key is 482 . or 4821973 .", add_special_tokens=False)
    assert enc.tokens[:6] == ["the", "pass", "key", "is", "482", "."]  # a number < 1000 is one token
    assert enc.tokens[7:12] == ["482", "##1", "##9", "##7", "##3"]  # longer: prefix + digit pieces
    assert tok.decode(enc.ids) == "the pass key is 482. or 4821973."
    assert tok.encode("the").ids[0] == T.BOS_ID  # [BOS] is prepended by default


def test_shipped_tokenizer_matches_builder(tok):
    built = T.build_tokenizer()
    assert built.get_vocab() == tok.get_vocab()


@pytest.mark.parametrize("task", T.TASKS)
def test_deterministic(task, tok):
    a = T.generate(task, 512, 0.5, seed=3, tokenizer=tok)
    b = T.generate(task, 512, 0.5, seed=3, tokenizer=tok)
    c = T.generate(task, 512, 0.5, seed=4, tokenizer=tok)
    assert a.to_dict() == b.to_dict()
    assert a.prompt != c.prompt


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("n", [512, 2048])
def test_scorer_and_length(task, n, tok):
    ex = T.generate(task, n, 0.25, seed=1, tokenizer=tok)
    assert ex.task == task and ex.context_length == n
    assert n - 32 <= ex.n_tokens <= n
    assert ex.n_tokens == T.count_tokens(ex.prompt, tok)
    assert "[UNK]" not in tok.encode(ex.prompt).tokens
    assert all(not t.startswith("##") or t[2:].isdigit() for t in tok.encode(ex.prompt).tokens)
    assert ex.score(ex.answer) == 1.0
    assert ex.score(ex.target) == 1.0  # what training teaches scores full marks
    assert "[UNK]" not in tok.encode(ex.target).tokens
    assert ex.score("") == 0.0
    assert ex.score("1 2 3 nothing useful") < 1.0


def test_wrong_answers_score_lower(tok):
    ex = T.make_passkey(512, 0.5, 0, tok)
    wrong = str(int(ex.answer) + 1)
    assert ex.score(wrong) == 0.0
    assert ex.score(ex.answer + " . done") == 1.0
    ex = T.make_docqa(1024, 0.5, 0, tok)
    assert 0.0 < ex.score(ex.answer.split()[0]) < 1.0
    # only the first sentence counts: what follows the answer's "." is not scored
    assert ex.score(ex.answer + " . what is the motto of the red hall ? the motto") == 1.0
    assert ex.score("wrong words . " + ex.answer) == 0.0
    assert all("." not in T.make_docqa(512, d, s, tok).answer for d in (0.0, 1.0) for s in range(20))
    # the first-word diagnostic: a right start with a wrong rest is split from a wrong start;
    # normalized as the F1 is
    first = ex.answer.split()[0]
    assert T.docqa_first_word(ex, ex.answer.upper() + " . what is the motto")
    assert T.docqa_first_word(ex, first + " wrong words") and ex.score(first + " wrong words") < 1.0
    assert not T.docqa_first_word(ex, "wrong " + ex.answer)
    assert not T.docqa_first_word(ex, "") and not T.docqa_first_word(ex, ". " + ex.answer)
    ex = T.make_longanswer(1024, 0.5, 0, tok)
    facts = ex.meta["facts"]
    half = " ".join(f"{n} {c} ;" for n, c in facts[: len(facts) // 2])
    assert ex.score(half) == pytest.approx((len(facts) // 2) / len(facts))
    assert len(tok.encode(ex.answer, add_special_tokens=False).ids) >= 128


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_depth(depth, tok):
    n = 2048
    ex = T.make_passkey(n, depth, 7, tok)
    assert abs(ex.needle_token_pos - depth * ex.n_tokens) <= 0.06 * n
    # the needle is really at that token offset
    ids = tok.encode(ex.prompt, add_special_tokens=False).ids
    needle = tok.encode("the pass key is", add_special_tokens=False).ids
    assert ids[ex.needle_token_pos:ex.needle_token_pos + len(needle)] == needle
    assert ex.prompt.endswith("the pass key is")


def test_twohop_mirrored(tok):
    ex = T.make_twohop(2048, 0.25, 2, tok)
    p = ex.prompt
    case, unit = ex.meta["case"], ex.meta["unit"]
    i1 = p.index(f"case {case} is assigned to unit {unit}")
    i2 = p.index(f"unit {unit} holds code {ex.answer}")
    assert i1 < len(p) * 0.4 and i2 > len(p) * 0.6
    assert p.count("holds code") == 9  # target + 8 decoys


def test_twohop_chained_answer(tok):
    """The answer names the unit (hop 1), then its code (hop 2); only the code is scored."""
    import re
    ex = T.make_twohop(1024, 0.5, 5, tok)
    unit, code = ex.meta["unit"], ex.answer
    assert ex.prompt.endswith(f"case {ex.meta['case']} is assigned to unit")
    assert ex.target == f"{unit} . unit {unit} holds code {code}"
    assert ex.score(ex.target) == 1.0
    # the right unit with another unit's code, or a decoy's whole chain, scores nothing
    decoy = next(c for q, c in ex.meta["queries"] if not c.startswith(unit + " "))
    decoy_code = re.search(r"\d+", decoy).group(0)
    assert ex.score(f"{unit} . unit {unit} holds code {decoy_code}") == 0.0
    assert ex.score(decoy) == 0.0
    # every query's chain is the context's own facts
    for q, c in ex.meta["queries"]:
        case = q.split("case ")[1].split(" ?")[0]
        u, k = c.split(" . unit ")[0], c.split("holds code ")[1]
        assert f"case {case} is assigned to unit {u} ." in ex.prompt
        assert f"unit {u} holds code {k} ." in ex.prompt


def test_filler_varied():
    import random
    r = random.Random(0)
    sents = [T.filler_sentence(r) for _ in range(200)]
    assert len(set(sents)) > 190


def test_suite_grid(tok):
    exs = list(T.make_suite(tasks=("passkey",), lengths=(512,), depths=(0.0, 1.0), n_per_cell=2, tokenizer=tok))
    assert len(exs) == 4 and {e.depth for e in exs} == {0.0, 1.0}


def test_multikey_sharing_keys(tok):
    """n_sharing distractor keys share exactly one word with the asked key, all keys stay
    distinct, and n_sharing=0 leaves the suite's examples as they were."""
    plain = T.generate("multikey", 512, 0.5, 7, tok)
    assert T.generate("multikey", 512, 0.5, 7, tok, n_sharing=0) == plain
    ex = T.generate("multikey", 512, 0.5, 7, tok, n_sharing=3)
    keys = [q.split(" for ", 1)[1].split(" ?")[0] for q, _ in ex.meta["queries"]]
    assert keys[0] == ex.meta["key"] and len(set(keys)) == len(keys) == plain.meta["n_keys"]
    asked = keys[0].split()
    shared = [len(set(k.split()) & set(asked)) for k in keys[1:]]
    assert shared[:3] == [1, 1, 1] and max(shared) == 1
    assert ex.score(ex.answer) == 1.0 and ex.prompt.count(f"for {keys[0]} is {ex.answer} .") == 1
