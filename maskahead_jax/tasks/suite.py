"""Seeded, deterministic long-context retrieval tasks in the RULER / needle style.

Every generator is `make_<task>(n_tokens, depth, seed, tokenizer=None) -> Example`:
`n_tokens` is the prompt length in tokens of the testbed tokenizer (without [BOS]), `depth`
in [0, 1] places the needle (0 = start of the context, 1 = just before the question). The
prompt is the context followed by the question; its last words start the answer sentence
(e.g. "... the pass key is"), so the answer is a plain continuation. `score(example, prediction)`
returns a float in [0, 1].

Tasks: passkey, multikey, twohop (niah_hard: case -> unit -> code at mirrored depths, 8 decoy
pairs), docqa (entity documents, QA F1), longanswer (>= 128 answer tokens: many facts from across
the context in the order asked; score = fraction of facts right).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Callable, Optional

from .. import metrics
from . import lexicon as L
from .tokenizer import count_tokens, get_tokenizer

TASKS = ("passkey", "multikey", "twohop", "docqa", "longanswer")


@dataclasses.dataclass
class Example:
    task: str
    prompt: str
    answer: str
    context_length: int  # requested prompt length in tokens
    depth: float  # requested needle depth in [0, 1]
    seed: int
    n_tokens: int = 0  # actual prompt tokens (without [BOS])
    needle_token_pos: int = -1  # token offset of the (first) needle in the prompt
    meta: dict = dataclasses.field(default_factory=dict)
    # what a model should write after the prompt, when it is more than the scored reference
    # (two-hop spells the unit out before the code); empty means `answer` itself
    completion: str = ""

    @property
    def target(self) -> str:
        """The text a model is trained to write after the prompt."""
        return self.completion or self.answer

    def score(self, prediction: str) -> float:
        return score(self, prediction)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ filler grammar
def _np(r: random.Random) -> str:
    k = r.random()
    if k < 0.4:
        return f"the {r.choice(L.ADJS)} {r.choice(L.NOUNS)}"
    if k < 0.6:
        return f"a {r.choice(L.NOUNS)}"
    if k < 0.8:
        return f"{r.choice(L.FIRST)} {r.choice(L.LAST)}"
    return f"the {r.choice(L.NOUNS)} of the {r.choice(L.NOUNS)}"


_PREPS = ["in", "near", "under", "over", "after", "before", "with", "from", "into", "about"]


def filler_sentence(r: random.Random) -> str:
    k = r.randrange(9)
    if k == 0:
        s = f"{_np(r)} {r.choice(L.VERBS)} {_np(r)} {r.choice(_PREPS)} the {r.choice(L.NOUNS)}"
    elif k == 1:
        s = f"{_np(r)} {r.choice(L.VERBS_PRES)} {r.choice(L.ADVS)}"
    elif k == 2:
        s = f"in the {r.choice(L.ADJS)} {r.choice(L.NOUNS)} , {_np(r)} {r.choice(L.VERBS)} {_np(r)}"
    elif k == 3:
        s = f"{_np(r)} was {r.choice(L.ADJS)} and {r.choice(L.ADJS)}"
    elif k == 4:
        s = (f"when {_np(r)} {r.choice(L.VERBS)} the {r.choice(L.NOUNS)} , "
             f"{_np(r)} {r.choice(L.VERBS_PRES)} {r.choice(L.ADVS)}")
    elif k == 5:
        s = f"there was {r.choice(['a', 'one', 'no'])} {r.choice(L.COLORS)} {r.choice(L.ANIMALS)} {r.choice(_PREPS)} the {r.choice(L.NOUNS)}"
    elif k == 6:
        s = f"{_np(r)} {r.choice(L.ADVS)} {r.choice(L.VERBS)} {_np(r)} and {r.choice(L.VERBS)} {_np(r)}"
    elif k == 7:
        s = f"every {r.choice(L.NOUNS)} {r.choice(L.VERBS_PRES)} {r.choice(_PREPS)} the {r.choice(L.ADJS)} {r.choice(L.NOUNS)}"
    else:
        s = f"{r.choice(L.FIRST)} said that the {r.choice(L.NOUNS)} was {r.choice(L.ADJS)}"
    return s + r.choice([" .", " .", " .", " !", " ;"])


def _filler(r: random.Random, n: int, tok) -> list[tuple[str, int]]:
    """Sentences (text, tokens) totalling about n tokens (never above n)."""
    out, tot = [], 0
    while True:
        s = filler_sentence(r)
        c = count_tokens(s, tok)
        if tot + c > n:
            break
        out.append((s, c))
        tot += c
    return out


def _assemble(r: random.Random, n_ctx: int, needles: list[tuple[float, str]], tok) -> tuple[str, list[int]]:
    """Filler of n_ctx tokens in total with each needle inserted at its depth (sentence boundary).

    Returns the context text and the token offset of each needle (in the order given)."""
    counts = [count_tokens(t, tok) for _, t in needles]
    sents = _filler(r, max(0, n_ctx - sum(counts)), tok)
    fill_tot = sum(c for _, c in sents)
    # insertion index for each needle: the sentence boundary closest to depth * filler tokens
    bounds = [0]
    for _, c in sents:
        bounds.append(bounds[-1] + c)
    order = sorted(range(len(needles)), key=lambda i: (needles[i][0], i))
    ins: dict[int, list[int]] = {}
    for i in order:
        target = needles[i][0] * fill_tot
        j = min(range(len(bounds)), key=lambda b: abs(bounds[b] - target))
        ins.setdefault(j, []).append(i)
    pieces, offs, pos = [], [0] * len(needles), 0
    for j in range(len(sents) + 1):
        for i in ins.get(j, []):
            offs[i] = pos
            pieces.append(needles[i][1])
            pos += counts[i]
        if j < len(sents):
            pieces.append(sents[j][0])
            pos += sents[j][1]
    return " ".join(pieces), offs


def _digits(r: random.Random, n: int) -> str:
    return str(r.randrange(1, 10)) + "".join(str(r.randrange(10)) for _ in range(n - 1))


def _finish(task, r, n_tokens, depth, seed, tok, needles, question, answer, meta, needle_idx=0,
            completion=""):
    q_tok = count_tokens(question, tok)
    ctx, offs = _assemble(r, n_tokens - q_tok, needles, tok)
    prompt = ctx + " " + question
    return Example(task=task, prompt=prompt, answer=answer, context_length=n_tokens, depth=depth,
                   seed=seed, n_tokens=count_tokens(prompt, tok),
                   needle_token_pos=offs[needle_idx] if offs else -1, meta=meta, completion=completion)


# ------------------------------------------------------------------------------ tasks
def make_passkey(n_tokens: int, depth: float, seed: int, tokenizer=None, n_digits: int = 3) -> Example:
    tok = tokenizer or get_tokenizer()
    r = random.Random(f"passkey:{seed}:{n_tokens}:{depth}")
    key = _digits(r, n_digits)
    needle = f"the pass key is {key} . remember it . {key} is the pass key ."
    question = "what is the pass key ? the pass key is"
    return _finish("passkey", r, n_tokens, depth, seed, tok, [(depth, needle)], question, key,
                   {"queries": [(question, key)]})


def _keyname(r):
    return f"{r.choice(L.ADJS)} {r.choice(L.NOUNS)}"


def _distinct(r, fn, k):
    out = []
    while len(out) < k:
        x = fn(r)
        if x not in out:
            out.append(x)
    return out


MULTIKEY_PHRASE = "the special magic number for"  # what every multi-key fact says before its key


def multikey_keys(r: random.Random, n: int) -> list[str]:
    """n distinct two-word keys ("adjective noun"), as the multi-key task draws them."""
    return _distinct(r, _keyname, n)


def multikey_fact(key: str, value: str) -> str:
    return f"{MULTIKEY_PHRASE} {key} is {value} ."


def multikey_question(key: str) -> str:
    """The question about `key`; its answer (the value) follows it."""
    return f"what is {MULTIKEY_PHRASE} {key} ? {MULTIKEY_PHRASE} {key} is"


def share_a_word(r: random.Random, key: str, taken: list[str]) -> str:
    """A key that shares one word (adjective or noun, at random) with `key` and is not in `taken`."""
    adj, noun = key.split()
    while True:
        other = f"{adj} {r.choice(L.NOUNS)}" if r.random() < 0.5 else f"{r.choice(L.ADJS)} {noun}"
        if other not in taken:
            return other


def make_multikey(n_tokens: int, depth: float, seed: int, tokenizer=None, n_keys: int = 0,
                  n_sharing: int = 0) -> Example:
    """Many "the special magic number for K is V ." facts; the question asks for the first key.
    `n_sharing` distractor keys share one word with the asked key (hard negatives: a model that
    matches one word of the key copies their values); 0, the evaluation's setting, leaves the
    keys as drawn, independent of each other."""
    tok = tokenizer or get_tokenizer()
    r = random.Random(f"multikey:{seed}:{n_tokens}:{depth}")
    n_keys = n_keys or max(4, min(64, n_tokens // 64))
    keys = multikey_keys(r, n_keys)
    for j in range(1, min(n_sharing + 1, n_keys)):  # (no draw at 0: the suite's examples stay)
        keys[j] = share_a_word(r, keys[0], keys[:j] + keys[j + 1:])
    vals = [_digits(r, 3) for _ in keys]
    needles = [(depth, multikey_fact(keys[0], vals[0]))]
    for k, v in zip(keys[1:], vals[1:]):
        needles.append((r.random(), multikey_fact(k, v)))
    question = multikey_question(keys[0])
    qa = [(multikey_question(k), v) for k, v in zip(keys, vals)]
    return _finish("multikey", r, n_tokens, depth, seed, tok, needles, question, vals[0],
                   {"key": keys[0], "n_keys": n_keys, "queries": qa})


def twohop_question(case: str) -> str:
    """The two-hop question about `case`; its last words start the first hop's answer."""
    return f"which code belongs to case {case} ? case {case} is assigned to unit"


def twohop_completion(unit: str, code: str) -> str:
    """The worked answer: the unit (hop 1), then the unit's code (hop 2), which is scored."""
    return f"{unit} . unit {unit} holds code {code}"


def make_twohop(n_tokens: int, depth: float, seed: int, tokenizer=None, n_decoys: int = 8) -> Example:
    """niah_hard: "case C is assigned to unit U" and "unit U holds code K" at mirrored depths.

    The answer is written as a chain (`twohop_completion`): the unit first, then its code, so
    each hop is one lookup and the second reads the first from the answer itself (the way a
    block-diffusion model resolves it across denoising steps). The score is exact match of the
    code, the first number of the prediction (units are words)."""
    tok = tokenizer or get_tokenizer()
    r = random.Random(f"twohop:{seed}:{n_tokens}:{depth}")
    cases = _distinct(r, lambda r: f"{r.choice(L.FIRST)} {r.choice(L.LAST)}", n_decoys + 1)
    units = _distinct(r, lambda r: f"{r.choice(L.COLORS)} {r.choice(L.ANIMALS)}", n_decoys + 1)
    codes = [_digits(r, 3) for _ in cases]
    needles = [(depth, f"case {cases[0]} is assigned to unit {units[0]} ."),
               (1.0 - depth, f"unit {units[0]} holds code {codes[0]} .")]
    for c, u, k in zip(cases[1:], units[1:], codes[1:]):
        needles.append((r.random(), f"case {c} is assigned to unit {u} ."))
        needles.append((r.random(), f"unit {u} holds code {k} ."))
    question = twohop_question(cases[0])
    qa = [(twohop_question(c), twohop_completion(u, k)) for c, u, k in zip(cases, units, codes)]
    return _finish("twohop", r, n_tokens, depth, seed, tok, needles, question, codes[0],
                   {"case": cases[0], "unit": units[0], "queries": qa},
                   completion=twohop_completion(units[0], codes[0]))


def first_sentence(prediction: str) -> str:
    """What a prediction answers with: its text up to the first "." (document QA's answer and
    two-hop's unit never hold one; a model that goes on to ask itself the next question is not
    scored on it)."""
    return prediction.split(".")[0]


def twohop_first_hop(ex: Example, prediction: str) -> bool:
    """Did the chain name the asked case's unit (its first hop)? A diagnostic beside the score."""
    return first_sentence(prediction).split() == ex.meta["unit"].split()


_ATTRS = {
    "located": ("where is {e} located ? {e} is located in the", lambda r: f"{r.choice(L.PLACES)} {r.choice(L.NOUNS)} district"),
    "founder": ("who founded {e} ? {e} was founded by", lambda r: f"{r.choice(L.FIRST)} {r.choice(L.LAST)}"),
    "material": ("what is {e} made of ? {e} is made of", lambda r: f"{r.choice(L.COLORS)} {r.choice(L.MATERIALS)}"),
    "motto": ("what is the motto of {e} ? the motto of {e} is", lambda r: f"{r.choice(L.ADVS)} {r.choice(L.VERBS)} the {r.choice(L.ADJS)} {r.choice(L.NOUNS)}"),
}


def make_docqa(n_tokens: int, depth: float, seed: int, tokenizer=None, n_docs: int = 0) -> Example:
    tok = tokenizer or get_tokenizer()
    r = random.Random(f"docqa:{seed}:{n_tokens}:{depth}")
    n_docs = n_docs or max(3, min(24, n_tokens // 160))
    ents = _distinct(r, lambda r: f"the {r.choice(L.ADJS)} {r.choice(['hall', 'tower', 'library', 'market', 'school', 'bridge', 'castle', 'harbor'])}", n_docs)
    docs = []
    for i, e in enumerate(ents):
        a = {k: g(r) for k, (_, g) in _ATTRS.items()}
        docs.append(a)
    needles = []
    for i, (e, a) in enumerate(zip(ents, docs)):
        text = (f"document : {e} is located in the {a['located']} . {e} was founded by {a['founder']} . "
                f"{e} is made of {a['material']} . the motto of {e} is {a['motto']} .")
        needles.append((depth if i == 0 else r.random(), text))
    attr = r.choice(sorted(_ATTRS))
    question = "answer the question from the documents . " + _ATTRS[attr][0].format(e=ents[0])
    qa = [(_ATTRS[a][0].format(e=e), d[a]) for e, d in zip(ents, docs) for a in sorted(_ATTRS)]
    return _finish("docqa", r, n_tokens, depth, seed, tok, needles, question, docs[0][attr],
                   {"entity": ents[0], "attribute": attr, "queries": qa})


def docqa_first_word(ex: Example, prediction: str) -> bool:
    """Is the answer's first word right (LongBench normalization)? A diagnostic beside the F1,
    which splits "found the fact, lost its later words" (the lexicon's words recur across the
    documents and the filler, so after the first word the continuation is ambiguous) from
    "found the wrong fact or none"."""
    pred = metrics.normalize_answer(first_sentence(prediction)).split()
    ref = metrics.normalize_answer(ex.answer).split()
    return bool(pred) and pred[0] == ref[0]


def make_longanswer(n_tokens: int, depth: float, seed: int, tokenizer=None, n_facts: int = 44) -> Example:
    """n_facts station codes spread over the context; the answer lists `name code ;` for every
    station in the order the question names them (>= 128 answer tokens with the default 44 facts).
    `depth` places the first fact; the others are spread uniformly over the context."""
    tok = tokenizer or get_tokenizer()
    r = random.Random(f"longanswer:{seed}:{n_tokens}:{depth}")
    names = _distinct(r, lambda r: r.choice(L.FIRST + L.LAST + L.ANIMALS), n_facts)
    codes = [_digits(r, 3) for _ in names]
    needles = [(depth if i == 0 else (i + r.random()) / n_facts, f"station {n} has code {c} .")
               for i, (n, c) in enumerate(zip(names, codes))]
    ask = r.sample(range(n_facts), n_facts)
    question = ("list the code of every station in this order : " + " , ".join(names[i] for i in ask)
                + " . answer :")
    answer = " ".join(f"{names[i]} {codes[i]} ;" for i in ask)
    return _finish("longanswer", r, n_tokens, depth, seed, tok, needles, question, answer,
                   {"facts": [[names[i], codes[i]] for i in ask]})


GENERATORS: dict[str, Callable[..., Example]] = {
    "passkey": make_passkey, "multikey": make_multikey, "twohop": make_twohop,
    "docqa": make_docqa, "longanswer": make_longanswer,
}


def generate(task: str, n_tokens: int, depth: float, seed: int, tokenizer=None, **kw) -> Example:
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    return GENERATORS[task](n_tokens, depth, seed, tokenizer, **kw)


def make_suite(tasks=TASKS, lengths=(512, 1024, 2048, 4096), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
               n_per_cell: int = 10, seed: int = 0, tokenizer=None):
    """Yield examples for every (task, length, depth) cell; seeds seed .. seed + n_per_cell - 1."""
    for t in tasks:
        for n in lengths:
            for d in depths:
                for s in range(seed, seed + n_per_cell):
                    yield generate(t, n, d, s, tokenizer)


# ------------------------------------------------------------------------------ scoring
def first_number(pred: str) -> Optional[str]:
    """The first run of digits in a prediction (None if it has none): what exact match compares."""
    m = re.search(r"\d+", pred)
    return m.group(0) if m else None


def score(ex: Example, prediction: str) -> float:
    if ex.task in ("passkey", "multikey", "twohop"):
        return float(first_number(prediction) == ex.answer)
    if ex.task == "docqa":
        # The answer completes a sentence and never holds a ".": the first sentence is the answer
        # (a model that goes on to ask itself the next question is not penalized for it, as
        # LongBench keeps only the first line of predictions for its few-shot datasets).
        return metrics.qa_f1_score(first_sentence(prediction), ex.answer)
    if ex.task == "longanswer":
        return longanswer_score(prediction, ex.meta["facts"])
    raise ValueError(f"unknown task {ex.task!r}")


def longanswer_score(prediction: str, facts) -> float:
    """Fraction of facts (name, code) whose i-th `;`-separated item of the prediction is right."""
    items = [it.split() for it in prediction.split(";")]
    ok = 0
    for i, (name, code) in enumerate(facts):
        if i < len(items) and items[i][:2] == [name, code]:
            ok += 1
    return ok / len(facts)
