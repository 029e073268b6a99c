"""Real long rows for the block-causal trainer (--real-long L:TAIL:EVERY, issue 53).

Skip-wise positions teach the testbed far distances inside <= 2048-token windows, but never the
dilution of a real 8192-token context: every query then spreads its attention over 4x the keys
any window had (the twin's pass key at 8192 moved only once it saw real long prompts). The
two-copy objective over a whole 8192-token row does not fit in 24 GB here, so a real long row is
trained as generation reads it: the row's first L - TAIL tokens (clean) go through one forward
without gradient, which leaves every layer's keys / values (the prompt cache), and only its last
TAIL tokens (the question and the answer, the prompt's last blocks) are trained in the two-copy
layout on top of that cache. The logits are the whole row's two-copy logits at the tail, number
for number (tests/test_real_long.py); the gradient leaves out the prefix's keys / values, or, with
--real-long-prefix-kv-grad (stage 40), takes them through their own layer's K / V projections
(each layer's input hidden states held constant): the far keys a question wrongly matches then
learn to score lower, not only the query and the near keys.

Every EVERY-th step is such a row (batch 1); the rows are task rows whose prompt ends inside the
tail (the depth's needle, the question and its answer there; the far context in the cache), and
with --pose-target they take skip-wise ids like the other rows (real dilution at far distances).
"""
from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maskahead_jax.kernels.reference import NEG_INF, chunking
from maskahead_jax.model.decoder import (Context, Segment, dense_layer, embed, full_mask, lm_head,
                                         model_step, project_qkv)
from maskahead_jax.model.layers import rms_norm, rope_tables
from maskahead_jax.model.two_copy import two_copy_mask

from .data import BLOCK, make_batch
from .objective import jitted_step, masked_loss


@dataclasses.dataclass(frozen=True)
class RealLong:
    length: int = 0  # the row's tokens (0: off)
    tail: int = 512  # the trained tail (a multiple of the block)
    every: int = 4  # one step in `every` is a real long row

    @property
    def prefix(self) -> int:
        return self.length - self.tail

    def due(self, step: int) -> bool:
        """Whether training step `step` (0-based) is a real long row."""
        return bool(self.length) and step % self.every == self.every - 1


def parse_real_long(text) -> RealLong:
    """'L:TAIL:EVERY' (e.g. 8192:512:4) -> RealLong; None / '' / '0' -> off. A malformed value
    exits with a message naming --real-long."""
    if not text or str(text).strip() == "0":
        return RealLong()
    parts = str(text).split(":")
    try:
        length, tail, every = (int(p) for p in parts)
    except ValueError:
        raise SystemExit(f"bad --real-long {text!r}: need L:TAIL:EVERY, e.g. 8192:512:4") from None
    if length <= 0 or tail <= 0 or length % BLOCK or tail % BLOCK or tail >= length:
        raise SystemExit(f"bad --real-long {text!r}: L and TAIL must be positive multiples of the block "
                         f"({BLOCK}) with TAIL < L")
    if every < 1:
        raise SystemExit(f"bad --real-long {text!r}: EVERY must be >= 1")
    return RealLong(length, tail, every)


def row_args(args, spec: RealLong):
    """The data flags of a real long row: task rows only (no copy / MQAR-only / packed rows) whose
    prompt ends inside the tail: its share of the row is U((L - 0.9 TAIL) / L, (L - 0.3 TAIL) / L).
    --real-long-task-weights / --real-long-edge-depths / --real-long-hard-keys, when given, replace
    --task-weights / --edge-depths / --hard-keys for these rows (the long rows' own mix; stage 38);
    --real-long-most-distractors
    gives that share of them the most keys / documents / decoys their length allows (stage 39)."""
    a = copy.copy(args)
    if getattr(args, "real_long_task_weights", None):
        a.task_weights = args.real_long_task_weights
    if getattr(args, "real_long_edge_depths", None) is not None:
        a.edge_depths = args.real_long_edge_depths
    if getattr(args, "real_long_hard_keys", None) is not None:
        a.hard_keys = args.real_long_hard_keys
    a.most_distractors = getattr(args, "real_long_most_distractors", None)
    lo, hi = (spec.length - 0.9 * spec.tail) / spec.length, (spec.length - 0.3 * spec.tail) / spec.length
    a.prompt_frac = f"{lo:.6f}:{hi:.6f}"
    a.copy_prob, a.mqar_prob = 0.0, 0.0
    return a


def make_long_batch(step: int, seed: int, tok, args, spec: RealLong):
    """(prefix [1, P], prefix ids [1, P], x_t / x0 / masked / w / ids of the tail [1, TAIL]): the
    batch of `step` at length L (make_batch's noise, answer-only rows and skip-wise ids), the
    prefix clean as a prompt is."""
    out = make_batch(step, seed, 1, spec.length, tok, row_args(args, spec), dense=0.0)
    xt, x0, masked, w = out[:4]
    pos = out[4] if len(out) > 4 else np.arange(spec.length, dtype=np.int32)[None]
    p = spec.prefix
    return (x0[:, :p], pos[:, :p], xt[:, p:], x0[:, p:], masked[:, p:], w[:, p:], pos[:, p:])


GRAD_MODES = ("none", "kv", "full")
PREFIX_CHUNK = 512  # query rows a softmax of the prefix pass with gradient ("full") takes at once


def prefix_attention(q, k, v, blocks, chunk: int):
    """Block-causal attention of the clean prefix, differentiable: q [B, Hkv, G, P, Dh], k / v
    [B, Hkv, P, Dh], blocks [B, P] each token's block (its id // block size, as full_mask has it)
    -> [B, Hkv, G, P, Dh]. Query rows in chunks of `chunk` (a multiple of the block), each chunk
    one softmax over the keys up to its end, so no [P, P] array is built whole (the library's
    chunked path is a fori_loop, which has no reverse mode)."""
    b, hk, g, p, d = q.shape
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    outs = []
    for a in range(0, p, chunk):
        e = min(a + chunk, p)
        lg = jnp.einsum("bhgtd,bhsd->bhgts", q[..., a:e, :], k[..., :e, :],
                        preferred_element_type=jnp.float32) * scale
        ok = blocks[:, None, None, None, :e] <= blocks[:, None, None, a:e, None]
        w = jax.nn.softmax(jnp.where(ok, lg, NEG_INF), axis=-1)
        outs.append(jnp.einsum("bhgts,bhsd->bhgtd", w.astype(v.dtype), v[..., :e, :],
                               preferred_element_type=jnp.float32))
    return jnp.concatenate(outs, axis=3).astype(q.dtype)


def _prefix_with_grad(params, cfg, prefix, ppos, cos, sin, chunk: int):
    """The clean prefix [B, P] through every layer with gradient (each layer rematerialised in the
    backward, so only its input is kept): (final hidden [B, P, D], K, V [L, B, Hkv, P, Dh])."""
    blocks = ppos.astype(jnp.int32) // cfg.block_size

    def layer(x, lp):
        x, k, v = dense_layer(lp, x, cos, sin, cfg, lambda *qkv: prefix_attention(*qkv, blocks, chunk))
        return x, (k, v)

    x, (k, v) = jax.lax.scan(jax.checkpoint(layer), embed(params, prefix), params["layers"])
    return rms_norm(x, params["final_norm"], cfg.rms_eps), k, v


def prefix_cache(params, cfg, prefix, ppos, last_pos, grad: str = "none"):
    """The clean prefix [B, P] at ids ppos through every layer: (Context over its keys / values,
    its last position's final hidden state [B, 1, D]). An inert token at the row's last id
    last_pos [B, 1] (a later block than every prefix token: none of them reads it) makes a
    length-dependent RoPE (dynamic_yarn) read the whole row's extent, as the tail's pass does.

    grad (the same numbers in each): "none", the pass takes no gradient; "kv", the keys / values
    are recomputed from each layer's input hidden state (held constant) with the parameters, so a
    loss on them reaches every layer's norm and K / V projections (one layer deep; stage 40);
    "full", the whole pass takes gradient (every layer, the embeddings; the 8192-token long step
    ~2x stage 40's, experiments/testbed/bench_long_step.py)."""
    if grad not in GRAD_MODES:
        raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}")
    if grad != "none" and cfg.num_dense_mlp_layers != cfg.num_layers:
        raise ValueError("a prefix with gradient: a mixture-of-experts stack is not supported")
    b, p = prefix.shape
    pos = jnp.concatenate([ppos, last_pos], 1).astype(jnp.int32)
    if grad == "full":
        cos, sin = rope_tables(pos, cfg)  # the row's extent (dynamic_yarn), then the prefix's rows
        h, k, v = _prefix_with_grad(params, cfg, prefix, ppos, cos[:, :p], sin[:, :p], PREFIX_CHUNK)
        valid = jnp.ones((cfg.num_layers, b, cfg.num_kv_heads, p), bool)
        return Context(k, v, valid), h[:, p - 1:p]
    sp = jax.lax.stop_gradient(params)
    toks = jnp.concatenate([prefix, jnp.full((b, 1), cfg.mask_token_id, prefix.dtype)], 1)
    hook = (lambda layer, lp, x_in, cos, sin, kb, vb: x_in) if grad == "kv" else None
    out = model_step(sp, cfg, toks, pos, full_mask(pos, "block_causal", cfg.block_size),
                     [Segment(0, cfg.num_layers, None)], layer_hook=hook)
    if grad == "kv":
        cos, sin = rope_tables(pos, cfg)
        x_in = jax.lax.stop_gradient(out.k)  # [L, B, P + 1, D]: every layer's input
        kv = jax.vmap(lambda lp, x: project_qkv(lp, x, cos, sin, cfg)[1:])(params["layers"], x_in)
        k, v = (a[:, :, :, :p] for a in kv)
    else:
        k, v = (jax.lax.stop_gradient(a[:, :, :, :p]) for a in (out.k, out.v))
    valid = jnp.ones((cfg.num_layers, b, cfg.num_kv_heads, p), bool)
    return Context(k, v, valid), jax.lax.stop_gradient(out.hidden[:, p - 1:p])


def tail_logits(params, cfg, prefix, ppos, xt, x0, tpos, grad: str = "none"):
    """Logits [B, TAIL, V] of the tail's noisy copy xt [B, TAIL] in the two-copy layout over the
    prefix cache: x_t block b reads the prefix, the clean x0 blocks < b and itself; x0 reads the
    prefix and its blocks <= b (what objective.two_copy_logits computes over the whole row there)."""
    ctx, last_h = prefix_cache(params, cfg, prefix, ppos, tpos[:, -1:], grad)
    b, t = xt.shape
    mask = jnp.broadcast_to(jnp.asarray(two_copy_mask(t, cfg.block_size)), (b, 2 * t, 2 * t))
    pos = jnp.concatenate([tpos, tpos], 1).astype(jnp.int32)
    with chunking(min_elems=1 << 62):  # the one-softmax path: the chunked one's loop has no gradient
        h = model_step(params, cfg, jnp.concatenate([xt, x0], 1), pos, mask,
                       [Segment(0, cfg.num_layers, ctx)]).hidden
    if not cfg.logits_shift:
        return lm_head(params, cfg, h[:, :t])
    # token p from p - 1: a block's first token from the clean copy (the tail's first: the prefix)
    first = (jnp.arange(t) % cfg.block_size == 0)[None, :, None]
    clean_prev = jnp.concatenate([last_h, h[:, t:2 * t - 1]], 1)
    noisy_prev = jnp.concatenate([last_h, h[:, :t - 1]], 1)
    return lm_head(params, cfg, jnp.where(first, clean_prev, noisy_prev))


def long_loss(params, cfg, prefix, ppos, xt, x0, masked, w, tpos, grad: str = "none"):
    """(loss, accuracy) of the tail, as objective.loss_and_accuracy weighs them (the tail's first
    position has a predictor: the prefix's last)."""
    return masked_loss(tail_logits(params, cfg, prefix, ppos, xt, x0, tpos, grad), x0, masked, w)


def make_long_step(cfg, opt, grad: str = "none"):
    """A jitted step(params, opt_state, *make_long_batch(...)) -> (params, opt_state, loss, acc);
    grad: how much of the prefix pass takes gradient (prefix_cache)."""
    return jitted_step(lambda params, *batch: long_loss(params, cfg, *batch, grad=grad), opt)
