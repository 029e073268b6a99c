"""One entry point per op; picks the Pallas kernel for the backend, the jnp reference on CPU.

    scored_attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask, stat_rows=None, ...)
    scored_attention_quant(q, ctx: QuantKV, ctx_valid, k_blk, v_blk, blk_mask, stat_rows=None, ...)
    sparse_attention(q, k_sel, v_sel, sel_valid, k_blk, v_blk, blk_mask, ...)

All share `reference.attention`'s contract: q [B, Hkv, G, T, D], context [B, Hkv, S, D] (or a
QuantKV with leading axes [B, Hkv]), ctx_valid [B, Hkv, S], block k/v [B, Hkv, T, D],
blk_mask [B, T, T], stat_rows [B, T]; they return (out [B, Hkv, G, T, D], ScoredStats or None).
`pool` (reference.POOLS) is how the statistics pool their rows; a pooling other than the mean
runs pass 2's pooled variant and a third pass (splitk.py), on the TPU and Triton kernels
(`pool_impl`: a Mosaic GPU call pools those on the Triton kernels).

`impl`: None picks by `jax.default_backend()` ("gpu" -> "pallas_gpu" (Mosaic GPU) for float
contexts and "pallas_triton" for packed ones, "tpu" -> "pallas_tpu", else "reference"; see
GPU_PACKED_IMPL for why and for when packed contexts fall back to the reference); tests force a
kernel with impl=... and interpret=True (or an InterpretParams / InterpretGPUParams instance) on
CPU. `tile` (tokens per KV tile) and `splits` (parallel KV splits of pass 1) default per backend.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import quant
from . import quant_reference, reference, splitk
from .reference import ScoredStats

IMPLS = ("reference", "pallas_gpu", "pallas_triton", "pallas_tpu")

# Automatic choice for packed (int4 / int2) contexts on a GPU: the Pallas Triton kernels
# (gpu_triton.py), which read the packed cache tile by tile.  Why those and not the Mosaic GPU
# ones: both lower for CUDA at model shapes on every jax checked here (0.10.2, 0.11.2, 0.12.0.1;
# the Mosaic ones failed to lower on jax 0.11.2 until kernels/gpu.py was fixed), but only the
# Triton ones can be executed on CPU (interpret mode), where they match quant_reference; no CPU
# interpreter runs the Mosaic GPU kernels.  NEITHER has run on a GPU yet: the first device session
# runs them (experiments/gpu_profile.sh, docs/results.md section 4).  Conservative guard: jax
# releases newer than GPU_PACKED_CHECKED_UP_TO (lowering not checked), or a jax without the
# (deprecated) Pallas Triton backend, read packed contexts with the jnp reference instead.
GPU_PACKED_IMPL = "pallas_triton"
GPU_PACKED_CHECKED_UP_TO = (0, 12)


def _jax_version() -> tuple:
    out = []
    for part in jax.__version__.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _triton_available() -> bool:
    try:
        from jax.experimental.pallas import triton  # noqa: F401  (deprecated since jax 0.11)
    except ImportError:
        return False
    return True


def target_backend() -> str:
    """The backend a trace is for: the platform of the abstract device of the context's abstract
    mesh when there is one (``jax.sharding.use_abstract_mesh``, e.g. lowering for a TPU on a CPU
    machine: maskahead_jax/lowering/), else ``jax.default_backend()``."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return dev.platform if dev is not None else jax.default_backend()


def resolve_impl(impl: Optional[str] = None, packed: bool = False) -> str:
    """The implementation to run: `impl` when given (checked), else by the target backend."""
    if impl is None:
        backend = target_backend()
        if packed and backend == "gpu":
            if _jax_version() <= GPU_PACKED_CHECKED_UP_TO and _triton_available():
                return GPU_PACKED_IMPL
            return "reference"
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "reference")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _backend(impl: str):
    if impl == "pallas_tpu":
        from . import tpu
        return tpu
    if impl == "pallas_triton":
        from . import gpu_triton
        return gpu_triton
    from . import gpu
    return gpu


def _pad(x, axis: int, n: int, value=0):
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pool_impl(impl: str, pool: str = "mean") -> str:
    """The kernel that pools statistics by `pool`: every backend's but the Mosaic GPU one, whose
    pass 2 pools by the mean only (the other poolings on a GPU take the Pallas Triton kernels,
    or the reference where resolve_impl would not pick Triton for packed contexts)."""
    if impl != "pallas_gpu" or pool == "mean":
        return impl
    if _jax_version() <= GPU_PACKED_CHECKED_UP_TO and _triton_available():
        return GPU_PACKED_IMPL
    return "reference"


def _pooled_stats(be, q_planes, q_rows, ctx, valid, cpb, fin, w, pool, tile, interpret, s_len,
                  residual):
    """Statistics of a non-mean pooling: pass 2 (per-key sum and max over the rows, and the
    max's value sum), the pooled mass and its centre (splitk.pool_mass), then pass 3 (each
    value's distance to that centre)."""
    lse = fin.lse_joint if pool == "max_joint" else fin.lse
    msum, mmax, vsum = be.pass2_pool(q_planes, ctx, valid, lse, w, tile=tile, interpret=interpret)
    msum, mmax = msum[..., :s_len], mmax[..., :s_len]
    if residual is not None:
        rsum, rmax, rvsum = splitk.pool_stats_jnp(q_rows, *residual, lse, w)
        msum, mmax = jnp.concatenate([msum, rsum], -1), jnp.concatenate([mmax, rmax], -1)
        vsum = vsum + rvsum
    mass, centre = splitk.pool_mass(pool, msum, mmax, vsum, fin.vsum)
    d2 = be.distance(ctx, splitk.to_planes(centre, cpb), tile=tile, interpret=interpret)[..., :s_len]
    if residual is not None:
        d2 = jnp.concatenate([d2, splitk.distance_jnp(residual[1], centre)], -1)
    return ScoredStats(mass, mass * jnp.sqrt(d2))


def _run(be, q, ctx, valid, cpb, k_blk, v_blk, blk_mask, stat_rows, tile, splits, interpret,
         s_len, residual=None, pool="mean", seq_axis=None):
    g = q.shape[2]
    q_rows = splitk.rows(q)  # [B, Hkv, R, D]
    q_planes = splitk.to_planes(q_rows, cpb)  # [B, Hkv, cpb, R, D/cpb]
    part = be.pass1(q_planes, ctx, valid, tile=tile, splits=splits, interpret=interpret)
    if residual is not None:
        part = splitk.concat(part, splitk.partial_jnp(q_rows, *residual))
    if seq_axis is not None:  # the context is split over devices: every device's splits, merged
        part = splitk.Partial(*(jax.lax.all_gather(x, seq_axis, axis=2, tiled=True) for x in part))
    fin = splitk.finish(part, q, k_blk, v_blk, blk_mask, stat_rows)
    if stat_rows is None:
        return fin.out, None
    w = splitk.row_weights(stat_rows, g)
    if pool != "mean":
        return fin.out, _pooled_stats(be, q_planes, q_rows, ctx, valid, cpb, fin, w, pool, tile,
                                      interpret, s_len, residual)
    mass, score = be.pass2(q_planes, ctx, valid, fin.lse, w, splitk.to_planes(fin.centre, cpb),
                           tile=tile, interpret=interpret)
    mass, score = mass[..., :s_len], score[..., :s_len]
    if residual is not None:
        rm, rs = splitk.stats_jnp(q_rows, *residual, fin.lse, w, fin.centre)
        mass, score = jnp.concatenate([mass, rm], -1), jnp.concatenate([score, rs], -1)
    return fin.out, ScoredStats(mass, score)


def _check_pool(pool: str) -> None:
    if pool not in reference.POOLS:
        raise ValueError(f"pool must be one of {reference.POOLS}, got {pool!r}")


def scored_attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask,
                     stat_rows: Optional[jax.Array] = None, *, impl: Optional[str] = None,
                     interpret=False, tile: Optional[int] = None, splits: Optional[int] = None,
                     pool: str = "mean", seq_axis: Optional[str] = None):
    """Exact attention over [context | block] plus prefix mass and value score (float context);
    `pool`: how the statistics pool their rows (reference.POOLS, `pool_impl`). `seq_axis`: inside
    a shard_map whose devices each hold a slice of the context along this mesh axis
    (kernels/sharded.py): pass 1 runs on the slice, the softmax states of every slice merge
    (flash-decoding across devices), the statistics come out for the local slice."""
    _check_pool(pool)
    impl = resolve_impl(impl)
    if stat_rows is not None:
        impl = pool_impl(impl, pool)
    if impl == "reference" or k_ctx is None:
        return reference.attention(q, k_ctx, v_ctx, ctx_valid, k_blk, v_blk, blk_mask, stat_rows, pool)
    be = _backend(impl)
    s_len = k_ctx.shape[2]
    tile, splits, n = be.plan(s_len, tile, splits)
    ctx = be.float_ctx(_pad(k_ctx, 2, n), _pad(v_ctx, 2, n))
    return _run(be, q, ctx, _pad(ctx_valid, 2, n, False), 1, k_blk, v_blk, blk_mask, stat_rows,
                tile, splits, interpret, s_len, pool=pool, seq_axis=seq_axis)


def scored_attention_quant(q, ctx: quant.QuantKV, ctx_valid, k_blk, v_blk, blk_mask,
                           stat_rows: Optional[jax.Array] = None, *, impl: Optional[str] = None,
                           interpret=False, tile: Optional[int] = None,
                           splits: Optional[int] = None, pool: str = "mean"):
    """Same as `scored_attention` with a packed context, dequantized tile by tile in the kernel.

    A bf16 residual (the trailing partial key group) is handled in jnp and merged into the
    same softmax state.
    """
    _check_pool(pool)
    impl = resolve_impl(impl, packed=True)
    if stat_rows is not None:
        impl = pool_impl(impl, pool)
    nq = ctx.num_packed
    if impl == "reference" or nq == 0:
        return quant_reference.attention_quant(q, ctx, ctx_valid, k_blk, v_blk, blk_mask, stat_rows, pool)
    be = _backend(impl)
    bits = ctx.bits
    cpb = quant.codes_per_byte(bits)
    tile, splits, n = be.plan(nq, tile, splits)
    ng = n // quant.GROUP
    packed = be.packed_ctx(
        _pad(ctx.k_codes, 2, n),
        _pad(splitk.to_planes(ctx.k_scale, cpb), 3, ng), _pad(splitk.to_planes(ctx.k_zero, cpb), 3, ng),
        _pad(ctx.v_codes, 2, n), _pad(ctx.v_scale, 2, n), _pad(ctx.v_zero, 2, n), bits)
    valid = _pad(ctx_valid[..., :nq], 2, n, False)
    residual = None
    if ctx.k_res.shape[-2]:
        residual = (ctx.k_res, ctx.v_res, ctx_valid[..., nq:])
    return _run(be, q, packed, valid, cpb, k_blk, v_blk, blk_mask, stat_rows, tile, splits,
                interpret, nq, residual, pool)


def sparse_attention(q, k_sel, v_sel, sel_valid, k_blk, v_blk, blk_mask, *,
                     impl: Optional[str] = None, interpret=False, tile: Optional[int] = None,
                     splits: Optional[int] = None) -> jax.Array:
    """Attention of the block over [selected entries | block] (steps >= 1); returns out only.

    k_sel, v_sel [B, Hkv, K, D] is the compact (gathered, dequantized bf16) buffer of the
    selected entries, sel_valid [B, Hkv, K].  Runs pass 1 only.
    """
    out, _ = scored_attention(q, k_sel, v_sel, sel_valid, k_blk, v_blk, blk_mask, None,
                              impl=impl, interpret=interpret, tile=tile, splits=splits)
    return out
