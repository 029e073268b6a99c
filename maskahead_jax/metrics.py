"""LongBench (v1) metric functions and `\\boxed{}` exact match, dependency-free.

Follows THUDM/LongBench `metrics.py`: `normalize_answer` (lower case, strip punctuation, drop the
articles a/an/the, collapse whitespace); `qa_f1_score` (token-level F1 of the normalized strings);
`rouge_score` (ROUGE-L as the `rouge` package's get_scores computes it, reimplemented by hand);
`classification_score`; `retrieval_score`; `count_score`; `code_sim_score` (fuzz.ratio as the
Indel similarity 2*LCS/(|a|+|b|)). `longbench_score(dataset, pred, answers)` picks the metric and
takes the max over reference answers. `extract_boxed` / `boxed_exact_match` for GSM8K / MATH.
RULER's `string_match_all` / `string_match_part` after its `postprocess_pred` (`ruler_score`).
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Iterable, Optional, Sequence


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (LongBench / SQuAD)."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def f1_tokens(prediction: list, ground_truth: list) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """LongBench qa_f1_score: F1 over whitespace tokens of the normalized strings."""
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def exact_match_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def _lcs_table(a, b):
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            t[i + 1][j + 1] = t[i][j] + 1 if x == y else max(t[i][j + 1], t[i + 1][j])
    return t


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence of two sequences (O(len a * len b))."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _recon_lcs(x, y) -> tuple:
    """The tokens of one LCS of x and y (as the `rouge` package reconstructs it)."""
    t = _lcs_table(x, y)
    out, i, j = [], len(x), len(y)
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            out.append(x[i - 1]); i -= 1; j -= 1
        elif t[i - 1][j] > t[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return tuple(reversed(out))


def rouge_l_f1(prediction: str, ground_truth: str) -> float:
    """Plain ROUGE-L F1 over whitespace tokens: 2PR/(P+R) with P = LCS/|pred|, R = LCS/|ref|."""
    p, g = prediction.split(), ground_truth.split()
    lcs = lcs_length(p, g)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(g)
    return 2 * prec * rec / (prec + rec)


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """LongBench rouge_score = `rouge.Rouge().get_scores([pred], [ref], avg=True)["rouge-l"]["f"]`
    (pltrdy `rouge` 1.0.1), reimplemented: sentences split on ".", words on spaces (no lower-casing),
    summary-level union LCS over reference sentences with m/n the numbers of *distinct* words of
    reference/prediction, and F = (1 + beta^2) R P / (R + beta^2 P) with beta = P / R. Returns 0
    for an empty prediction or reference (LongBench catches the package's ValueError)."""
    sents = lambda s: [" ".join(x.split()) for x in s.split(".") if len(x) > 0]
    words = lambda ss: [w for x in ss for w in x.split(" ")]
    hyp, ref = sents(prediction), sents(ground_truth)
    if not any(x for x in hyp) or not any(x for x in ref):
        return 0.0
    m, n = len(set(words(ref))), len(set(words(hyp)))
    union: set = set()
    llcs = 0
    for r in ref:
        rw = r.split(" ")
        prev = len(union)
        for h in hyp:
            union |= set(_recon_lcs(rw, h.split(" ")))
        llcs += len(union) - prev
    r_lcs, p_lcs = llcs / m, llcs / n
    beta = p_lcs / (r_lcs + 1e-12)
    num = (1 + beta ** 2) * r_lcs * p_lcs
    den = r_lcs + (beta ** 2) * p_lcs
    return num / (den + 1e-12)


def classification_score(prediction: str, ground_truth: str, all_classes: Iterable[str] = (), **kwargs) -> float:
    """LongBench classification_score (kept literally, including its in-loop list removal)."""
    em_match_list = []
    for class_name in all_classes:
        if class_name in prediction:
            em_match_list.append(class_name)
    for match_term in em_match_list:
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """LongBench passage_retrieval_en: fraction of numbers in the prediction equal to the
    paragraph number of `Paragraph (\\d+)` in the ground truth."""
    matches = re.findall(r"Paragraph (\d+)", ground_truth)
    gt_id = matches[0] if matches else ground_truth
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if str(n) == str(gt_id)) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """LongBench passage_count: fraction of numbers in the prediction equal to the ground truth."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if str(n) == str(ground_truth)) / len(numbers)


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy / rapidfuzz `fuzz.ratio`: round(100 * 2 * LCS_chars / (len a + len b)), i.e. the
    normalized Indel similarity (what python-Levenshtein's ratio computes); 100 for two empties."""
    if not a and not b:
        return 100
    return int(round(100 * 2 * lcs_length(a, b) / (len(a) + len(b))))


def difflib_ratio(a: str, b: str) -> int:
    """The pure-python fuzzywuzzy fallback (difflib.SequenceMatcher), for comparison."""
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """LongBench code_sim_score: the first line of the prediction without '`', '#' or '//',
    fuzz.ratio against the ground truth, / 100."""
    all_lines = prediction.lstrip("\n").split("\n")
    pred = ""
    for line in all_lines:
        if ("`" not in line) and ("#" not in line) and ("//" not in line):
            pred = line
            break
    return fuzz_ratio(pred, ground_truth) / 100


# ------------------------------------------------------------------------------ math answers
def extract_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = text.find("{", idx)
    if i < 0:
        m = re.match(r"\\boxed\s+([^\s$]+)", text[idx:])
        return m.group(1) if m else None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def normalize_math(s: str) -> str:
    """Light normalization for exact match: strip spaces, $, \\left/\\right, text wrappers,
    trailing '.', thousands commas in plain numbers, and trailing zeros of decimals."""
    s = s.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|!|,|;|:)", "", s)
    s = s.replace("$", "").replace(" ", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".")
    return s


def boxed_exact_match(prediction: str, ground_truth: str) -> float:
    """1.0 when the last \\boxed{} of the prediction equals the reference (itself boxed or plain)."""
    pred = extract_boxed(prediction)
    if pred is None:
        return 0.0
    ref = extract_boxed(ground_truth)
    ref = ground_truth if ref is None else ref
    return float(normalize_math(pred) == normalize_math(ref))


LONGBENCH_METRICS = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score, "2wikimqa": qa_f1_score, "musique": qa_f1_score,
    "gov_report": rouge_score, "qmsum": rouge_score, "multi_news": rouge_score,
    "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "passage_retrieval_en": retrieval_score, "passage_count": count_score,
    "lcc": code_sim_score, "repobench-p": code_sim_score,
}


def longbench_score(dataset: str, prediction: str, answers: list[str], all_classes=()) -> float:
    """LongBench scorer: max over reference answers; for trec/triviaqa/samsum only the first line
    of the prediction is scored (as LongBench's eval.py does)."""
    fn = LONGBENCH_METRICS[dataset]
    if dataset in ("trec", "triviaqa", "samsum", "lsht"):
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max(fn(prediction, a, all_classes=all_classes) for a in answers)


# ------------------------------------------------------------------------------ RULER
# NVIDIA/RULER scripts/eval/synthetic/constants.py and evaluate.py (evaluation/ruler.py generates
# the prompts).
def postprocess_pred(prediction: str) -> str:
    """RULER's evaluate.py cleanup: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (case-insensitive): niah, vt, cwe, fwe."""
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 when any reference is found in the prediction (case-insensitive): qa."""
    pred = prediction.lower()
    return float(max(r.lower() in pred for r in references))


def ruler_score(task: str, prediction: str, references: Sequence[str]) -> float:
    """One example's score in [0, 1] by the task's RULER metric (RULER reports the mean x 100):
    string_match_part for the QA tasks (qa_1, qa_2), string_match_all for every other."""
    if not references:
        raise ValueError(f"RULER example of {task} has no references")
    metric = string_match_part if task.startswith("qa_") else string_match_all
    return float(metric(postprocess_pred(prediction), references))
