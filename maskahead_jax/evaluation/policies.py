"""The evaluation front end of the one policy registry (maskahead_jax.policies): knob and
capacity parsing for the command line, and the budgets a policy exposes for plots."""
from __future__ import annotations

from typing import Optional

from ..policies import PolicyError, make, names, takes_budget  # noqa: F401  (one registry, one error)


def available() -> list[str]:
    """Names `make_policy` can build."""
    return names()


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
    """`maskahead_jax.policies.make`, except that a budget given to a policy that has none is
    dropped rather than refused: a sweep's --capacity list applies to the policies it fits, and
    the others run once (`sweep._runs`). Errors are the registry's PolicyError."""
    if capacity_pct is not None and not 0 < float(capacity_pct) <= 100:
        raise PolicyError(f"capacity {capacity_pct} out of range: a percentage in (0, 100]")
    if capacity_pct is not None and not takes_budget(name):
        capacity_pct = None
    try:
        return make(name, capacity_pct, **kw)
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
