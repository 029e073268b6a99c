"""LongBench metric functions and \\boxed{} extraction against hand-computed values."""
import pytest

from maskahead_jax import metrics as M


def test_normalize_answer():
    assert M.normalize_answer("The Cat, sat on a mat!") == "cat sat on mat"
    assert M.normalize_answer("  An  apple. ") == "apple"
    assert M.normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_qa_f1():
    # pred {cat, sat}, ref {cat, sat, down}: P = 1, R = 2/3 -> F1 = 0.8
    assert M.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert M.qa_f1_score("Paris.", "paris") == 1.0
    assert M.qa_f1_score("dog", "cat") == 0.0
    assert M.qa_f1_score("", "cat") == 0.0
    # repeated tokens count with multiplicity: pred [a1, a1, b], ref [a1, b]: common 2, P 2/3, R 1 -> 0.8
    assert M.qa_f1_score("x x y", "x y") == pytest.approx(0.8)


def test_rouge_l():
    # distinct words: ref {the,cat,is,on,mat} = 5, pred {the,cat,sat,on,mat} = 5, LCS words {the,cat,on,mat}
    assert M.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-9)
    # plain token F1: LCS 5 of 6 and 6 -> 5/6
    assert M.rouge_l_f1("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # R = 1, P = 1/2, beta = 1/2: F = 1.25 * 0.5 / (1 + 0.25 * 0.5) = 5/9
    assert M.rouge_score("a b c d", "a b") == pytest.approx(5 / 9, abs=1e-9)
    assert M.rouge_score("x y", "x y") == pytest.approx(1.0, abs=1e-9)
    assert M.rouge_score("", "x y") == 0.0
    assert M.rouge_score("p q", "x y") == 0.0
    assert M.lcs_length("abcbdab", "bdcaba") == 4


def test_classification_retrieval_count():
    classes = ["LOC", "NUM", "HUM"]
    assert M.classification_score("It is NUM", "NUM", all_classes=classes) == 1.0
    assert M.classification_score("LOC or NUM", "NUM", all_classes=classes) == 0.5
    assert M.classification_score("HUM", "NUM", all_classes=classes) == 0.0
    assert M.retrieval_score("Paragraph 3, or 3 or 5", "Paragraph 3") == pytest.approx(2 / 3)
    assert M.retrieval_score("no idea", "Paragraph 3") == 0.0
    assert M.count_score("there are 7 or 8", "7") == 0.5


def test_code_sim():
    # "hello world" vs "hallo world": LCS 10 chars, 2*10/22 = 0.909 -> 91
    assert M.fuzz_ratio("hello world", "hallo world") == 91
    assert M.fuzz_ratio("abc", "abc") == 100
    assert M.fuzz_ratio("", "") == 100
    # comment and fence lines are skipped; "return x + 1" vs "return x+1": LCS 10, 2*10/22 -> 0.91
    assert M.code_sim_score("```python\n# c\nreturn x + 1\n", "return x+1") == pytest.approx(0.91)


def test_longbench_score_dispatch():
    assert M.longbench_score("hotpotqa", "the Eiffel tower", ["Louvre", "Eiffel Tower"]) == 1.0
    assert M.longbench_score("triviaqa", "Paris\nLondon", ["London"]) == 0.0  # first line only
    assert M.longbench_score("lcc", "return x+1", ["return x+1"]) == 1.0


def test_boxed():
    assert M.extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert M.extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert M.extract_boxed("no box") is None
    assert M.boxed_exact_match(r"answer: \boxed{1,000.50}", "1000.5") == 1.0
    assert M.boxed_exact_match(r"\boxed{\dfrac{3}{4}}", r"\boxed{\frac{3}{4}}") == 1.0
    assert M.boxed_exact_match(r"\boxed{18}", "18") == 1.0
    assert M.boxed_exact_match(r"\boxed{17}", "18") == 0.0
    assert M.boxed_exact_match("18", "18") == 0.0  # no box, no credit
    assert M.boxed_exact_match(r"$\boxed{\text{(B)}}$", "(B)") == 1.0
