"""Batch-invariant numerics: a prompt's tokens must not depend on what else is in its batch.

What breaks it (measured, docs/evaluation.md "Batch invariance"): XLA's CPU backend hands some
reductions to YNNPACK ("__ynn_fusion"), and whether the elementwise tail of a reduction (RMSNorm's
mean -> + eps -> rsqrt) goes into that fusion or stays in XLA's own loop depends on the array's
size, i.e. on the batch. The two paths round rsqrt differently by one ulp; in bfloat16 that
flips roundings of the normalised activations, and greedy decoding then diverges after a few
layers (the testbed in bf16: 2 of 8 prompts alone vs in a batch of 2, 4 or 8). Matmuls,
softmax and padding to a longer bucket were measured invariant.

The fix: every program the library compiles (the generate cores, `api.forward`, the reference
decoder) is compiled with `compiler_options()`, which on the CPU backend turns YNNPACK fusions
off (`xla_cpu_experimental_ynn_fusion_type=""`). With it the testbed's tokens are identical
alone and in any batch, in bfloat16 and float32, for dense, MaskAhead and Q-MaskAhead.

Opt out with MASKAHEAD_BATCH_VARIANT=1 (bf16 CPU forwards ~1.16x faster, float32 ones ~1.13x
slower: experiments/bench_batch_invariance.py; batch-dependent results), or by
naming the option in XLA_FLAGS yourself (your value is then left alone). GPU / TPU programs get
no option: their batch (in)variance has not been measured yet.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp

OPT_OUT_ENV = "MASKAHEAD_BATCH_VARIANT"
CPU_BATCH_INVARIANT = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def compiler_options(backend: Optional[str] = None) -> Optional[dict]:
    """The XLA compile options of batch-invariant programs on `backend` (default: JAX's default
    backend), or None when there is nothing to set: not CPU, opted out, the user's XLA_FLAGS name
    the option, or this jaxlib does not know it (then with a warning: results may depend on the
    batch)."""
    backend = backend or jax.default_backend()
    if backend != "cpu" or os.environ.get(OPT_OUT_ENV) == "1":
        return None
    if any(k in os.environ.get("XLA_FLAGS", "") for k in CPU_BATCH_INVARIANT):
        return None
    try:  # an unknown option is an error at compile time: probe it once on a trivial program
        jax.jit(jnp.negative, compiler_options=dict(CPU_BATCH_INVARIANT)).lower(
            jnp.zeros((1,), jnp.float32)).compile()
    except Exception as e:  # noqa: BLE001  (jaxlib without the option: fall back, say so)
        warnings.warn(f"this jaxlib does not accept {sorted(CPU_BATCH_INVARIANT)} ({type(e).__name__}); "
                      f"CPU results may depend on batch composition", stacklevel=2)
        return None
    return dict(CPU_BATCH_INVARIANT)


class _LazyJit:
    """`jax.jit(fn, compiler_options=compiler_options(), **kw)`, built at the first use: the
    options depend on the backend, which importing the library must not initialise."""

    def __init__(self, fn: Callable, kw: dict):
        self._fn, self._kw, self._jitted = fn, kw, None
        functools.update_wrapper(self, fn)

    @property
    def jitted(self):
        if self._jitted is None:
            self._jitted = jax.jit(self._fn, compiler_options=compiler_options(), **self._kw)
        return self._jitted

    def __call__(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)

    def _cache_size(self) -> int:
        return self._jitted._cache_size() if self._jitted is not None else 0


def jit(fn: Callable, **kw) -> _LazyJit:
    """`jax.jit` for the library's programs: batch-invariant compile options (see the module)."""
    return _LazyJit(fn, kw)
