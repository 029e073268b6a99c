"""Why does a multi-key answer miss? Re-ask each missed example with one thing changed. Prints JSON.

    python experiments/multikey_counterfactuals.py [--model DIR] [--lengths 512,2048] \
        [--depths 0,1] [--n 20] [--seed 0] [--threshold 0.95]

The cells' held-out examples (eval_testbed.py's seeds) are answered with the dense cache; every
example answered wrong is asked again in each variant below, with the same reference answer:

  pad_front      12 of the context's own filler sentences put before it: every absolute
                 position moves ~150 tokens, every distance between tokens stays
  drop_front     the context's first quarter dropped (the asked fact kept): the distractors
                 there go and absolute positions move
  fact_inward    the asked fact moved 12 sentences towards the middle of the context: at depth 1
                 it no longer sits right before the question, at depth 0 right after [BOS]
  no_copied      the fact whose value the wrong answer copied removed (when there is one)
  renamed_key    the asked key renamed, in its fact and in the question, to a key no fact uses

With --every, every example is re-asked (does a variant break answers that were right?).
Each miss also records where its wrong value came from (`copied_from`): the other key that
holds it, whether that key shares a word with the asked key, and whether the sentence before
that fact holds one of the asked key's words ("copied_word_before" counts those that share none).
A variant that repairs most misses names the cause: position (pad_front), where the fact sits
(fact_inward), one distractor (no_copied) or the key's own words (renamed_key).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maskahead_jax import GenerationConfig, generate, load_pretrained  # noqa: E402
from maskahead_jax import tasks as T  # noqa: E402
from maskahead_jax.evaluation.datasets import TESTBED_MAX_NEW  # noqa: E402
from maskahead_jax.tasks.suite import multikey_fact, multikey_keys, multikey_question  # noqa: E402

VARIANTS = ("pad_front", "drop_front", "fact_inward", "no_copied", "renamed_key")
SHIFT = 12  # sentences moved or padded


def split_sentences(text: str) -> list[str]:
    """The context's sentences (each ends with ".", "!" or ";"); " ".join gives the text back."""
    return re.split(r"(?<=[.!;]) (?=\S)", text)


def _parts(ex: T.Example):
    """(context sentences, index of the asked fact among them, the question)."""
    question = multikey_question(ex.meta["key"])
    ctx = ex.prompt[: len(ex.prompt) - len(question) - 1]
    if ex.prompt[len(ctx):] != " " + question:
        raise ValueError(f"multikey seed {ex.seed}: the prompt does not end with its question")
    sents = split_sentences(ctx)
    fact = multikey_fact(ex.meta["key"], ex.answer)
    if fact not in sents:
        raise ValueError(f"multikey seed {ex.seed}: the asked fact {fact!r} is not one sentence")
    return sents, sents.index(fact), question


def _holding(sents: list[str], i: int, value: str | None) -> list[int]:
    """Indices of the context's facts other than the asked one (sentence i) that hold `value`."""
    if not value:
        return []
    return [j for j, s in enumerate(sents) if j != i and T.suite.MULTIKEY_PHRASE in s
            and s.endswith(f" is {value} .")]


def counterfactuals(ex: T.Example, wrong_value: str | None = None) -> dict[str, str]:
    """The variant prompts of one multi-key example (module docstring); `no_copied` only when
    `wrong_value` is another fact's value in the context."""
    sents, i, question = _parts(ex)
    filler = [s for s in sents if T.suite.MULTIKEY_PHRASE not in s]
    fact = sents[i]
    out = {"pad_front": " ".join(filler[:SHIFT] + sents + [question])}
    cut = len(sents) // 4
    out["drop_front"] = " ".join(([fact] if i < cut else []) + sents[cut:] + [question])
    rest = sents[:i] + sents[i + 1:]
    j = min(i + SHIFT, len(rest)) if i < len(sents) / 2 else max(i - SHIFT, 0)
    out["fact_inward"] = " ".join(rest[:j] + [fact] + rest[j:] + [question])
    copied = _holding(sents, i, wrong_value)
    if copied:
        out["no_copied"] = " ".join([s for j, s in enumerate(sents) if j not in copied] + [question])
    used = {q.split(" for ", 1)[1].split(" ?")[0] for q, _ in ex.meta["queries"]}
    r = random.Random(f"renamed:{ex.seed}")
    new_key = next(k for k in multikey_keys(r, len(used) + 8) if k not in used)
    renamed = sents[:i] + [multikey_fact(new_key, ex.answer)] + sents[i + 1:]
    out["renamed_key"] = " ".join(renamed + [multikey_question(new_key)])
    return out


def copied_from(ex: T.Example, value: str) -> dict:
    """Where a wrong value came from: the key of the context's other fact that holds it (None when
    no fact does), whether that key shares a word with the asked key, and whether the sentence
    right before that fact holds one of the asked key's words."""
    sents, i, _ = _parts(ex)
    hits = _holding(sents, i, value)
    if value == ex.answer or not hits:
        return {"copied_key": None}
    j = hits[0]
    key = sents[j][len(T.suite.MULTIKEY_PHRASE) + 1:-len(f" is {value} .")]
    asked = set(ex.meta["key"].split())
    return {"copied_key": key, "shares_word": bool(asked & set(key.split())),
            "word_before": bool(j > 0 and asked & set(sents[j - 1].split()))}


def _answers(model, tok, prompts: list[str], threshold: float, batch: int) -> list[str]:
    texts = []
    for b in range(0, len(prompts), batch):
        ids = [tok.encode(p).ids for p in prompts[b:b + batch]]
        outs = generate(model, ids, GenerationConfig(max_new_tokens=TESTBED_MAX_NEW["multikey"],
                                                     threshold=threshold)).tokens
        texts += [tok.decode(o) for o in outs]
    return texts


def run(model, tok, lengths, depths, n: int, seed: int, threshold: float, batch: int = 16,
        every: bool = False) -> dict:
    """Misses and their repairs; with `every`, every example is re-asked (does a variant break
    an answer that was right?) and "repaired" counts right answers among all of them."""
    exs = [T.generate("multikey", L, d, seed + i, tok) for L in lengths for d in depths for i in range(n)]
    first = _answers(model, tok, [e.prompt for e in exs], threshold, batch)
    n_missed = sum(not e.score(t) for e, t in zip(exs, first))
    missed = [(e, t) for e, t in zip(exs, first) if every or not e.score(t)]
    predicted = [T.suite.first_sentence(t).strip() for _, t in missed]
    jobs = []  # (example index in missed, variant, prompt)
    for k, ((e, _), wrong) in enumerate(zip(missed, predicted)):
        jobs += [(k, v, p) for v, p in counterfactuals(e, wrong).items()]
    again = _answers(model, tok, [p for _, _, p in jobs], threshold, batch)
    rows = [{"length": e.context_length, "depth": e.depth, "seed": e.seed, "answer": e.answer,
             "predicted": wrong, "right": bool(e.score(t)), **copied_from(e, wrong)}
            for (e, t), wrong in zip(missed, predicted)]
    for (k, v, _), t in zip(jobs, again):
        rows[k][v] = bool(missed[k][0].score(t))
    repaired = {v: [r[v] for r in rows if v in r] for v in VARIANTS}
    located = [r for r in rows if not r["right"] and r["copied_key"]]
    return {"examples": len(exs), "missed": n_missed, "copied_located": len(located),
            "copied_shares_word": sum(r["shares_word"] for r in located),
            "copied_word_before": sum(r["word_before"] and not r["shares_word"] for r in located),
            "repaired": {v: f"{sum(x)}/{len(x)}" for v, x in repaired.items()}, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--depths", default="0,1")
    ap.add_argument("--n", type=int, default=20, help="examples per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=0, help="first held-out seed (as eval_testbed.py)")
    ap.add_argument("--threshold", type=float, default=None, help="default: the model's config")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--every", action="store_true",
                    help="re-ask every example, not only the missed ones")
    args = ap.parse_args(argv)
    model = load_pretrained(args.model)
    tok = T.get_tokenizer(os.path.join(args.model, "tokenizer.json"))
    threshold = model.config.threshold if args.threshold is None else args.threshold
    out = run(model, tok, [int(x) for x in args.lengths.split(",")],
              [float(x) for x in args.depths.split(",")], args.n, args.seed, threshold, args.batch,
              args.every)
    name = os.path.relpath(args.model, ROOT) if os.path.abspath(args.model).startswith(ROOT) else args.model
    print(json.dumps({"model": name, "threshold": threshold, "n_per_cell": args.n, **out}, indent=1))


if __name__ == "__main__":
    main()
