"""Pallas Triton kernels (`pl.pallas_call` + `pltriton.CompilerParams`) of the two-pass scored
attention (splitk.py), for GPUs.  Impl name "pallas_triton".

Why a second GPU backend: the Mosaic GPU kernels (gpu.py) cannot be executed by any CPU
interpreter, so their numerics are only checked on a device.  A Triton-lowered `pallas_call`
runs under the generic Pallas interpreter (`interpret=True`) on CPU, so these kernels are
checked against the references here, and they lower for CUDA from a CPU host (tests).  The
Pallas Triton backend is deprecated from jax 0.11.0 on (it warns at lowering) but works on
0.10.2 - 0.12, and any sm80+ GPU.

Layout.  Rows R = G*T (splitk.rows) are zero-padded to row blocks of BLOCK_R (a power of two,
Triton tensors must be).  Pass 1: grid (B, Hkv, row blocks, splits); a program walks the
`tile`-token tiles of its split with a fori_loop, reading each tile straight from the context
arrays (packed: uint8 codes + fp16 scale / zero), dequantizing it in registers into channel
planes (tiles.py's scheme: plane p holds channels j*cpb + p) and updating the online softmax
state.  Pass 2: grid (B, Hkv, tiles); a program dequantizes one tile once and loops over the
row blocks for the pooled mass, then adds the value distance to the centre.

Plane widths that are not a power of two >= 16 (head_dim 96, or 32 at 2 bits) are zero-padded
in jnp before the call (exact: zero codes with zero scale / zero dequantize to 0); that pads a
copy of the uint8 / float context, so such head sizes pay one extra pass over the layer.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import splitk
from .reference import NEG_INF
from .splitk import Partial, default_splits

GROUP = 32
DEFAULT_TILE = 64  # KV tokens per step: two key groups
MIN_DOT = 16  # Triton dots need every dimension >= 16
NT = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k] -> [m, n]


def _pow2(n: int, lo: int = MIN_DOT) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def block_rows(r: int) -> int:
    """Query rows per program: the whole (padded) row set up to 64, else blocks of 64."""
    return min(_pow2(r), 64)


def plan(n: int, tile=None, splits=None) -> tuple[int, int, int]:
    """(tile, splits, padded length): tiles are powers of two >= 32 tokens (whole key groups)."""
    tile = tile or DEFAULT_TILE
    if tile < GROUP or tile & (tile - 1):
        raise ValueError(f"Triton tiles must be a power of two >= {GROUP} tokens, got {tile}")
    splits = splits or default_splits(n, tile)
    step = tile * splits
    return tile, splits, -(-n // step) * step


class Ctx(NamedTuple):
    kind: str  # "float" | "packed"
    arrays: tuple  # [B, Hkv, ...] with the plane width padded to `dp`
    bits: int  # 16 for float
    dp: int  # padded plane width (a power of two >= 16)
    dp_true: int  # plane width before padding


def _pad_last(x, n):
    extra = n - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def float_ctx(k, v) -> Ctx:
    """k, v [B, Hkv, S, D] (kept in their dtype; the dots run in the query's dtype)."""
    d = k.shape[-1]
    dp = _pow2(d)
    return Ctx("float", (_pad_last(k, dp), _pad_last(v, dp)), 16, dp, d)


def packed_ctx(k_codes, k_scale_p, k_zero_p, v_codes, v_scale, v_zero, bits: int) -> Ctx:
    """Codes [B, Hkv, S, Dp] uint8; key metadata in planes [B, Hkv, cpb, S/32, Dp]; value
    metadata [B, Hkv, S, D/32] (layouts of tpu.packed_ctx)."""
    cpb = 8 // bits
    d0 = k_codes.shape[-1]
    dp = _pow2(d0)
    ngv = dp * cpb // GROUP  # value groups per token after padding
    arrays = (_pad_last(k_codes, dp), _pad_last(k_scale_p, dp), _pad_last(k_zero_p, dp),
              _pad_last(v_codes, dp), _pad_last(v_scale, ngv), _pad_last(v_zero, ngv))
    return Ctx("packed", arrays, bits, dp, d0)


def _interpret(interpret) -> bool:
    return bool(interpret)


def _params(rows: int):
    return pltriton.CompilerParams(num_warps=4 if rows <= 64 else 8, num_stages=2)


def _bcast(x, shape, dim):
    return lax.broadcast_in_dim(x, shape, (dim,))


def _load_keys(ctx: Ctx, refs, t, tile):
    """Tile t of the key refs -> cpb planes [tile, dp] float32."""
    span = pl.ds(t * tile, tile)
    if ctx.kind == "float":
        return [refs[0][span, :].astype(jnp.float32)]
    codes_ref, s_ref, z_ref = refs
    codes = codes_ref[span, :].astype(jnp.int32)
    ng, bits, dp = tile // GROUP, ctx.bits, ctx.dp
    group = lax.broadcasted_iota(jnp.int32, (tile, dp), 0) // GROUP
    out = []
    for p in range(8 // bits):
        plane = ((codes >> (bits * p)) & ((1 << bits) - 1)).astype(jnp.float32)
        sc = zc = None
        for g in range(ng):  # the tile's key groups: per-channel scale / zero, one row each
            s = _bcast(s_ref[p, t * ng + g, :].astype(jnp.float32), (tile, dp), 1)
            z = _bcast(z_ref[p, t * ng + g, :].astype(jnp.float32), (tile, dp), 1)
            sc = s if sc is None else jnp.where(group == g, s, sc)
            zc = z if zc is None else jnp.where(group == g, z, zc)
        out.append(plane * sc + zc)
    return out


def _load_values(ctx: Ctx, refs, t, tile):
    """Tile t of the value refs -> cpb planes [tile, dp] float32."""
    span = pl.ds(t * tile, tile)
    if ctx.kind == "float":
        return [refs[0][span, :].astype(jnp.float32)]
    codes_ref, s_ref, z_ref = refs
    bits, dp = ctx.bits, ctx.dp
    cpb = 8 // bits
    codes = codes_ref[span, :].astype(jnp.int32)
    lane_group = lax.broadcasted_iota(jnp.int32, (tile, dp), 1) // (GROUP // cpb)
    sc = zc = None
    for g in range(dp * cpb // GROUP):  # per-token scale / zero of each 32-channel group
        s = _bcast(s_ref[span, g].astype(jnp.float32), (tile, dp), 0)
        z = _bcast(z_ref[span, g].astype(jnp.float32), (tile, dp), 0)
        sc = s if sc is None else jnp.where(lane_group == g, s, sc)
        zc = z if zc is None else jnp.where(lane_group == g, z, zc)
    mask = (1 << bits) - 1
    return [((codes >> (bits * p)) & mask).astype(jnp.float32) * sc + zc for p in range(cpb)]


def _logits(q_planes, k_planes, scale):
    s = None
    for qp, kp in zip(q_planes, k_planes):
        d = lax.dot_general(qp, kp.astype(qp.dtype), NT, preferred_element_type=jnp.float32)
        s = d if s is None else s + d
    return s * scale


def _compute_dtype(q_dtype, ctx: Ctx):
    """Dot operand dtype: float32 stays float32 (exact tests); packed tiles use float16 (11-bit
    mantissa, less rounding of the dequantized values than bf16); float contexts their dtype."""
    if q_dtype == jnp.float32:
        return jnp.float32
    return jnp.float16 if ctx.kind == "packed" else q_dtype


def _ctx_specs(ctx: Ctx, span: int, tile_of) -> list:
    """BlockSpecs giving a program the `span` tokens of block tile_of(*grid) of each array."""
    cpb = 8 // ctx.bits if ctx.kind == "packed" else 1
    tok = pl.BlockSpec((None, None, span, ctx.dp), lambda *g: (g[0], g[1], tile_of(*g), 0))
    if ctx.kind == "float":
        return [tok, tok]
    kmeta = pl.BlockSpec((None, None, cpb, span // GROUP, ctx.dp),
                         lambda *g: (g[0], g[1], 0, tile_of(*g), 0))
    ngv = ctx.arrays[4].shape[-1]
    vmeta = pl.BlockSpec((None, None, span, ngv), lambda *g: (g[0], g[1], tile_of(*g), 0))
    return [tok, kmeta, kmeta, tok, vmeta, vmeta]


def _pad_rows(q_planes, ctx: Ctx, br: int, dtype):
    b, h, cpb, r, dp = q_planes.shape
    rp = -(-r // br) * br
    q = jnp.pad(q_planes, ((0, 0),) * 3 + ((0, rp - r), (0, ctx.dp - dp)))
    return q.astype(dtype), rp


def _dist2(v_planes, cen_ref, dp):
    """[tile] squared distance of the tile's values (planes [tile, dp]) to the centre
    cen_ref [cpb, dp]."""
    d2 = None
    for i, vp in enumerate(v_planes):
        diff = vp - _bcast(cen_ref[i, :], vp.shape, 1)
        x = (diff * diff).sum(axis=1)
        d2 = x if d2 is None else d2 + x
    return d2


def pass1(q_planes, ctx: Ctx, valid, *, tile: int, splits: int, interpret=False) -> Partial:
    """Partial softmax states, see tpu.pass1 for the contract."""
    b, h, cpb, r, dp0 = q_planes.shape
    dp = ctx.dp
    s_len = valid.shape[-1]
    span = s_len // splits
    tps = span // tile
    scale = 1.0 / float(cpb * dp0) ** 0.5
    br = block_rows(r)
    cdt = _compute_dtype(q_planes.dtype, ctx)
    qp, rp = _pad_rows(q_planes, ctx, br, cdt)
    n_arr = len(ctx.arrays)
    n_k = 1 if ctx.kind == "float" else 3

    def kernel(q_ref, *refs):
        c_refs, valid_ref = refs[:n_arr], refs[n_arr]
        m_ref, l_ref, acc_ref = refs[n_arr + 1:]
        q = [q_ref[p] for p in range(cpb)]  # [br, dp] each

        def body(t, carry):
            m, l, accs = carry
            s = _logits(q, _load_keys(ctx, c_refs[:n_k], t, tile), scale)  # [br, tile]
            ok = _bcast(valid_ref[pl.ds(t * tile, tile)] != 0, (br, tile), 1)
            s = jnp.where(ok, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(ok, jnp.exp(s - _bcast(m_new, (br, tile), 0)), 0.0)
            l = l * alpha + p.sum(axis=1)
            pc = p.astype(cdt)
            new = tuple(acc * _bcast(alpha, (br, dp), 0)
                        + jnp.dot(pc, vp.astype(cdt), preferred_element_type=jnp.float32)
                        for acc, vp in zip(accs, _load_values(ctx, c_refs[n_k:], t, tile)))
            return m_new, l, new

        init = (jnp.full((br,), NEG_INF, jnp.float32), jnp.zeros((br,), jnp.float32),
                tuple(jnp.zeros((br, dp), jnp.float32) for _ in range(cpb)))
        m, l, accs = lax.fori_loop(0, tps, body, init)
        m_ref[...] = m
        l_ref[...] = l
        for p in range(cpb):
            acc_ref[p] = accs[p]

    tile_of = lambda b_, h_, rb, s_: s_
    in_specs = ([pl.BlockSpec((None, None, cpb, br, dp), lambda b_, h_, rb, s_: (b_, h_, 0, rb, 0))]
                + _ctx_specs(ctx, span, tile_of)
                + [pl.BlockSpec((None, None, span), lambda b_, h_, rb, s_: (b_, h_, s_))])
    st = pl.BlockSpec((None, None, None, br), lambda b_, h_, rb, s_: (b_, h_, s_, rb))
    out_specs = [st, st, pl.BlockSpec((None, None, None, cpb, br, dp),
                                      lambda b_, h_, rb, s_: (b_, h_, s_, 0, rb, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, splits, rp), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((b, h, splits, cpb, rp, dp), jnp.float32)]
    m, l, acc = pl.pallas_call(
        kernel, grid=(b, h, rp // br, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=_params(br), interpret=_interpret(interpret),
        name="scored_attention_pass1_triton",
    )(qp, *ctx.arrays, valid.astype(jnp.int32))
    acc = jnp.moveaxis(acc[:, :, :, :, :r, :dp0], 3, -1).reshape(b, h, splits, r, cpb * dp0)
    return Partial(m[..., :r], l[..., :r], acc)


def pass2(q_planes, ctx: Ctx, valid, lse, w, centre_p, *, tile: int, interpret=False):
    """Mass and value score per context key, see tpu.pass2 for the contract."""
    b, h, cpb, r, dp0 = q_planes.shape
    dp = ctx.dp
    s_len = valid.shape[-1]
    scale = 1.0 / float(cpb * dp0) ** 0.5
    br = block_rows(r)
    cdt = _compute_dtype(q_planes.dtype, ctx)
    qp, rp = _pad_rows(q_planes, ctx, br, cdt)
    lse_p = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, rp - r)), constant_values=1e30)
    w_p = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, rp - r)))
    cen = _pad_last(centre_p.astype(jnp.float32), dp)  # [B, Hkv, cpb, dp]
    n_arr = len(ctx.arrays)
    n_k = 1 if ctx.kind == "float" else 3

    def kernel(q_ref, *refs):
        c_refs = refs[:n_arr]
        valid_ref, lse_ref, w_ref, cen_ref, mass_ref, score_ref = refs[n_arr:]
        k_planes = [x.astype(cdt) for x in _load_keys(ctx, c_refs[:n_k], 0, tile)]
        ok = _bcast(valid_ref[...] != 0, (br, tile), 1)

        def body(rb, mass):  # one block of query rows against the tile
            rows = pl.ds(rb * br, br)
            s = _logits([q_ref[p, rows, :] for p in range(cpb)], k_planes, scale)
            p = jnp.where(ok, jnp.exp(s - _bcast(lse_ref[rows], (br, tile), 0)), 0.0)
            return mass + (p * _bcast(w_ref[rows], (br, tile), 0)).sum(axis=0)

        mass = lax.fori_loop(0, rp // br, body, jnp.zeros((tile,), jnp.float32))
        mass_ref[...] = mass
        score_ref[...] = mass * jnp.sqrt(_dist2(_load_values(ctx, c_refs[n_k:], 0, tile), cen_ref, dp))

    tile_of = lambda b_, h_, t_: t_
    per_tok = pl.BlockSpec((None, None, tile), lambda b_, h_, t_: (b_, h_, t_))
    in_specs = ([pl.BlockSpec((None, None, cpb, rp, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))]
                + _ctx_specs(ctx, tile, tile_of)
                + [per_tok,
                   pl.BlockSpec((None, None, rp), lambda b_, h_, t_: (b_, h_, 0)),
                   pl.BlockSpec((None, rp), lambda b_, h_, t_: (b_, 0)),
                   pl.BlockSpec((None, None, cpb, dp), lambda b_, h_, t_: (b_, h_, 0, 0))])
    out_shape = [jax.ShapeDtypeStruct((b, h, s_len), jnp.float32)] * 2
    mass, score = pl.pallas_call(
        kernel, grid=(b, h, s_len // tile), in_specs=in_specs, out_specs=[per_tok, per_tok],
        out_shape=out_shape, compiler_params=_params(br), interpret=_interpret(interpret),
        name="scored_attention_pass2_triton",
    )(qp, *ctx.arrays, valid.astype(jnp.int32), lse_p, w_p, cen)
    return mass, score


def pass2_pool(q_planes, ctx: Ctx, valid, lse, w, *, tile: int, interpret=False):
    """Pass 2 of a pooling other than the mean, see tpu.pass2_pool for the contract."""
    b, h, cpb, r, dp0 = q_planes.shape
    dp = ctx.dp
    s_len = valid.shape[-1]
    nt = s_len // tile
    scale = 1.0 / float(cpb * dp0) ** 0.5
    br = block_rows(r)
    cdt = _compute_dtype(q_planes.dtype, ctx)
    qp, rp = _pad_rows(q_planes, ctx, br, cdt)
    lse_p = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, rp - r)), constant_values=1e30)
    w_p = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, rp - r)))
    n_arr = len(ctx.arrays)
    n_k = 1 if ctx.kind == "float" else 3

    def kernel(q_ref, *refs):
        c_refs = refs[:n_arr]
        valid_ref, lse_ref, w_ref, sum_ref, max_ref, vsum_ref = refs[n_arr:]
        k_planes = [x.astype(cdt) for x in _load_keys(ctx, c_refs[:n_k], 0, tile)]
        ok = _bcast(valid_ref[...] != 0, (br, tile), 1)

        def body(rb, carry):  # one block of query rows against the tile
            msum, mmax = carry
            rows = pl.ds(rb * br, br)
            s = _logits([q_ref[i, rows, :] for i in range(cpb)], k_planes, scale)
            p = jnp.where(ok, jnp.exp(s - _bcast(lse_ref[rows], (br, tile), 0)), 0.0)
            wb = _bcast(w_ref[rows], (br, tile), 0)
            return msum + (p * wb).sum(axis=0), jnp.maximum(mmax, jnp.where(wb > 0, p, 0.0).max(axis=0))

        zero = jnp.zeros((tile,), jnp.float32)
        msum, mmax = lax.fori_loop(0, rp // br, body, (zero, zero))
        sum_ref[...] = msum
        max_ref[...] = mmax
        for i, vp in enumerate(_load_values(ctx, c_refs[n_k:], 0, tile)):
            vsum_ref[i] = (vp * _bcast(mmax, (tile, dp), 0)).sum(axis=0)

    per_tok = pl.BlockSpec((None, None, tile), lambda b_, h_, t_: (b_, h_, t_))
    in_specs = ([pl.BlockSpec((None, None, cpb, rp, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))]
                + _ctx_specs(ctx, tile, lambda b_, h_, t_: t_)
                + [per_tok,
                   pl.BlockSpec((None, None, rp), lambda b_, h_, t_: (b_, h_, 0)),
                   pl.BlockSpec((None, rp), lambda b_, h_, t_: (b_, 0))])
    out_specs = [per_tok, per_tok, pl.BlockSpec((None, None, None, cpb, dp),
                                                lambda b_, h_, t_: (b_, h_, t_, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, s_len), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((b, h, nt, cpb, dp), jnp.float32)]
    msum, mmax, vsum = pl.pallas_call(
        kernel, grid=(b, h, nt), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=_params(br), interpret=_interpret(interpret),
        name="scored_attention_pass2_pool_triton",
    )(qp, *ctx.arrays, valid.astype(jnp.int32), lse_p, w_p)
    return msum, mmax, splitk.planes_to_channels(vsum.sum(2)[..., :dp0])


def distance(ctx: Ctx, centre_p, *, tile: int, interpret=False):
    """Squared distance of every context value to the centre, see tpu.distance."""
    b, h, cpb, dp0 = centre_p.shape
    dp = ctx.dp
    n_k = 1 if ctx.kind == "float" else 3
    vals = ctx.arrays[n_k:]
    s_len = vals[0].shape[2]
    n_v = len(vals)
    cen = _pad_last(centre_p.astype(jnp.float32), dp)

    def kernel(*refs):
        refs[n_v + 1][...] = _dist2(_load_values(ctx, refs[:n_v], 0, tile), refs[n_v], dp)

    per_tok = pl.BlockSpec((None, None, tile), lambda b_, h_, t_: (b_, h_, t_))
    in_specs = (_ctx_specs(ctx, tile, lambda b_, h_, t_: t_)[n_k:]
                + [pl.BlockSpec((None, None, cpb, dp), lambda b_, h_, t_: (b_, h_, 0, 0))])
    return pl.pallas_call(
        kernel, grid=(b, h, s_len // tile), in_specs=in_specs, out_specs=per_tok,
        out_shape=jax.ShapeDtypeStruct((b, h, s_len), jnp.float32),
        compiler_params=_params(16), interpret=_interpret(interpret),
        name="scored_attention_distance_triton",
    )(*vals, cen)
