"""Lowering one case for TPU / CUDA from this host (`lower_case`) and counting the Pallas kernel
calls in its StableHLO text: a failure is a row with a one-line error (`describe`), never an
exception, so the matrix goes on."""
from __future__ import annotations

import os
import re
import time
import traceback
from collections import Counter
from typing import Optional

from .cases import (CAPACITY, OUT_LEN, TARGETS, _core, abstract_args, abstract_mesh, build_policy, case_config,
                    generation, mesh_label, mesh_sizes_of)

# custom-call targets of the Pallas kernels (Mosaic TPU, Mosaic GPU, Triton)
KERNEL_TARGET = re.compile(r"tpu_custom_call|mosaic_gpu|triton")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")


def lower_program(cfg, gen, policy, prompt_len: int, batch: int, platform: str, mesh: Optional[str] = None):
    """The generate core lowered for `platform` ("tpu" / "cuda") on `mesh` (abstract): jax Lowered."""
    import jax
    import jax.numpy as jnp

    target = TARGETS[platform]
    am = abstract_mesh(mesh, target)
    args = abstract_args(cfg, gen, prompt_len, batch, am)
    with jax.sharding.use_abstract_mesh(am):
        traced = _core(cfg).trace(*args, cfg=cfg, gen=gen, policy=policy, cache_dtype=jnp.dtype(jnp.bfloat16))
        return traced.lower(lowering_platforms=(target.lowering,))


def count_kernels(text: str) -> tuple[int, dict]:
    """(custom calls of the Pallas kernels, {custom-call target: count}) in a StableHLO text."""
    calls = Counter(_CUSTOM_CALL.findall(text))
    return sum(n for t, n in calls.items() if KERNEL_TARGET.search(t)), dict(sorted(calls.items()))


def describe(e: BaseException) -> str:
    """One line: the exception's type and first line, and the deepest library frame it was traced
    or raised at (JAX keeps the trace-time stack of a lowering error in the cause chain)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    where, seen, x = None, set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        for fr in traceback.extract_tb(x.__traceback__):
            f = fr.filename.replace(os.sep, "/")
            if "/maskahead_jax/" in f and "/maskahead_jax/lowering/" not in f:  # not this package's frames
                where = f"{f.split('/maskahead_jax/')[-1]}:{fr.lineno}"
        x = x.__cause__ or x.__context__
    msg = f"{type(e).__name__}: {first[:400]}"
    return msg + (f" (at maskahead_jax/{where})" if where else "")


def lower_case(shape: str, platform: str, policy: str = "dense", prompt_len: int = 8192,
               mesh: Optional[str] = None, batch: Optional[int] = None, out_len: int = OUT_LEN,
               capacity: float = CAPACITY) -> dict:
    """Lower one case (the package docstring: maskahead_jax/lowering/__init__.py); errors are
    reported in the row, never raised."""
    from ..policies import PolicyError

    if platform not in TARGETS:
        raise ValueError(f"unknown platform {platform!r}; choose from {', '.join(TARGETS)}")
    sizes = mesh_sizes_of(mesh)
    batch = int(batch or sizes["data"])
    cfg, need, trained = case_config(shape, prompt_len, out_len)
    row = dict(platform=platform, shape=shape, policy=policy, mesh=mesh_label(mesh), prompt_len=int(prompt_len),
               batch=batch, out_len=int(out_len), lowered=False, error=None, skipped=None, stablehlo_chars=0,
               kernel_calls=0, custom_calls={}, manual_regions=0, positions=need, trained_positions=trained,
               seconds=0.0)
    gen = generation(cfg, out_len)
    try:
        pol = build_policy(policy, cfg, gen, capacity)
    except PolicyError as e:
        row["skipped"] = str(e).splitlines()[0]
        return row
    t0 = time.perf_counter()
    try:
        text = lower_program(cfg, gen, pol, prompt_len, batch, platform, mesh).as_text()
        n, calls = count_kernels(text)
        row.update(lowered=True, stablehlo_chars=len(text), kernel_calls=n, custom_calls=calls,
                   manual_regions=text.count("sdy.manual_computation"))
    except Exception as e:  # noqa: BLE001  (every failure is a row: the matrix goes on)
        row["error"] = describe(e)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row
