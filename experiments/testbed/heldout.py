"""Held-out needle accuracy during training, decoded by the library's own cached `generate`
(dense cache, the config's threshold decoding): the numbers the training log reports are the
numbers users get, with no decoder of our own.

Examples: seeds 900_000 + i (training draws its seeds from [1e7, 2^31)), depth (i % 5) / 4, a
context of L - 24 tokens."""
from __future__ import annotations

import numpy as np

from maskahead_jax import GenerationConfig, Model, generate
from maskahead_jax import tasks as T
from maskahead_jax.evaluation.datasets import TESTBED_MAX_NEW

HELDOUT_TASKS = ("passkey", "multikey", "twohop", "longanswer")
HELDOUT_SEED = 900_000
# 16 tokens: room for two-hop's chained answer ("U . unit U holds code K", ~9 tokens); the long
# answer gets the suite's budget for it (its list of facts)
MAX_NEW = 16


def heldout_examples(task: str, L: int, n: int, tok):
    """The n held-out examples of `task` at length L (a context of L - 24 tokens)."""
    return [T.generate(task, L - 24, (i % 5) / 4, HELDOUT_SEED + i, tok) for i in range(n)]


def heldout_eval(params, cfg, tok, L: int, n: int = 16, tasks=HELDOUT_TASKS, batch: int = 16) -> dict:
    """{task: mean score, task_from_context: share of answers whose first number occurs in the
    context} over n held-out examples per task, `batch` prompts per generate call.

    "_from_context" near 1 with the score at chance means the model retrieves *a* value of the
    context but does not match the key (multi-key, two-hop)."""
    model = Model(cfg, params)
    res = {}
    for task in tasks:
        gen = GenerationConfig(max_new_tokens=max(MAX_NEW, TESTBED_MAX_NEW[task]))  # threshold: the config's
        exs = heldout_examples(task, L, n, tok)
        texts = []
        for b in range(0, n, batch):
            prompts = [tok.encode(e.prompt).ids for e in exs[b:b + batch]]
            texts += [tok.decode(o) for o in generate(model, prompts, gen).tokens]
        res[task] = float(np.mean([e.score(t) for e, t in zip(exs, texts)]))
        firsts = [T.first_number(t) for t in texts]
        res[task + "_from_context"] = round(float(np.mean([
            bool(f) and f" {f} " in f" {e.prompt} " for e, f in zip(exs, firsts)])), 3)
    return res
