"""XLA flags for the test suite: cheap CPU code generation.

The suite's shapes are tiny, so nearly all of its time is XLA compiling programs (generate's
while loops, per family and policy), and most of that is LLVM optimising CPU code that then runs
for milliseconds. Backend optimisation level 0 without LLVM's expensive passes about halves a
compile-bound test (tests/sharding_scripts/parity.py, two families, dense: 73 s -> 37 s) and does
not change what a program computes: HLO passes (fusion, sharding propagation, the collectives the
HLO checks inspect) run as before, and every comparison is within one process under one set of
flags. MASKAHEAD_TEST_FULL_OPT=1 runs the suite with XLA's default optimisation instead.
"""
from __future__ import annotations

import os

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_test_flags(flags: str) -> str:
    """`flags` plus FAST_COMPILE_FLAGS (unless MASKAHEAD_TEST_FULL_OPT=1 or already set)."""
    if os.environ.get("MASKAHEAD_TEST_FULL_OPT") == "1" or "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE_FLAGS}".strip()
