"""Did moving the testbed's decoding to the library change any answer? Prints JSON.

    python experiments/compare_heldout_decoders.py [--n-heldout 16] [--n-eval 6]

Until issue 39 the training script had a decoder of its own (`greedy_answers`, a full forward
over prompt + masks per step) for its held-out probe and for `eval_testbed.py --engine
reference`; both now decode with the library (`generate`, `engine.reference.reference_generate`).
This loads that decoder from the commit before the change (`git show cd7e542:...`, into a
temporary folder) and decodes the same prompts with all three on the shipped testbed at its
threshold: the probe's held-out examples (512 tokens, max_new 16) and eval_testbed's (512 tokens,
depth 0.5, the suite's max_new per task). Needs git and the repository's history.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile

import numpy as np

from experiments.testbed.heldout import MAX_NEW as HELDOUT_MAX_NEW
from experiments.testbed.heldout import heldout_examples
from maskahead_jax import GenerationConfig, generate, load_pretrained
from maskahead_jax import tasks as T
from maskahead_jax.engine.reference import reference_generate
from maskahead_jax.evaluation.datasets import TESTBED_MAX_NEW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = "cd7e542"  # the last commit with experiments/train_testbed.py's own decoder


def old_decoder_module():
    src = subprocess.run(["git", "-C", ROOT, "show", f"{OLD}:experiments/train_testbed.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_train_testbed.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_train_testbed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--n-heldout", type=int, default=16)
    ap.add_argument("--n-eval", type=int, default=6)
    a = ap.parse_args(argv)
    old = old_decoder_module()
    m = load_pretrained(a.model, dtype="float32")
    tok = T.get_tokenizer(os.path.join(a.model, "tokenizer.json"))
    pred = old.make_decoder(m.config)
    out = {"threshold": m.config.threshold}
    for task in ("passkey", "multikey", "twohop"):
        exs = heldout_examples(task, 512, a.n_heldout, tok)
        ids = [tok.encode(e.prompt).ids for e in exs]
        was = old.greedy_answers(m.params, m.config, pred, ids, HELDOUT_MAX_NEW, total=512 + 64)
        now = generate(m, ids, GenerationConfig(max_new_tokens=HELDOUT_MAX_NEW)).tokens
        out[f"heldout/{task}/512"] = dict(
            n=len(exs), same_tokens=sum(w[:HELDOUT_MAX_NEW] == n for w, n in zip(was, now)),
            old=float(np.mean([e.score(tok.decode(w)) for e, w in zip(exs, was)])),
            generate=float(np.mean([e.score(tok.decode(n)) for e, n in zip(exs, now)])))
    for task in T.TASKS:
        k = TESTBED_MAX_NEW[task]
        exs = [T.generate(task, 512, 0.5, i, tok) for i in range(a.n_eval)]
        ids = [tok.encode(e.prompt).ids for e in exs]
        gen = GenerationConfig(max_new_tokens=k)
        was = old.greedy_answers(m.params, m.config, pred, ids, k)
        ref = [reference_generate(m, p, gen) for p in ids]
        cached = generate(m, ids, gen).tokens
        score = lambda outs: float(np.mean([e.score(tok.decode(o)) for e, o in zip(exs, outs)]))  # noqa: E731
        out[f"eval/{task}/512/0.5"] = dict(
            n=len(exs), old_vs_reference_same_tokens=sum(w[:k] == r for w, r in zip(was, ref)),
            reference_vs_cached_same_tokens=sum(r == c for r, c in zip(ref, cached)),
            old=score(was), reference=score(ref), cached=score(cached))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
