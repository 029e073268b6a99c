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
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import warnings
from typing import Any, Iterable, Optional, Sequence

from .. import metrics

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
LONGBENCH_V2 = "longbench_v2"
LONGBENCH_V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
    "(D) $C_D$\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")
LONGBENCH_V2_MAXLEN = 128
LONGBENCH_V2_FIELDS = ("question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")

MATH_PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

# testbed suite answer lengths (as experiments/eval_testbed.py)
TESTBED_MAX_NEW = {"passkey": 16, "multikey": 16, "twohop": 16, "docqa": 16, "longanswer": 160}


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


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` or a transformers tokenizer.

    chat_template / special_tokens: a `tokenizers.Tokenizer` has no chat template of its own;
    one read from tokenizer_config.json is rendered here (sandboxed jinja2, as transformers does)."""

    def __init__(self, tok, hf: bool = False, name: str = "", chat_template: Optional[str] = None,
                 special_tokens: Optional[dict] = None):
        self.tok, self.hf, self.name = tok, hf, name
        self.chat_template, self.special_tokens = chat_template, dict(special_tokens or {})

    @property
    def has_chat_template(self) -> bool:
        if self.hf:
            return bool(getattr(self.tok, "chat_template", None))
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        if self.hf:
            return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.hf:
            return self.tok.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids)

    def chat(self, text: str) -> str:
        """The user message wrapped by the chat template (with the generation prompt)."""
        import jinja2

        messages = [{"role": "user", "content": text}]
        try:
            if self.hf:
                return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return _render_chat(self.chat_template, messages, **self.special_tokens)
        except (jinja2.TemplateError, ValueError, TypeError) as e:  # syntax, raise_exception, the sandbox
            what = {"TemplateSyntaxError": "has a syntax error", "SecurityError": "does something the sandbox "
                    "forbids"}.get(type(e).__name__, "failed")
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ValueError(f"the chat template of {self.name or 'the tokenizer'} {what}{line}: {first}") from None

    def encode_prompt(self, text: str, chat: bool = True) -> list:
        if chat and self.has_chat_template:
            # the template carries its own special tokens
            return self.encode(self.chat(text), add_special_tokens=False)
        return self.encode(text)


def _render_chat(template: str, messages: list, **special_tokens) -> str:
    """Render a chat template in jinja2's sandbox with transformers' settings and helpers."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)


_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


def _tokenizers_fallback(model_dir: str, config: dict, why: str) -> Tokenizer:
    """tokenizer.json through `tokenizers` (no checkpoint code), keeping the config's chat template."""
    from ..tasks import get_tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {why}, and there is no "
                         "tokenizer.json to read instead")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
               if k in _SPECIAL_TOKENS}
    tok = get_tokenizer(os.path.abspath(path))  # an unreadable tokenizer.json: its one-line error, no warning
    warnings.warn(f"{model_dir}: {why}; loaded tokenizer.json with the `tokenizers` library instead "
                  f"({'with' if template else 'without'} the chat template of tokenizer_config.json)",
                  stacklevel=3)
    return Tokenizer(tok, name=path, chat_template=template, special_tokens=special)


def load_tokenizer(model_dir: Optional[str] = None) -> Tokenizer:
    """The tokenizer of a model folder: transformers (chat template) when tokenizer_config.json
    is there, else tokenizer.json through `tokenizers`, else the testbed tokenizer.

    No code from the folder is ever run: transformers is called with trust_remote_code=False, and
    a folder whose tokenizer_config.json names a custom class (`auto_map`), or that transformers
    cannot load, is read from tokenizer.json with `tokenizers` (chat template kept), with a warning.
    """
    from ..tasks import get_tokenizer

    if model_dir and not os.path.isdir(model_dir):
        from converters.load import resolve_model_path  # a hub id: its cached snapshot folder

        model_dir = resolve_model_path(model_dir, quiet=True)
    if model_dir and os.path.isdir(model_dir):
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {config_path}: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} is not a JSON object")
            if "auto_map" in config:
                return _tokenizers_fallback(model_dir, config, "tokenizer_config.json names a custom "
                                            "tokenizer class (auto_map), whose code is not run")
            try:
                from transformers import AutoTokenizer
                from transformers.utils import logging as hf_logging

                was = hf_logging.get_verbosity()
                hf_logging.set_verbosity_error()  # its notes on the model type are not ours to print
                try:
                    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
                finally:
                    hf_logging.set_verbosity(was)
            except Exception as e:
                first = (str(e).splitlines() or [""])[0]
                return _tokenizers_fallback(model_dir, config,
                                            f"transformers cannot load it ({type(e).__name__}: {first})")
            return Tokenizer(tok, hf=True, name=model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.exists(path):
            return Tokenizer(get_tokenizer(os.path.abspath(path)), name=path)
        warnings.warn(f"{model_dir} holds no tokenizer (tokenizer.json / tokenizer_config.json): "
                      f"using the testbed tokenizer", stacklevel=2)
    return Tokenizer(get_tokenizer(), name="testbed")


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


# ------------------------------------------------------------------------------ LongBench v1
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


def extract_choice(response: str) -> Optional[str]:
    """LongBench v2 pred.py's extract_answer: the letter of "The correct answer is (X)" or
    "... is X" (asterisks removed), else None."""
    response = response.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", response) or \
        re.search(r"The correct answer is ([A-D])", response)
    return m.group(1) if m else None


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


# ------------------------------------------------------------------------------ scoring
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
