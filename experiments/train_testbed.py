"""Train the testbed: a small SDAR-layout (Qwen3 keys) block-diffusion model on synthetic retrieval.

This file is the command line; the pieces are the package `experiments/testbed/`:
  data.py       training sequences (task formats with MQAR-style extra questions, fact-packed
                contexts, one-token-key recall, induction), the two-copy noise, data flags
  prefetch.py   batches built ahead in CPU worker processes (--workers)
  objective.py  two-copy block diffusion: logits, loss, the jitted train step, the optimizer
  real_long.py  --real-long: real L-token rows, a prefix cache without gradient, the tail trained
  surgery.py    --init-from / --grow-after / --grow-heads
  clock.py      ActiveClock, the gated length curriculum (--stages), the learning-rate schedule
  heldout.py    held-out accuracy through the library's own cached `generate`
  state.py      the portable training state (--save-state / --resume-state): a few flat files that
                carry a run from one lent machine to the next
  export.py     the HF folder, through the converters' key tables (converters.export.save_hf)

Objective (research/models.md §1.3, BD3-LM / Fast-dLLM v2 "two-copy"): the sequence x0 of L tokens
is noised block by block (block 32; per block t ~ U(0,1), mask prob (1-1e-3) t + 1e-3, or with
probability --suffix-prob a "prompt tail + masked answer" pattern: a random cut per block, every
position after it masked), the model reads concat(x_t, x0) with positions concat(arange, arange)
and the mask: x_t block b sees x_t block b (bidirectional) and x0 blocks < b; x0 is block-causal.
Loss: cross entropy on the masked positions of x_t (no token shift: a mask predicts its own token;
with --logits-shift token p is predicted at p - 1), answer tokens weighted --answer-weight.
Embeddings are tied (copying a context token is then an identity map through the residual stream).

Data, generated on the fly: (1) the task suite's formats with extra questions appended
(MQAR-style: every answer is retrievable from the context); with the stage's `packed` probability
the context is packed with facts (many keys, little filler); (2) with --copy-prob, induction
sequences (a random segment repeated after short filler); (3) with --mqar-prob, associative recall.
Curriculum over the sequence length, gated on held-out accuracy (a longer stage starts only once
passkey/multikey accuracy reaches --gate, or 15% of the budget later). Held-out accuracy
(passkey / multikey / twohop, the library's generate with the config's threshold) is logged every
--eval-minutes.

Long positions from short windows (issue 53; PoSE arXiv 2309.10400, CREAM arXiv 2406.07138):
--pose-target T (a multiple of 32, <= --max-positions; 0 = off, the default, and every batch is
then exactly the batch without the flag) gives a --pose-prob share of the rows of length >=
--pose-min-len skip-wise position ids up to T: the window is cut into --pose-chunks chunks at
block boundaries (one cut a block before the first answer, so the question's chunk lies a gap
away from the context's needle), each chunk keeps contiguous ids, and the gaps are whole blocks
whose total makes the window's extent log-uniform in [L, T] (data.pose_positions). Both copies
of the two-copy objective read the same ids; the attention mask still follows the token blocks,
which the chunk edges keep equal to the position blocks. The other rows keep arange(L) (the
original positions: short-context skills). For generation at T tokens pass --max-positions
>= T + 512 (the export's max_position_embeddings); --rope-theta changes the RoPE base (a
higher base costs the shipped weights' short-context loss at once: docs/testbed_history.md,
"Long-context stage"). --eval-lengths 512,4096,8192 makes the periodic held-out probe score each
of those lengths (--eval-tasks, --eval-n at <= 2048 and --eval-long-n above; on the CPU a probe
at 8192 takes minutes, so set --eval-minutes accordingly).

Everything is resumable: orbax checkpoints every --ckpt-minutes in --run-dir; re-running the same
command continues (the time budget counts training time over all runs together; time the process
spends stopped, e.g. by SIGSTOP, does not count, see ActiveClock). Across machines: --save-state DIR
writes params, optimizer state, step and training time as flat files at every checkpoint and at
the end, and --resume-state DIR continues from them (experiments/gpu_train_testbed_long.sh). Run from the repository root
with the package installed (`pip install -e .`) or PYTHONPATH=. (the GPU scripts set it).

Usage:
  python experiments/train_testbed.py --run-dir runs/tb3           # train 175 min (resumes)
  python experiments/train_testbed.py --run-dir runs/tb3 --export-only   # export the latest checkpoint
  python experiments/train_testbed.py --smoke                      # 2.5-minute loss check
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.testbed.clock import (ActiveClock, batch_shape, curriculum, learning_rate,  # noqa: F401
                                       parse_stages, stage_shape)
from experiments.testbed.config import MAX_POSITIONS, THRESHOLD, head_dim, make_config  # noqa: F401
from experiments.testbed.data import (BLOCK, MQAR_TEMPLATES, PACKED_TASKS, PACKED_WEIGHTS,  # noqa: F401
                                      PROMPT_FRAC, TASK_WEIGHTS, copy_sequence, data_options,
                                      longest_run, make_batch, mqar_sequence, parse_pairs,
                                      parse_probability, parse_prompt_frac, parse_templates,
                                      pose_options, pose_positions, train_sequence)
from experiments.testbed.export import export_hf, hf_config  # noqa: F401
from experiments.testbed.heldout import heldout_eval
from experiments.testbed.objective import (make_optimizer, make_train_step, two_copy_logits,  # noqa: F401
                                           two_copy_mask)
from experiments.testbed.prefetch import BatchPrefetcher
from experiments.testbed.real_long import make_long_batch, make_long_step, parse_real_long, row_args
from experiments.testbed.state import has_state, load_state, save_state
from experiments.testbed.surgery import (grow_heads, grow_layers, load_init,  # noqa: F401
                                         loaded_logits_shift, parse_grow_after)
from maskahead_jax import tasks as T
from maskahead_jax.model.init import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    """The command line (unchanged since the shipped stages: every card's command still runs)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=175.0, help="training time budget (all runs together)")
    ap.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "testbed"))
    ap.add_argument("--out", default=os.path.join(ROOT, "maskahead_jax", "testbed"))
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny run: 2.5 minutes at L=128, no checkpoint")
    ap.add_argument("--smoke-stage", default="0:128:16:0.5", help="--smoke: the one stage to train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=None, help="default: --d-model / --heads")
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--rope-scaling", default=None,
                    help="RoPE scaling the model trains and exports with, TYPE:FACTOR[:ORIGINAL] (e.g. "
                         "yarn:4:2048: YaRN's frequencies and attention temperature; docs/rope.md)")
    ap.add_argument("--max-positions", type=int, default=MAX_POSITIONS,
                    help="max_position_embeddings of the config and export (generate refuses prompts "
                         "whose prompt + new tokens + a block pass it)")
    ap.add_argument("--vocab", type=int, default=1536)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--constant-lr", action="store_true",
                    help="no cosine decay after the warm-up (phases of a curriculum run one after another)")
    ap.add_argument("--answer-weight", type=float, default=3.0)
    ap.add_argument("--answer-mask-prob", type=float, default=0.0,
                    help="fraction of sequences with only their answer tokens masked (the rest clean)")
    ap.add_argument("--answer-mask-max-len", type=int, default=0,
                    help="--answer-mask-prob only for sequences whose answers are at most this many "
                         "tokens each (0: any; 32 leaves the long answer's usual noise alone)")
    ap.add_argument("--mask-ratio-max", type=float, default=1.0,
                    help="per-block mask ratios are drawn from U(0, this) (low: most context stays visible)")
    ap.add_argument("--suffix-prob", type=float, default=0.5)
    ap.add_argument("--stages", default="0:128:32:0.8,0.2:256:16:0.6,0.4:512:8:0.4,0.6:1024:4:0.3,0.8:2048:2:0.3",
                    help="curriculum start_fraction:seq_len:batch[:packed_prob],...")
    ap.add_argument("--copy-prob", type=float, default=0.25,
                    help="fraction of induction sequences (a random segment repeated; see copy_sequence)")
    ap.add_argument("--mqar-prob", type=float, default=0.0,
                    help="fraction of one-token-key associative recall sequences (see mqar_sequence), "
                         "drawn after the induction sequences")
    ap.add_argument("--mqar-pairs", default=None,
                    help="LO:HI key-value pairs per associative recall sequence (default L/12:L/5); "
                         "2:4 is what makes the key -> value lookup form (see mqar_sequence)")
    ap.add_argument("--mqar-templates", default="list",
                    help="comma list of recall templates each recall sequence draws from: list (one-word "
                         "keys), sentence, question (two-word keys, towards the multi-key task's "
                         "sentences; see mqar_sequence)")
    ap.add_argument("--task-weights", default=None,
                    help="sampling weights of passkey,multikey,twohop,docqa,longanswer "
                         f"(default {','.join(map(str, TASK_WEIGHTS))})")
    ap.add_argument("--prompt-frac", default=None,
                    help="LO:HI share of a stage's length an unpacked needle context takes "
                         f"(default {PROMPT_FRAC[0]}:{PROMPT_FRAC[1]}; the rest holds extra questions)")
    ap.add_argument("--edge-depths", type=float, default=0.0,
                    help="probability that an unpacked needle sits at one of the context's two ends "
                         "(depth 0 or 1; otherwise U(0, 1)): where the shipped testbed scores worst")
    ap.add_argument("--hard-keys", type=float, default=0.0,
                    help="probability that a multi-key context holds 1-4 distractor keys sharing one "
                         "word with the asked key (hard negatives; the shipped testbed's multi-key "
                         "misses copy such a key's value about half the time)")
    ap.add_argument("--packed-weights", default=None,
                    help="packed contexts: weights of multikey,twohop,longanswer,docqa "
                         f"(default {','.join(map(str, PACKED_WEIGHTS))})")
    ap.add_argument("--logits-shift", action="store_true",
                    help="predict token p from position p - 1 (Fast-dLLM v2 style); the lookup then "
                         "queries from the key token itself instead of from the mask after it")
    ap.add_argument("--no-qk-norm", action="store_true", help="ablation: no q/k RMSNorm")
    ap.add_argument("--untied", action="store_true",
                    help="separate lm_head (default: tied to the embedding, which makes copying a token "
                         "from the context an identity map the model gets for free)")
    ap.add_argument("--layout", choices=("qwen3", "qwen2"), default="qwen3",
                    help="qwen3: SDAR layout (q/k norm); qwen2: Fast-dLLM v2 layout (q/k/v biases)")
    ap.add_argument("--gate", type=float, default=0.3,
                    help="held-out passkey/multikey accuracy needed to grow the context (see curriculum)")
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--eval-minutes", type=float, default=4.0)
    ap.add_argument("--eval-n", type=int, default=16)
    ap.add_argument("--init-from", default=None,
                    help="start from an exported folder's weights (fresh optimizer state), e.g. the shipped testbed")
    ap.add_argument("--grow-after", default=None,
                    help="with --init-from: insert a new layer after each of these original layers "
                         "(e.g. 1,3; a copy with zeroed output projections, so the deeper model starts "
                         "as the loaded one); --layers is the new total")
    ap.add_argument("--grow-heads", action="store_true",
                    help="with --init-from: widen the loaded model's attention to --heads/--kv-heads "
                         "(pass its --head-dim; new heads' output projections start at zero, so the "
                         "wider model starts as the loaded one; see grow_heads)")
    ap.add_argument("--workers", type=int, default=0,
                    help="build batches in this many CPU processes ahead of the step (0: inline)")
    ap.add_argument("--wall-minutes", type=float, default=None,
                    help="stop after this much wall-clock time in this run (evals included), then save and export")
    ap.add_argument("--export-minutes", type=float, default=None,
                    help="also export to --out every this many training minutes")
    ap.add_argument("--final-lengths", default="512,1024", help="held-out eval lengths after training (empty: none)")
    ap.add_argument("--final-n", type=int, default=32, help="held-out examples per task of each final eval length")
    ap.add_argument("--save-state", default=None, metavar="DIR",
                    help="also write the portable state (params.npz, opt.npz, metrics.jsonl: see "
                         "experiments/testbed/state.py) into DIR at every checkpoint and at the end")
    ap.add_argument("--resume-state", default=None, metavar="DIR",
                    help="continue from the portable state in DIR (params, optimizer state, step, training "
                         "time, metrics) when it is ahead of --run-dir's checkpoint; takes the place of "
                         "--init-from's weights. Without DIR/opt.npz the moments start fresh and warm up "
                         "again over --warmup steps")
    ap.add_argument("--state-max-mb", type=float, default=15.0,
                    help="--save-state: largest file in MiB (a lent machine returns files of up to 16 MiB); "
                         "float32 params over it are kept in bfloat16, an optimizer state over it is left out")
    ap.add_argument("--pose-target", type=int, default=0,
                    help="skip-wise position ids up to this length (PoSE / CREAM; a multiple of 32, "
                         "<= --max-positions; 0: off, every row at arange(L)); see data.pose_positions")
    ap.add_argument("--pose-prob", type=float, default=1.0,
                    help="--pose-target: the share of eligible rows given skip-wise ids (the rest keep "
                         "the original positions)")
    ap.add_argument("--pose-chunks", type=int, default=3,
                    help="--pose-target: chunks per window (>= 2; PoSE 2, CREAM 3)")
    ap.add_argument("--pose-min-len", type=int, default=0,
                    help="--pose-target: rows of shorter stages keep the original positions (e.g. 2048 "
                         "with --stages '0:512|2048:8|2': the 512 steps at arange, the 2048 steps skip-wise)")
    ap.add_argument("--pose-tail-blocks", type=int, default=1,
                    help="--pose-target: the answer's chunk starts t blocks before the answer, t uniform in "
                         "[1, this] (1: only the question's last block; 24: the long answer's station "
                         "list and a needle right before the question stay next to the answer at far "
                         "positions; stage 35)")
    ap.add_argument("--real-long", default=None,
                    help="L:TAIL:EVERY (e.g. 8192:512:4): every EVERY-th step is one real L-token task "
                         "row, its first L - TAIL tokens a cache from a forward without gradient, its last "
                         "TAIL tokens (the prompt's end, the answer) trained in the two-copy layout on "
                         "top (testbed/real_long.py; stage 37). Default: off")
    ap.add_argument("--real-long-task-weights", default=None,
                    help="--real-long: the long rows' own --task-weights (default: --task-weights)")
    ap.add_argument("--real-long-edge-depths", default=None,
                    help="--real-long: the long rows' own --edge-depths (default: --edge-depths)")
    ap.add_argument("--real-long-hard-keys", default=None,
                    help="--real-long: the long rows' own --hard-keys (the share of multi-key rows with "
                         "1-4 keys sharing one word with the asked one; default: --hard-keys)")
    ap.add_argument("--real-long-most-distractors", default=None,
                    help="--real-long: the share of long multi-key / two-hop / document-QA rows holding "
                         "the most keys / decoys / documents their length allows, as the evaluation at "
                         "that length does (default 0: a uniform count; stage 39)")
    ap.add_argument("--real-long-prefix-kv-grad", action="store_true",
                    help="--real-long: the prefix's keys / values take gradient through their own layer's "
                         "norm and K / V projections, each layer's input held constant (far keys a "
                         "question wrongly matches learn to score lower; stage 40). Default: off, the "
                         "prefix cache is constant")
    ap.add_argument("--real-long-prefix-full-grad", action="store_true",
                    help="--real-long: the whole prefix pass takes gradient (every layer and the "
                         "embeddings, each layer rematerialised in the backward): what the far keys are "
                         "built from learns too, not only their last projection (stage 41). Default: off")
    ap.add_argument("--eval-lengths", default=None,
                    help="lengths of the periodic held-out probe (e.g. 512,4096,8192; default: the "
                         "stage's length capped at 512)")
    ap.add_argument("--eval-tasks", default="passkey,multikey,twohop",
                    help="tasks of the periodic held-out probe (passkey, multikey, twohop)")
    ap.add_argument("--eval-long-n", type=int, default=4,
                    help="--eval-lengths: held-out examples per task at lengths above 2048")
    ap.add_argument("--log-every", type=int, default=25,
                    help="append the running loss to --run-dir/metrics.jsonl every this many steps")
    return ap


def prefix_grad_mode(args) -> str:
    """How much of a real long row's prefix pass takes gradient (real_long.prefix_cache's grad)."""
    if getattr(args, "real_long_prefix_full_grad", False):
        return "full"
    return "kv" if getattr(args, "real_long_prefix_kv_grad", False) else "none"


def check_data_flags(args) -> None:
    """Parse every data flag once at startup, so that a malformed value fails before the model is
    built (make_batch parses them again for each batch, also in --workers' processes)."""
    data_options(args)
    pose_options(args)
    eval_plan(args)
    parse_stages(args.smoke_stage if args.smoke else args.stages)
    if getattr(args, "answer_mask_max_len", 0) < 0:
        raise SystemExit(f"bad --answer-mask-max-len {args.answer_mask_max_len}: need a token count >= 0 "
                         "(0: no limit)")
    if getattr(args, "log_every", 1) < 1:
        raise SystemExit(f"bad --log-every {args.log_every}: need a step count >= 1")
    real = parse_real_long(getattr(args, "real_long", None))
    if real.length:
        data_options(row_args(args, real))  # the long rows' own mix parses too
    else:
        for flag in ("prefix_kv_grad", "prefix_full_grad"):
            if getattr(args, f"real_long_{flag}", False):
                name = "--real-long-" + flag.replace("_", "-")
                raise SystemExit(f"{name} trains the prefix of --real-long rows; pass --real-long too")
    maxpos = getattr(args, "max_positions", None) or MAX_POSITIONS
    if real.length > maxpos:
        raise SystemExit(f"bad --real-long {args.real_long}: its rows ({real.length}) pass --max-positions {maxpos}")
    if parse_grow_after(getattr(args, "grow_after", None)) and not getattr(args, "init_from", None):
        raise SystemExit("--grow-after deepens the model loaded by --init-from; pass --init-from too")
    if getattr(args, "grow_heads", False) and not getattr(args, "init_from", None):
        raise SystemExit("--grow-heads widens the model loaded by --init-from; pass --init-from too")


def eval_plan(args):
    """[(length, n)] of the periodic held-out probe from --eval-lengths / --eval-n /
    --eval-long-n, or None (the stage's length capped at 512, --eval-n examples), and the
    --eval-tasks tuple; bad values exit naming the flag."""
    tasks = tuple(t.strip() for t in (getattr(args, "eval_tasks", None) or "passkey,multikey,twohop").split(","))
    from experiments.testbed.heldout import HELDOUT_TASKS
    if not tasks or any(t not in HELDOUT_TASKS for t in tasks):
        raise SystemExit(f"bad --eval-tasks {args.eval_tasks!r}: choose from {HELDOUT_TASKS}")
    text = getattr(args, "eval_lengths", None)
    if not text:
        return None, tasks
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    maxpos = getattr(args, "max_positions", None) or MAX_POSITIONS
    if not lengths or any(n < 64 or n + 64 > maxpos for n in lengths):
        raise SystemExit(f"bad --eval-lengths {text!r}: need lengths >= 64 whose prompt + answer fit "
                         f"--max-positions {maxpos}")
    long_n = getattr(args, "eval_long_n", 4)
    return [(n, args.eval_n if n <= 2048 else long_n) for n in lengths], tasks


def last_heldout(log_path) -> float:
    """The mean passkey / multikey held-out accuracy last logged in metrics.jsonl (0 if none):
    a resumed run's curriculum gate starts from it."""
    heldout = 0.0
    if log_path and os.path.exists(log_path):
        for line in open(log_path):
            rec = json.loads(line)
            if "eval" in rec:
                heldout = float(np.mean([rec["eval"].get(t, 0.0) for t in ("passkey", "multikey")]))
    return heldout


def last_logged(log_path, key: str, elapsed: float) -> float:
    """The training time of the last metrics.jsonl record holding `key` ("eval", "exported"), at
    most `elapsed` (the resumed time); `elapsed` itself if there is none. The probe and export
    timers of a resumed run count from it, so a run stopped every session before --eval-minutes /
    --export-minutes still probes and exports on schedule."""
    last = None
    if log_path and os.path.exists(log_path):
        for line in open(log_path):
            rec = json.loads(line)
            if key in rec:
                last = float(rec["elapsed"])
    return elapsed if last is None else min(last, elapsed)


def initial_params(args, cfg):
    """Fresh params from --seed, or --init-from's weights (grown by --grow-after / --grow-heads)."""
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    if not args.init_from:
        return params
    params = load_init(args.init_from, params, parse_grow_after(args.grow_after), args.grow_heads, args.seed)
    print(f"initialized from {args.init_from}", flush=True)
    loaded_theta = _loaded_config(args.init_from).get("rope_theta")
    if loaded_theta is not None and float(loaded_theta) != float(cfg.rope_theta):
        print(f"note: RoPE base {loaded_theta} in {args.init_from} -> {cfg.rope_theta} (--rope-theta): "
              "the same weights, new rotation frequencies; training adapts to them", flush=True)
    if loaded_logits_shift(args.init_from) and not args.logits_shift:
        print(f"warning: {args.init_from} predicts with shifted logits (config logits_shift true) but "
              "this run trains without --logits-shift: its lookups will have to form again", flush=True)
    return params


def _loaded_config(path) -> dict:
    cfg = os.path.join(path, "config.json")
    return json.load(open(cfg)) if os.path.exists(cfg) else {}


def resume_from_state(args, cfg, state, opt, log_path):
    """state (params, opt_state, step, elapsed) continued from --resume-state when that folder is
    ahead of `state` (--run-dir's checkpoint, or the fresh start); returns (state, warm_from):
    warm_from is the step the learning-rate warm-up counts from (the resumed step when the folder
    held no optimizer state, so that fresh moments warm up again; else 0)."""
    d = args.resume_state
    if not has_state(d):
        if d:
            print(f"--resume-state {d}: no state there (no params.npz): starting as without it", flush=True)
        return state, 0
    params, opt_state, step, elapsed, meta = load_state(d, state["params"], state["opt_state"])
    if step <= int(state["step"]):
        print(f"--resume-state {d}: step {step} is not ahead of step {int(state['step'])}; kept the latter",
              flush=True)
        return state, 0
    saved = meta.get("config") or {}
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as the state's meta stores it
    for k in ("rope_theta", "max_position_embeddings", "logits_shift", "rope_scaling"):
        if k in saved and saved[k] != now[k]:
            print(f"warning: --resume-state {d} was trained with {k}={saved[k]}, this run has "
                  f"{now[k]}", flush=True)
    warm_from = 0
    if opt_state is None:
        opt_state, warm_from = opt.init(params), step
        print(f"--resume-state {d}: no optimizer state: fresh moments, warm-up over {args.warmup} steps "
              f"from step {step}", flush=True)
    src = os.path.join(d, "metrics.jsonl")
    if log_path and os.path.exists(src) and not os.path.exists(log_path):
        import shutil
        shutil.copyfile(src, log_path)
    print(f"resumed from {d}: step {step}, {elapsed / 60:.1f} min trained", flush=True)
    return {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int64),
            "elapsed": np.asarray(elapsed, np.float64)}, warm_from


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_data_flags(args)

    import orbax.checkpoint as ocp
    from tqdm import tqdm

    tok = T.build_tokenizer()
    assert tok.get_vocab_size() <= args.vocab
    cfg = make_config(args, args.vocab)
    params = initial_params(args, cfg)
    nparam = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"params: {nparam / 1e6:.2f}M  cfg: {cfg}", flush=True)
    opt = make_optimizer(args.lr)
    opt_state = opt.init(params)
    state = {"params": params, "opt_state": opt_state, "step": np.asarray(0, np.int64), "elapsed": np.asarray(0.0, np.float64)}

    run_dir = os.path.abspath(args.run_dir)
    mngr = None
    if not args.smoke:
        os.makedirs(run_dir, exist_ok=True)
        mngr = ocp.CheckpointManager(os.path.join(run_dir, "ckpt"),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
        if mngr.latest_step() is not None:
            state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(state))
            print(f"resumed from step {int(state['step'])}, {float(state['elapsed']) / 60:.1f} min trained",
                  flush=True)
    warm_from = 0
    if args.resume_state and not args.smoke:
        state, warm_from = resume_from_state(args, cfg, state, opt, os.path.join(run_dir, "metrics.jsonl"))
    if args.export_only:
        if mngr is None or (mngr.latest_step() is None and int(state["step"]) == 0):
            print("no checkpoint to export"); return 1
        export_hf(state["params"], cfg, args.out)
        print(f"exported step {int(state['step'])} to {args.out}")
        return 0

    budget = 60 * (2.5 if args.smoke else args.minutes)
    stages = parse_stages(args.smoke_stage) if args.smoke else parse_stages(args.stages)
    params, opt_state = state["params"], state["opt_state"]
    step, elapsed = int(state["step"]), float(state["elapsed"])
    steps_fns = {}
    log_path = os.path.join(run_dir, "metrics.jsonl") if mngr else None
    clock = ActiveClock()  # training time: wall time less any time the process was stopped
    t_last = clock()
    last_ckpt = elapsed  # resume: the probe and export timers count from their last record
    last_eval, last_export = last_logged(log_path, "eval", elapsed), last_logged(log_path, "exported", elapsed)
    pbar = tqdm(total=int(budget), initial=int(elapsed), unit="s", dynamic_ncols=True, mininterval=5)
    wall_start = time.time()
    wall_limit = 60 * args.wall_minutes if args.wall_minutes else float("inf")
    prefetch = BatchPrefetcher(args, args.workers) if args.workers else None
    ema = None
    stage, heldout = 0, last_heldout(log_path)  # resume: the gate sees the last held-out accuracy
    plan, eval_tasks = eval_plan(args)
    real = parse_real_long(args.real_long)

    def save_portable():
        if not args.save_state or args.smoke:
            return
        info = save_state(args.save_state, params, opt_state, step, elapsed, cfg, args.state_max_mb)
        if log_path and os.path.exists(log_path):
            import shutil
            shutil.copyfile(log_path, os.path.join(args.save_state, "metrics.jsonl"))
        return info

    def save():
        if mngr is None or mngr.latest_step() == step:  # already saved at this step (orbax refuses twice)
            return
        st = {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int64), "elapsed": np.asarray(elapsed, np.float64)}
        mngr.save(step, args=ocp.args.StandardSave(st), force=True)
        mngr.wait_until_finished()
        info = save_portable()
        if info:
            log({"step": step, "elapsed": elapsed, "state": args.save_state, **info})

    def log(rec):
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    while elapsed < budget and time.time() - wall_start < wall_limit:
        frac = elapsed / budget
        stage = curriculum(frac, stages, stage, heldout, args.gate)
        B, L, dense = batch_shape(stages[stage], step)
        lr = learning_rate(step - warm_from, frac, args.lr, args.warmup, args.constant_lr)
        opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        if real.due(step):  # a real long row: a cache without gradient, the tail trained on it
            L, fn = real.length, "real"
            if fn not in steps_fns:
                steps_fns[fn] = make_long_step(cfg, opt, prefix_grad_mode(args))
            batch = make_long_batch(step, args.seed, tok, args, real)
        else:
            fn = L
            if L not in steps_fns:
                steps_fns[L] = make_train_step(cfg, opt, L)
            if prefetch:
                batch = prefetch.get(step, functools.partial(batch_shape, stages[stage]))
            else:
                batch = make_batch(step, args.seed, B, L, tok, args, dense)
        # (xt, x0, masked, w), plus the position ids with --pose-target
        params, opt_state, loss, acc = steps_fns[fn](params, opt_state, *batch)
        loss = float(loss)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        now = clock()
        elapsed += now - t_last
        t_last = now
        pbar.n = int(min(elapsed, budget))
        pbar.set_postfix(step=step, L=L, loss=f"{ema:.3f}", acc=f"{float(acc):.2f}", lr=f"{lr:.1e}", refresh=False)
        pbar.update(0)
        if step % args.log_every == 0:
            log({"step": step, "elapsed": elapsed, "L": L, "loss": ema, "acc": float(acc), "lr": lr})
        if elapsed - last_eval >= 60 * args.eval_minutes or (args.smoke and elapsed >= budget):
            for k, (eL, en) in enumerate(plan or [(min(L, 512) if not args.smoke else 128, args.eval_n)]):
                te = time.time()
                res = heldout_eval(params, cfg, tok, eL, n=en, tasks=eval_tasks, batch=min(16, en))
                print(f"\n[eval] step {step} L={L} elapsed {elapsed / 60:.1f}m loss {ema:.3f} heldout@{eL} "
                      f"{res} ({time.time() - te:.0f}s)", flush=True)
                log({"step": step, "elapsed": elapsed, "eval": res, "eval_L": eL, "n": en})
                if k == 0:  # the gate reads the first length's pass key / multi-key
                    heldout = float(np.mean([res.get(t, 0.0) for t in ("passkey", "multikey")]))
            last_eval = elapsed
            t_last = clock()  # eval time does not count against the training budget
        if mngr and elapsed - last_ckpt >= 60 * args.ckpt_minutes:
            save()
            last_ckpt = elapsed
            t_last = clock()
        if args.export_minutes and elapsed - last_export >= 60 * args.export_minutes:
            export_hf(params, cfg, args.out)
            log({"step": step, "elapsed": elapsed, "exported": args.out})
            last_export = elapsed
            t_last = clock()
    pbar.close()
    clock.close()
    if prefetch:
        prefetch.close()
    if args.smoke:
        res = heldout_eval(params, cfg, tok, 128, n=args.eval_n)
        print(f"smoke done: step {step} loss {ema:.3f} heldout@128 {res}")
        return 0
    export_hf(params, cfg, args.out)  # first: the weights are out even if the checkpoint fails
    save()
    for Lf in (int(x) for x in args.final_lengths.split(",") if x.strip()):
        te = time.time()
        res = heldout_eval(params, cfg, tok, Lf, n=args.final_n)
        print(f"[final eval] L={Lf} {res} ({time.time() - te:.0f}s)", flush=True)
        log({"step": step, "final_eval": res, "eval_L": Lf, "n": args.final_n})
        if args.save_state and log_path and os.path.exists(log_path):  # the state's log has the eval too
            import shutil
            shutil.copyfile(log_path, os.path.join(args.save_state, "metrics.jsonl"))
    print(f"exported to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
