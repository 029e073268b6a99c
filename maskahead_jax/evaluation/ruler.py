"""RULER (Hsieh et al. 2024, NVIDIA/RULER) long-context tasks, generated offline.

Our own generator following RULER's published task definitions: the 13 tasks of its
scripts/synthetic.yaml (needle in a haystack x 8, variable tracking, common / frequent words
extraction, single- and multi-hop QA), its prompt templates and answer prefixes
(scripts/data/synthetic/constants.py), its sizing rule (the largest haystack whose tokenized
prompt, answer prefix included, fits max_seq_length - tokens_to_generate) and its metrics
(scripts/eval/synthetic/constants.py: string_match_all, string_match_part).

What is not shipped and must be given as local files: the essay haystack RULER builds from Paul
Graham's essays (any plain text works: `haystack=`), SQuAD v2 dev (qa_1) and HotpotQA dev
distractor (qa_2) JSON (`qa=`). Word keys and the common-words vocabulary come from the
`wonderwords` package, as in RULER (optional extra `maskahead-jax[ruler]`).

Every example draws from its own RNG, seeded by (seed, task, length, index), so example ids and
prompts are the same on every run (resume relies on it).

Code: the task definitions are in ruler_tasks.py, the local data and its checks in
ruler_sources.py, the generators in ruler_generators.py; this module sizes each task's haystack
to a length and makes the examples (`ruler_examples`), and re-exports the public names of the
others.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

# RULER's metrics live in maskahead_jax/metrics.py (datasets.score_example uses them without
# importing this generator); re-exported here.
from ..metrics import postprocess_pred, ruler_score, string_match_all, string_match_part
from .ruler_generators import _cwe, _fwe, _largest_fitting, _niah, _qa, _vt
from .ruler_sources import (WONDERWORDS_MISSING, QASet, Sources, available_tasks, check_tasks, file_digest,
                            load_sources, read_haystack, read_qa, word_lists)
from .ruler_tasks import (DEPTHS, DOCUMENT_PROMPT, ESSAY_TASKS, GENERATOR_VERSION, NEEDLE, NOISE,
                          OFFLINE_TASKS, QA_TASKS, TASK_NAMES, TASKS, TEMPLATES, tokens_to_generate)

__all__ = [
    # sizing and examples (here)
    "RulerPrompt", "encode", "generate_prompt", "haystack_size", "ruler_examples",
    # ruler_tasks.py
    "DEPTHS", "DOCUMENT_PROMPT", "ESSAY_TASKS", "GENERATOR_VERSION", "NEEDLE", "NOISE", "OFFLINE_TASKS",
    "QA_TASKS", "TASK_NAMES", "TASKS", "TEMPLATES", "tokens_to_generate",
    # ruler_sources.py
    "WONDERWORDS_MISSING", "QASet", "Sources", "available_tasks", "check_tasks", "file_digest", "load_sources",
    "read_haystack", "read_qa", "word_lists",
    # maskahead_jax/metrics.py
    "postprocess_pred", "ruler_score", "string_match_all", "string_match_part",
]


def encode(tokenizer, body: str, prefix: str, chat: bool = True) -> list:
    """Prompt ids: the body as the user message of the tokenizer's chat template (when it has one
    and chat is on), then the answer prefix after the generation prompt; else body + prefix."""
    if chat and tokenizer.has_chat_template:
        return tokenizer.encode(tokenizer.chat(body) + prefix, add_special_tokens=False)
    return tokenizer.encode(body + prefix)


@dataclasses.dataclass
class RulerPrompt:
    """One generated example before it becomes an EvalExample (the text is kept for tests)."""

    task: str
    length: int
    index: int
    body: str
    prefix: str
    answers: list
    ids: list
    size: int


def _generator(task: str, length: int, tokenizer, sources: Sources, index: int):
    """(rng, size) -> (body, prefix, answers) for one example of a task."""
    family, a = TASKS[task]
    if family == "niah":
        return lambda rng, size: _niah(rng, size, a, sources)
    if family == "variable_tracking":
        return lambda rng, size: _vt(rng, size, a, sources, tokenizer=tokenizer)
    if family == "common_words_extraction":
        return lambda rng, size: _cwe(rng, size, a, sources, length=length)
    if family == "freq_words_extraction":
        return lambda rng, size: _fwe(rng, size, a, sources, length=length)
    return lambda rng, size: _qa(rng, size, a, sources, index=index)


# a small first sample to estimate tokens per haystack unit
_START = {"noise": 25, "needle": 25, "essay": 500}


def _start_size(task: str) -> int:
    family, a = TASKS[task]
    if family == "niah":
        return _START[a["type_haystack"]]
    return {"variable_tracking": 25, "common_words_extraction": 100, "freq_words_extraction": 500,
            "qa": 10}[family]


def _least_size(task: str) -> int:
    """The smallest haystack that makes an example: cwe needs its num_cw common words plus one;
    sentence haystacks need as many slots as statements to insert (RULER samples them)."""
    family, a = TASKS[task]
    if family == "common_words_extraction":
        return a["num_cw"] + 1
    if family == "variable_tracking":
        return (a["num_hops"] + 1) * a["num_chains"]
    if family == "niah" and a["type_haystack"] != "essay":
        return max(a["num_needle_k"], a["num_needle_q"]) * a["num_needle_v"]
    return 1


def haystack_size(task: str, length: int, tokenizer, sources: Sources, seed: int = 0, chat: bool = True) -> int:
    """The haystack size of (task, length), searched once on a sample drawn from its own RNG."""
    budget = length - tokens_to_generate(task)
    make = _generator(task, length, tokenizer, sources, index=0)

    def n_tokens(size):
        body, prefix, _ = make(random.Random(f"ruler-search/{seed}/{task}/{length}/{size}"), size)
        return len(encode(tokenizer, body, prefix, chat))

    least = _least_size(task)
    best = _largest_fitting(n_tokens, budget, max(_start_size(task), least), least) if budget > 0 else 0
    if best < least:
        raise ValueError(f"RULER {task}: {length} tokens cannot hold its prompt (with the smallest haystack, "
                         f"{least}, it takes {n_tokens(least)} tokens + {tokens_to_generate(task)} to generate); "
                         f"use a longer length")
    return best


def generate_prompt(task: str, length: int, index: int, size: int, tokenizer, sources: Sources,
                    seed: int = 0, chat: bool = True) -> RulerPrompt:
    """Example `index` of (task, length), from its own RNG; when its prompt overflows the budget
    (samples vary) the haystack shrinks by a few percent until it fits, as RULER's loop."""
    budget = length - tokens_to_generate(task)
    make = _generator(task, length, tokenizer, sources, index=index)
    step, least = max(1, size // 50), _least_size(task)
    while True:
        body, prefix, answers = make(random.Random(f"ruler/{seed}/{task}/{length}/{index}"), size)
        ids = encode(tokenizer, body, prefix, chat)
        if len(ids) <= budget or size <= least:
            break
        size = max(least, size - step)
    if len(ids) > budget:
        raise ValueError(f"RULER {task} example {index}: no haystack size fits {length} tokens")
    return RulerPrompt(task, length, index, body, prefix, [str(x) for x in answers], ids, size)


def ruler_examples(tasks: Sequence[str], lengths: Sequence[int], tokenizer, n: int, sources: Sources,
                   seed: int = 0, chat: bool = True) -> list:
    """EvalExamples of every (task, length): n each, id ruler/<task>/<length>/<i>, dataset = the
    task, meta length = the length (max_seq_length), max_new_tokens = RULER's tokens_to_generate."""
    from .example import EvalExample

    check_tasks(tasks, sources)
    out = []
    for task in tasks:
        for length in lengths:
            size = haystack_size(task, int(length), tokenizer, sources, seed=seed, chat=chat)
            for i in range(n):
                p = generate_prompt(task, int(length), i, size, tokenizer, sources, seed=seed, chat=chat)
                out.append(EvalExample(
                    id=f"ruler/{task}/{length}/{i}", dataset=task, ids=p.ids, answers=p.answers,
                    max_new_tokens=tokens_to_generate(task), kind="ruler",
                    meta=dict(length=int(length), n_tokens=len(p.ids), haystack=p.size, seed=seed)))
    return out
