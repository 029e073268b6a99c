"""Which retrieval circuits has a testbed export formed? Prints JSON.

    python experiments/probe_retrieval.py [--model DIR] [--length 128] [--n 16]

For each kind of training sequence (experiments/testbed/data.py) the probe runs one two-copy
forward (the training layout: noisy copy x_t reading the clean copy x0 of earlier blocks) with
*only the answer tokens* masked, and reports the accuracy of the argmax on those tokens:

  copy             induction sequences (a segment repeated after filler): in-order copying
  mqar_few         one-token-key associative recall ("recall : k v , ... . answer : k v ; ...")
                   with 2-4 pairs (chance when copying any earlier value: ~1/3)
  mqar             the same with L/12 .. L/5 pairs
  multikey_packed  fact-packed multi-key contexts with MQAR-style extra questions
  multikey         multi-key needles in filler

A model that copies but sits near chance on mqar / multikey retrieves values without matching
their keys (the state of the shipped testbed; see docs/testbed_history.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np

from experiments.testbed.data import BLOCK, copy_sequence, mqar_sequence, train_sequence
from experiments.testbed.objective import two_copy_logits
from maskahead_jax import tasks as T
from maskahead_jax.api import load_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = ("copy", "mqar_few", "mqar", "multikey_packed", "multikey")


def _sequence(kind: str, r: random.Random, L: int, tok, w_ans: float):
    if kind == "copy":
        return copy_sequence(r, L, tok, w_ans)
    if kind == "mqar_few":
        return mqar_sequence(r, L, tok, w_ans, pairs=(2, 4))
    if kind == "mqar":
        return mqar_sequence(r, L, tok, w_ans)
    only_multikey = (0, 1, 0, 0, 0)
    packed = 1.0 if kind == "multikey_packed" else 0.0
    return train_sequence(r, L, tok, w_ans, packed, 0.0, only_multikey, (1, 0, 0, 0))


def probe(params, cfg, tok, L: int = 128, n: int = 16, seed: int = 12345, kinds=KINDS) -> dict:
    """Answer-token accuracy per kind (answers = the tokens the training data weights as answers)."""
    if L % BLOCK:
        raise ValueError(f"length {L} must be a multiple of the block size {BLOCK}")

    @jax.jit
    def predict(xt, x0):
        return two_copy_logits(params, cfg, xt, x0).argmax(-1)

    w_ans = 3.0
    r = random.Random(seed)
    out = {}
    for kind in kinds:
        xs, ws = zip(*[_sequence(kind, r, L, tok, w_ans) for _ in range(n)])
        x0, w = np.stack(xs), np.stack(ws)
        ans = w == w_ans
        pred = np.asarray(predict(jnp.asarray(np.where(ans, T.MASK_ID, x0)), jnp.asarray(x0)))
        out[kind] = {"accuracy": round(float((pred[ans] == x0[ans]).mean()), 3), "answers": int(ans.sum())}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--n", type=int, default=16, help="sequences per kind")
    ap.add_argument("--seed", type=int, default=12345)
    a = ap.parse_args(argv)
    model = load_pretrained(a.model, dtype="float32")
    res = probe(model.params, model.config, T.build_tokenizer(), a.length, a.n, a.seed)
    print(json.dumps({"model": a.model, "length": a.length, "n": a.n, "probe": res}, indent=1))


if __name__ == "__main__":
    main()
