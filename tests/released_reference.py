"""Numpy transcriptions of the released MaskAhead code's rules (brain-lab-research/MaskAhead
@ c37f4b6), and small hand-built caches, shared by tests/test_released_policies.py and
tests/test_released_added.py."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from maskahead_jax import cache as kvc
from maskahead_jax.policies import StepContext


def released_survivors(pos, score, policy, capacity, window=0, sinks=0):
    """eviction.EvictionState.survivors for one lane: the kept positions, sorted."""
    pos = np.asarray(pos)
    score = np.asarray(score, np.float64).copy()
    top = lambda r, k: np.argsort(-r, kind="stable")[:k]
    if policy == "recent":  # StreamingLLM: the newest C, sinks first
        rank = pos.astype(np.float64)
        rank[pos < sinks] = np.inf
        keep = top(rank, capacity)
    elif policy == "snapkv":  # the window verbatim, sinks, then the pooled score
        score[top(pos, min(window, capacity))] = np.inf
        score[pos < sinks] = np.inf
        keep = top(score, capacity)
    else:  # ema_recent / expected_attention / lookahead: W newest, then the top C - W
        w = min(window, capacity)
        recent = top(pos, w)
        score[pos < sinks] = np.inf
        score[recent] = -np.inf
        keep = np.concatenate([recent, top(score, capacity - w)])
    return sorted(pos[keep].tolist())


def released_middle(positions, block_size):
    """config.SelectorConfig.query_indices, mode "middle"."""
    centre = (block_size - 1) / 2.0
    return min(positions, key=lambda x: (abs(x - centre), x))


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def np_softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis, keepdims=True)


# ----------------------------------------------------------------------------- helpers
def _hand_cache(v, pos, k=None, layers=1, acc=None):
    n, d = v.shape
    c = kvc.empty(layers, 1, 1, n, d, jnp.float32)
    vv = jnp.broadcast_to(jnp.asarray(v, jnp.float32), (layers, 1, 1, n, d))
    kk = vv * 0 if k is None else jnp.broadcast_to(jnp.asarray(k, jnp.float32), (layers, 1, 1, n, d))
    c = kvc.append(c, kk, vv, jnp.asarray([pos], jnp.int32), jnp.asarray([n], jnp.int32))
    return c if acc is None else c._replace(acc=_row(acc))


def _kept(c):
    return np.asarray(c.pos)[0, 0, 0][np.asarray(c.valid)[0, 0, 0]].tolist()


def _row(x):
    return jnp.asarray(np.asarray(x, np.float32))[None, None, None]


def _no_forward(*a):
    raise AssertionError("no probe forward expected")


def _ctx(n, forward=_no_forward, **kw):
    base = StepContext(forward, jnp.zeros((1, 64), jnp.int32), jnp.asarray([n]), jnp.asarray([n]), 8, 47, n,
                       jnp.asarray([True]))
    return base._replace(**kw)


