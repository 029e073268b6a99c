"""The evaluation front end of the one policy registry (maskahead_jax.policies): knob and
capacity parsing for the command line, knob type checks, per-policy knobs, building and
validating every policy of a run up front, and the budgets a policy exposes for plots."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from ..policies import PolicyError, knobs, make, names, takes_budget  # noqa: F401  (one registry, one error)
from ..policies.registry import entry


def available() -> list[str]:
    """Names `make_policy` can build."""
    return names()


def policy_key(name: str) -> str:
    """The registry spelling of a policy name (lower case, - for _)."""
    return str(name).strip().lower().replace("_", "-")


def split_items(text: str) -> list[str]:
    """Split on the commas outside brackets / quotes ('a=[1,2],b=3' -> ['a=[1,2]', 'b=3'])."""
    out, cur, depth, quote = [], "", 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth <= 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return out + [cur]


def parse_policy_kw(text: Optional[str]) -> dict:
    """'capacity_floor=128,snapkv:window=16' -> {'capacity_floor': 128, 'snapkv:window': 16}.

    Values are read as JSON where they parse (numbers, true/false, null, lists), else kept as
    strings. A `name:` prefix ties a knob to one policy (`resolve_policy_kw`)."""
    import json

    out = {}
    for item in split_items(text or ""):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"bad policy knob {item!r}: expected key=value or policy:key=value")
        k, v = item.split("=", 1)
        k = k.strip()
        if not k or k.endswith(":") or k.startswith(":"):
            raise ValueError(f"bad policy knob {item!r}: expected key=value or policy:key=value")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v.strip()
    return out


# ----------------------------------------------------------------------------- knob types
_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}
_CONTAINERS = {"tuple", "Tuple", "list", "List", "Sequence"}
_DESCR = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          tuple: "a list like [1,2]", type(None): "null"}


def knob_types(name: str) -> dict:
    """{knob: allowed Python types} of a policy, from its dataclass field annotations (strings under
    `from __future__ import annotations`: 'int', 'Optional[float]', 'tuple', ...), else from the
    field's default value. A knob whose type cannot be told is left out (not checked). The
    storage part's knobs (bits, compaction, ...) are typed from the packed storage's fields."""
    from ..policies.storage import Packed

    e = entry(name)
    out = {}
    for f in (*dataclasses.fields(e.cls), *dataclasses.fields(Packed)):
        if f.name in e.preset or f.name == "storage":
            continue
        ann = str(f.type)  # "int", "Optional[float]"; a real type: "<class 'int'>", "typing.Optional[int]"
        words = set(re.findall(r"[A-Za-z_]+", str(ann)))
        if words & _CONTAINERS:  # Tuple[int, ...] is a list of ints, not an int
            allowed = {tuple}
        else:
            allowed = {_SCALARS[w] for w in words if w in _SCALARS}
        if not allowed and f.default is not dataclasses.MISSING and f.default is not None:
            d = tuple if isinstance(f.default, (list, tuple)) else type(f.default)
            allowed = {d} if d in _DESCR else set()
        if allowed:
            out[f.name] = allowed | ({type(None)} if words & {"Optional", "None"} or f.default is None else set())
    return out


def _fits(value, allowed: set) -> bool:
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    if isinstance(value, float):
        return float in allowed
    if isinstance(value, str):
        return str in allowed
    if isinstance(value, (list, tuple)):
        return tuple in allowed
    return True  # an object passed from Python: the policy's own validate decides


def check_knob_types(name: str, kw: dict) -> None:
    """PolicyError for a knob value whose type does not match the policy's field (e.g.
    topk_pct=abc, a string where a number is expected)."""
    types = knob_types(name)
    for k, v in kw.items():
        allowed = types.get(k)
        if allowed and not _fits(v, allowed):
            want = " or ".join(_DESCR[t] for t in (int, float, bool, str, tuple, type(None))
                               if t in allowed and not (t is int and float in allowed))
            raise PolicyError(f"policy {policy_key(name)!r}: knob {k} expects {want}, got {v!r}")


def resolve_policy_kw(policies: Sequence[str], kw: Optional[dict]) -> dict:
    """Per-policy knobs of a run: {policy: {knob: value}} for every name in `policies`.

    An unprefixed knob goes to every policy that has it (`knobs(name)`), and must belong to at
    least one of them; `name:knob` goes to that policy only, which must be in the run and have
    the knob; a prefixed knob overrides an unprefixed one. Values are checked against the
    knobs' types. Unknown policy names are refused. Errors: PolicyError."""
    pols = []
    for p in policies:
        entry(p)  # unknown name -> PolicyError naming the known ones
        if policy_key(p) not in pols:
            pols.append(policy_key(p))
    out = {p: {} for p in pols}
    common, per = {}, {}
    for k, v in (kw or {}).items():
        if ":" in k:
            p, knob = (x.strip() for x in k.split(":", 1))
            per[(policy_key(p), knob)] = v
        else:
            common[k] = v
    for k, v in common.items():
        takers = [p for p in pols if k in knobs(p)]
        if not takers:
            raise PolicyError(f"--policy-kw {k}: no policy of this run ({', '.join(pols)}) has the knob {k}")
        for p in takers:
            out[p][k] = v
    for (p, k), v in per.items():
        if p not in out:
            raise PolicyError(f"--policy-kw {p}:{k}: policy {p!r} is not in this run ({', '.join(pols)})")
        if k not in knobs(p):
            raise PolicyError(f"--policy-kw {p}:{k}: policy {p!r} has no knob {k}; its knobs: "
                              f"{', '.join(knobs(p)) or 'none'}")
        out[p][k] = v
    for p, d in out.items():
        check_knob_types(p, d)
    return out


def run_label(name: str, capacity: Optional[float]) -> str:
    return f"{name}@{'full' if capacity is None else f'{capacity:g}'}"


def validate_policy(policy, cfg, gen, label: str = "") -> None:
    """policy.check_run(cfg, resolved gen) with the run's label in the message; every failure is a
    PolicyError (a knob of a wrong type can fail as a TypeError inside validate)."""
    try:
        policy.check_run(cfg, gen)
    except PolicyError as e:
        raise PolicyError(f"{label}: {e}" if label else str(e)) from None
    except (ValueError, TypeError, AttributeError) as e:
        raise PolicyError(f"{label + ': ' if label else ''}invalid settings ({type(e).__name__}: {e})") from None


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


def make_policy(name: str, capacity_pct: Optional[float] = None, /, **kw):
    """`maskahead_jax.policies.make`, except that a budget given to a policy that has none is
    dropped rather than refused: a sweep's --capacity list applies to the policies it fits, and
    the others run once (`sweep._runs`). Knob values are type-checked (`check_knob_types`), and a
    knob that sets the budget is refused when a capacity is given. Errors: PolicyError."""
    if capacity_pct is not None and not 0 < float(capacity_pct) <= 100:
        raise PolicyError(f"capacity {capacity_pct} out of range: a percentage in (0, 100]")
    if capacity_pct is not None and not takes_budget(name):
        capacity_pct = None
    budget_field = entry(name).budget_field
    if capacity_pct is not None and budget_field in kw:
        raise PolicyError(f"policy {policy_key(name)!r}: its budget {budget_field} comes from the capacity "
                          f"({capacity_pct:g}); do not set it as a knob too")
    check_knob_types(name, kw)
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
