"""Policy construction by name, through `maskahead_jax.policies.make` when it exists."""
from __future__ import annotations

from typing import Optional

KNOWN = ("dense", "maskahead", "maskahead-noevict", "q-maskahead", "mage", "herald", "streaming",
         "h2o", "caote", "snapkv", "maskkv", "pyramidkv", "adakv")
NO_CAPACITY = ("dense",)


class PolicyError(ValueError):
    """Unknown policy name or a bad budget."""


def _registry():
    try:
        from .. import policies as P
    except Exception:  # pragma: no cover - the package always imports
        return None
    return getattr(P, "make", None)


def available() -> list[str]:
    """Names `make_policy` can build in this checkout."""
    mk = _registry()
    if mk is None:
        return ["dense"]
    from .. import policies as P

    if hasattr(P, "names"):
        return list(P.names())
    out = []
    for n in KNOWN:
        try:
            mk(n, None if n in NO_CAPACITY else 10.0)
            out.append(n)
        except Exception:
            pass
    return out or ["dense"]


def parse_capacities(text) -> list[Optional[float]]:
    """'5,10,20' -> [5.0, 10.0, 20.0]; each must be in (0, 100]."""
    if text is None or text == "":
        return [None]
    vals = text if isinstance(text, (list, tuple)) else str(text).split(",")
    out = []
    for v in vals:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise PolicyError(f"bad capacity {v!r}: expected a percentage like 10") from None
        if not 0 < f <= 100:
            raise PolicyError(f"capacity {f} out of range: a percentage in (0, 100]")
        out.append(f)
    return out


def make_policy(name: str, capacity_pct: Optional[float] = None, **kw):
    """Build a policy: `maskahead_jax.policies.make(name, capacity_pct, **kw)` when the registry
    exists, else only "dense". Raises PolicyError with the known names otherwise."""
    name = name.strip().lower()
    if capacity_pct is not None and not 0 < float(capacity_pct) <= 100:
        raise PolicyError(f"capacity {capacity_pct} out of range: a percentage in (0, 100]")
    mk = _registry()
    if mk is None:
        if name == "dense":
            from ..policies import Dense
            return Dense()
        raise PolicyError(f"policy {name!r} is not available in this checkout "
                          f"(maskahead_jax.policies.make is missing); available: ['dense']")
    try:
        return mk(name, None if name in NO_CAPACITY else capacity_pct, **kw)
    except PolicyError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise PolicyError(f"cannot build policy {name!r} (capacity {capacity_pct}): {e}") from e


def policy_budgets(policy, stats: Optional[dict] = None):
    """Per-layer / per-head budgets a policy exposes (MaskKV), else None.

    Looks for stats['layer_budgets'/'head_budgets'], then policy attributes or a `budgets()`
    method. Returns {'layer': [L] or None, 'head': [[L x H]] or None}."""
    import numpy as np

    def grab(src, key):
        v = src.get(key) if isinstance(src, dict) else getattr(src, key, None)
        if callable(v):
            try:
                v = v()
            except Exception:
                return None
        if v is None:
            return None
        try:
            return np.asarray(v, dtype=float).tolist()
        except Exception:
            return None

    out = {}
    for src in ([stats] if stats else []) + [policy]:
        for key, name in (("layer_budgets", "layer"), ("head_budgets", "head")):
            if name not in out or out[name] is None:
                out[name] = grab(src, key)
        if hasattr(src, "budgets") and callable(getattr(src, "budgets")) and not out.get("layer"):
            try:
                b = src.budgets()
                if isinstance(b, dict):
                    out["layer"] = out.get("layer") or grab(b, "layer")
                    out["head"] = out.get("head") or grab(b, "head")
            except Exception:
                pass
    if not out.get("layer") and not out.get("head"):
        return None
    return out
