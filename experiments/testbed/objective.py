"""The training objective: two-copy block diffusion (BD3-LM / Fast-dLLM v2, research/models.md
§1.3). The model reads [x_t | x0] with positions (arange, arange): x_t block b sees x_t block b
and x0 blocks < b, x0 is block-causal (`two_copy_mask`, computed without a dense mask by
`maskahead_jax.model.two_copy_hidden`). Loss: weighted cross entropy on the masked positions of
x_t (no token shift, or with --logits-shift token p predicted at p - 1). With --pose-target the
positions are the batch's skip-wise ids, the same for both copies (two_copy_hidden_at)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from maskahead_jax.model.decoder import lm_head
from maskahead_jax.model.two_copy import two_copy_hidden, two_copy_mask as _two_copy_mask

from .data import BLOCK


def two_copy_mask(L: int) -> np.ndarray:
    """The dense [2L, 2L] two-copy mask at the testbed's block size (model.two_copy_mask)."""
    return _two_copy_mask(L, BLOCK)


def make_optimizer(lr: float):
    """AdamW (b2 0.98, weight decay 0.01) after clipping the global norm to 1; the learning rate
    is a hyperparameter in the state (opt_state.hyperparams["learning_rate"]), set every step."""
    return optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(learning_rate, b1=0.9, b2=0.98, weight_decay=0.01))
    )(learning_rate=lr)


def two_copy_hidden_at(params, cfg, xt, x0, pos, chunk: int = 512):
    """model.two_copy_hidden with position ids pos [B, L] for both copies (RoPE reads
    concat(pos, pos)): the skip-wise positions of --pose-target. The attention mask is the
    library's two-copy mask over token *indices* (block b = tokens [32 b, 32 b + 32)), which is
    the mask over position blocks as long as every block holds 32 consecutive ids from a multiple
    of 32 (data.pose_positions' chunks are cut on block boundaries)."""
    return two_copy_hidden(params, cfg, xt, x0, chunk, positions=pos)


def two_copy_logits(params, cfg, xt, x0, chunk: int = 512, pos=None):
    """Logits [B, L, V] of the noisy copy x_t [B, L] in the two-copy layout: x_t block b reads
    itself and the clean x0 [B, L] blocks < b (two_copy_mask), positions concat(arange, arange),
    or concat(pos, pos) with position ids pos [B, L] (two_copy_hidden_at).
    The forward is model.two_copy_hidden (chunked, no dense 2L x 2L mask; same numbers)."""
    L = xt.shape[1]
    h = two_copy_hidden(params, cfg, xt, x0, chunk, positions=pos)
    if not cfg.logits_shift:
        return lm_head(params, cfg, h[:, :L])
    # shifted logits (Fast-dLLM v2): token p is predicted at p - 1; a block's first token from the
    # clean copy's last position of the previous block (what generation reads from its cache)
    first = (jnp.arange(L) % cfg.block_size == 0)[None, :, None]
    src = jnp.where(first, jnp.roll(h[:, L:], 1, axis=1), jnp.roll(h[:, :L], 1, axis=1))
    return lm_head(params, cfg, src)  # position 0 has no predictor: the loss skips it


def loss_and_accuracy(params, cfg, xt, x0, masked, w, pos=None):
    """(loss, accuracy): cross entropy on the masked positions of x_t weighted by w (all [B, L]),
    normalised by the weights' sum; the argmax accuracy over the masked positions. pos [B, L]:
    position ids of both copies (None: arange)."""
    logits = two_copy_logits(params, cfg, xt, x0, pos=pos)
    return masked_loss(logits, x0, masked, w, skip_first=cfg.logits_shift)


def masked_loss(logits, x0, masked, w, skip_first: bool = False):
    """(loss, accuracy) of logits [B, L, V] against x0 [B, L]: cross entropy on the masked
    positions weighted by w, normalised by the weights' sum (skip_first: position 0 has no
    predictor and is left out); the argmax accuracy over the masked positions."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, x0)
    wm = w * masked
    if skip_first:
        wm = wm.at[:, 0].set(0.0)
    loss = (ce * wm).sum() / jnp.maximum(wm.sum(), 1.0)
    acc = ((logits.argmax(-1) == x0) * masked).sum() / jnp.maximum(masked.sum(), 1)
    return loss, acc


def jitted_step(loss_fn, opt):
    """step(params, opt_state, *batch) -> (params, opt_state, loss, acc), jitted, for
    loss_fn(params, *batch) -> (loss, acc)."""

    @jax.jit
    def step(params, opt_state, *batch):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, acc

    return step


def make_train_step(cfg, opt, L=None):
    """A jitted step(params, opt_state, x_t, x0, masked, w[, pos]) -> (params, opt_state, loss, acc)
    (one compile per batch shape and per pos given or not; `L` is kept for the callers that name
    it). `step(params, opt_state, *make_batch(...))` takes either batch form."""

    def loss_fn(params, xt, x0, masked, w, pos=None):
        return loss_and_accuracy(params, cfg, xt, x0, masked, w, pos)

    return jitted_step(loss_fn, opt)
