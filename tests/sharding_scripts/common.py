"""Shared setup for the sharding helper scripts: they run in their own process so that
XLA_FLAGS=--xla_force_host_platform_device_count=N is set before jax initialises."""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Forced CPU devices are threads of one process. On a loaded 2-core machine their collectives
# have been seen to lag past XLA's default 40 s termination timeout and, once in CI, to hang for
# good (q-maskahead parity: a 4-way all-reduce waited > 900 s for a participant that never came).
# So a collective stuck for 240 s (far beyond any lag seen) aborts the process with XLA's
# "Termination timeout" message, and tests/test_sharding.py runs such a script once more.
COLLECTIVE_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=240 "
                    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60")
# A script still running after MASKAHEAD_DUMP_AFTER_S seconds (tests/test_sharding.py sets it a
# little under its own timeout) prints its Python threads' stacks and exits: faulthandler's
# "(most recent call first)" header marks a stuck run too, and the stacks show where it was.
STUCK_MARKERS = ("Termination timeout for", "may be stuck", "(most recent call first)")


def setup(n_devices: int | None = None) -> None:
    dump_after = float(os.environ.get("MASKAHEAD_DUMP_AFTER_S", 0))
    if dump_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(dump_after, exit=True)
    flags = os.environ.get("XLA_FLAGS", "")
    if n_devices and "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={n_devices}"
    if "collective_call_terminate_timeout" not in flags:
        flags += " " + COLLECTIVE_FLAGS
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for p in (ROOT, os.path.join(ROOT, "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)


def prompts(lens, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


# small MaskAhead budgets that make selection and eviction fire on tiny models
SMALL = dict(capacity_pct=10, capacity_floor=24, topk_pct=5, topk_floor=16, dense_layers=1, sinks=2,
             recent=8, interval_blocks=2, lookahead_blocks=3)


# Q-MaskAhead needs head_dim, block_size and prefill_chunk in multiples of 32 (whole key groups);
# these budgets select every block and evict after every block (as tests/test_qmaskahead.py)
Q_SMALL = dict(capacity_pct=30, capacity_floor=64, topk_pct=30, topk_floor=32, dense_layers=1, sinks=2,
               recent=32, interval_blocks=1, lookahead_blocks=2)
Q_MODEL = dict(head_dim=32, block_size=32)


def is_quantized(name: str) -> bool:
    return name.lower().replace("_", "-") in ("q-maskahead", "qmaskahead")


def make_policy(name: str):
    """(policy, None) or (None, reason it is unavailable)."""
    if name == "dense":
        return None, None
    try:
        from maskahead_jax import policies
    except Exception as e:  # pragma: no cover
        return None, f"maskahead_jax.policies does not import: {e!r}"
    if not hasattr(policies, "make"):
        return None, "maskahead_jax.policies.make does not exist yet"
    try:
        if is_quantized(name):
            return policies.make("q-maskahead", **Q_SMALL), None
        return policies.make(name, **SMALL), None
    except Exception as e:
        return None, f"policies.make({name!r}, ...) failed: {e!r}"
