"""The model's one attention entry point: every forward of the engine calls `attend`, which runs
the implementation chosen for the current trace (`GenerationConfig.attention`).

    "reference"  the plain jnp ops (kernels/reference.py, quant_reference.py): one joint softmax
                 over [context | block], packed contexts dequantized in the layer body
    "kernels"    per backend (dispatch.resolve_impl): the Pallas split-K kernels for every
                 forward that reads a context (float: flash-decoding over the cache with the
                 block merged in the same softmax state, plus the per-key mass and value score
                 when the engine asks for statistics; packed int4 / int2: codes dequantized tile
                 by tile in the kernel), and `jax.nn.dot_product_attention` for a block that
                 reads no context (the first prefill chunk, the bidirectional full pass)
    "auto"       kernels on GPU / TPU, reference on CPU; under a device mesh the kernels run
                 per shard (kernels/sharded.py: shard_map over data / model / seq)
    "pallas_gpu" | "pallas_tpu" | ...   one kernel backend by name (tests: with interpret=True
                 on the CPU)

Why Pallas and not cuDNN for [cache | block]: the cache's validity is per KV head (eviction
keeps different entries per head), which `dot_product_attention` can only take as a
[B, H, T, S] mask or bias materialised per forward, while the split-K kernel reads the
[B, Hkv, S] validity tile by tile; cuDNN's padding masks (one length per row) cannot say it.

The choice is a trace-time setting (`use`), like a logical-axis-rules context: the engine's cores
run inside `use(gen.attention, gen.attention_interpret)`, and the jit cache is keyed by the
resolved GenerationConfig, so switching implementations recompiles instead of reusing a trace.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .. import quant
from . import dispatch, masks, quant_reference, reference, sharded

CHOICES = ("auto", "reference", "kernels")
# Pass 2 of the Mosaic GPU kernel keeps every query row of a (batch, KV head) in shared memory:
# R = G * T <= 512 at head_dim 128 (kernels/gpu.py "Limits"); statistics over more rows (a long
# bounded-prefill chunk) take the reference path.
GPU_MAX_STAT_ROWS = 512


class Choice(NamedTuple):
    impl: str  # "reference" or a dispatch impl ("pallas_gpu", "pallas_tpu", ...)
    interpret: bool = False  # run the Pallas kernel in interpret mode (CPU tests)
    automatic: bool = False  # chosen by "auto"/"kernels": packed contexts follow dispatch's
    #                          per-version choice (a kernel that does not lower falls back)


_CURRENT: contextvars.ContextVar[Choice] = contextvars.ContextVar("maskahead_attention",
                                                                  default=Choice("reference"))


def resolve(name: str, backend: Optional[str] = None) -> str:
    """The implementation `name` means on `backend` (default: the trace's target,
    dispatch.target_backend: jax's default backend unless an abstract mesh names a device):
    "reference" or a dispatch impl. Unknown names are a ValueError that lists the valid ones."""
    backend = backend or dispatch.target_backend()
    if name in ("auto", "kernels"):
        kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend)
        if kernel is None:
            if name == "kernels":
                raise ValueError(
                    f"attention='kernels' has no kernels for the {backend!r} backend (Pallas "
                    f"targets GPU and TPU); use 'auto' or 'reference', or name a kernel backend "
                    f"with attention_interpret=True to run it in Pallas interpret mode")
            return "reference"
        return kernel
    if name == "reference" or name in dispatch.IMPLS:
        return name
    raise ValueError(f"unknown attention implementation {name!r}; choose one of "
                     f"{CHOICES + tuple(i for i in dispatch.IMPLS if i != 'reference')}")


@contextlib.contextmanager
def use(name: str, interpret: bool = False):
    """Trace the enclosed forwards with the implementation `name` means here (see `resolve`)."""
    token = _CURRENT.set(Choice(resolve(name), bool(interpret), name in ("auto", "kernels")))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Choice:
    return _CURRENT.get()


# `jax.nn.dot_product_attention`'s implementation for a block that reads no context: "xla" (the
# default) or "cudnn" on a GPU (tried at trace time; XLA when cuDNN refuses the shape). cuDNN is
# opt-in until it has run on a device here: a compile-time cuDNN failure would fail the generate.
BLOCK_ATTENTION_GPU = "xla"


def fused_block_attention(q, k_blk, v_blk, blk_mask):
    """Attention of a block over itself only (no context): q [B, Hkv, G, T, D], k/v
    [B, Hkv, T, D], blk_mask [B, T, T] -> [B, Hkv, G, T, D], through
    `jax.nn.dot_product_attention` (see BLOCK_ATTENTION_GPU)."""
    b, hkv, g, t, d = q.shape
    qh = q.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)  # head h = kv * G + g: GQA order
    kh, vh = k_blk.transpose(0, 2, 1, 3), v_blk.transpose(0, 2, 1, 3).astype(k_blk.dtype)
    qh = qh.astype(kh.dtype)
    mask = blk_mask[:, None]
    out = None
    if jax.default_backend() == "gpu" and BLOCK_ATTENTION_GPU == "cudnn":
        try:
            out = jax.nn.dot_product_attention(qh, kh, vh, mask=mask, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError, TypeError):
            out = None  # a shape / dtype / version cuDNN does not take: the XLA path below
    if out is None:
        out = jax.nn.dot_product_attention(qh, kh, vh, mask=mask, implementation="xla")
    return out.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).astype(q.dtype)


def attend(q, ctx, k_blk, v_blk, blk_mask, stat_rows: Optional[jax.Array] = None, pool: str = "mean"):
    """Attention of one layer's block over [context | block] with the current implementation.

    q [B, Hkv, G, T, D]; ctx None or (k, v, valid) with k/v [B, Hkv, S, D] float or k a
    QuantKV and v None (packed); block k/v [B, Hkv, T, D]; blk_mask [B, T, T]; stat_rows [B, T]
    (pool the step-0 statistics over these rows), pooled by `pool` (reference.POOLS: the
    kernels pool by every rule; dispatch: a non-mean pooling's pass 2 keeps each key's sum and
    max over the rows, and a third pass measures the values' distance to the pooled centre; on
    a GPU those forwards take the Pallas Triton kernels, the Mosaic GPU pass 2 pooling by the
    mean). Returns (out [B, Hkv, G, T, D], ScoredStats or None), the contract of
    `reference.attention`.
    """
    if pool not in reference.POOLS:
        raise ValueError(f"pool must be one of {reference.POOLS}, got {pool!r}")
    choice = current()
    if ctx is None:
        # a long pass with no context (the bidirectional full pass, an uncached forward) runs the
        # chunked jnp attention on every backend: O(T) memory, where dot_product_attention
        # would need its [B, H, T, T] mask materialised
        if choice.impl == "reference" or (isinstance(blk_mask, masks.PositionMask)
                                          and reference.is_long(q.shape[3], 0)):
            return reference.attention_any(q, None, None, None, k_blk, v_blk, blk_mask)
        return fused_block_attention(q, k_blk, v_blk, masks.dense(blk_mask)), None
    kc, vc, valid = ctx
    packed = isinstance(kc, quant.QuantKV)
    impl = choice.impl
    pool = pool if stat_rows is not None else "mean"
    if impl != "reference" and pool != "mean":
        impl = dispatch.pool_impl(impl, pool)  # Mosaic GPU pools by the mean only: Triton's
    if impl != "reference" and stat_rows is not None and impl == "pallas_gpu" \
            and q.shape[2] * q.shape[3] > GPU_MAX_STAT_ROWS:
        impl = "reference"
    if packed:
        if impl != "reference" and choice.automatic:
            impl = dispatch.resolve_impl(None, packed=True) if not choice.interpret else impl
        if impl == "reference":
            return quant_reference.attention_quant(q, kc, valid, k_blk, v_blk, blk_mask, stat_rows, pool)

        def call_quant(q, kc, _, valid, k_blk, v_blk, blk_mask, stat_rows, seq_axis):
            return dispatch.scored_attention_quant(q, kc, valid, k_blk, v_blk, blk_mask, stat_rows,
                                                   impl=impl, interpret=choice.interpret, pool=pool)
        return sharded.run(call_quant, q, kc, None, valid, k_blk, v_blk, masks.dense(blk_mask), stat_rows,
                           split_seq=False)
    if impl == "reference":
        return reference.attention_any(q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, pool)

    def call(q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, seq_axis):
        return dispatch.scored_attention(q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, impl=impl,
                                         interpret=choice.interpret, pool=pool, seq_axis=seq_axis)
    return sharded.run(call, q, kc, vc, valid, k_blk, v_blk, masks.dense(blk_mask), stat_rows,
                       split_seq=pool == "mean" or stat_rows is None)
