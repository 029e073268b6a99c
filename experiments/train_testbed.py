"""Train the testbed: a small SDAR-layout (Qwen3 keys) block-diffusion model on synthetic retrieval.

Objective (research/models.md §1.3, BD3-LM / Fast-dLLM v2 "two-copy"): the sequence x0 of L tokens
is noised block by block (block 32; per block t ~ U(0,1), mask prob (1-1e-3) t + 1e-3, or with
probability --suffix-prob a "prompt tail + masked answer" pattern: a random cut per block, every
position after it masked), the model reads concat(x_t, x0) with positions concat(arange, arange)
and the mask: x_t block b sees x_t block b (bidirectional) and x0 blocks < b; x0 is block-causal.
Loss: cross entropy on the masked positions of x_t (no token shift: a mask predicts its own token),
answer tokens weighted --answer-weight. Embeddings are tied (copying a context token is then an
identity map through the residual stream).

Data, generated on the fly: (1) the task suite's formats with extra questions appended
(MQAR-style: every answer is retrievable from the context); with the stage's `packed` probability
the context is packed with facts (many keys, little filler); (2) with --copy-prob, induction
sequences (a random segment repeated after short filler). Curriculum over the sequence length,
gated on held-out accuracy (a longer stage starts only once passkey/multikey accuracy reaches
--gate, or 15% of the budget later). Held-out greedy needle accuracy (passkey / multikey /
twohop, threshold decoding of the answer block) is logged every --eval-minutes.

Everything is resumable: orbax checkpoints every --ckpt-minutes in --run-dir; re-running the same
command continues (the time budget counts training time over all runs together; time the process
spends stopped, e.g. by SIGSTOP, does not count, see ActiveClock).

Usage:
  python experiments/train_testbed.py --run-dir runs/tb3           # train 175 min (resumes)
  python experiments/train_testbed.py --run-dir runs/tb3 --export-only   # export the latest checkpoint
  python experiments/train_testbed.py --smoke                      # 2.5-minute loss check
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from maskahead_jax.config import ModelConfig  # noqa: E402
from maskahead_jax.model.decoder import forward_hidden, lm_head  # noqa: E402
from maskahead_jax.model.two_copy import two_copy_hidden, two_copy_mask as _two_copy_mask  # noqa: E402
from maskahead_jax.model.init import init_params  # noqa: E402
from maskahead_jax import tasks as T  # noqa: E402

BLOCK = 32


# The commit threshold an export's config.json carries (and so the held-out probe decodes with): 0.95
# since Dec 3 (0.85 before; docs/testbed_history.md's "Decoding threshold 0.95" chose it on validation seeds).
THRESHOLD = 0.95


# ----------------------------------------------------------------------------- model config
def head_dim(args) -> int:
    """--head-dim, or d_model / heads when it is not given."""
    return getattr(args, "head_dim", None) or args.d_model // args.heads


def make_config(args, vocab: int) -> ModelConfig:
    if getattr(args, "layout", "qwen3") == "qwen2":  # Fast-dLLM v2 layout: q/k/v biases, no q/k norm
        return ModelConfig(
            family="fast_dllm_v2", layout="qwen2", vocab_size=vocab, hidden_size=args.d_model,
            num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
            head_dim=head_dim(args), intermediate_size=args.ffn, rms_eps=1e-6,
            rope_theta=args.rope_theta, qk_norm=False, qkv_bias=True,
            tie_embeddings=not getattr(args, "untied", False),
            attention="block_causal", logits_shift=getattr(args, "logits_shift", False), mask_token_id=T.MASK_ID,
            eos_token_ids=(T.EOS_ID,), pad_token_id=T.PAD_ID, block_size=BLOCK,
            commit_rule="dynamic", threshold=THRESHOLD, max_position_embeddings=8192)
    return ModelConfig(
        family="sdar", layout="qwen3", vocab_size=vocab, hidden_size=args.d_model,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=head_dim(args), intermediate_size=args.ffn, rms_eps=1e-6,
        rope_theta=args.rope_theta, qk_norm=not getattr(args, "no_qk_norm", False),
        tie_embeddings=not getattr(args, "untied", False),
        attention="block_causal", logits_shift=getattr(args, "logits_shift", False), mask_token_id=T.MASK_ID,
        eos_token_ids=(T.EOS_ID,), pad_token_id=T.PAD_ID, block_size=BLOCK,
        commit_rule="dynamic", threshold=THRESHOLD, max_position_embeddings=8192)


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "family": "sdar",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "use_qk_norm": cfg.qk_norm, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": "bfloat16",
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "pad_token_id": cfg.pad_token_id, "bos_token_id": T.BOS_ID, "block_size": cfg.block_size,
        "attention": cfg.attention, "logits_shift": cfg.logits_shift, "commit_rule": cfg.commit_rule,
        "threshold": cfg.threshold,
    }


# ----------------------------------------------------------------------------- data
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


MQAR_TEMPLATES = ("list", "sentence", "question")


TASK_WEIGHTS = (0.22, 0.3, 0.18, 0.15, 0.15)  # passkey, multikey, twohop, docqa, longanswer
PROMPT_FRAC = (0.45, 0.85)  # an unpacked context's share of the sequence (--prompt-frac)
PACKED_TASKS = ("multikey", "twohop", "longanswer", "docqa")  # the tasks a packed context can hold
PACKED_WEIGHTS = (0.45, 0.2, 0.2, 0.15)  # their weights, in PACKED_TASKS' order


def train_sequence(r: random.Random, L: int, tok, answer_weight: float, dense: float = 0.0,
                   copy: float = 0.0, task_weights=TASK_WEIGHTS, packed_weights=PACKED_WEIGHTS,
                   mqar: float = 0.0, mqar_pairs=None, mqar_templates=("list",),
                   prompt_frac=PROMPT_FRAC, edge_depths: float = 0.0, hard_keys: float = 0.0):
    """One clean training sequence of exactly L tokens and its per-token loss weights.

    An unpacked needle context takes a fraction U(prompt_frac) of L (the rest: extra questions);
    an evaluation at length n reads an n-token prompt, so a stage of length L trains prompts
    up to prompt_frac[1] * L only. The needle's depth is U(0, 1), or with probability
    `edge_depths` one of the two ends (0: right after [BOS]; 1: right before the question).
    With probability `hard_keys` a multi-key context holds 1-4 distractor keys that share one
    word with the asked key (make_multikey's n_sharing).

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
            kw["n_keys"] = max(2, n // 15) if packed else r.randint(2, max(2, min(64, n // 24)))
            if hard_keys and r.random() < hard_keys:  # (no extra draw at 0: old recipes reproduce)
                kw["n_sharing"] = r.randint(1, min(4, kw["n_keys"] - 1))
        elif task == "twohop":
            kw["n_decoys"] = max(1, n // 22 - 1) if packed else r.randint(0, max(0, min(8, n // 40 - 1)))
        elif task == "docqa":
            kw["n_docs"] = max(1, n // 45) if packed else r.randint(1, max(1, min(24, n // 60)))
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
                hard_keys=parse_probability(g("hard_keys"), "--hard-keys"))


def check_data_flags(args) -> None:
    """Parse every data flag once at startup, so that a malformed value fails before the model is
    built (make_batch parses them again for each batch, also in --workers' processes)."""
    data_options(args)
    parse_stages(args.smoke_stage if args.smoke else args.stages)
    if getattr(args, "answer_mask_max_len", 0) < 0:
        raise SystemExit(f"bad --answer-mask-max-len {args.answer_mask_max_len}: need a token count >= 0 "
                         "(0: no limit)")
    if parse_grow_after(getattr(args, "grow_after", None)) and not getattr(args, "init_from", None):
        raise SystemExit("--grow-after deepens the model loaded by --init-from; pass --init-from too")
    if getattr(args, "grow_heads", False) and not getattr(args, "init_from", None):
        raise SystemExit("--grow-heads widens the model loaded by --init-from; pass --init-from too")


def longest_run(flags: np.ndarray) -> np.ndarray:
    """The length of the longest run of True in each row of `flags` [B, L] -> [B]."""
    best = np.zeros(flags.shape[0], np.int64)
    cur = np.zeros_like(best)
    for col in flags.T:
        cur = np.where(col, cur + 1, 0)
        best = np.maximum(best, cur)
    return best


def make_batch(step: int, seed: int, B: int, L: int, tok, args, dense: float = 0.0):
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
    return xt.astype(np.int32), x0, masked, w


def two_copy_mask(L: int) -> np.ndarray:
    """The dense [2L, 2L] two-copy mask at the testbed's block size (model.two_copy_mask)."""
    return _two_copy_mask(L, BLOCK)


# ----------------------------------------------------------------------------- training
def two_copy_logits(params, cfg, xt, x0, chunk: int = 512):
    """Logits [B, L, V] of the noisy copy x_t [B, L] in the two-copy layout: x_t block b reads
    itself and the clean x0 [B, L] blocks < b (two_copy_mask), positions concat(arange, arange).
    The forward is model.two_copy_hidden (chunked, no dense 2L x 2L mask; same numbers)."""
    L = xt.shape[1]
    h = two_copy_hidden(params, cfg, xt, x0, chunk)
    if not cfg.logits_shift:
        return lm_head(params, cfg, h[:, :L])
    # shifted logits (Fast-dLLM v2): token p is predicted at p - 1; a block's first token from the
    # clean copy's last position of the previous block (what generation reads from its cache)
    first = (jnp.arange(L) % BLOCK == 0)[None, :, None]
    src = jnp.where(first, jnp.roll(h[:, L:], 1, axis=1), jnp.roll(h[:, :L], 1, axis=1))
    return lm_head(params, cfg, src)  # position 0 has no predictor: the loss skips it


def make_train_step(cfg, opt, L):
    def loss_fn(params, xt, x0, masked, w):
        logits = two_copy_logits(params, cfg, xt, x0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, x0)
        wm = w * masked
        if cfg.logits_shift:
            wm = wm.at[:, 0].set(0.0)
        loss = (ce * wm).sum() / jnp.maximum(wm.sum(), 1.0)
        acc = ((logits.argmax(-1) == x0) * masked).sum() / jnp.maximum(masked.sum(), 1)
        return loss, acc

    @jax.jit
    def step(params, opt_state, xt, x0, masked, w):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, xt, x0, masked, w)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, acc

    return step


# ----------------------------------------------------------------------------- held-out eval
def make_decoder(cfg):
    @jax.jit
    def pred(params, toks):
        b, t = toks.shape
        logits = lm_head(params, cfg, forward_hidden(params, cfg, toks))
        if cfg.logits_shift:  # token p is predicted at p - 1 (position 0 is [BOS], never a mask)
            logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
        prob = jax.nn.softmax(logits, -1)
        return prob.argmax(-1), prob.max(-1)

    return pred


def greedy_answers(params, cfg, pred, prompts_ids, max_new: int, threshold: float | None = None,
                   total: int | None = None):
    """Threshold decoding of the answer blocks (at least one commit per step, highest confidence
    first), batched: prompt + masks to the end of the block holding prompt+max_new, PAD after.
    threshold: None -> the config's (as the library's generate resolves it)."""
    threshold = cfg.threshold if threshold is None else threshold
    B = len(prompts_ids)
    ends = [((len(p) + max_new + BLOCK - 1) // BLOCK) * BLOCK for p in prompts_ids]
    T_ = max(total or 0, -(-max(ends) // 64) * 64)
    toks = np.full((B, T_), T.PAD_ID, np.int32)
    for i, p in enumerate(prompts_ids):
        toks[i, :len(p)] = p
        toks[i, len(p):ends[i]] = T.MASK_ID
    for _ in range(max_new + 2 * BLOCK):
        ism = toks == T.MASK_ID
        if not ism.any():
            break
        am, conf = pred(params, jnp.asarray(toks))
        am, conf = np.asarray(am), np.asarray(conf)
        for i in range(B):
            mpos = np.nonzero(ism[i])[0]
            if not len(mpos):
                continue
            blk = mpos[0] // BLOCK
            cand = mpos[mpos // BLOCK == blk]
            c = conf[i, cand]
            sel = cand[c >= threshold]
            if not len(sel):
                sel = cand[[int(np.argmax(c))]]
            toks[i, sel] = am[i, sel]
    outs = []
    for i, p in enumerate(prompts_ids):
        gen = list(toks[i, len(p):ends[i]])
        if T.EOS_ID in gen:
            gen = gen[:gen.index(T.EOS_ID)]
        outs.append(gen)
    return outs


def heldout_eval(params, cfg, pred, tok, L: int, n: int = 16, tasks=("passkey", "multikey", "twohop")):
    res = {}
    ctx = L - 24
    for task in tasks:
        exs = [T.generate(task, ctx, (i % 5) / 4, 900_000 + i, tok) for i in range(n)]
        prompts = [tok.encode(e.prompt).ids for e in exs]
        # 16 tokens: room for two-hop's chained answer ("U . unit U holds code K", ~9 tokens)
        outs = greedy_answers(params, cfg, pred, prompts, 16, total=L + 64)
        texts = [tok.decode(o) for o in outs]
        res[task] = float(np.mean([e.score(t) for e, t in zip(exs, texts)]))
        # how often the answer is *some* number of the context: near 1 with exact match at chance
        # means the model retrieves a value but does not match the key (multikey, twohop)
        firsts = [T.first_number(t) for t in texts]
        res[task + "_from_context"] = round(float(np.mean([
            bool(f) and f" {f} " in f" {e.prompt} " for e, f in zip(exs, firsts)])), 3)
    return res


# ----------------------------------------------------------------------------- export
def export_hf(params, cfg: ModelConfig, out_dir: str, extra_card: str = ""):
    """Write the params as an HF folder: bfloat16 safetensors (the converters' key maps run
    backwards, converters.export), config.json (hf_config) and the testbed tokenizer."""
    import ml_dtypes

    from converters.export import save_hf

    P = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    save_hf(P, cfg, out_dir, config=hf_config(cfg), dtype=ml_dtypes.bfloat16)
    T.save_tokenizer(os.path.join(out_dir, "tokenizer.json"))
    return out_dir



# ----------------------------------------------------------------------------- data workers
_WORKER = {}


def _worker_init(args):
    _WORKER["tok"] = T.build_tokenizer()
    _WORKER["args"] = args


def _worker_batch(step: int, B: int, L: int, dense: float):
    return make_batch(step, _WORKER["args"].seed, B, L, _WORKER["tok"], _WORKER["args"], dense)


class BatchPrefetcher:
    """Builds batches in `workers` spawned CPU processes, `ahead` steps in advance.

    Batch contents depend only on (seed, step, B, L, dense), so a prefetched batch equals the one
    make_batch would build inline. `get` takes the current stage's schedule, shape_of(step) ->
    (B, L, dense), and queues each future step with its own shape, so a stage that alternates
    lengths step by step is prefetched as well as a one-length stage; at a stage change the queued
    batches whose shape the new schedule no longer gives are dropped and built again."""

    def __init__(self, args, workers: int, ahead: int = 0):
        import multiprocessing as mp

        saved = os.environ.get("JAX_PLATFORMS")
        os.environ["JAX_PLATFORMS"] = "cpu"  # the workers never touch the accelerator
        try:
            self.pool = mp.get_context("spawn").Pool(workers, _worker_init, (args,))
        finally:
            if saved is None:
                os.environ.pop("JAX_PLATFORMS")
            else:
                os.environ["JAX_PLATFORMS"] = saved
        self.ahead = ahead or 2 * workers
        self.queue = []  # [(step, (B, L, dense), AsyncResult)], consecutive steps

    def get(self, step: int, shape_of):
        """The batch of `step`; shape_of(s) -> (B, L, dense) is the schedule from `step` on."""
        # keep the queued run of steps from `step` on that the schedule still agrees with
        q = [e for e in self.queue if e[0] >= step]
        keep = 0
        while keep < len(q) and q[keep][0] == step + keep and q[keep][1] == shape_of(step + keep):
            keep += 1
        self.queue = q[:keep]
        nxt = self.queue[-1][0] + 1 if self.queue else step
        while nxt < step + self.ahead:
            shape = shape_of(nxt)
            self.queue.append((nxt, shape, self.pool.apply_async(_worker_batch, (nxt, *shape))))
            nxt += 1
        s, _, res = self.queue.pop(0)
        assert s == step
        return res.get()

    def close(self):
        self.pool.terminate()


class ActiveClock:
    """Seconds of this process's life, leaving out the time it spent stopped (SIGSTOP, a suspended
    machine), so that pausing a run does not spend its --minutes budget.

    A daemon thread wakes every `tick` seconds; a gap longer than `gap` between two wake-ups can only
    mean the whole process was not running, and that gap (less one tick) is left out. Reading the
    clock just after a resume may still include the pause; the next reading takes it back, so sums of
    differences are right. A thread starved for longer than `gap` also reads as stopped (harmless:
    the run trains a little longer)."""

    def __init__(self, tick: float = 0.5, gap: float = 10.0):
        import threading

        self.tick, self.gap = tick, gap
        self.stopped = 0.0  # seconds left out so far
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="active-clock")
        self._thread.start()

    def _beat(self):
        last = time.monotonic()
        while not self._done.wait(self.tick):
            now = time.monotonic()
            if now - last > self.gap:
                with self._lock:
                    self.stopped += now - last - self.tick
            last = now

    def __call__(self) -> float:
        with self._lock:
            return time.monotonic() - self.stopped

    def close(self):
        self._done.set()
        self._thread.join()


_OUTPUT_PROJECTIONS = (("wo",), ("mlp", "down"))  # a layer's writes into the residual stream


def parse_grow_after(text) -> list[int]:
    """--grow-after '1,3' -> [1, 3]: the original layers after which a new layer goes."""
    if not text:
        return []
    try:
        out = sorted(int(x) for x in str(text).split(","))
    except ValueError:
        raise SystemExit(f"--grow-after {text!r}: want layer indices, e.g. 1,3") from None
    if any(i < 0 for i in out):
        raise SystemExit(f"--grow-after {text!r}: layer indices must be >= 0")
    return out


def grow_layers(params, after: list[int]):
    """Deeper params that compute the same function: after each original layer i in `after`, a copy
    of layer i whose output projections (attention `wo`, MLP `down`) are zero, so it adds nothing
    to the residual stream until training moves them. Its queries and keys start as layer i's, so
    its attention reads what layer i reads. params["layers"] leaves are stacked [num_layers, ...]."""
    layers = params["layers"]
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    bad = [i for i in after if i >= n]
    if bad:
        raise SystemExit(f"--grow-after: layer {bad[0]} does not exist (the model has {n} layers: 0..{n - 1})")
    order = []  # (source layer, zeroed output projections)
    for i in range(n):
        order.append((i, False))
        order += [(i, True)] * after.count(i)

    def grow(path, a):
        keys = tuple(getattr(k, "key", k) for k in path)
        out = any(keys[-len(o):] == o for o in _OUTPUT_PROJECTIONS)
        return jnp.stack([jnp.zeros_like(a[i]) if z and out else a[i] for i, z in order])

    return {**params, "layers": jax.tree_util.tree_map_with_path(grow, layers)}


def _append_heads(a, n_new: int, axis: int, key=None):
    """`a` with n_new heads appended on `axis`: random with a's spread (`key` given) or zeros."""
    shape = a.shape[:axis] + (n_new,) + a.shape[axis + 1:]
    extra = jnp.std(a) * jax.random.normal(key, shape, a.dtype) if key is not None else jnp.zeros(shape, a.dtype)
    return jnp.concatenate([a, extra], axis)


def grow_heads(params, heads: int, kv_heads: int, key):
    """Params with more attention heads that compute the same function: new query heads are
    appended after the old ones and new key/value heads after theirs (the query -> key/value
    grouping, head h reading kv head h // (heads / kv_heads), must stay the same, so the old heads
    keep their keys), new projections are random with the spread of the old ones (biases zero),
    and the new heads' rows of the output projection `wo` are zero: they add nothing to the
    residual stream until training moves them. Stacked layer groups: [n, d, heads, head_dim]."""
    out = dict(params)
    for name in ("layers", "moe_layers"):
        if name not in params:
            continue
        lay = dict(params[name])
        h, hk = lay["wq"].shape[2], lay["wk"].shape[2]
        if heads < h or kv_heads < hk or heads * hk != kv_heads * h:
            raise SystemExit(f"--grow-heads: {h} query / {hk} key-value heads cannot grow into {heads} / "
                             f"{kv_heads} (need at least as many of each, {h // hk} query heads per "
                             "key-value head as before)")
        key, *keys = jax.random.split(key, 4)
        new = {"q": heads - h, "k": kv_heads - hk, "v": kv_heads - hk}
        for (p, n_new), k in zip(new.items(), keys):
            lay[f"w{p}"] = _append_heads(lay[f"w{p}"], n_new, 2, k)  # [n, d, heads, head_dim]
            if f"b{p}" in lay:
                lay[f"b{p}"] = _append_heads(lay[f"b{p}"], n_new, 1)  # [n, heads, head_dim]
        lay["wo"] = _append_heads(lay["wo"], heads - h, 1)  # [n, heads, head_dim, d]
        out[name] = lay
    return out


def load_init(path: str, like, grow_after=(), widen_heads: bool = False, seed: int = 0):
    """The float32 params of an exported folder (deepened by grow_layers when `grow_after` names
    layers, given `like`'s head counts by grow_heads when `widen_heads`), checked against `like`
    (the configured model)."""
    from maskahead_jax.api import load_pretrained

    loaded = load_pretrained(path, dtype="float32").params
    if grow_after:
        loaded = grow_layers(loaded, list(grow_after))
    if widen_heads:
        group = like.get("layers", like.get("moe_layers"))
        loaded = grow_heads(loaded, group["wq"].shape[2], group["wk"].shape[2],
                            jax.random.PRNGKey(seed + 1))
    want = jax.tree_util.tree_map(lambda a: a.shape, like)
    got = jax.tree_util.tree_map(lambda a: a.shape, loaded)
    if want != got:
        raise SystemExit(f"--init-from {path}: parameter shapes {got} do not match the "
                         f"configured model {want} (pass the same --layers/--d-model/... it was trained with; "
                         f"with --grow-after, --layers counts the new layers too; with --grow-heads, "
                         f"--heads/--kv-heads the new heads and --head-dim stays the loaded one)")
    return loaded


# ----------------------------------------------------------------------------- main
def curriculum(frac: float, stages, current: int = 0, heldout: float = 1.0, gate: float = 0.0,
               slack: float = 0.15) -> int:
    """stages: parse_stages' list of (start_fraction, ((L, B), ...), packed). Returns the index
    of the stage to train.

    The next stage is entered once its start fraction is reached and the held-out accuracy of the
    current stage is at least `gate` (grow the context only after retrieval appears), or anyway
    `slack` of the budget later, so the run always reaches the long contexts."""
    k = current
    while k + 1 < len(stages) and frac >= stages[k + 1][0] and (
            heldout >= gate or frac >= stages[k + 1][0] + slack):
        k += 1
    return k


def parse_stages(s: str):
    """"start:L:B[:packed],..." -> [(start, ((L, B), ...), packed)]. A stage may alternate
    lengths step by step: "0.8:512|2560:8|2:0.3" trains 512 x 8 and 2560 x 2 in turn (keeps the
    short contexts' skills while the long ones are trained; --workers prefetch each step with its
    own shape)."""
    out = []
    for part in s.split(","):
        f = part.split(":")
        if len(f) not in (3, 4):
            raise SystemExit(f"bad stage {part!r}: want start:L:B[:packed]")
        ls, bs = f[1].split("|"), f[2].split("|")
        if len(ls) != len(bs):
            raise SystemExit(f"bad stage {part!r}: {len(ls)} lengths but {len(bs)} batch sizes")
        out.append((float(f[0]), tuple((int(a), int(b)) for a, b in zip(ls, bs)),
                    float(f[3]) if len(f) > 3 else 0.0))
    return out


def stage_shape(stage, step: int):
    """(L, B) of a parsed stage at this step (alternating stages cycle through their lengths)."""
    shapes = stage[1]
    return shapes[step % len(shapes)]


def batch_shape(stage, step: int):
    """(B, L, dense) of a parsed stage's batch at this step: what make_batch and the prefetcher take."""
    L, B = stage_shape(stage, step)
    return B, L, stage[2]


def main(argv=None):
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
    args = ap.parse_args(argv)
    check_data_flags(args)

    import orbax.checkpoint as ocp
    from tqdm import tqdm

    tok = T.build_tokenizer()
    assert tok.get_vocab_size() <= args.vocab
    cfg = make_config(args, args.vocab)
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    if args.init_from:
        params = load_init(args.init_from, params, parse_grow_after(args.grow_after), args.grow_heads, args.seed)
        print(f"initialized from {args.init_from}", flush=True)
        init_cfg = os.path.join(args.init_from, "config.json")
        init_shift = False
        if os.path.exists(init_cfg):
            with open(init_cfg) as f:
                init_shift = json.load(f).get("logits_shift") is True
        if init_shift and not args.logits_shift:
            print(f"warning: {args.init_from} predicts with shifted logits (config logits_shift true) but "
                  "this run trains without --logits-shift: its lookups will have to form again", flush=True)
    nparam = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"params: {nparam / 1e6:.2f}M  cfg: {cfg}", flush=True)
    opt = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(learning_rate, b1=0.9, b2=0.98, weight_decay=0.01))
    )(learning_rate=args.lr)
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
    if args.export_only:
        if mngr is None or mngr.latest_step() is None:
            print("no checkpoint to export"); return 1
        export_hf(state["params"], cfg, args.out)
        print(f"exported step {int(state['step'])} to {args.out}")
        return 0

    budget = 60 * (2.5 if args.smoke else args.minutes)
    stages = parse_stages(args.smoke_stage) if args.smoke else parse_stages(args.stages)
    params, opt_state = state["params"], state["opt_state"]
    step, elapsed = int(state["step"]), float(state["elapsed"])
    steps_fns = {}
    pred = make_decoder(cfg)
    log_path = os.path.join(run_dir, "metrics.jsonl") if mngr else None
    clock = ActiveClock()  # training time: wall time less any time the process was stopped
    t_last = clock()
    last_ckpt, last_eval = elapsed, elapsed
    pbar = tqdm(total=int(budget), initial=int(elapsed), unit="s", dynamic_ncols=True, mininterval=5)
    wall_start = time.time()
    wall_limit = 60 * args.wall_minutes if args.wall_minutes else float("inf")
    last_export = elapsed
    prefetch = BatchPrefetcher(args, args.workers) if args.workers else None
    ema = None
    stage, heldout = 0, 0.0
    if log_path and os.path.exists(log_path):  # resume: the gate sees the last held-out accuracy
        for line in open(log_path):
            rec = json.loads(line)
            if "eval" in rec:
                heldout = float(np.mean([rec["eval"]["passkey"], rec["eval"]["multikey"]]))

    def save():
        if mngr is None or mngr.latest_step() == step:  # already saved at this step (orbax refuses twice)
            return
        st = {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int64), "elapsed": np.asarray(elapsed, np.float64)}
        mngr.save(step, args=ocp.args.StandardSave(st), force=True)
        mngr.wait_until_finished()

    def log(rec):
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    while elapsed < budget and time.time() - wall_start < wall_limit:
        frac = elapsed / budget
        stage = curriculum(frac, stages, stage, heldout, args.gate)
        B, L, dense = batch_shape(stages[stage], step)
        if L not in steps_fns:
            steps_fns[L] = make_train_step(cfg, opt, L)
        decay = 1.0 if args.constant_lr else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * decay
        opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        if prefetch:
            xt, x0, masked, w = prefetch.get(step, functools.partial(batch_shape, stages[stage]))
        else:
            xt, x0, masked, w = make_batch(step, args.seed, B, L, tok, args, dense)
        params, opt_state, loss, acc = steps_fns[L](params, opt_state, xt, x0, masked, w)
        loss = float(loss)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        now = clock()
        elapsed += now - t_last
        t_last = now
        pbar.n = int(min(elapsed, budget))
        pbar.set_postfix(step=step, L=L, loss=f"{ema:.3f}", acc=f"{float(acc):.2f}", lr=f"{lr:.1e}", refresh=False)
        pbar.update(0)
        if step % 25 == 0:
            log({"step": step, "elapsed": elapsed, "L": L, "loss": ema, "acc": float(acc), "lr": lr})
        if elapsed - last_eval >= 60 * args.eval_minutes or (args.smoke and elapsed >= budget):
            te = time.time()
            res = heldout_eval(params, cfg, pred, tok, min(L, 512) if not args.smoke else 128, n=args.eval_n)
            print(f"\n[eval] step {step} L={L} elapsed {elapsed / 60:.1f}m loss {ema:.3f} heldout {res} "
                  f"({time.time() - te:.0f}s)", flush=True)
            log({"step": step, "elapsed": elapsed, "eval": res, "eval_L": min(L, 512)})
            heldout = float(np.mean([res["passkey"], res["multikey"]]))
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
        res = heldout_eval(params, cfg, pred, tok, 128, n=args.eval_n)
        print(f"smoke done: step {step} loss {ema:.3f} heldout@128 {res}")
        return 0
    export_hf(params, cfg, args.out)  # first: the weights are out even if the checkpoint fails
    save()
    for Lf in (int(x) for x in args.final_lengths.split(",") if x.strip()):
        res = heldout_eval(params, cfg, pred, tok, Lf, n=32)
        print(f"[final eval] L={Lf} {res}", flush=True)
        log({"step": step, "final_eval": res, "eval_L": Lf})
    print(f"exported to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
