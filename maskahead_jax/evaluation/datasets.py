"""Evaluation datasets as token-id examples with per-dataset scoring.

Loaders (all local; nothing is downloaded):
  testbed_suite   the synthetic suite of `maskahead_jax.tasks` (tasks x lengths x depths x seeds)
  needle_grid     passkey (niah) or two-hop (niah_hard) over context length x depth
  load_longbench  LongBench v1 JSONL files (official prompt templates, max_new_tokens per dataset,
                  middle truncation keeping the first and last halves, chat template when the
                  tokenizer has one, except for the few-shot / code tasks, as LongBench's pred.py),
                  and LongBench v2's data.json (multiple choice A-D, the 0-shot prompt of its
                  pred.py, scored by the letter after "The correct answer is")
  load_math       GSM8K / MATH-500 style JSONL, scored by exact match on the last \\boxed{}
  (RULER)         generated offline by `evaluation.ruler.ruler_examples`, kind "ruler"

This module holds the testbed suite and needle grids; `EvalExample` and `score_example` are in
example.py, the tokenizer in tokenizer.py, the LongBench and math loaders in loaders.py. Their
public names are re-exported here.
"""
from __future__ import annotations

from typing import Iterable, Optional

from .example import LONGBENCH_V2, EvalExample, extract_choice, score_example
from .loaders import (LONGBENCH_MAXLEN, LONGBENCH_NO_CHAT, LONGBENCH_PROMPTS, LONGBENCH_V2_FIELDS,
                      LONGBENCH_V2_MAXLEN, LONGBENCH_V2_PROMPT, MATH_PROMPT, load_longbench, load_math,
                      longbench_examples, longbench_v2_examples, middle_truncate)
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    # the testbed suite and needle grids (here)
    "TESTBED_MAX_NEW", "needle_grid", "testbed_suite",
    # example.py
    "LONGBENCH_V2", "EvalExample", "extract_choice", "score_example",
    # loaders.py
    "LONGBENCH_MAXLEN", "LONGBENCH_NO_CHAT", "LONGBENCH_PROMPTS", "LONGBENCH_V2_FIELDS", "LONGBENCH_V2_MAXLEN",
    "LONGBENCH_V2_PROMPT", "MATH_PROMPT", "load_longbench", "load_math", "longbench_examples",
    "longbench_v2_examples", "middle_truncate",
    # tokenizer.py
    "Tokenizer", "load_tokenizer",
]

# testbed suite answer lengths (as experiments/eval_testbed.py)
TESTBED_MAX_NEW = {"passkey": 16, "multikey": 16, "twohop": 16, "docqa": 16, "longanswer": 160}


# ------------------------------------------------------------------------------ testbed / needles
def _testbed_example(ex, tok: Tokenizer, dataset: str, max_new: Optional[int]) -> EvalExample:
    return EvalExample(
        id=f"{dataset}/{ex.task}/{ex.context_length}/{ex.depth:g}/{ex.seed}", dataset=dataset,
        ids=tok.encode(ex.prompt), answers=[ex.answer],
        max_new_tokens=int(max_new or TESTBED_MAX_NEW[ex.task]), kind="testbed",
        meta=dict(task=ex.task, length=ex.context_length, depth=ex.depth, seed=ex.seed,
                  facts=ex.meta.get("facts"), n_tokens=ex.n_tokens))


def testbed_suite(tasks: Iterable[str] = ("passkey", "multikey", "twohop", "docqa", "longanswer"),
                  lengths: Iterable[int] = (512, 1024), depths: Iterable[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                  n_per_cell: int = 2, seed: int = 0, tokenizer: Optional[Tokenizer] = None,
                  max_new_tokens: Optional[int] = None) -> list[EvalExample]:
    """The task suite; dataset = task name; lengths in testbed-tokenizer tokens."""
    from .. import tasks as T

    tok = tokenizer or load_tokenizer()
    raw = []
    for t in tasks:
        if t not in T.TASKS:
            raise ValueError(f"unknown testbed task {t!r}; choose from {T.TASKS}")
        for n in lengths:
            for d in depths:
                for s in range(seed, seed + n_per_cell):
                    raw.append(T.generate(t, int(n), float(d), s))
    _refuse_short(raw)
    return [_testbed_example(ex, tok, ex.task, max_new_tokens) for ex in raw]


def _refuse_short(raw) -> None:
    """ValueError when a requested length is below what a task's needles and question take alone
    (the prompt would come out longer than its length label), naming the shortest that fits."""
    short = [ex for ex in raw if ex.n_tokens > ex.context_length]
    if short:
        lengths = sorted({ex.context_length for ex in short})
        tasks = list(dict.fromkeys(ex.task for ex in short))
        need = max(ex.n_tokens for ex in short)
        raise ValueError(f"length{'s' if len(lengths) > 1 else ''} {', '.join(map(str, lengths))} too short for "
                         f"the {', '.join(tasks)} task{'s' if len(tasks) > 1 else ''}: the needles and question "
                         f"alone take up to {need} tokens, so prompts would be longer than their length label; "
                         f"use lengths of at least {need}")


def needle_grid(lengths: Iterable[int] = (512, 1024, 2048), depths: Iterable[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                n_per_cell: int = 1, seed: int = 0, task: str = "passkey",
                tokenizer: Optional[Tokenizer] = None, max_new_tokens: Optional[int] = None) -> list[EvalExample]:
    """Needle in a haystack over (context length x depth): passkey ("niah") or the two-hop
    task ("niah_hard")."""
    from .. import tasks as T

    name = {"passkey": "niah", "twohop": "niah_hard"}.get(task)
    if name is None:
        raise ValueError("needle grids use task 'passkey' (niah) or 'twohop' (niah_hard)")
    tok = tokenizer or load_tokenizer()
    raw = [T.generate(task, int(n), float(d), s) for n in lengths for d in depths for s in range(seed, seed + n_per_cell)]
    _refuse_short(raw)
    return [_testbed_example(ex, tok, name, max_new_tokens) for ex in raw]
