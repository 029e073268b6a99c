"""Fine-tune the block-causal testbed into its bidirectional twin (Dream-style), issue 39 part 2.

The twin is the shipped testbed's weights read as a Dream-style model: full attention over
[prompt | response], shifted logits (the output at j - 1 predicts token j), and the response
decoded block by block by the library's bidirectional engine (maskahead_jax/engine/
bidirectional.py). The objective copies the engine's forwards exactly, so that training sees the
states decoding visits:

* sequence: prompt = one task-suite prompt ([BOS] + context + question, as the evaluation encodes
  it), right-padded to the batch's prompt width P with [MASK] and masked out as keys (the
  engine's prompt bucket); response = the task's target, then [EOS] up to G tokens, G = the
  evaluation's max_new_tokens rounded up to the block (32 for the four short tasks, 160 for the
  long answer), at positions plen .. plen + G - 1.
* pass 1 (the engine's `full_pass`): [prompt | all-[MASK] response] with full attention, which
  builds the prompt K/V cache and the last prompt position's output. With probability
  `refresh_prob` per row the response in this pass is the noised one instead (what a
  `prompt_refresh` > 0 pass sees: Dream's plain full attention over the current state).
* pass 2 (the engine's `resp_logits`): the noised response against [prompt cache | itself].
* noise on the response only: with probability `semi_ar` a semi-autoregressive state (a
  uniformly drawn current block c: blocks < c clean, block c masked at ratio t ~ U(0, 1), blocks
  > c fully masked), else plain uniform masking at ratio t over the whole response; at least one
  masked position per row.
* loss: cross entropy on the masked response positions with shifted logits (response token 0
  from pass 1's last prompt position, token j from pass 2's output j - 1), weighted: answer
  tokens `answer_weight`, the first [EOS] 1, the [EOS] padding after it `pad_weight`.

Checkpoints (plain npz: params, optimizer state, step, trained seconds) go to --run-dir every
--ckpt-minutes; re-running the same command resumes. Batches are a pure function of (seed,
step), so a resumed run reads the batches it would have read.

Long context (issue 53): --init-from a long-context export (its RoPE scaling comes along, or
--rope-scaling replaces it) and --pose-target 32768 give the prompt skip-wise position ids
(`twin_positions`, PoSE as the block-causal trainer's --pose-target), so the twin learns far
positions from the same <= 2048-token windows.

Usage:
  python -m experiments.testbed.bidirectional --run-dir runs/twin --minutes 60     # (resumes)
  python -m experiments.testbed.bidirectional --run-dir runs/twin --export-only --out maskahead_jax/testbed_bidir
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.testbed.objective import jitted_step
from experiments.train_testbed import hf_config, load_init
from maskahead_jax import tasks as T
from maskahead_jax.config import ModelConfig
from maskahead_jax.evaluation.datasets import TESTBED_MAX_NEW
from maskahead_jax.model import Context, Segment, lm_head, model_step

BLOCK = 32
SHORT_TASKS = ("passkey", "multikey", "twohop", "docqa")  # G = 32
LONG_TASKS = ("longanswer",)  # G = 160
DEFAULT_SHAPES = "2048:32:2,1024:160:3,2048:160:2,1024:32:4"  # prompt length : G : batch rows


def response_len(task: str) -> int:
    """The engine's response length for a task: max_new_tokens rounded up to the block."""
    return int(math.ceil(TESTBED_MAX_NEW[task] / BLOCK) * BLOCK)


class Shape(NamedTuple):
    length: int  # the longest prompt (tokens) a batch draws; its width is length + 64
    resp: int  # G, response tokens (a multiple of BLOCK)
    rows: int  # B

    @property
    def width(self) -> int:
        return self.length + 64


def parse_shapes(text: str) -> list[Shape]:
    """'2048:32:2,1024:160:3' -> [Shape(2048, 32, 2), ...]; the steps cycle through them."""
    out = []
    for item in text.split(","):
        try:
            n, g, b = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--shapes item {item!r}: expected LENGTH:G:ROWS, e.g. 1024:32:4") from None
        if g % BLOCK or g not in (response_len("passkey"), response_len("longanswer")) or n < 64 or b < 1:
            raise SystemExit(f"--shapes item {item!r}: G must be {response_len('passkey')} (short tasks) or "
                             f"{response_len('longanswer')} (long answer), LENGTH >= 64, ROWS >= 1")
        out.append(Shape(n, g, b))
    return out


# ----------------------------------------------------------------------------- data
def example_ids(tok, task: str, n: int, depth: float, seed: int):
    """(prompt ids with [BOS], target ids) of one suite example, encoded as the evaluation does."""
    ex = T.generate(task, n, depth, seed, tok)
    return [T.BOS_ID] + tok.encode(ex.prompt, add_special_tokens=False).ids, \
        tok.encode(ex.target, add_special_tokens=False).ids


def response_row(target: list, g: int, answer_weight: float, pad_weight: float):
    """Response tokens [G] (target, [EOS], [EOS] padding) and their loss weights [G]."""
    if len(target) >= g:
        raise ValueError(f"a target of {len(target)} tokens does not fit a {g}-token response")
    n = g - len(target)
    toks = np.asarray(list(target) + [T.EOS_ID] * n, np.int32)
    w = np.asarray([answer_weight] * len(target) + [1.0] + [pad_weight] * (n - 1), np.float32)
    return toks, w


def noise_response(rng: np.random.Generator, b: int, g: int, semi_ar: float):
    """Masked positions [B, G] bool and each row's current block [B] (-1: uniform masking).

    semi-AR rows: blocks before a uniformly drawn current block clean, the current block masked at
    ratio t ~ U(0, 1) (mask prob (1 - 1e-3) t + 1e-3), later blocks all masked; other rows: the
    whole response at ratio t. Every row has at least one masked position (in its current block
    for semi-AR rows)."""
    nb = g // BLOCK
    t = rng.uniform(size=(b, 1))
    p = (1 - 1e-3) * t + 1e-3
    m = rng.uniform(size=(b, g)) < p
    sar = rng.uniform(size=b) < semi_ar
    cur = np.where(sar, rng.integers(0, nb, size=b), -1)
    blk = np.arange(g)[None] // BLOCK
    m = np.where(sar[:, None] & (blk < cur[:, None]), False, m)
    m = np.where(sar[:, None] & (blk > cur[:, None]), True, m)
    # at least one mask: a random position (of the current block for semi-AR rows)
    lo = np.where(sar, cur * BLOCK, 0)
    hi = np.where(sar, cur * BLOCK + BLOCK, g)
    forced = lo + (rng.uniform(size=b) * (hi - lo)).astype(np.int64)
    pos = np.arange(g)[None]
    in_cur = (m & (pos >= lo[:, None]) & (pos < hi[:, None])).any(1)
    none = ~in_cur
    m[np.nonzero(none)[0], forced[none]] = True
    return m, cur


class Batch(NamedTuple):
    prompt: np.ndarray  # [B, P] int32, [MASK] after plen
    plen: np.ndarray  # [B] int32
    x0: np.ndarray  # [B, G] int32 clean response
    xt: np.ndarray  # [B, G] int32 noised response
    masked: np.ndarray  # [B, G] bool
    w: np.ndarray  # [B, G] float32 loss weights (before masking)
    refresh: np.ndarray  # [B] bool: pass 1 reads the noised response (else all [MASK])
    pos: np.ndarray  # [B, P + G] int32 position ids of [prompt | response] (twin_positions)


class Pose(NamedTuple):
    """Skip-wise prompt positions (PoSE) for the twin, as the block-causal trainer's --pose-target."""
    target: int = 0  # positions < target (0: off, every row at arange)
    prob: float = 1.0  # share of eligible rows given skip-wise ids
    min_len: int = 0  # shapes shorter than this keep arange
    chunks: int = 3
    tail_blocks: int = 1


def twin_positions(plen: int, pw: int, g: int, rng=None, pose: Pose = Pose()) -> np.ndarray:
    """Position ids [pw + g] of one row [prompt (plen real tokens, padded to pw) | response (g)].

    Without `rng`: the prompt at 0 .. plen - 1, the response right after it (the engine's layout).
    With it: the prompt's tokens at data.pose_positions' skip-wise ids (chunks cut on block
    boundaries, the extent log-uniform up to pose.target - g, the question's chunk starting 1 ..
    tail_blocks blocks before the response) and the response contiguous after the last prompt id,
    so every id is < pose.target. Padding takes the last prompt id: it is masked out as a key, and a
    length-dependent RoPE (dynamic_yarn reads each row's largest id) then sees the row's true
    extent, as the engine's run length fixes it."""
    if rng is None:
        ids = np.arange(plen, dtype=np.int64)
    else:
        from .data import pose_positions

        L = -(-(plen + 1) // BLOCK) * BLOCK  # whole blocks up to the response's first token
        w = np.zeros(L, np.float32)
        w[plen] = 1.0  # the "answer" whose chunk keeps its tail (pose_positions' anchor)
        ids = pose_positions(rng, L, pose.target - g, w, answer_weight=1.0, chunks=pose.chunks,
                             tail_blocks=pose.tail_blocks)[:plen].astype(np.int64)
    last = int(ids[-1])
    pad = np.full(pw - plen, last, np.int64)
    return np.concatenate([ids, pad, last + 1 + np.arange(g)]).astype(np.int32)


def make_batch(step: int, seed: int, shape: Shape, tok, answer_weight: float = 3.0, pad_weight: float = 0.5,
               semi_ar: float = 0.7, refresh_prob: float = 0.2, edge_depths: float = 0.2,
               task_weights=(0.1, 0.35, 0.3, 0.25), min_frac: float = 0.4, pose: Pose = Pose()) -> Batch:
    """The batch of `step`: a pure function of (seed, step, shape). Short-response shapes draw the
    four short tasks by `task_weights`, G = 160 shapes the long answer. Prompt lengths are
    U(min_frac, 1) x shape.length (the evaluation's lengths are requested prompt tokens); training
    seeds are >= 10**7, the evaluation's are small integers. With pose.target a pose.prob share of
    the rows of shapes >= pose.min_len get skip-wise positions (twin_positions), drawn from a
    generator of their own: every other draw, and so the batch without the flag, is unchanged."""
    r = random.Random(seed * 1_000_003 + step)
    tasks = SHORT_TASKS if shape.resp == response_len("passkey") else LONG_TASKS
    weights = task_weights if tasks is SHORT_TASKS else (1.0,)
    b, pw, g = shape.rows, shape.width, shape.resp
    prompt = np.full((b, pw), T.MASK_ID, np.int32)
    plen = np.zeros(b, np.int32)
    x0 = np.zeros((b, g), np.int32)
    w = np.zeros((b, g), np.float32)
    for i in range(b):
        task = r.choices(tasks, weights=weights)[0]
        n = int(shape.length * r.uniform(min_frac, 1.0))
        depth = float(r.random() < 0.5) if r.random() < edge_depths else r.random()
        sd = r.randrange(10 ** 7, 2 ** 31)
        while True:
            p, a = example_ids(tok, task, n, depth, sd)
            if len(p) <= pw and len(a) < g:
                break
            n = int(n * 0.9)
        prompt[i, :len(p)] = p
        plen[i] = len(p)
        x0[i], w[i] = response_row(a, g, answer_weight, pad_weight)
    rng = np.random.default_rng(seed * 7919 + step)
    masked, _ = noise_response(rng, b, g, semi_ar)
    refresh = rng.uniform(size=b) < refresh_prob
    xt = np.where(masked, T.MASK_ID, x0).astype(np.int32)
    skip = np.random.default_rng([seed, step, 53]) if pose.target and shape.length >= pose.min_len else None
    pos = np.stack([twin_positions(int(plen[i]), pw, g, skip if skip and skip.uniform() < pose.prob else None,
                                   pose) for i in range(b)])
    return Batch(prompt, plen, x0, xt, masked, w, refresh, pos)


# ----------------------------------------------------------------------------- objective
def twin_logits(params, cfg: ModelConfig, prompt, plen, xt, refresh, cache_grad: bool = False, pos=None):
    """Shifted logits [B, G, V] of the response xt [B, G] as the bidirectional engine computes
    them (engine/bidirectional.py): pass 1 = [prompt | all-[MASK] (or, where `refresh`, the
    noised) response] with full attention -> the prompt K/V and the last prompt position's output;
    pass 2 = xt against [prompt cache | itself]. Response token 0 is predicted by the last prompt
    position, token j by pass 2's output j - 1.

    cache_grad=False (the default; ~3x cheaper on the CPU): no gradient flows back through pass 1
    (the prompt cache is a constant); the last prompt position is recomputed as a one-token block
    against pass 1's K/V of every other position (the same numbers), so the first response token's
    loss still trains that position's own path. True: the exact gradient through both passes.

    pos [B, P + G]: the position ids of [prompt | response] (Batch.pos; None: twin_positions'
    default layout, the prompt at 0 .. plen - 1 and the response right after it)."""
    b, pw = prompt.shape
    g = xt.shape[1]
    L = cfg.num_layers
    idx = jnp.arange(pw + g, dtype=jnp.int32)
    if pos is None:
        last = (plen - 1)[:, None]
        pos = jnp.where(idx[None] < plen[:, None], idx[None], jnp.where(idx[None] < pw, last, plen[:, None] + idx[None] - pw))
    pvalid = idx[None, :pw] < plen[:, None]
    rpos = pos[:, pw:]
    resp1 = jnp.where(refresh[:, None], xt, cfg.mask_token_id)
    key_valid = jnp.concatenate([pvalid, jnp.ones((b, g), bool)], axis=1)
    mask = jnp.broadcast_to(key_valid[:, None, :], (b, pw + g, pw + g))
    out = model_step(params if cache_grad else jax.lax.stop_gradient(params), cfg,
                     jnp.concatenate([prompt, resp1], 1), pos, mask, [Segment(0, L, None)])
    hkv = cfg.num_kv_heads
    if cache_grad:
        last_h = jnp.take_along_axis(out.hidden, (plen - 1)[:, None, None], axis=1)  # [B, 1, D]
    else:  # the last prompt position as a one-token block over pass 1's other keys
        other = key_valid & (idx[None] != (plen - 1)[:, None])
        lctx = Context(out.k, out.v, jnp.broadcast_to(other[None, :, None, :], (L, b, hkv, pw + g)))
        last_tok = jnp.take_along_axis(prompt, (plen - 1)[:, None], axis=1)
        last_pos = jnp.take_along_axis(pos, (plen - 1)[:, None], axis=1)
        s = cfg.rope_scaling
        if s is not None and s.length_dependent and not s.seq_len:
            # an inert second token at the row's last position, reading only itself: the row's
            # largest id, and so a length-dependent RoPE's frequencies, are the whole sequence's
            last_tok = jnp.concatenate([last_tok, jnp.full_like(last_tok, cfg.mask_token_id)], 1)
            last_pos = jnp.concatenate([last_pos, rpos[:, -1:]], 1)
        n = last_tok.shape[1]
        last_h = model_step(params, cfg, last_tok, last_pos, jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)),
                            [Segment(0, L, lctx)]).hidden[:, :1]
    valid = jnp.broadcast_to(pvalid[None, :, None, :], (L, b, hkv, pw))
    ctx = Context(out.k[:, :, :, :pw], out.v[:, :, :, :pw], valid)
    o2 = model_step(params, cfg, xt, rpos, jnp.ones((b, g, g), bool), [Segment(0, L, ctx)])
    h = jnp.concatenate([last_h, o2.hidden[:, :-1]], axis=1)
    return lm_head(params, cfg, h)


def twin_loss(params, cfg: ModelConfig, batch, cache_grad: bool = False):
    """(loss, accuracy): weighted cross entropy over the masked response positions only."""
    prompt, plen, x0, xt, masked, w, refresh, *pos = batch  # pos: Batch.pos, or none (the default layout)
    logits = twin_logits(params, cfg, prompt, plen, xt, refresh, cache_grad, pos[0] if pos else None)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, x0)
    wm = w * masked
    loss = (ce * wm).sum() / jnp.maximum(wm.sum(), 1e-6)
    acc = ((logits.argmax(-1) == x0) * masked).sum() / jnp.maximum(masked.sum(), 1)
    return loss, acc


def make_optimizer(lr: float, warmup: int, total: int, final_frac: float = 0.2):
    """AdamW (b2 0.98, weight decay 0.01, the block-causal trainer's) after clipping the global
    norm to 1; linear warm-up to `lr`, then cosine to final_frac * lr at step `total`."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(total, warmup + 1),
                                               end_value=lr * final_frac)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.01)), sched


def make_train_step(cfg: ModelConfig, opt, cache_grad: bool = False):
    """A jitted step(params, opt_state, batch) -> (params, opt_state, loss, acc)."""
    return jitted_step(lambda params, batch: twin_loss(params, cfg, batch, cache_grad), opt)


# ----------------------------------------------------------------------------- checkpoints
CKPT = "ckpt.npz"


def save_checkpoint(run_dir: str, params, opt_state, step: int, trained_s: float) -> str:
    """Atomically write params + optimizer state + counters to run_dir/ckpt.npz."""
    os.makedirs(run_dir, exist_ok=True)
    leaves = jax.tree_util.tree_leaves((params, opt_state))
    tmp = os.path.join(run_dir, "ckpt.tmp.npz")
    np.savez(tmp, step=np.int64(step), trained_s=np.float64(trained_s),
             **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})
    path = os.path.join(run_dir, CKPT)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: str, params, opt_state):
    """(params, opt_state, step, trained_s) from run_dir/ckpt.npz, or None when there is none;
    `params` / `opt_state` give the tree structure (and are checked against the stored shapes)."""
    path = os.path.join(run_dir, CKPT)
    if not os.path.exists(path):
        return None
    like, tdef = jax.tree_util.tree_flatten((params, opt_state))
    with np.load(path) as z:
        leaves = [z[f"leaf{i}"] for i in range(len(like))]
        step, trained = int(z["step"]), float(z["trained_s"])
    bad = [i for i, (a, b) in enumerate(zip(like, leaves)) if np.shape(a) != b.shape]
    if bad:
        raise SystemExit(f"{path}: stored shapes differ from the model's (leaves {bad[:5]}); "
                         f"a different model or optimizer was trained in this run dir")
    p, o = jax.tree_util.tree_unflatten(tdef, [jnp.asarray(x, jnp.asarray(a).dtype) for a, x in zip(like, leaves)])
    return p, o, step, trained


# ----------------------------------------------------------------------------- config / export
def twin_config(cfg: ModelConfig) -> ModelConfig:
    """The block-causal testbed config read as the bidirectional twin (shifted logits kept)."""
    return cfg.replace(attention="bidirectional", logits_shift=True)


def twin_hf_config(cfg: ModelConfig) -> dict:
    """config.json of the twin: Dream's model_type and family, Qwen3 layout (q/k norm, no bias),
    bidirectional attention, shifted logits, the testbed's special token ids and decoding
    defaults (block 32, dynamic commit at threshold 0.95)."""
    hf = hf_config(cfg)
    hf.update(architectures=["DreamModel"], model_type="Dream", family="dream", attention="bidirectional",
              logits_shift=True, use_qk_norm=bool(cfg.qk_norm), attention_bias=False)
    return hf


def export_twin(params, cfg: ModelConfig, out_dir: str) -> str:
    """Write the twin as an HF folder: bf16 model.safetensors through the converters' key tables
    (converters.export.save_hf), config.json (twin_hf_config), the testbed's tokenizer.json."""
    import ml_dtypes

    from converters.export import save_hf

    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    save_hf(p, cfg, out_dir, config=twin_hf_config(cfg), dtype=ml_dtypes.bfloat16)
    shutil.copyfile(T.TOKENIZER_PATH, os.path.join(out_dir, "tokenizer.json"))
    return out_dir


# ----------------------------------------------------------------------------- held-out probe
def heldout(params, cfg: ModelConfig, length: int = 1024, n: int = 4,
            tasks=("multikey", "twohop", "longanswer")) -> dict:
    """Dense cached generate through the library's bidirectional engine on a few held-out
    examples per task (seeds 500_000 + i: neither the evaluation's nor training's), scored by the
    suite's scorers: a progress probe, not the reported evaluation."""
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.engine.generate import generate
    from maskahead_jax.model import Model

    tok = T.get_tokenizer()
    model = Model(cfg, params)
    res = {}
    for task in tasks:
        exs = [T.generate(task, length, (i % 5) / 4, 500_000 + i, tok) for i in range(n)]
        prompts = [[T.BOS_ID] + tok.encode(e.prompt, add_special_tokens=False).ids for e in exs]
        out = generate(model, prompts, GenerationConfig(max_new_tokens=TESTBED_MAX_NEW[task]))
        res[task] = round(float(np.mean([e.score(tok.decode(t)) for e, t in zip(exs, out.tokens)])), 3)
    return res


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init-from", default="maskahead_jax/testbed", help="the block-causal export to start from")
    ap.add_argument("--run-dir", default="runs/twin")
    ap.add_argument("--out", default=None, help="export folder (default RUN_DIR/export)")
    ap.add_argument("--minutes", type=float, default=60.0, help="training minutes over all runs together")
    ap.add_argument("--steps", type=int, default=2000, help="schedule length (cosine end); training stops at it")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop at this step (before --steps / --minutes): replays a time-limited run exactly")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="LENGTH:G:ROWS,... cycled step by step")
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--answer-weight", type=float, default=3.0)
    ap.add_argument("--pad-weight", type=float, default=0.5)
    ap.add_argument("--semi-ar", type=float, default=0.7, help="share of semi-autoregressive noise states")
    ap.add_argument("--refresh-prob", type=float, default=0.2, help="rows whose pass 1 reads the noised response")
    ap.add_argument("--cache-grad", action="store_true", help="exact gradient through pass 1 (~3x slower)")
    ap.add_argument("--edge-depths", type=float, default=0.2)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--eval-minutes", type=float, default=20.0, help="held-out probe + export interval (0: off)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--eval-length", type=int, default=1024, help="prompt tokens of the held-out probe")
    long = ap.add_argument_group("long context (issue 53): skip-wise positions, RoPE scaling")
    long.add_argument("--rope-scaling", default=None,
                      help="replace the init export's RoPE scaling, e.g. dynamic_yarn:16:2048 (default: its own)")
    long.add_argument("--max-positions", type=int, default=None, help="replace the init export's max_position_embeddings")
    long.add_argument("--pose-target", type=int, default=0,
                      help="skip-wise prompt positions up to this id (a multiple of 32, <= the max positions; "
                           "0: off, every batch exactly as without it); see twin_positions")
    long.add_argument("--pose-prob", type=float, default=1.0, help="share of eligible rows given skip-wise ids")
    long.add_argument("--pose-min-len", type=int, default=0, help="shapes shorter than this keep arange positions")
    long.add_argument("--pose-chunks", type=int, default=3, help="chunks per prompt (>= 2)")
    long.add_argument("--pose-tail-blocks", type=int, default=1,
                      help="the question's chunk starts 1..N blocks before the response (N >= 1)")
    return ap


def pose_options(args, cfg: ModelConfig, shapes) -> Pose:
    """The Pose of the flags, checked against the config and the shapes."""
    pose = Pose(args.pose_target, args.pose_prob, args.pose_min_len, args.pose_chunks, args.pose_tail_blocks)
    if not pose.target:
        return pose
    widest = max(sh.width + sh.resp for sh in shapes)
    if pose.target % BLOCK or pose.target > cfg.max_position_embeddings or pose.target <= widest:
        raise SystemExit(f"--pose-target {pose.target}: must be a multiple of {BLOCK}, <= the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings}; --max-positions) and "
                         f"> the widest shape's prompt + response ({widest})")
    if not 0.0 < pose.prob <= 1.0 or pose.chunks < 2 or pose.tail_blocks < 1:
        raise SystemExit("--pose-prob must be in (0, 1], --pose-chunks >= 2, --pose-tail-blocks >= 1")
    return pose


def main(argv=None):
    args = build_parser().parse_args(argv)
    shapes = parse_shapes(args.shapes)
    from maskahead_jax.api import load_pretrained

    base = load_pretrained(args.init_from, dtype="float32", rope_scaling=args.rope_scaling,
                           max_position_embeddings=args.max_positions)
    cfg = twin_config(base.config)
    pose = pose_options(args, cfg, shapes)
    params = load_init(args.init_from, base.params)
    opt, sched = make_optimizer(args.lr, args.warmup, args.steps)
    opt_state = opt.init(params)
    step, trained = 0, 0.0
    got = load_checkpoint(args.run_dir, params, opt_state)
    if got is not None:
        params, opt_state, step, trained = got
        print(f"[twin] resumed {args.run_dir} at step {step} ({trained / 60:.1f} trained minutes)", flush=True)
    out = args.out or os.path.join(args.run_dir, "export")
    if args.export_only:
        print(f"[twin] exported step {step} -> {export_twin(params, cfg, out)}")
        return
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)
    tok = T.get_tokenizer()
    train_step = make_train_step(cfg, opt, args.cache_grad)
    t_ckpt = t_eval = time.perf_counter()
    seen = 0
    log = []
    stop = min(args.steps, args.stop_at or args.steps)
    while step < stop and trained < args.minutes * 60:
        shape = shapes[step % len(shapes)]
        t0 = time.perf_counter()
        batch = make_batch(step, args.seed, shape, tok, args.answer_weight, args.pad_weight, args.semi_ar,
                           args.refresh_prob, args.edge_depths, pose=pose)
        params, opt_state, loss, acc = train_step(params, opt_state, tuple(map(jnp.asarray, batch)))
        loss = float(loss)
        trained += time.perf_counter() - t0
        seen += batch.prompt.size + batch.x0.size
        step += 1
        log.append(loss)
        if step % args.log_every == 0:
            print(f"[twin] step {step} loss {np.mean(log):.4f} acc {float(acc):.3f} lr {float(sched(step)):.2e} "
                  f"shape {tuple(shape)} trained {trained / 60:.1f} min tokens {seen}", flush=True)
            log = []
        now = time.perf_counter()
        if now - t_ckpt > args.ckpt_minutes * 60:
            save_checkpoint(args.run_dir, params, opt_state, step, trained)
            t_ckpt = now
        if args.eval_minutes and now - t_eval > args.eval_minutes * 60:
            save_checkpoint(args.run_dir, params, opt_state, step, trained)
            export_twin(params, cfg, os.path.join(args.run_dir, f"export_{step}"))
            print(f"[twin] held-out ({args.eval_length}, n=4) at step {step}: "
                  f"{heldout(params, cfg, args.eval_length)}", flush=True)
            t_eval = t_ckpt = time.perf_counter()
    save_checkpoint(args.run_dir, params, opt_state, step, trained)
    export_twin(params, cfg, out)
    print(f"[twin] done: step {step}, {trained / 60:.1f} trained minutes -> {out}", flush=True)


if __name__ == "__main__":
    main()
