"""The local data some RULER tasks need, read and checked before anything is generated: the
essay haystack (any plain text), SQuAD v2 dev / HotpotQA dev distractor JSON for qa_1 / qa_2,
and wonderwords' word lists (keys and the common-words vocabulary); `check_tasks` refuses a task
whose data is missing, in one line."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Optional, Sequence

from .ruler_tasks import ESSAY_TASKS, QA_TASKS, TASK_NAMES, TASKS

WONDERWORDS_MISSING = "RULER's word lists come from the wonderwords package: pip install 'maskahead-jax[ruler]'"


@dataclasses.dataclass
class QASet:
    """A QA dataset as RULER's qa.py reads it: unique documents and the answerable questions,
    each with the indices of its gold documents (and, for SQuAD, its article's other paragraphs)."""

    name: str
    docs: list
    qas: list


@dataclasses.dataclass
class Sources:
    """The local data some tasks need: essay words (the essay haystack) and QA sets by name."""

    essay: Optional[list] = None
    qa: dict = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def word_lists() -> tuple:
    """wonderwords' (adjectives, nouns, verbs), each sorted and deduplicated."""
    try:
        import wonderwords  # noqa: F401
    except ImportError:
        raise ValueError(WONDERWORDS_MISSING) from None
    from importlib import resources

    def read(name):
        text = resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
        return sorted({w.strip() for w in text.splitlines() if w.strip()})

    return read("adjectivelist.txt"), read("nounlist.txt"), read("verblist.txt")


def read_haystack(path: str) -> list:
    """The essay haystack: a plain text file, whitespace collapsed, split into words (as niah.py)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ruler-haystack: no such file: {path}")
    with open(path, encoding="utf-8", errors="replace") as f:
        words = re.sub(r"\s+", " ", f.read()).strip().split(" ")
    words = [w for w in words if w]
    if len(words) < 100:
        raise ValueError(f"--ruler-haystack {path}: {len(words)} words; give a longer text (essays, a book)")
    return words


def _squad(data: dict) -> QASet:
    """SQuAD (v2 dev) -> documents = unique paragraphs; answerable questions with their paragraph
    and the other paragraphs of the same article (qa.py's read_squad)."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = index[p["context"]]
            for q in p["qas"]:
                if q.get("is_impossible") or not q.get("answers"):
                    continue
                qas.append(dict(query=q["question"], outputs=[a["text"] for a in q["answers"]],
                                context=[own], more=[i for i in article if i != own]))
    return QASet("squad", docs, qas)


def _hotpot(data: list) -> QASet:
    """HotpotQA (dev distractor) -> documents = "title\\nsentences"; each question with all of its
    10 paragraphs (qa.py's read_hotpotqa)."""
    def doc(title, sents):
        return f"{title}\n{''.join(sents)}"

    docs = sorted({doc(t, s) for d in data for t, s in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [dict(query=d["question"], outputs=[d["answer"]], context=[index[doc(t, s)] for t, s in d["context"]],
                more=[]) for d in data]
    return QASet("hotpotqa", docs, qas)


def read_qa(path: str) -> QASet:
    """A SQuAD or HotpotQA JSON file, told apart by its structure."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ruler-qa: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--ruler-qa {path}: not a JSON file ({e})") from None
    try:
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            qa = _squad(data)
        elif isinstance(data, list) and data and all(k in data[0] for k in ("question", "answer", "context")):
            qa = _hotpot(data)
        else:
            qa = None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--ruler-qa {path}: malformed record ({type(e).__name__}: {e})") from None
    if qa is None:
        raise ValueError(f"--ruler-qa {path}: neither SQuAD JSON ({{\"data\": [{{\"paragraphs\": ...}}]}}) "
                         f"nor HotpotQA JSON ([{{\"question\", \"answer\", \"context\"}}, ...])")
    if not qa.qas:
        raise ValueError(f"--ruler-qa {path}: no answerable questions")
    return qa


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (the run fingerprint names the data, not only its path)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_tasks(tasks: Sequence[str], sources: Sources) -> None:
    """Refuse unknown tasks and tasks whose local data was not given, in one line each."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; choose from {', '.join(TASK_NAMES)}")
    essay = [t for t in tasks if t in ESSAY_TASKS]
    if essay and sources.essay is None:
        raise ValueError(f"RULER task(s) {', '.join(essay)} need an essay haystack: pass --ruler-haystack "
                         f"TEXT_FILE (any long plain text; RULER uses Paul Graham's essays)")
    qa = [t for t in tasks if t in QA_TASKS and QA_TASKS[t] not in sources.qa]
    if qa:
        need = ", ".join(f"{t} ({'SQuAD v2 dev' if QA_TASKS[t] == 'squad' else 'HotpotQA dev distractor'} JSON)"
                         for t in qa)
        raise ValueError(f"RULER task(s) {need} need --ruler-qa FILE[,FILE]")
    if any(TASKS[t][0] in ("niah", "common_words_extraction") for t in tasks):
        word_lists()  # wonderwords missing: refuse now, not half-way


def available_tasks(sources: Sources) -> list:
    """The tasks the given local data allows, in RULER's order."""
    return [t for t in TASKS if (t not in ESSAY_TASKS or sources.essay is not None)
            and (t not in QA_TASKS or QA_TASKS[t] in sources.qa)]


def load_sources(haystack: Optional[str] = None, qa: Sequence[str] = ()) -> Sources:
    """Read the essay haystack and QA files; two files of the same QA set are refused."""
    src = Sources(essay=read_haystack(haystack) if haystack else None)
    for path in qa:
        q = read_qa(path)
        if q.name in src.qa:
            raise ValueError(f"--ruler-qa: two {q.name} files given; pass one SQuAD and/or one HotpotQA file")
        src.qa[q.name] = q
    return src
