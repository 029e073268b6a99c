"""Control for issue 6's key matching: does a small model of the testbed's layout learn one-token-key
associative recall (MQAR) at all, outside the block-diffusion objective? Prints one JSON line per
report and a final summary.

    python experiments/recall_control.py --pairs 2:4 --minutes 6                   # causal LM
    python experiments/recall_control.py --pairs 2:4 --mask-answers --block 32     # answers masked

The model is the testbed's SDAR layout (experiments/testbed/config.make_config) with 2 layers, trained
with next-token loss on the answer tokens only (the values of the query part of
experiments/testbed/data.mqar_sequence). `--mask-answers` replaces those values in the input by [MASK] (so an
earlier query's answer is not visible to a later one, as in block diffusion where the answers are
the masks); `--block N` lets positions read their whole N-token block (block-causal, as the
testbed does), which needs `--mask-answers` so that no answer is read by its own predictor.
`--switch S` changes to the default pair counts (L/12 .. L/5) after S steps: does the lookup carry
over to longer recall lists? `--save DIR` exports the weights, e.g. to start block-diffusion
training from a model that already matches keys (train_testbed.py --init-from DIR).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.testbed.config import make_config
from experiments.testbed.data import MQAR_TEMPLATES, PACKED_TASKS, mqar_sequence, parse_pairs, train_sequence
from experiments.testbed.export import export_hf
from experiments.testbed.surgery import load_init
from maskahead_jax import tasks as T
from maskahead_jax.model.decoder import forward_hidden, lm_head
from maskahead_jax.model.init import init_params

ANSWER_WEIGHT = 3.0


def make_loss(cfg, L: int, block: int, mask_answers: bool):
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    attend = jnp.asarray(k // block <= q // block if block > 1 else k <= q)

    def loss_fn(params, x, w):  # x, w [B, L]
        b = x.shape[0]
        ans = w == ANSWER_WEIGHT
        inp = jnp.where(ans, T.MASK_ID, x) if mask_answers else x
        h = forward_hidden(params, cfg, inp, jnp.broadcast_to(jnp.arange(L), (b, L)),
                           mask=jnp.broadcast_to(attend, (b, L, L)))
        logits = lm_head(params, cfg, h[:, :-1])  # position p predicts token p + 1
        target, tgt_ans = x[:, 1:], ans[:, 1:].astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, target)
        loss = (ce * tgt_ans).sum() / tgt_ans.sum()
        acc = ((logits.argmax(-1) == target) * tgt_ans).sum() / tgt_ans.sum()
        return loss, acc

    return loss_fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="2:4", help="LO:HI key-value pairs per sequence (train_testbed --mqar-pairs)")
    ap.add_argument("--data", default="mqar",
                    help="mqar: one-token keys (experiments/testbed/data.mqar_sequence); task names (comma list of "
                         f"{', '.join(PACKED_TASKS)}): those tasks' fact-packed contexts with extra "
                         "questions, drawn with equal weights (experiments/testbed/data.train_sequence, packed)")
    ap.add_argument("--key-words", type=int, choices=(1, 2), default=1, help="mqar: words per key")
    ap.add_argument("--link", default="", help='mqar: a word between key and value, e.g. "is"')
    ap.add_argument("--template", choices=MQAR_TEMPLATES, default="list",
                    help="mqar: recall list, the task's fact sentences, or its questions (mqar_sequence)")
    ap.add_argument("--switch", type=int, default=0, help="after this many steps use the default pair counts")
    ap.add_argument("--mask-answers", action="store_true")
    ap.add_argument("--block", type=int, default=1, help="1: causal; N: block-causal with N-token blocks")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=0, help="0: 2 x d-model")
    ap.add_argument("--init-from", default=None,
                    help="start from an exported folder (e.g. maskahead_jax/testbed with --layers 4 "
                         "--d-model 128 --heads 4 --ffn 384)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--report-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None,
                    help="export the trained weights here (HF layout; train_testbed.py --init-from reads it, "
                         "with --layers 2 --d-model D --heads 2 --kv-heads K --ffn 2D)")
    a = ap.parse_args(argv)
    if a.block > 1 and not a.mask_answers:
        raise SystemExit("--block > 1 needs --mask-answers: otherwise an answer is read by its own predictor")
    pairs = parse_pairs(a.pairs)
    data = a.data.split(",")
    bad = [d for d in data if d not in PACKED_TASKS] if data != ["mqar"] else []
    if bad:
        raise SystemExit(f"bad --data {a.data!r}: unknown {bad}; use mqar or tasks of {PACKED_TASKS}")
    packed = tuple(float(t in data) for t in PACKED_TASKS)
    tok = T.build_tokenizer()
    margs = argparse.Namespace(layout="qwen3", d_model=a.d_model, heads=a.heads, kv_heads=a.kv_heads,
                               ffn=a.ffn or 2 * a.d_model, layers=a.layers, rope_theta=1e4)
    cfg = make_config(margs, 1536)
    params = init_params(cfg, jax.random.PRNGKey(a.seed))
    if a.init_from:
        params = load_init(a.init_from, params)
    sched = optax.warmup_constant_schedule(0.0, a.lr, 200)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.0))
    opt_state = opt.init(params)
    loss_fn = make_loss(cfg, a.length, a.block, a.mask_answers)

    @jax.jit
    def step(params, opt_state, x, w):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, w)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, acc

    r = random.Random(a.seed)
    t0, n, accs, first_half = time.time(), 0, [], None
    while time.time() - t0 < 60 * a.minutes and (not a.max_steps or n < a.max_steps):
        p = None if (a.switch and n >= a.switch) else pairs
        if data != ["mqar"]:
            xs, ws = zip(*[train_sequence(r, a.length, tok, ANSWER_WEIGHT, 1.0, 0.0, (0, 1, 0, 0, 0),
                                             packed) for _ in range(a.batch)])
        else:
            xs, ws = zip(*[mqar_sequence(r, a.length, tok, ANSWER_WEIGHT, p, a.key_words, a.link,
                                            a.template)
                           for _ in range(a.batch)])
        params, opt_state, loss, acc = step(params, opt_state, np.stack(xs), np.stack(ws))
        n += 1
        accs.append(float(acc))
        if n % a.report_every == 0:
            mean = float(np.mean(accs[-a.report_every:]))
            if first_half is None and mean >= 0.5 and not (a.switch and n > a.switch):
                first_half = n
            print(json.dumps({"step": n, "seconds": round(time.time() - t0), "loss": round(float(loss), 3),
                              "answer_accuracy": round(mean, 3)}), flush=True)
    last = float(np.mean(accs[-a.report_every:])) if accs else 0.0
    if a.save:
        export_hf(params, cfg, a.save)
    print(json.dumps({"summary": True, "steps": n, "pairs": a.pairs, "switch": a.switch,
                      "mask_answers": a.mask_answers, "block": a.block,
                      "first_step_at_or_above_0.5": first_half, "final_answer_accuracy": round(last, 3)}))
    return last


if __name__ == "__main__":
    main()
