"""LongBench and GSM8K / MATH-500 loaders: local record files -> EvalExamples (nothing is
downloaded). LongBench v1 JSONL with its official prompt templates, per-dataset max_new_tokens,
middle truncation and chat template as its pred.py; LongBench v2's data.json as multiple choice
(0-shot prompt); math JSONL scored by the last \\boxed{}."""
from __future__ import annotations

import collections
import glob
import json
import os
from typing import Iterable, Optional, Sequence

from .. import metrics
from .example import LONGBENCH_V2, EvalExample
from .tokenizer import Tokenizer

# LongBench v1 config/dataset2prompt.json (English tasks), verbatim.
LONGBENCH_PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench v1 config/dataset2maxlen.json (English tasks).
LONGBENCH_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
    "samsum": 128, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}

# pred.py: no chat template for the few-shot and code-completion tasks.
LONGBENCH_NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")

# LongBench v2 (THUDM/LongBench prompts/0shot.txt and pred.py: 128 new tokens, no CoT).
LONGBENCH_V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
    "(D) $C_D$\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")
LONGBENCH_V2_MAXLEN = 128
LONGBENCH_V2_FIELDS = ("question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")

MATH_PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


# ------------------------------------------------------------------------------ LongBench v1 / v2
def middle_truncate(ids: Sequence[int], max_len: int) -> list:
    """LongBench truncation: keep the first and the last int(max_len / 2) tokens."""
    ids = list(ids)
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if len(ids) <= max_len:
        return ids
    half = int(max_len / 2)
    return ids[:half] + ids[len(ids) - half:]


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not a JSON line ({e})") from None
    return out


def _dataset_of(path: str, rec: dict) -> str:
    name = rec.get("dataset") or os.path.basename(path).rsplit(".", 1)[0]
    name = str(name)
    if name.endswith("_e") and name[:-2] in LONGBENCH_PROMPTS:  # LongBench-E files
        name = name[:-2]
    return name


def longbench_examples(records: Iterable[dict], dataset: str, tokenizer: Tokenizer, max_length: int,
                       chat: Optional[bool] = None, max_new_tokens: Optional[int] = None,
                       limit: Optional[int] = None, id_prefix: str = "") -> list[EvalExample]:
    """LongBench records (fields context, input, answers, all_classes, _id) -> examples.

    Prompt = official template; if its tokens exceed `max_length` the prompt is middle-truncated
    (first and last halves, decoded and joined, as pred.py does); then the chat template is
    applied (unless the dataset is in LONGBENCH_NO_CHAT or chat=False)."""
    if dataset not in LONGBENCH_PROMPTS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; English v1 tasks: {sorted(LONGBENCH_PROMPTS)}")
    tmpl = LONGBENCH_PROMPTS[dataset]
    use_chat = (dataset not in LONGBENCH_NO_CHAT) if chat is None else (chat and dataset not in LONGBENCH_NO_CHAT)
    out = []
    for i, rec in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        for k in ("context", "answers"):
            if k not in rec:
                raise ValueError(f"LongBench record {i} of {dataset} lacks field {k!r}")
        prompt = tmpl.format(context=rec["context"], input=rec.get("input", ""))
        raw = tokenizer.encode(prompt, add_special_tokens=False)
        n_raw = len(raw)
        if n_raw > max_length:
            half = int(max_length / 2)
            prompt = tokenizer.decode(raw[:half]) + tokenizer.decode(raw[n_raw - half:])
        ids = tokenizer.encode_prompt(prompt, chat=use_chat)
        answers = rec["answers"] if isinstance(rec["answers"], list) else [rec["answers"]]
        out.append(EvalExample(
            id=f"{id_prefix}{dataset}/{rec.get('_id', i)}", dataset=dataset, ids=ids,
            answers=[str(a) for a in answers],
            max_new_tokens=int(max_new_tokens or LONGBENCH_MAXLEN[dataset]), kind="longbench",
            meta=dict(all_classes=rec.get("all_classes") or [], length=rec.get("length"),
                      n_prompt_raw=n_raw, truncated=n_raw > max_length)))
    return out


def longbench_v2_examples(records: Iterable[dict], tokenizer: Tokenizer, max_length: int,
                          chat: Optional[bool] = None, max_new_tokens: Optional[int] = None,
                          limit: Optional[int] = None, source: str = "LongBench v2") -> list[EvalExample]:
    """LongBench v2 records (_id, domain, sub_domain, difficulty, length, question, choice_A..D,
    answer, context) -> multiple-choice examples, as its pred.py (0-shot, no CoT): the 0shot.txt
    template with each field stripped; a prompt longer than `max_length` tokens keeps its first
    and last max_length // 2 tokens (decoded and joined); then the chat template (unless
    chat=False); 128 new tokens. Scored 1 when the letter after "The correct answer is" (asterisks
    dropped, "(B)" or "B") equals `answer`."""
    out = []
    for i, rec in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(rec, dict):
            raise ValueError(f"{source}: record {i} is a {type(rec).__name__}, not a JSON object")
        missing = [k for k in LONGBENCH_V2_FIELDS if k not in rec]
        if missing:
            raise ValueError(f"{source}: record {i} lacks LongBench v2 field(s) {', '.join(missing)}")
        answer = str(rec["answer"]).strip().upper()
        if answer not in ("A", "B", "C", "D"):
            raise ValueError(f"{source}: record {i} has answer {rec['answer']!r}, expected A, B, C or D")
        prompt = LONGBENCH_V2_PROMPT
        for key, field in (("$DOC$", "context"), ("$Q$", "question"), ("$C_A$", "choice_A"),
                           ("$C_B$", "choice_B"), ("$C_C$", "choice_C"), ("$C_D$", "choice_D")):
            prompt = prompt.replace(key, str(rec[field]).strip())
        raw = tokenizer.encode(prompt, add_special_tokens=False)
        n_raw = len(raw)
        if n_raw > max_length:
            half = max_length // 2
            prompt = tokenizer.decode(raw[:half]) + tokenizer.decode(raw[n_raw - half:])
        ids = tokenizer.encode_prompt(prompt, chat=chat is not False)
        out.append(EvalExample(
            id=f"{LONGBENCH_V2}/{rec.get('_id', i)}", dataset=LONGBENCH_V2, ids=ids, answers=[answer],
            max_new_tokens=int(max_new_tokens or LONGBENCH_V2_MAXLEN), kind=LONGBENCH_V2,
            meta=dict(domain=rec.get("domain"), sub_domain=rec.get("sub_domain"),
                      difficulty=rec.get("difficulty"), length=rec.get("length"),
                      n_prompt_raw=n_raw, truncated=n_raw > max_length)))
    return out


def _read_records(path: str) -> list:
    """A JSON array file (LongBench v2's data.json, or v1 records as one array) or JSON lines."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, expected a .jsonl / .json file")
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        try:
            with open(path, encoding="utf-8") as f:
                recs = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON array ({e})") from None
    else:
        recs = _read_jsonl(path)
        if len(recs) == 1 and isinstance(recs[0], list):
            recs = recs[0]
    for i, r in enumerate(recs):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: record {i} is a {type(r).__name__}, not a JSON object; expected "
                             f"LongBench v1 JSONL (context, input, answers) or LongBench v2 data.json "
                             f"(question, choice_A..choice_D, answer, context)")
    return recs


def _longbench_format(path: str, rec: dict) -> str:
    if all(k in rec for k in ("choice_A", "question")):
        return "v2"
    if "context" in rec and "answers" in rec:
        return "v1"
    raise ValueError(f"{path}: records are in neither LongBench format: v1 JSONL has context, input, answers "
                     f"(+ all_classes, _id); v2 data.json has question, choice_A..choice_D, answer, context; "
                     f"the first record has {', '.join(sorted(map(str, rec))[:8]) or 'no fields'}")


def load_longbench(paths, tokenizer: Tokenizer, max_length: int, datasets: Optional[Sequence[str]] = None,
                   limit: Optional[int] = None, chat: Optional[bool] = None,
                   max_new_tokens: Optional[int] = None) -> list[EvalExample]:
    """LongBench files: v1 JSONL files (or folders of `<dataset>.jsonl`; the dataset comes from
    each record's `dataset` field or the file name) and LongBench v2's data.json (a JSON array,
    or a folder holding data.json; dataset `longbench_v2`). `limit` caps examples per file;
    `datasets` keeps only those datasets (v1 names, or longbench_v2)."""
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    if max_length <= 0:
        raise ValueError(f"LongBench max length must be positive, got {max_length}")
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.jsonl")))
            files += [f for f in found if _dataset_of(f, {}) in LONGBENCH_PROMPTS]
            if os.path.exists(os.path.join(p, "data.json")):
                files.append(os.path.join(p, "data.json"))
        else:
            files.append(p)
    if not files:
        raise FileNotFoundError(f"no LongBench files under {paths} (v1: <dataset>.jsonl, v2: data.json)")
    out = []
    for f in files:
        recs = _read_records(f)
        if not recs:
            continue
        if _longbench_format(f, recs[0]) == "v2":
            if datasets and LONGBENCH_V2 not in datasets:
                continue
            out += longbench_v2_examples(recs, tokenizer, max_length, chat=chat,
                                         max_new_tokens=max_new_tokens, limit=limit, source=f)
            continue
        ds = _dataset_of(f, recs[0])
        if datasets and ds not in datasets:
            continue
        out += longbench_examples(recs, ds, tokenizer, max_length, chat=chat,
                                  max_new_tokens=max_new_tokens, limit=limit)
    counts = collections.Counter(e.id for e in out)
    if any(n > 1 for n in counts.values()):
        dup = sorted(i for i, n in counts.items() if n > 1)
        raise ValueError(f"LongBench example ids repeat across the files given ({', '.join(dup[:3])}): "
                         f"pass each file once")
    return out


# ------------------------------------------------------------------------------ GSM8K / MATH-500
def _math_answer(rec: dict) -> str:
    ans = rec.get("answer")
    if ans is None:
        sol = rec.get("solution")
        if sol is None:
            raise ValueError("math record has neither 'answer' nor 'solution'")
        b = metrics.extract_boxed(sol)
        return b if b is not None else sol
    ans = str(ans)
    if "####" in ans:  # GSM8K: rationale then '#### 42'
        ans = ans.split("####")[-1].strip().replace(",", "")
    return ans


def load_math(path: str, tokenizer: Tokenizer, dataset: Optional[str] = None, limit: Optional[int] = None,
              max_new_tokens: int = 2048, chat: bool = True, template: str = MATH_PROMPT) -> list[EvalExample]:
    """GSM8K / MATH-500 JSONL (question|problem, answer|solution) scored by \\boxed{} exact match."""
    recs = _read_jsonl(path)
    ds = dataset or os.path.basename(path).rsplit(".", 1)[0]
    out = []
    for i, rec in enumerate(recs[:limit] if limit else recs):
        q = rec.get("question", rec.get("problem", rec.get("prompt")))
        if q is None:
            raise ValueError(f"{path}: record {i} has no 'question' / 'problem' field")
        out.append(EvalExample(
            id=f"{ds}/{rec.get('id', rec.get('unique_id', i))}", dataset=ds,
            ids=tokenizer.encode_prompt(template.format(question=q), chat=chat),
            answers=[_math_answer(rec)], max_new_tokens=int(max_new_tokens), kind="math"))
    return out
