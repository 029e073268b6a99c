"""Paired two-sided sign test (exact binomial, no scipy) and a paired bootstrap interval for a
suite-mean gap."""
from __future__ import annotations

from math import comb
from typing import Callable, Mapping

import numpy as np


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value for `wins` vs `losses` (ties already dropped).

    p = min(1, 2 * P[X <= min(wins, losses)]), X ~ Binomial(wins + losses, 1/2); 1.0 when n = 0."""
    if wins < 0 or losses < 0:
        raise ValueError("wins and losses must be non-negative")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def paired_sign_test(a: Mapping, b: Mapping, tol: float = 1e-9) -> dict:
    """Compare per-example scores a[id] vs b[id] on the ids both hold.

    Returns n (paired), wins (a > b), losses (a < b), ties, p (two-sided sign test)."""
    ids = sorted(set(a) & set(b))
    wins = sum(1 for i in ids if a[i] > b[i] + tol)
    losses = sum(1 for i in ids if a[i] < b[i] - tol)
    return dict(n=len(ids), wins=wins, losses=losses, ties=len(ids) - wins - losses,
                p=sign_test(wins, losses))


def paired_bootstrap_gap(a: Mapping, b: Mapping, group_of: Callable[[str], str] = lambda i: i.split("/")[0],
                         n_boot: int = 10000, level: float = 0.95, seed: int = 0) -> dict:
    """The suite-mean difference a - b on the ids both hold, with a paired bootstrap interval.

    The suite mean is the mean over groups (tasks, `group_of(id)`) of the group's mean score, as
    the eval's summary; the interval resamples each group's paired differences with replacement
    (stratified, so every resample keeps the suite's weighting) and takes the central `level`
    quantiles. Returns n (paired), gap, lo, hi (in the scores' units)."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("no example id is in both score maps")
    groups: dict = {}
    for i in ids:
        groups.setdefault(group_of(i), []).append(float(a[i]) - float(b[i]))
    rng = np.random.default_rng(seed)
    gap, boot = 0.0, np.zeros(n_boot)
    for diffs in groups.values():
        d = np.asarray(diffs)
        gap += d.mean()
        boot += d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(1)
    k = len(groups)
    lo, hi = np.quantile(boot / k, [(1 - level) / 2, (1 + level) / 2])
    return dict(n=len(ids), gap=gap / k, lo=float(lo), hi=float(hi))
