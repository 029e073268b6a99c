"""Training data of the testbed, generated on the fly (never stored): the task suite's formats with
MQAR-style extra questions, fact-packed contexts, one-token-key associative recall and induction
sequences; the two-copy noise (`make_batch`); the data flags' parsing.

Batch contents depend only on (seed, step, B, L, dense) and the data flags, so a resumed run, a
prefetching worker (`prefetch.py`) and an inline build all draw the very same batch.
"""
from __future__ import annotations

import random

import numpy as np

from maskahead_jax import tasks as T

BLOCK = 32  # the testbed's block size: noise is drawn per 32-token block
MQAR_TEMPLATES = ("list", "sentence", "question")  # mqar_sequence's recall templates


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def copy_sequence(r: random.Random, L: int, tok, answer_weight: float):
    """Induction data: a random segment (numbers and words, 6-24 tokens) stated once, then repeated
    after short filler ("again : <segment> ."), until L tokens. Every repeat is predictable only by
    copying the earlier occurrence in order: the copy circuit that multi-digit answers need."""
    from maskahead_jax.tasks import lexicon as LX
    from maskahead_jax.tasks.suite import filler_sentence

    parts = []
    for _ in range(r.randint(2, 6)):
        parts.append(T.suite._digits(r, r.randint(2, 8)) if r.random() < 0.6 else r.choice(LX.ALL_WORDS))
    seg = _ids(tok, " ".join(parts))
    ids = [T.BOS_ID] + seg + _ids(tok, ".")
    w = [1.0] * len(ids)
    while len(ids) < L:
        fill = _ids(tok, " ".join(filler_sentence(r) for _ in range(r.randint(0, 2))))
        pre = fill + _ids(tok, "again :")
        ids += pre + seg + _ids(tok, ".")
        w += [1.0] * len(pre) + [answer_weight] * len(seg) + [1.0]
    return np.asarray(ids[:L], np.int32), np.asarray(w[:L], np.float32)


def mqar_sequence(r: random.Random, L: int, tok, answer_weight: float, pairs=None, key_words: int = 1,
                  link: str = "", template: str = "list"):
    """Associative recall with one-token keys (MQAR, Arora et al. 2023): "recall : k1 v1 , k2 v2 ,
    ... . answer : k3 v3 ; k1 v1 ; ..." with word keys and 3-digit values. A value in the query
    part is predictable only by finding its key earlier: the key -> value lookup that multi-key
    and two-hop need, without their two-word keys and sentence template.

    `pairs` (lo, hi) draws the number of key-value pairs from [lo, hi] (default L/12 .. L/5).
    Few pairs (2-4) is what lets the lookup form: copying any earlier value is then already
    right a third of the time, and matching the key is a large, frequent gain.
    `key_words` 2 makes each key "adjective noun" (as multi-key's keys are); `link` puts a word
    between key and value (multi-key's "... is VALUE"), so the value no longer follows its key.

    `template` moves the recall list towards the multi-key task's sentences:
    "list" (above); "sentence": every fact and query is "[P] KEY is VALUE ." where P is the last
    0-5 words of the task's "the special magic number for" (one draw per sequence; a causal
    model trained on the list recall passes 0.5 after ~250 steps on it and 0.97 by 600, while on
    the full phrase alone it stays at chance for 500, and then handles the full phrase at once); "question": facts are the
    task's sentences, queries its question and answer, "what is the special magic number for KEY
    ? the special magic number for KEY is VALUE ." (the key also occurs just before its answer,
    followed by "?"). `pairs` defaults to L/12 .. L/5 for the list, L/48 .. L/24 for sentences."""
    from maskahead_jax.tasks import lexicon as LX

    if template not in MQAR_TEMPLATES:
        raise ValueError(f"unknown recall template {template!r}; expected one of {MQAR_TEMPLATES}")
    lo, hi = pairs or ((L // 12, L // 5) if template == "list" else (L // 48, L // 24))
    n = max(2, min(len(LX.NOUNS), r.randint(lo, max(lo, hi))))
    keys = r.sample(LX.NOUNS, n) if key_words == 1 else T.multikey_keys(r, n)
    vals = [str(r.randrange(100, 1000)) for _ in keys]
    if template == "list":
        sep_link = f" {link}" if link else ""
        fact = lambda k, v: f"{k}{sep_link} {v} ,"  # noqa: E731
        query = lambda k: (k + sep_link, ";")  # noqa: E731
        head, middle = "recall :", ". answer :"
    elif template == "sentence":
        phrase = T.MULTIKEY_PHRASE.split()
        lead = " ".join(phrase[r.randint(0, len(phrase)):])
        lead = lead + " " if lead else ""
        fact = lambda k, v: f"{lead}{k} is {v} ."  # noqa: E731
        query = lambda k: (f"{lead}{k} is", ".")  # noqa: E731
        head, middle = "", ""
    else:  # the task's own fact sentences and questions
        fact, query = T.multikey_fact, lambda k: (T.multikey_question(k), ".")  # noqa: E731
        head, middle = "", ""
    ids = [T.BOS_ID] + (_ids(tok, head) if head else [])
    for k, v in zip(keys, vals):
        ids += _ids(tok, fact(k, v))
    ids += _ids(tok, middle) if middle else []
    w = [1.0] * len(ids)
    while len(ids) < L:
        i = r.randrange(n)
        before, after = query(keys[i])
        ki, vi, sep = _ids(tok, before), _ids(tok, vals[i]), _ids(tok, after)
        ids += ki + vi + sep
        w += [1.0] * len(ki) + [answer_weight] * len(vi) + [1.0] * len(sep)
    return np.asarray(ids[:L], np.int32), np.asarray(w[:L], np.float32)



TASK_WEIGHTS = (0.22, 0.3, 0.18, 0.15, 0.15)  # passkey, multikey, twohop, docqa, longanswer
PROMPT_FRAC = (0.45, 0.85)  # an unpacked context's share of the sequence (--prompt-frac)
PACKED_TASKS = ("multikey", "twohop", "longanswer", "docqa")  # the tasks a packed context can hold
PACKED_WEIGHTS = (0.45, 0.2, 0.2, 0.15)  # their weights, in PACKED_TASKS' order


def train_sequence(r: random.Random, L: int, tok, answer_weight: float, dense: float = 0.0,
                   copy: float = 0.0, task_weights=TASK_WEIGHTS, packed_weights=PACKED_WEIGHTS,
                   mqar: float = 0.0, mqar_pairs=None, mqar_templates=("list",),
                   prompt_frac=PROMPT_FRAC, edge_depths: float = 0.0, hard_keys: float = 0.0,
                   most_distractors: float = 0.0):
    """One clean training sequence of exactly L tokens and its per-token loss weights.

    An unpacked needle context takes a fraction U(prompt_frac) of L (the rest: extra questions);
    an evaluation at length n reads an n-token prompt, so a stage of length L trains prompts
    up to prompt_frac[1] * L only. The needle's depth is U(0, 1), or with probability
    `edge_depths` one of the two ends (0: right after [BOS]; 1: right before the question).
    With probability `hard_keys` a multi-key context holds 1-4 distractor keys that share one
    word with the asked key (make_multikey's n_sharing). With probability `most_distractors` a
    multi-key / two-hop / document-QA context holds the most distractors its length allows (the
    top of the uniform range: at 8192, the 64 keys and 24 documents the evaluation holds) instead
    of a uniform count.

    With probability `dense` the context is packed with facts (many keys, little filler) and
    followed by many questions: MQAR-style data where recall is the main source of
    predictability (the early curriculum; retrieval then carries over to sparse needles)."""
    if r.random() < copy:
        return copy_sequence(r, L, tok, answer_weight)
    if mqar and r.random() < mqar:
        template = r.choice(mqar_templates)  # the list keeps one-word keys; sentences use the task's two
        return mqar_sequence(r, L, tok, answer_weight, mqar_pairs, 1 if template == "list" else 2,
                             "", template)
    task = r.choices(T.TASKS, weights=task_weights)[0]
    packed = r.random() < dense
    if packed:
        task = r.choices(PACKED_TASKS, weights=packed_weights)[0]
    frac = r.uniform(0.3, 0.5) if packed else r.uniform(*prompt_frac)
    depth = r.random()
    if edge_depths and r.random() < edge_depths:  # (no extra draw at 0: old recipes reproduce)
        depth = float(depth < 0.5)
    most = bool(most_distractors) and not packed and r.random() < most_distractors  # (no draw at 0)
    seed = r.randrange(10 ** 7, 2 ** 31)
    if task == "longanswer":
        nf = max(3, min(44, int(L * (0.35 if packed else 0.5)) // 6))
        ctx = max(16, 10 * nf if packed else L - 8 * nf - 18)
        ex = T.make_longanswer(ctx, depth, seed, tok, n_facts=nf)
        queries = []
    else:
        kw = {}
        n = max(24, int(L * frac))
        if task == "passkey":
            kw["n_digits"] = 3
        elif task == "multikey":
            top = max(2, min(64, n // 24))
            kw["n_keys"] = max(2, n // 15) if packed else top if most else r.randint(2, top)
            if hard_keys and r.random() < hard_keys:  # (no extra draw at 0: old recipes reproduce)
                kw["n_sharing"] = r.randint(1, min(4, kw["n_keys"] - 1))
        elif task == "twohop":
            top = max(0, min(8, n // 40 - 1))
            kw["n_decoys"] = max(1, n // 22 - 1) if packed else top if most else r.randint(0, top)
        elif task == "docqa":
            top = max(1, min(24, n // 60))
            kw["n_docs"] = max(1, n // 45) if packed else top if most else r.randint(1, top)
        ex = T.generate(task, n, depth, seed, tok, **kw)
        queries = list(ex.meta.get("queries", []))
    ids = [T.BOS_ID] + _ids(tok, ex.prompt)
    w = [1.0] * len(ids)
    a = _ids(tok, ex.target)
    ids += a
    w += [answer_weight] * len(a)
    # extra questions (MQAR-style): recall other facts of the same context
    while queries and len(ids) < L:
        q, ans = r.choice(queries)
        qi, ai = _ids(tok, ". " + q), _ids(tok, ans)
        if len(ids) + len(qi) + len(ai) >= L and r.random() < 0.7:
            break  # end on a complete answer followed by [EOS]
        ids += qi + ai
        w += [1.0] * len(qi) + [answer_weight] * len(ai)
    ids = ids[:L]
    w = w[:L]
    # EOS after the last complete item, then EOS padding (weight 0.2: cheap to learn)
    if len(ids) < L:
        n = L - len(ids)
        ids += [T.EOS_ID] * n
        w += [1.0] + [0.2] * (n - 1)
    return np.asarray(ids, np.int32), np.asarray(w, np.float32)


def _weights(text, default, flag: str = "--task-weights"):
    """"w1,w2,..." -> a tuple as long as `default`, exiting with a message that names `flag`."""
    if not text:
        return default
    try:
        w = tuple(float(x) for x in text.split(","))
    except ValueError:
        w = ()
    if len(w) != len(default) or min(w) < 0 or sum(w) <= 0:
        raise SystemExit(f"bad {flag} {text!r}: need {len(default)} non-negative numbers, not all 0")
    return w


def _parse_range(text, flag: str, cast, valid, need: str, example: str):
    """"LO:HI" -> (cast(LO), cast(HI)), exiting with a message that names `flag` when malformed
    or when `valid(lo, hi)` fails."""
    try:
        lo, hi = (cast(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"bad {flag} {text!r}: expected LO:HI, e.g. {example}") from None
    if not valid(lo, hi):
        raise SystemExit(f"bad {flag} {text!r}: need {need}")
    return lo, hi


def parse_prompt_frac(text):
    """"LO:HI" (0 < LO <= HI < 1) -> (LO, HI); None -> PROMPT_FRAC."""
    if not text:
        return PROMPT_FRAC
    return _parse_range(text, "--prompt-frac", float, lambda lo, hi: 0 < lo <= hi < 1,
                        "0 < LO <= HI < 1", "0.5:0.92")


def parse_probability(value, flag: str) -> float:
    """A probability flag's value (0 <= P <= 1); None -> 0; anything else exits naming `flag`."""
    try:
        p = float(value or 0.0)
    except (TypeError, ValueError):
        p = -1.0
    if not 0.0 <= p <= 1.0:
        raise SystemExit(f"bad {flag} {value!r}: need a probability in [0, 1]")
    return p


def parse_pairs(text):
    """"LO:HI" -> (LO, HI), or None for the length-dependent default."""
    if not text:
        return None
    return _parse_range(text, "--mqar-pairs", int, lambda lo, hi: 2 <= lo <= hi, "2 <= LO <= HI", "2:4")


def parse_templates(text):
    """"list,sentence" -> ("list", "sentence"): the recall templates a sequence draws from."""
    if not text:
        return ("list",)
    out = tuple(t.strip() for t in text.split(","))
    bad = [t for t in out if t not in MQAR_TEMPLATES]
    if bad:
        raise SystemExit(f"bad --mqar-templates {text!r}: unknown {bad}; choose from {MQAR_TEMPLATES}")
    return out


def data_options(args) -> dict:
    """The parsed data flags train_sequence takes (absent ones at their defaults); a malformed
    value exits with a message naming its flag."""
    g = lambda name: getattr(args, name, None)  # noqa: E731
    return dict(task_weights=_weights(g("task_weights"), TASK_WEIGHTS),
                packed_weights=_weights(g("packed_weights"), PACKED_WEIGHTS, "--packed-weights"),
                mqar=g("mqar_prob") or 0.0, mqar_pairs=parse_pairs(g("mqar_pairs")),
                mqar_templates=parse_templates(g("mqar_templates")),
                prompt_frac=parse_prompt_frac(g("prompt_frac")), edge_depths=parse_probability(g("edge_depths"), "--edge-depths"),
                hard_keys=parse_probability(g("hard_keys"), "--hard-keys"),
                most_distractors=parse_probability(g("most_distractors"), "--real-long-most-distractors"))


def longest_run(flags: np.ndarray) -> np.ndarray:
    """The length of the longest run of True in each row of `flags` [B, L] -> [B]."""
    best = np.zeros(flags.shape[0], np.int64)
    cur = np.zeros_like(best)
    for col in flags.T:
        cur = np.where(col, cur + 1, 0)
        best = np.maximum(best, cur)
    return best


POSE_CHUNKS = 3  # --pose-chunks' default: CREAM's head / middle / tail


def pose_positions(rng: np.random.Generator, L: int, target: int, w=None, answer_weight: float = 3.0,
                   chunks: int = POSE_CHUNKS, block: int = BLOCK, tail_blocks: int = 1) -> np.ndarray:
    """Skip-wise position ids (PoSE, arXiv 2309.10400; CREAM, arXiv 2406.07138) [L] int32 for a
    window of L real tokens: the window is cut into `chunks` chunks at block boundaries, each
    chunk keeps contiguous ids, and chunk i + 1 starts a gap of whole blocks after chunk i ends,
    so the ids are sorted, unique, < `target`, and every 32-token block holds 32 consecutive ids
    starting at a multiple of `block` (generation's block layout at those positions). The first
    chunk starts at 0 ([BOS] keeps its place, as in PoSE).

    Where the cuts go: one cut is the block boundary at least t blocks before the first answer
    token (the first `w == answer_weight`), t = 1 or, with tail_blocks > 1, drawn uniform in
    [1, tail_blocks]: with t = 1 the question (<= 32 tokens in every task but the long answer's
    station list) starts the last chunk's run and the context before it (the needle, unless it
    sits right before the question) lies a gap away; a longer tail keeps what sits right before
    the answer (the long answer's whole station list, a needle at depth 1) contiguous with it at
    the window's far extent, the local layout inference has at every length (stage 35; no other
    cut falls inside that tail). The other cuts are uniform among the remaining boundaries.
    How far: the window's whole extent (last id + 1) is drawn log-uniform in [L, target] (so 4k,
    8k, 16k and 32k are all trained, the 4k-16k goals about as often as 16k-32k; PoSE draws the
    skip uniform), and the skipped blocks are split
    among the gaps uniformly (CREAM's middle chunk anywhere, not only at the ends)."""
    nb = L // block
    if target <= L or nb < 2 or chunks < 2:
        return np.arange(L, dtype=np.int32)
    cuts, tail = set(), range(0)
    if w is not None:
        ans = np.nonzero(np.asarray(w) == answer_weight)[0]
        t = int(rng.integers(1, tail_blocks + 1)) if tail_blocks > 1 else 1  # no draw at 1
        c = int((ans[0] - t * block) // block) if len(ans) else 0
        if c >= 1:
            cuts.add(c)
            if tail_blocks > 1:  # the tail stays whole: no other cut up to the answer's block
                tail = range(c + 1, int(ans[0] // block) + 1)
    free = [b for b in range(1, nb) if b not in cuts and b not in tail]
    k = min(chunks - 1 - len(cuts), len(free))
    if k > 0:
        cuts.update(int(b) for b in rng.choice(free, size=k, replace=False))
    cuts = sorted(cuts)
    extent = int(np.exp(rng.uniform(np.log(L), np.log(target))))
    skip = max(0, min(extent, target) - L) // block  # blocks skipped in all
    pts = np.sort(rng.integers(0, skip + 1, size=len(cuts) - 1))
    gaps = np.diff(np.concatenate([[0], pts, [skip]]))
    offset = np.zeros(nb, np.int64)
    for c, g in zip(cuts, gaps):
        offset[c:] += g
    starts = (np.arange(nb) + offset) * block
    return (starts[:, None] + np.arange(block)[None, :]).reshape(L).astype(np.int32)


def pose_options(args) -> dict:
    """The skip-wise position flags (--pose-target, --pose-prob, --pose-chunks, --pose-min-len,
    --pose-tail-blocks), checked; target 0 (the default) means every row keeps positions arange(L)."""
    g = lambda name, d: getattr(args, name, None) if getattr(args, name, None) is not None else d  # noqa: E731
    target, chunks, min_len = int(g("pose_target", 0)), int(g("pose_chunks", POSE_CHUNKS)), int(g("pose_min_len", 0))
    prob = parse_probability(g("pose_prob", 1.0), "--pose-prob")
    if target < 0 or (target and target % BLOCK):
        raise SystemExit(f"bad --pose-target {target}: need 0 (off) or a multiple of the block ({BLOCK})")
    if chunks < 2:
        raise SystemExit(f"bad --pose-chunks {chunks}: need >= 2 (PoSE: one chunk fails)")
    tail = int(g("pose_tail_blocks", 1))
    if tail < 1:
        raise SystemExit(f"bad --pose-tail-blocks {tail}: need >= 1 (1: the cut a block before the answer)")
    maxpos = getattr(args, "max_positions", None)
    if target and maxpos and target > maxpos:
        raise SystemExit(f"bad --pose-target {target}: past --max-positions {maxpos}")
    return dict(target=target, prob=prob, chunks=chunks, min_len=max(0, min_len), tail=tail)


def make_batch(step: int, seed: int, B: int, L: int, tok, args, dense: float = 0.0):
    """The batch of `step`: (x_t, x0, masked, w), each [B, L] (x_t int32 with [MASK] at `masked`,
    x0 int32 clean, w float32 loss weights). Every 32-token block is noised with its own mask
    ratio t ~ U(0, --mask-ratio-max) (mask prob (1-1e-3) t + 1e-3), or, for a --suffix-prob share
    of rows, everything after a random cut per block; an --answer-mask-prob share of rows masks
    exactly its answer tokens. `args` carries the data flags (data_options).

    With --pose-target T (> 0) a fifth array comes back, the position ids pos [B, L] int32: a
    --pose-prob share of the rows of length >= --pose-min-len get skip-wise ids up to T
    (pose_positions), the others arange(L); the first four arrays are those of the batch
    without the flag (the ids are drawn from their own random stream)."""
    r = random.Random(seed * 1_000_003 + step)
    opts = data_options(args)
    xs, ws = zip(*[train_sequence(r, L, tok, args.answer_weight, dense, args.copy_prob, **opts)
                   for _ in range(B)])
    x0 = np.stack(xs)
    w = np.stack(ws)
    nb = L // BLOCK
    # noise
    rn = np.random.default_rng(seed * 7919 + step)
    t = rn.uniform(size=(B, nb, 1)) * getattr(args, "mask_ratio_max", 1.0)
    p = (1 - 1e-3) * t + 1e-3
    masked = rn.uniform(size=(B, nb, BLOCK)) < p
    suffix = rn.uniform(size=(B, 1, 1)) < args.suffix_prob
    cut = rn.integers(0, BLOCK, size=(B, nb, 1))
    masked_suffix = np.arange(BLOCK)[None, None, :] >= cut
    masked = np.where(suffix, masked_suffix, masked).reshape(B, L)
    # answer-only rows: every answer token masked, everything else clean (the layout of inference,
    # where the question is read and the answer is the mask; the densest retrieval signal)
    answers_only = rn.uniform(size=(B, 1)) < getattr(args, "answer_mask_prob", 0.0)
    max_len = getattr(args, "answer_mask_max_len", 0)
    if max_len:  # a row whose answer is longer keeps the usual noise (it is denoised block by block)
        answers_only &= (longest_run(w == args.answer_weight) <= max_len)[:, None]
    masked = np.where(answers_only, w == args.answer_weight, masked)
    xt = np.where(masked, T.MASK_ID, x0)
    pose = pose_options(args)
    if not pose["target"]:
        return xt.astype(np.int32), x0, masked, w
    # skip-wise positions (own random stream: the tokens and the noise are the batch without them)
    rp = np.random.default_rng([seed, step, 53])
    pos = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    for i in range(B):
        if L >= pose["min_len"] and rp.uniform() < pose["prob"]:
            pos[i] = pose_positions(rp, L, pose["target"], w[i], args.answer_weight, pose["chunks"],
                                    tail_blocks=pose["tail"])
    return xt.astype(np.int32), x0, masked, w, pos