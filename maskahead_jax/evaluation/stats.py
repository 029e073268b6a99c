"""Paired two-sided sign test (exact binomial), no scipy."""
from __future__ import annotations

from math import comb
from typing import Mapping


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
