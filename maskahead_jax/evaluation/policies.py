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


def parse_policy_kw(text: Optional[str]) -> dict:
    """'capacity_floor=128,topk_floor=32' -> {'capacity_floor': 128, 'topk_floor': 32}.

    Values are read as JSON where they parse (numbers, true/false, lists), else kept as strings."""
    import json

    out = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"bad policy knob {item!r}: expected key=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


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


def policy_budgets(policy, stats: Optional[dict] = None, num_layers: Optional[int] = None,
                   prompt_lens=None):
    """Per-layer / per-head budgets a policy exposes (MaskKV and its allocation baselines), else None.

    Sources, in order: stats['layer_budgets' / 'head_budgets'] (if the engine reports them);
    array-valued attributes `layer_budgets` / `head_budgets`; for MaskKV-style policies
    (`per_head_budget(plen)` and `layer_budgets(b_head, num_layers)` methods) the layer budgets
    of the offline allocation, computed for each prompt length in `prompt_lens` and averaged
    (the online head split needs the mask-voting scores and is only plotted when reported).
    Returns {'layer': [L] or None, 'head': [[L x H]] or None}."""
    import numpy as np

    def arr(v):
        if v is None or callable(v):
            return None
        try:
            a = np.asarray(v, dtype=float)
        except (TypeError, ValueError):
            return None
        return a.tolist() if a.size else None

    out = {"layer": None, "head": None}
    for src in ([stats] if stats else []) + [policy]:
        for key, name in (("layer_budgets", "layer"), ("head_budgets", "head")):
            v = src.get(key) if isinstance(src, dict) else getattr(src, key, None)
            if out[name] is None:
                out[name] = arr(v)
    if out["layer"] is None and num_layers and prompt_lens is not None \
            and callable(getattr(policy, "per_head_budget", None)) \
            and callable(getattr(policy, "layer_budgets", None)):
        try:
            per = [np.asarray(policy.layer_budgets(policy.per_head_budget(int(n)), int(num_layers)),
                              dtype=float).reshape(-1) for n in prompt_lens]
            out["layer"] = np.mean(per, axis=0).tolist() if per else None
        except Exception:
            pass
    if out["layer"] is None and out["head"] is None:
        return None
    return out
