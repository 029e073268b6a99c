"""Keep a long-running process under the kernel's memory-map limit while it compiles.

Every program XLA's CPU backend compiles is loaded by LLVM's JIT into its own memory mappings
(measured: 500-1,500 per generate core of the testbed; `/proc/self/maps`), and they stay until
the program leaves JAX's caches. Linux caps a process at `vm.max_map_count` mappings (65,530 by
default); past it every mmap fails, and the next compile dies inside LLVM ("Unable to allocate
section memory", or a segfault). A sweep over ~40 (policy, budget) runs, or a test worker that
compiles a few hundred programs, reaches it. `relieve()` drops JAX's compiled programs when the
process holds more than `fraction` of the limit: the next call of a dropped program recompiles
(seconds), instead of the process crashing hours in. Linux only; elsewhere a no-op.
"""
from __future__ import annotations

import gc
import os
from typing import Optional

import jax

DEFAULT_FRACTION = 0.5


def mapped_regions() -> Optional[int]:
    """Memory mappings this process holds (None where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> Optional[int]:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def under_pressure(fraction: float = DEFAULT_FRACTION) -> bool:
    limit, used = max_map_count(), mapped_regions()
    return limit is not None and used is not None and used > fraction * limit


def relieve(fraction: float = DEFAULT_FRACTION) -> bool:
    """Clear JAX's compiled programs if this process holds more than `fraction` of the
    kernel's mapping limit; True when it did."""
    if not under_pressure(fraction):
        return False
    jax.clear_caches()
    gc.collect()
    return True
