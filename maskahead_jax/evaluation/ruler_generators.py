"""RULER's task generators, one per family (niah, variable tracking, common / frequent words
extraction, QA), each following its NVIDIA/RULER script: (rng, haystack size, task arguments,
sources) -> (prompt body, answer prefix, answers). Also the haystack-size search they and the
sizing in ruler.py share (`_largest_fitting`)."""
from __future__ import annotations

import functools
import random
import re
import string
import uuid
from typing import Callable

from .ruler_sources import Sources, word_lists
from .ruler_tasks import DEPTHS, DOCUMENT_PROMPT, NEEDLE, NOISE, TEMPLATES, tokens_to_generate


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


# ------------------------------------------------------------------------------ sizing search
# (vt's in-context example here, every task's haystack in ruler.haystack_size)
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
