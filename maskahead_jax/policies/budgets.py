"""Budget arithmetic shared by MaskKV (policies/maskkv.py) and the allocations inside MaskAhead's
eviction (policies/eviction.Allocation): MaskKV's layer budgets (Eq. 9-13) and head budgets
(Eq. 15), PyramidKV's and AdaKV's. Pure functions on numpy or jnp arrays; research/maskkv.md §3, §4.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .protocol import PolicyError


def guarded(x):
    """x nudged up by a relative 1e-6 before a floor: float32 under jit (and XLA's x / 100 ->
    x * 0.01) lands a few ulps below an exact integer (30% of 70 -> 20.999998 -> 20), where the
    released code's Python arithmetic gives 21. Eager and jitted budgets agree with it."""
    return x * (1.0 + 1e-6) + 1e-6


def _xp(*xs):
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def _floor(xp, x):
    # guard against float error just below an integer (e.g. 0.4 * 80 / 8)
    return xp.floor(x + 1e-6).astype(xp.int32 if xp is jnp else np.int64)


def _spread(xp, base, frac, remainder, axis):
    """Add 1 to the `remainder` entries with the largest `frac` along `axis` (ties: lower index)."""
    order = xp.argsort(-frac, axis=axis, **({"kind": "stable"} if xp is np else {}))
    rank = xp.argsort(order, axis=axis, **({"kind": "stable"} if xp is np else {}))
    return base + (rank < xp.expand_dims(remainder, axis)).astype(base.dtype)


def boundary_layers(num_layers: int) -> tuple[int, ...]:
    """S_bound = {first, last} layer (research/maskkv.md §3a: the exact rule is NOT FOUND)."""
    return (0,) if num_layers == 1 else (0, num_layers - 1)


def layer_budgets(total, importance, beta: float = 0.4, boundary=None, exact_total: bool = True):
    """Per-layer average per-head budgets k_l (Eq. 9-13) for a total prompt budget k_p.

    total: int, or [B] int array (one total per row); importance: [L] layer importances I^(l)
    (None or empty: uniform). Returns [L] (or [L, B]) integer budgets; with exact_total they sum
    to the total.
    """
    if importance is None or len(importance) == 0:
        raise PolicyError("layer_budgets needs one importance per layer (uniform: [1.0] * L)")
    imp = np.asarray(importance, np.float64)
    xp = _xp(total)
    L = len(imp)
    bound = tuple(boundary_layers(L) if boundary is None else boundary)
    in_b = np.zeros(L, bool)
    in_b[list(bound)] = True
    n_b, n_m = int(in_b.sum()), int((~in_b).sum())
    i_b, i_m = float(imp[in_b].sum()), float(imp[~in_b].sum())
    share = i_b / (i_b + i_m) if i_b + i_m > 0 else n_b / L  # all-zero importance: by group size
    kp = xp.asarray(total)
    k_base = _floor(xp, beta * kp / L)  # Eq. 9
    k_imp = kp - L * k_base  # Eq. 10
    g_b = _floor(xp, k_imp * share)  # Eq. 11
    g_m = k_imp - g_b  # Eq. 12
    if n_m == 0:  # every layer is a boundary layer
        g_b, g_m = k_imp, 0 * k_imp
    per_b = g_b // n_b
    per_m = g_m // n_m if n_m else 0 * g_m
    shape = (L,) + tuple(kp.shape)
    sel = in_b.reshape((L,) + (1,) * kp.ndim)
    k_l = xp.where(sel, k_base + per_b, k_base + per_m) * xp.ones(shape, k_base.dtype)  # Eq. 13
    if exact_total:
        rem_b, rem_m = g_b - n_b * per_b, g_m - n_m * per_m
        # rank of each layer within its group (layer order): the first `rem` layers get +1
        grank = np.zeros(L, np.int64)
        grank[in_b] = np.arange(n_b)
        grank[~in_b] = np.arange(n_m)
        grank = grank.reshape(sel.shape)
        extra = xp.where(sel, grank < rem_b, grank < rem_m)
        k_l = k_l + extra.astype(k_l.dtype)
    return k_l


def pyramid_budgets(total_per_head, num_layers: int, pyramid_beta: float = 20.0,
                    exact_total: bool = True, max_len=None):
    """PyramidKV: k_l = max - l (max - min) / (L - 1), min = B / beta, max = 2B - min (AdaKV's
    implementation, research/maskkv.md §4). total_per_head: B (int or [B_rows] array). max_len
    (int or [B_rows]): as AdaKV's, a max above the selectable length becomes that length and
    min = 2B - max, so the layers still spend L * B (when it fits)."""
    xp = _xp(total_per_head, max_len)
    b = xp.asarray(total_per_head).astype(xp.float32 if xp is jnp else np.float64)
    L = num_layers
    lo = b / pyramid_beta
    hi = 2 * b - lo
    if max_len is not None:
        over = hi >= xp.asarray(max_len)
        hi = xp.where(over, xp.asarray(max_len).astype(hi.dtype), hi)
        lo = xp.where(over, 2 * b - hi, lo)
    step = (hi - lo) / max(L - 1, 1)
    l = np.arange(L, dtype=np.float64).reshape((L,) + (1,) * b.ndim)
    x = hi - l * step if L > 1 else b * xp.ones((1,) + b.shape)
    k = _floor(xp, x)
    if exact_total:
        kp = _floor(xp, b * L)
        k = _spread(xp, k, x - k, kp - k.sum(0), axis=0)
    return k


def head_budgets(layer_budget, preference, alpha: float = 0.1, max_len=None, exact_total: bool = True):
    """Per-head budgets k_{l,h} (Eq. 15) from layer budgets k_l [...] and prompt preferences
    P_h [..., N_h] (unnormalised, e.g. mass on the prompt per head). Clipped to [0, max_len]
    (int or array broadcastable to [...]) when given. Returns [..., N_h] integers."""
    xp = _xp(layer_budget, preference)
    kl = xp.asarray(layer_budget)
    p = xp.asarray(preference).astype(xp.float32 if xp is jnp else np.float64)
    nh = p.shape[-1]
    tot = p.sum(-1, keepdims=True)
    phat = xp.where(tot > 0, p / xp.where(tot > 0, tot, 1.0), 1.0 / nh)
    klf = kl[..., None].astype(p.dtype)
    x = alpha * klf + (1 - alpha) * nh * klf * phat
    k = _floor(xp, x)
    if exact_total:
        rem = xp.maximum(nh * kl.astype(k.dtype) - k.sum(-1), 0)
        k = _spread(xp, k, x - k, rem, axis=-1)
    if max_len is not None:
        k = xp.minimum(k, xp.asarray(max_len)[..., None] if np.ndim(max_len) else max_len)
    return xp.maximum(k, 0)


def adakv_head_budgets(layer_budget, scores, valid, floor_alpha: float = 0.2, max_len=None):
    """AdaKV: per layer N_h * k_l slots; floor(floor_alpha * k_l) per head, the remaining
    N_h * (k_l - floor) to the heads holding the layer's global top scores (flattened over heads
    and tokens), a head taking at most its valid entries. layer_budget [...], scores/valid
    [..., N_h, S]. Returns [..., N_h]. (Released AdaKV: round(count * (1 - floor_alpha) + floor)
    with count from the global top N_h * k_l, which need not sum to N_h * k_l; ours does.)"""
    xp = _xp(layer_budget, scores)
    kl = xp.asarray(layer_budget)
    nh, s = scores.shape[-2:]
    fl = _floor(xp, floor_alpha * kl)
    rest = nh * (kl - fl)
    # a head can take no more than its valid entries: only its top (valid - floor) compete
    kw = {"kind": "stable"} if xp is np else {}
    in_head = xp.argsort(xp.argsort(-xp.where(valid, scores, -np.inf), axis=-1, **kw), axis=-1, **kw)
    valid = valid & (in_head < (valid.sum(-1) - fl[..., None])[..., None])
    flat = xp.where(valid, scores, -np.inf).reshape(scores.shape[:-2] + (nh * s,))
    order = xp.argsort(-flat, axis=-1, **({"kind": "stable"} if xp is np else {}))
    rank = xp.argsort(order, axis=-1, **({"kind": "stable"} if xp is np else {}))
    chosen = (rank < rest[..., None]) & valid.reshape(flat.shape)
    k = fl[..., None] + chosen.reshape(scores.shape).sum(-1).astype(fl.dtype)
    if max_len is not None:
        k = xp.minimum(k, xp.asarray(max_len)[..., None] if np.ndim(max_len) else max_len)
    return xp.maximum(k, 0)
