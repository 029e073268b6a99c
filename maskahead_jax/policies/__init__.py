"""KV-cache policies: frozen, hashable dataclasses passed to `generate(..., policy=...)`.

`make(name, capacity_pct=None, **knobs)` builds one by name (the CLI and the sweep use it)."""
from .base import Dense
from .maskahead import BoundedPrefillMaskAhead, MaskAhead, PolicyError

_REGISTRY = {
    "dense": lambda **kw: Dense(),
    "maskahead": lambda **kw: MaskAhead(**kw),
    "maskahead-noevict": lambda **kw: MaskAhead(evict_ranking="none", **kw),
    "mage": lambda **kw: MaskAhead(select_ranking="mass", evict_ranking="none", **kw),
    "maskahead-bounded": lambda **kw: BoundedPrefillMaskAhead(**kw),
}


def register(name: str, factory) -> None:
    """Add a policy factory under `name` (used by the modules defining baselines)."""
    _REGISTRY[name] = factory


def names() -> list[str]:
    return sorted(_REGISTRY)


def make(name: str, capacity_pct: float | None = None, **knobs):
    """Build a policy by name; `capacity_pct` sets the eviction budget where the policy has one."""
    key = name.lower().replace("_", "-")
    if key not in _REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(names())}")
    if capacity_pct is not None and key != "dense":
        knobs["capacity_pct"] = float(capacity_pct)
    return _REGISTRY[key](**knobs)


__all__ = ["BoundedPrefillMaskAhead", "Dense", "MaskAhead", "PolicyError", "make", "names", "register"]
from .qmaskahead import QMaskAhead  # noqa: E402,F401  (registers "q-maskahead")
from . import baselines, maskkv  # noqa: E402,F401  (register streaming, h2o, caote, snapkv, herald, maskkv, pyramidkv, adakv)
