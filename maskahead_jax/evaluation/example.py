"""One evaluation item (`EvalExample`: prompt token ids, references, generation length) and how
its prediction is scored, by the metric of its kind (testbed, LongBench v1 / v2, math, RULER).
Kept apart from the loaders so the sweep and the RULER generator need no loader code."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from .. import metrics

# the dataset and kind of LongBench v2 examples (loaders.longbench_v2_examples)
LONGBENCH_V2 = "longbench_v2"


@dataclasses.dataclass
class EvalExample:
    """One evaluation item: prompt token ids, references and how to score them.

    kind: testbed | longbench | longbench_v2 | math | ruler.  meta: length / depth for needle heatmaps,
    the testbed task fields, LongBench all_classes, LongBench v2 domain / difficulty, the
    untruncated prompt length."""

    id: str
    dataset: str
    ids: list
    answers: list
    max_new_tokens: int
    kind: str
    meta: dict = dataclasses.field(default_factory=dict)


def extract_choice(response: str) -> Optional[str]:
    """LongBench v2 pred.py's extract_answer: the letter of "The correct answer is (X)" or
    "... is X" (asterisks removed), else None."""
    response = response.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", response) or \
        re.search(r"The correct answer is ([A-D])", response)
    return m.group(1) if m else None


def score_example(ex: EvalExample, prediction: str) -> float:
    """Score in [0, 1] by the dataset's metric."""
    if ex.kind == "testbed":
        from ..tasks import Example, score

        m = ex.meta
        e = Example(task=m["task"], prompt="", answer=ex.answers[0], context_length=m.get("length", 0),
                    depth=m.get("depth", 0.0), seed=m.get("seed", 0), meta={"facts": m.get("facts")})
        return float(score(e, prediction))
    if ex.kind == "longbench":
        return float(metrics.longbench_score(ex.dataset, prediction, ex.answers,
                                             all_classes=ex.meta.get("all_classes") or []))
    if ex.kind == "math":
        return float(metrics.boxed_exact_match(prediction, ex.answers[0]))
    if ex.kind == LONGBENCH_V2:
        return float(extract_choice(prediction) == ex.answers[0])
    if ex.kind == "ruler":  # RULER's string_match_all / string_match_part (dataset = the task)
        return metrics.ruler_score(ex.dataset, prediction, ex.answers)
    raise ValueError(f"unknown example kind {ex.kind!r}")
