"""The one error a policy raises (a module of its own so that every part can import it)."""
from __future__ import annotations


class PolicyError(ValueError):
    """An invalid policy setting: unknown name, bad budget or knob, a model it cannot run on."""
