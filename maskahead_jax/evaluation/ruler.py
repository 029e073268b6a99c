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
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import string
import uuid
from typing import Callable, Optional, Sequence

# Bumped whenever a prompt would change: it is part of the eval run fingerprint.
GENERATOR_VERSION = 1

# NVIDIA/RULER scripts/data/synthetic/constants.py, verbatim (tokens_to_generate, template,
# answer_prefix of each task family).
TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}

# NVIDIA/RULER scripts/synthetic.yaml: the 13 tasks and their default arguments.
TASKS = {
    "niah_single_1": ("niah", dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=4, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=4, num_needle_q=1)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=4)),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
TASK_NAMES = tuple(TASKS)
ESSAY_TASKS = tuple(t for t, (_, a) in TASKS.items() if a.get("type_haystack") == "essay")
QA_TASKS = {"qa_1": "squad", "qa_2": "hotpotqa"}
OFFLINE_TASKS = tuple(t for t in TASKS if t not in ESSAY_TASKS and t not in QA_TASKS)

# niah.py / variable_tracking.py: the "noise" haystack sentence and the needle sentence.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# qa.py: how each document is shown.
DOCUMENT_PROMPT = "Document {i}:\n{document}"
# niah.py: the 40 insertion depths (percent) of essay haystacks.
DEPTHS = [int(round(100 * i / 39)) for i in range(40)]

WONDERWORDS_MISSING = "RULER's word lists come from the wonderwords package: pip install 'maskahead-jax[ruler]'"


def tokens_to_generate(task: str) -> int:
    """RULER's generation length of a task (its template family's tokens_to_generate)."""
    return TEMPLATES[TASKS[task][0]]["tokens_to_generate"]


# ------------------------------------------------------------------------------ metrics
# RULER's metrics live in maskahead_jax/metrics.py (datasets.score_example uses them without
# importing this generator); re-exported here.
from ..metrics import postprocess_pred, ruler_score, string_match_all, string_match_part  # noqa: E402,F401


# ------------------------------------------------------------------------------ local data
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


# ------------------------------------------------------------------------------ generators
# Each generator takes (rng, size, args, sources) and returns (body, answer_prefix, answers):
# body = the task template filled in, answer_prefix = RULER's prefix filled in.
def _random_value(rng: random.Random, kind: str) -> str:
    """niah.py's needle keys / values: 7-digit numbers, adjective-noun words, or uuid4s."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        adjs, nouns, _ = word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _essay_words(words: list, n: int) -> str:
    """The first n essay words, the text repeated when it is shorter (niah.py)."""
    if n > len(words):
        words = words * (-(-n // len(words)))
    return " ".join(words[:n])


def _sentences(text: str) -> list:
    """Sentence split (a regex stand-in for nltk's sent_tokenize, which RULER uses)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _insert_at_depths(rng: random.Random, sents: list, inserts: list) -> str:
    """Put `inserts` between sentences at depths drawn from DEPTHS (niah.py's essay insertion)."""
    cuts = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(inserts)))
    cuts = [0] + cuts + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


def _niah(rng: random.Random, size: int, a: dict, src: Sources):
    """Needle in a haystack: keys with values hidden in `size` haystack units (noise sentences,
    other needles, or essay words); the question asks the values of num_needle_q keys."""
    n_keys = max(a["num_needle_k"], a["num_needle_q"])
    tv = a["type_needle_v"]
    keys, values, needles = [], [], []
    while len(keys) < n_keys:
        k = _random_value(rng, a["type_needle_k"])
        if k in keys:
            continue
        keys.append(k)
        values.append([_random_value(rng, tv) for _ in range(a["num_needle_v"])])
        needles += [NEEDLE.format(type_needle_v=tv, key=k, value=v) for v in values[-1]]
    rng.shuffle(needles)
    if a["type_haystack"] == "essay":
        context = _insert_at_depths(rng, _sentences(_essay_words(src.essay, size)), needles)
    else:
        if a["type_haystack"] == "noise":
            sents = [NOISE] * size
        else:  # "needle": distractor needles with other keys
            sents = []
            while len(sents) < size:
                k = _random_value(rng, a["type_needle_k"])
                if k not in keys:
                    sents.append(NEEDLE.format(type_needle_v=tv, key=k, value=_random_value(rng, tv)))
        for pos, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            sents.insert(pos, needle)
        context = "\n".join(sents)
    picked = rng.sample(range(n_keys), a["num_needle_q"])
    queries = [keys[i] for i in picked]
    answers = [v for i in picked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, prefix = TEMPLATES["niah"]["template"], TEMPLATES["niah"]["answer_prefix"]
    if a["num_needle_q"] * a["num_needle_v"] == 1:  # niah.py's singular wording
        template, prefix = _singular(template), _singular(prefix)
        tv = tv[:-1]
    fill = dict(type_needle_v=tv, query=query)
    return template.format(context=context, **fill), prefix.format(**fill), answers


def _singular(text: str) -> str:
    """niah.py's rewrite of the template for a single answer."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def _vt_chain(rng: random.Random, n_hops: int, name_len: int, taken: set):
    """One variable chain: VAR A = 12345, VAR B = VAR A, ... with fresh uppercase names."""
    names = []
    while len(names) < n_hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if v not in taken:
            taken.add(v)
            names.append(v)
    value = str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(n_hops)]
    return names, chain, value


def _vt_text(rng: random.Random, size: int, n_chains: int, n_hops: int, name_len: int):
    """variable_tracking.py's noise haystack with the chains' statements inserted in order;
    returns (body, prefix, answer names)."""
    taken: set = set()
    chains = [_vt_chain(rng, n_hops, name_len, taken) for _ in range(n_chains)]
    sents = [NOISE] * size
    for _, chain, _ in chains:
        positions = sorted(rng.sample(range(len(sents)), len(chain)))
        for j, (pos, stmt) in enumerate(zip(positions, chain)):
            sents.insert(pos + j, stmt)
    context = "\n".join(sents).replace(". \n", ".\n")
    names, _, value = chains[0]
    fill = dict(query=value, num_v=n_hops + 1)
    t = TEMPLATES["variable_tracking"]
    return t["template"].format(context=context, **fill), t["answer_prefix"].format(**fill), names


@functools.lru_cache(maxsize=8)
def _vt_icl_size(tokenizer, n_chains: int, n_hops: int) -> int:
    """Noise sentences of the in-context example: as variable_tracking.py, the largest that fits
    500 tokens (template and its answer prefix, no generation room)."""
    hops = min(10, n_hops)

    def n_tokens(size):
        body, prefix, names = _vt_text(random.Random(f"vt-icl/{size}"), size, n_chains, hops, 3)
        return len(tokenizer.encode(body + prefix + " " + " ".join(names) + "\n", add_special_tokens=False))

    least = (hops + 1) * n_chains
    return max(_largest_fitting(n_tokens, 500, start=5, least=least), least)


def _vt(rng: random.Random, size: int, a: dict, src: Sources, tokenizer=None):
    """Variable tracking: chains of `VAR X = VAR Y` hidden in noise; answer all names of the
    first chain. Preceded by one solved example (3-letter names, as RULER's ICL example)."""
    icl_size = _vt_icl_size(tokenizer, a["num_chains"], a["num_hops"])
    body, prefix, names = _vt_text(rng, icl_size, a["num_chains"], min(10, a["num_hops"]), 3)
    icl = body + prefix + " " + " ".join(names) + "\n"
    body, prefix, names = _vt_text(rng, size, a["num_chains"], a["num_hops"], 5)
    return icl + "\n" + body, prefix, names


def _cwe_vocab() -> list:
    """common_words_extraction.py's vocabulary: wonderwords' nouns, adjectives and verbs."""
    adjs, nouns, verbs = word_lists()
    return sorted(set(nouns + adjs + verbs))


def _cwe_list(rng: random.Random, n_words: int, common_reps: int, uncommon_reps: int, n_common: int):
    """A numbered, shuffled word list: n_common words x common_reps, the rest x uncommon_reps."""
    vocab = _cwe_vocab()
    if n_words <= len(vocab):
        words = rng.sample(vocab, n_words)
    else:  # RULER switches to a bigger English list here; we draw adjective-noun compounds
        adjs, nouns, _ = word_lists()
        seen, words = set(), []
        while len(words) < n_words:
            w = f"{rng.choice(adjs)}-{rng.choice(nouns)}"
            if w not in seen:
                seen.add(w)
                words.append(w)
    common, uncommon = words[:n_common], words[n_common:]
    items = common * common_reps + uncommon * uncommon_reps
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def _cwe(rng: random.Random, size: int, a: dict, src: Sources, length: int = 0):
    """Common words extraction: which num_cw words repeat most in a numbered list of `size`
    distinct words; one solved example first. Below 4096 tokens RULER uses fewer repeats."""
    t = TEMPLATES["common_words_extraction"]
    if length < 4096:
        shot_cfg, reps = (20, 3, 1), (6, 1)
    else:
        shot_cfg, reps = (40, 10, 3), (a["freq_cw"], a["freq_ucw"])
    shot_ctx, shot_ans = _cwe_list(rng, shot_cfg[0], shot_cfg[1], shot_cfg[2], a["num_cw"])
    shot = (t["template"].format(context=shot_ctx) + t["answer_prefix"] + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans)))
    ctx, answers = _cwe_list(rng, size, reps[0], reps[1], a["num_cw"])
    return shot + "\n" + t["template"].format(context=ctx), t["answer_prefix"], answers


def _zeta(s: float) -> float:
    """Riemann zeta(s), s > 1: the partial sum plus its Euler-Maclaurin tail."""
    n = 1000
    return sum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + 0.5 * n ** -s + s * n ** (-s - 1) / 12


def _fwe(rng: random.Random, size: int, a: dict, src: Sources, length: int = 0):
    """Frequent words extraction: `size` coded 6-letter words drawn by a Zipf(alpha) law over a
    vocabulary of (length - tokens_to_generate) // 50; the top rank is '...' (noise), the answer
    the next three."""
    vocab_size = max(5, (length - tokens_to_generate("fwe")) // 50)
    vocab: set = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    z = _zeta(a["alpha"])
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -a["alpha"] / z))]
    rng.shuffle(words)
    t = TEMPLATES["freq_words_extraction"]
    return t["template"].format(context=" ".join(words)), t["answer_prefix"], vocab[1:4]


def _qa(rng: random.Random, size: int, a: dict, src: Sources, index: int = 0):
    """QA: question `index` of the set with its gold documents among `size` documents (its
    article's other paragraphs first, then random ones), shuffled (qa.py)."""
    qa = src.qa[a["dataset"]]
    q = qa.qas[index % len(qa.qas)]
    gold, more = q["context"], q["more"]
    if size < len(qa.docs):
        if size - len(gold) > len(more):
            used = set(gold) | set(more)
            others = [i for i in range(len(qa.docs)) if i not in used]
            picked = gold + more + rng.sample(others, max(0, size - len(gold) - len(more)))
        else:
            picked = gold + rng.sample(more, max(0, size - len(gold)))
        docs = [qa.docs[i] for i in picked]
    else:
        docs = (qa.docs * (-(-size // len(qa.docs))))[:size]
    rng.shuffle(docs)
    context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(docs))
    t = TEMPLATES["qa"]
    return t["template"].format(context=context, query=q["query"]), t["answer_prefix"], list(q["outputs"])


# ------------------------------------------------------------------------------ sizing
def _largest_fitting(n_tokens: Callable[[int], int], budget: int, start: int, least: int = 1) -> int:
    """The largest haystack size >= least whose prompt takes <= budget tokens (a binary search up
    to three times the size a small sample's tokens-per-unit suggests, as RULER's scripts); 0 if
    none fits."""
    per_unit = max(n_tokens(start) / start, 1e-3)
    lo, hi, best = least, max(2 * start, int(budget / per_unit * 3)), 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if n_tokens(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


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


def load_sources(haystack: Optional[str] = None, qa: Sequence[str] = ()) -> Sources:
    """Read the essay haystack and QA files; two files of the same QA set are refused."""
    src = Sources(essay=read_haystack(haystack) if haystack else None)
    for path in qa:
        q = read_qa(path)
        if q.name in src.qa:
            raise ValueError(f"--ruler-qa: two {q.name} files given; pass one SQuAD and/or one HotpotQA file")
        src.qa[q.name] = q
    return src


def ruler_examples(tasks: Sequence[str], lengths: Sequence[int], tokenizer, n: int, sources: Sources,
                   seed: int = 0, chat: bool = True) -> list:
    """EvalExamples of every (task, length): n each, id ruler/<task>/<length>/<i>, dataset = the
    task, meta length = the length (max_seq_length), max_new_tokens = RULER's tokens_to_generate."""
    from .datasets import EvalExample

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
