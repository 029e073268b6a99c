"""The one policy registry: names -> (class, preset knobs), and `make`, which builds a policy by
name with a budget where the policy has one and refuses one where it means nothing.

    make("maskahead", 10)                      MaskAhead(capacity_pct=10.0)
    make("maskkv", 5)                          MaskKV(budget_pct=5.0)
    make("mage", 10)                           PolicyError: mage never evicts, it takes no budget
    make("snapkv", 10, bits=4)                 SnapKV on the packed 4-bit cache (storage=Packed(4))
    register("keynorm", KeyNorm)               a user's policy, usable by name everywhere

Policies of other packages are found without code changes here: a module named in the
environment variable MASKAHEAD_POLICY_PLUGINS (comma-separated) or in the entry-point group
"maskahead_jax.policies" is imported on first lookup, and its `register` calls add its names.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from importlib.metadata import entry_points
from typing import NamedTuple, Optional

from . import storage as storage_part
from .errors import PolicyError


class Entry(NamedTuple):
    cls: type
    preset: dict  # knobs fixed by the name (e.g. mage: select_ranking="mass")
    defaults: dict  # knobs the name sets and a caller may change (q-maskahead: storage=Packed(4))
    budget_field: Optional[str]  # the field a budget percentage sets; None: no budget
    entries_field: Optional[str]  # the field an absolute budget (KV entries per lane) sets


_REGISTRY: dict[str, Entry] = {}
PLUGINS_ENV = "MASKAHEAD_POLICY_PLUGINS"
_loaded: set[str] = set()


def load_plugins() -> None:
    """Import the plugin modules (env var, then entry points) not imported yet; each registers
    its policies. A module that cannot be imported is a PolicyError naming it."""
    mods = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    mods += [ep.value.split(":")[0] for ep in entry_points(group="maskahead_jax.policies")]
    for mod in mods:
        if mod in _loaded:
            continue
        _loaded.add(mod)
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise PolicyError(f"policy plugin {mod!r} cannot be imported: {e}") from e


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register(name: str, cls: type, budget_field: Optional[str] = "capacity_pct",
             entries_field: Optional[str] = "capacity_entries", defaults: Optional[dict] = None,
             **preset) -> None:
    """Add a policy class under `name`; `preset` knobs are fixed by the name, `defaults` are set
    by it and may be changed by the caller (a storage part goes there). budget_field=None
    (or a class whose default instance has takes_budget False) marks a policy without a budget;
    entries_field names the knob of an absolute budget (None, or a field the class lacks: none)."""
    if not dataclasses.is_dataclass(cls):
        raise PolicyError(f"policy {name!r}: {cls!r} is not a dataclass (policies are frozen dataclasses)")
    defaults = dict(defaults or {})
    if budget_field is not None and not cls(**preset, **defaults).takes_budget:
        budget_field = None
    fields = {f.name for f in dataclasses.fields(cls)}
    if budget_field is None or entries_field not in fields:
        entries_field = None
    _REGISTRY[_key(name)] = Entry(cls, dict(preset), defaults, budget_field, entries_field)


def names() -> list[str]:
    load_plugins()
    return sorted(_REGISTRY)


def entry(name: str) -> Entry:
    key = _key(name)
    if key not in _REGISTRY:
        load_plugins()
    if key not in _REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(names())}")
    return _REGISTRY[key]


def takes_budget(name: str) -> bool:
    """Whether `make(name, capacity_pct)` applies a budget (sweeps fan only these out)."""
    return entry(name).budget_field is not None


def knobs(name: str) -> list[str]:
    """The knobs a policy accepts: its dataclass fields, less those its name fixes, with the
    storage part's knobs (bits, compaction, ...) in place of the `storage` field."""
    e = entry(name)
    own = [f.name for f in dataclasses.fields(e.cls) if f.name not in e.preset and f.name != "storage"]
    return own + list(storage_part.KNOBS)


def make(name: str, capacity_pct: float | None = None, *, compression_ratio: float | None = None,
         kv_entries: int | None = None, **kw):
    """Build a policy by name. Its budget, if any, in one of three ways: `capacity_pct`, the
    percentage of seen tokens kept, in (0, 100]; `compression_ratio`, the fraction removed, in
    [0, 1) (kvpress's convention: 0.9 keeps 10%); `kv_entries`, an absolute number of KV entries
    kept per (layer, row, KV head). A policy that never evicts refuses a budget. Unknown knobs
    are a PolicyError naming the accepted ones."""
    e = entry(name)
    key = _key(name)
    given = [n for n, v in (("capacity_pct", capacity_pct), ("compression_ratio", compression_ratio),
                            ("kv_entries", kv_entries)) if v is not None]
    if len(given) > 1:
        raise PolicyError(f"give one budget, not {' and '.join(given)}")
    if compression_ratio is not None:
        if not 0 <= float(compression_ratio) < 1:
            raise PolicyError(f"compression_ratio must be in [0, 1) (the fraction removed), got {compression_ratio}")
        capacity_pct = 100.0 * (1.0 - float(compression_ratio))
    if kv_entries is not None:
        if e.budget_field is None or e.entries_field is None:
            raise PolicyError(f"policy {key!r} takes no absolute budget (kv_entries)")
        if int(kv_entries) != kv_entries or kv_entries <= 0:
            raise PolicyError(f"kv_entries must be a positive integer, got {kv_entries}")
        kw[e.entries_field] = int(kv_entries)
    if capacity_pct is not None:
        if e.budget_field is None:
            raise PolicyError(f"policy {key!r} never evicts, so it takes no budget (got {capacity_pct}); "
                              f"run it without one")
        if not 0 < float(capacity_pct) <= 100:
            raise PolicyError(f"{e.budget_field} must be a percentage in (0, 100], got {capacity_pct}")
        kw[e.budget_field] = float(capacity_pct)
    bad = sorted(set(kw) - set(knobs(key)) - {"storage"})
    if bad:
        raise PolicyError(f"policy {key!r} has no knob {', '.join(bad)}; its knobs: {', '.join(knobs(key))}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}  # hashable
    kw = {**e.defaults, **kw}
    # the storage part: the name's default (q-maskahead: Packed(4)) refined by the storage knobs
    base = kw.pop("storage", storage_part.Float())
    store = storage_part.from_knobs(base, {k: kw.pop(k) for k in storage_part.KNOBS if k in kw})
    return e.cls(**e.preset, **kw, storage=store)
