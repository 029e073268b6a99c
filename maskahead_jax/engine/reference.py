"""Plain uncached reference decoding: a full forward over everything at every step.

This is the ground truth the cached, jitted `generate` is tested against (same commit rules,
same family conventions), written for clarity, one prompt at a time.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import numerics
from ..config import GenerationConfig, ModelConfig
from ..decoding import commit
from ..model import forward_logits


_forward = numerics.jit(forward_logits, static_argnames=("cfg", "attention"))  # one compile per length


def _logits(params, cfg: ModelConfig, seq, attention):
    return _forward(params, cfg, jnp.asarray([seq], jnp.int32), attention=attention)[0]


def reference_generate(model, prompt, config: GenerationConfig = GenerationConfig()) -> list[int]:
    """Greedy/sampled decoding of one prompt with no cache; returns generated ids (cut at EOS)."""
    cfg: ModelConfig = model.config
    gen = config.resolve(cfg)
    if cfg.attention == "bidirectional":
        return _reference_bidirectional(model, list(prompt), gen, config.seed)
    bs, mask_id = gen.block_size, cfg.mask_token_id
    p = list(map(int, prompt))
    n_pre = len(p) // bs * bs
    seq = p[:n_pre]
    x = np.array((p[n_pre:] + [mask_id] * bs)[:bs], np.int32)
    key = jax.random.PRNGKey(config.seed)
    eos = set(cfg.eos_token_ids)
    nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
    active = jnp.ones((1,), bool)
    for _ in range(nblk):
        start = len(seq)
        prev = _logits(model.params, cfg, seq, "block_causal")[-1] if (cfg.logits_shift and seq) else None
        if cfg.logits_shift and x[0] == mask_id:
            x[0] = int(jnp.argmax(prev))
        m0 = jnp.asarray([(x == mask_id).sum()], jnp.int32)
        key, _k0 = jax.random.split(key)
        step = 0
        kk = _k0
        while (x == mask_id).any():
            lg = _logits(model.params, cfg, seq + x.tolist(), "block_causal")
            if cfg.logits_shift:
                lg = lg[start - 1:start + bs - 1] if start else jnp.concatenate([lg[:1], lg[:bs - 1]])
            else:
                lg = lg[start:start + bs]
            x = np.asarray(commit(jnp.asarray(x)[None], lg[None], jnp.int32(step), m0, active, gen,
                                  mask_id, kk))[0].copy()
            step += 1
            key, kk = jax.random.split(key)
        seq = seq + x.tolist()
        gen_part = seq[len(p):]
        if len(seq) >= len(p) + gen.max_new_tokens or (gen.stop_at_eos and eos & set(gen_part)):
            break
        x = np.full((bs,), mask_id, np.int32)
    return _cut(seq[len(p):len(p) + gen.max_new_tokens], eos, gen.stop_at_eos)


def _cut(row, eos, stop):
    if stop:
        for j, t in enumerate(row):
            if t in eos:
                return row[:j]
    return row


def _reference_bidirectional(model, p, gen, seed):
    cfg: ModelConfig = model.config
    bs, mask_id = gen.block_size, cfg.mask_token_id
    nblk = math.ceil(gen.max_new_tokens / bs)
    resp = np.full((nblk * bs,), mask_id, np.int32)
    key = jax.random.PRNGKey(seed)
    active = jnp.ones((1,), bool)
    for blk in range(nblk):
        sl = slice(blk * bs, (blk + 1) * bs)
        m0 = jnp.asarray([(resp[sl] == mask_id).sum()], jnp.int32)
        step = 0
        while (resp[sl] == mask_id).any():
            key, kk = jax.random.split(key)
            lg = _logits(model.params, cfg, p + resp.tolist(), "bidirectional")
            lg = lg[len(p) - 1:-1] if cfg.logits_shift else lg[len(p):]
            xb = commit(jnp.asarray(resp[sl])[None], lg[sl][None], jnp.int32(step), m0, active, gen,
                        mask_id, kk)
            resp[sl] = np.asarray(xb)[0]
            step += 1
    return _cut(resp.tolist()[:gen.max_new_tokens], set(cfg.eos_token_ids), gen.stop_at_eos)
