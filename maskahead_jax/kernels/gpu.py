"""Mosaic GPU kernels (`plgpu.kernel`, Hopper wgmma) of the two-pass scored attention.

Why this backend: `plgpu.kernel` is the GPU entry point no jax version deprecates (0.10.2 warns
on `pl.pallas_call` routed to Mosaic GPU; Pallas Triton is deprecated from 0.11). sm90 only.

Layout. One CTA = one warpgroup = 64 query rows of one (batch, KV head) and one KV split (grid
(B*Hkv, row blocks, splits)); rows R = G*T zero-padded to a multiple of 64. KV tiles of 64 tokens
stream through SMEM (`plgpu.emit_pipeline`: TMA, double buffered); QK^T and PV are wgmma with
fp32 accumulators; the softmax state lives in the pipeline carry.

Packed tiles: uint8 codes loaded into registers in the WGMMA layout, split into channel planes
(shifts / masks), dequantized (keys: per-channel scale / zero of the tile's two 32-token groups;
values: per-token scale / zero of each 32-channel group), cast to float16 (less loss than bf16)
and stored to swizzled SMEM as the wgmma B operand; queries and probabilities are float16 there.
Float contexts run in their own dtype (bf16 or f16; float32 inputs are cast to bf16).

Verification status: the kernels lower for CUDA on a CPU host at model shapes (layouts, wgmma
shapes, swizzles, TMA boxes) on jax 0.10.2, 0.11.2 and 0.12 (tests); the float ones ran and
matched the references on an H200 (jax 0.11.2); the packed ones have not run on a GPU yet, and
no CPU interpreter executes them (gpu_triton.py is the packed GPU path CPU tests can run).
jax >= 0.11: each dequantized plane has its own SMEM ref (a plane index closed over by the
pl.run_state step does not lower); jax 0.12: per-plane output copies (TMA strides <= 5 dims).
A TMA copy moves <= 256 elements per dimension (pass 2 copies its rows in chunks: _copy_rows).
Limits: packed rows need head_dim * bits / 8 >= 32 B; pass 2 keeps all R <= 512 rows in SMEM.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .reference import NEG_INF
from .splitk import Partial, default_splits

GROUP = 32
BLOCK_R = 64  # query rows per warpgroup (the wgmma M)
TMA_MAX = 256  # a TMA copy moves at most this many elements along each dimension
DEFAULT_TILE = 64  # KV tokens per pipeline step (two key groups)
WG = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, n] WGMMA array
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def _transposed(ref):
    """[T, D] ref as [D, T]: ref.transpose (plgpu.transpose_ref was removed in jax 0.12.1)."""
    return ref.transpose((1, 0)) if hasattr(ref, "transpose") else plgpu.transpose_ref(ref, (1, 0))


def plan(n: int, tile=None, splits=None) -> tuple[int, int, int]:
    """(tile, splits, padded length): tiles are multiples of 64 tokens (the PV wgmma K)."""
    tile = tile or DEFAULT_TILE
    if tile % 64:
        raise ValueError(f"GPU tiles must be multiples of 64 tokens, got {tile}")
    splits = splits or default_splits(n, tile)
    step = tile * splits
    return tile, splits, -(-n // step) * step


class Ctx(NamedTuple):
    kind: str  # "float" | "packed"
    arrays: tuple
    bits: int
    dtype: object  # compute dtype of the MMA operands


def float_ctx(k, v) -> Ctx:
    dt = k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    return Ctx("float", (k.astype(dt), v.astype(dt)), 16, dt)


def packed_ctx(k_codes, k_scale_p, k_zero_p, v_codes, v_scale, v_zero, bits: int) -> Ctx:
    """Value metadata is transposed to [B, Hkv, D/32, S] so a group's scales are one row."""
    if k_codes.shape[-1] < 32:
        raise ValueError("the Mosaic GPU packed kernels need head_dim * bits / 8 >= 32 bytes "
                         f"(swizzled SMEM rows), got {k_codes.shape[-1]}")
    vs_t, vz_t = (jnp.swapaxes(x, -1, -2) for x in (v_scale, v_zero))
    return Ctx("packed", (k_codes, k_scale_p, k_zero_p, v_codes, vs_t, vz_t), bits, jnp.float16)


def _interpret(interpret):  # True: the (private) Mosaic GPU interpreter's parameters
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return InterpretGPUParams()
    return interpret or None


def _mma_transforms(minor: int, dtype) -> tuple:  # tiling + swizzle of a wgmma SMEM operand
    bits = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


def _flat(x):  # [B, Hkv, ...] -> [B*Hkv, ...]
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _load(ref, layout):
    """Load a whole SMEM ref straight into `layout` (get + layout_cast lowers as one load)."""
    return plgpu.layout_cast(ref[...], layout)


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)


def _bcast(x, shape, dim):
    return lax.broadcast_in_dim(x, shape, [dim])


def _dequant_keys(codes_ref, s_ref, z_ref, bits, tile, dp):
    """codes [tile, Dp] u8, scale/zero [cpb, tile/32, Dp] -> cpb planes [tile, Dp] f32 (WGMMA)."""
    codes = _load(codes_ref, WG).astype(jnp.int32)
    rows = _iota((tile, dp), 0)
    mask = (1 << bits) - 1
    out = []
    for p in range(8 // bits):
        plane = ((codes >> (bits * p)) & mask).astype(jnp.float32)
        sc = zc = None
        for g in range(tile // GROUP):
            s = _bcast(_load(s_ref.at[p, g], COL).astype(jnp.float32), (tile, dp), 1)
            z = _bcast(_load(z_ref.at[p, g], COL).astype(jnp.float32), (tile, dp), 1)
            if g == 0:
                sc, zc = s, z
            else:
                sel = rows >= g * GROUP
                sc, zc = jnp.where(sel, s, sc), jnp.where(sel, z, zc)
        out.append(plane * sc + zc)
    return out


def _dequant_values(codes_ref, st_ref, zt_ref, bits, tile, dp):
    """codes [tile, Dp] u8, scale/zero transposed [D/32, tile] -> cpb planes [tile, Dp] f32."""
    cpb = 8 // bits
    codes = _load(codes_ref, WG).astype(jnp.int32)
    lane_group = _iota((tile, dp), 1) // (GROUP // cpb)
    sc = zc = None
    for g in range(dp * cpb // GROUP):
        s = _bcast(_load(st_ref.at[g], ROW).astype(jnp.float32), (tile, dp), 0)
        z = _bcast(_load(zt_ref.at[g], ROW).astype(jnp.float32), (tile, dp), 0)
        if g == 0:
            sc, zc = s, z
        else:
            sel = lane_group == g
            sc, zc = jnp.where(sel, s, sc), jnp.where(sel, z, zc)
    mask = (1 << bits) - 1
    return [((codes >> (bits * p)) & mask).astype(jnp.float32) * sc + zc for p in range(cpb)]


def _tile_specs(ctx: Ctx, tile: int, dp: int, d: int):
    """Pipeline BlockSpecs over one (batch*head, split) slice of the context arrays."""
    if ctx.kind == "float":
        tr = _mma_transforms(d, ctx.dtype)
        kv = plgpu.BlockSpec((tile, d), lambda t: (t, 0), transforms=tr)
        return [kv, kv]
    cpb = 8 // ctx.bits
    ng = tile // GROUP
    codes = plgpu.BlockSpec((tile, dp), lambda t: (t, 0), transforms=_mma_transforms(dp, jnp.uint8))
    kmeta = plgpu.BlockSpec((cpb, ng, dp), lambda t: (0, t, 0))
    vmeta = plgpu.BlockSpec((d // GROUP, tile), lambda t: (0, t))
    return [codes, kmeta, kmeta, codes, vmeta, vmeta]


def _slice_ctx(ctx: Ctx, refs, bh, start, length):
    """GMEM views of one (batch*head) lane and `length` tokens from `start`."""
    if ctx.kind == "float":
        return [r.at[bh, pl.ds(start, length)] for r in refs]
    kc, ks, kz, vc, vs, vz = refs
    gs, gl = start // GROUP, length // GROUP
    return [kc.at[bh, pl.ds(start, length)], ks.at[bh, :, pl.ds(gs, gl)],
            kz.at[bh, :, pl.ds(gs, gl)], vc.at[bh, pl.ds(start, length)],
            vs.at[bh, :, pl.ds(start, length)], vz.at[bh, :, pl.ds(start, length)]]


def _key_refs(ctx, kd_smem, key_refs, tile, dp, cpb):
    """SMEM refs [tile, Dp] of the tile's key planes (packed keys are dequantized into kd_smem)."""
    if ctx.kind == "float":
        return [key_refs[0]]
    for p, kp in enumerate(_dequant_keys(*key_refs, ctx.bits, tile, dp)):
        kd_smem[p][...] = kp.astype(ctx.dtype)
    plgpu.commit_smem()  # make the stores visible to the async proxy (wgmma)
    return list(kd_smem)


def _value_refs(ctx, vd_smem, val_refs, tile, dp, cpb):
    """SMEM refs [tile, Dp] of the tile's value planes (packed values dequantized into vd_smem)."""
    if ctx.kind == "float":
        return [val_refs[0]]
    for p, vp in enumerate(_dequant_values(*val_refs, ctx.bits, tile, dp)):
        vd_smem[p][...] = vp.astype(ctx.dtype)
    plgpu.commit_smem()
    return list(vd_smem)


def _logits(q_refs, k_refs, tile, scale):
    """S [64, tile] f32 = sum over planes of q_p k_p^T (wgmma, B transposed in SMEM)."""
    def qk(acc_ref):
        for qr, kr in zip(q_refs, k_refs):
            plgpu.wgmma(acc_ref, qr, _transposed(kr))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((BLOCK_R, tile), jnp.float32)) * scale


def _prepare(q_planes, ctx: Ctx, valid):
    b, h, cpb, r, dp = q_planes.shape
    rp = -(-r // BLOCK_R) * BLOCK_R
    qp = jnp.pad(q_planes, ((0, 0),) * 3 + ((0, rp - r), (0, 0))).astype(ctx.dtype)
    return (_flat(qp), [_flat(a) for a in ctx.arrays], _flat(valid.astype(jnp.float32)), rp)


def _scratch(ctx, cpb, tile, dp, rows=BLOCK_R):
    """SMEM: queries (MMA A operand), dequantized K / V planes (MMA B operands)."""
    q_tr = _mma_transforms(dp, ctx.dtype)
    q = plgpu.SMEM((cpb, rows, dp), ctx.dtype, transforms=q_tr)
    if ctx.kind == "float":
        return (q,)
    # one ref per plane: a plane index into a stacked ref would be a scalar that pl.run_state
    # (the PV accumulator step) closes over, which jax >= 0.11 cannot lower (see pass1)
    kv = plgpu.SMEM((tile, dp), ctx.dtype, transforms=_mma_transforms(dp, ctx.dtype))
    return (q,) + (kv,) * (2 * cpb)


def pass1(q_planes, ctx: Ctx, valid, *, tile: int, splits: int, interpret=False) -> Partial:
    """Partial softmax states, see tpu.pass1 for the contract."""
    b, h, cpb, r, dp = q_planes.shape
    d = cpb * dp
    s_len = valid.shape[-1]
    tps = s_len // tile // splits
    scale = 1.0 / float(d) ** 0.5
    qf, arrays, vf, rp = _prepare(q_planes, ctx, valid)
    nrb = rp // BLOCK_R
    n_arr = len(arrays)
    n_k = 1 if ctx.kind == "float" else 3
    specs = _tile_specs(ctx, tile, dp, d) + [plgpu.BlockSpec((tile,), lambda t: (t,))]

    def kernel(q_ref, *refs):
        c_refs, v_ref = refs[:n_arr], refs[n_arr]
        m_out, l_out, acc_out = refs[n_arr + 1:n_arr + 4]
        q_smem, o_smem, ml_smem, bar, *kv_smem = refs[n_arr + 4:]
        kd_smem, vd_smem = kv_smem[:cpb], kv_smem[cpb:]
        bh, rb, sp = lax.axis_index("bh"), lax.axis_index("rb"), lax.axis_index("sp")
        start = sp * (tps * tile)
        plgpu.copy_gmem_to_smem(q_ref.at[bh, :, pl.ds(rb * BLOCK_R, BLOCK_R)], q_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def step(_, *args):
            tile_refs, (m, l, accs) = args[:-1], args[-1]
            k_refs = _key_refs(ctx, kd_smem, tile_refs[:n_k], tile, dp, cpb)
            s = _logits([q_smem.at[p] for p in range(cpb)], k_refs, tile, scale)
            ok = _bcast(_load(tile_refs[-1], COL), (BLOCK_R, tile), 1) > 0
            s = jnp.where(ok, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(ok, jnp.exp(s - _bcast(m_new, s.shape, 0)), 0.0)
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(ctx.dtype)
            v_refs = _value_refs(ctx, vd_smem, tile_refs[n_k:-1], tile, dp, cpb)
            new = []
            for acc, vr in zip(accs, v_refs):
                def pv(acc_ref, vr=vr):
                    plgpu.wgmma(acc_ref, p16, vr)

                # run_state waits for the wgmma before handing the accumulator back
                new.append(pl.run_state(pv)(plgpu.ACC.init(acc * _bcast(alpha, acc.shape, 0))))
            return m_new, l, tuple(new)

        init = (plgpu.layout_cast(jnp.full((BLOCK_R,), NEG_INF, jnp.float32), ROW),
                plgpu.layout_cast(jnp.zeros((BLOCK_R,), jnp.float32), ROW),
                tuple(plgpu.layout_cast(jnp.zeros((BLOCK_R, dp), jnp.float32), WG)
                      for _ in range(cpb)))
        pipe = plgpu.emit_pipeline(step, grid=(tps,), in_specs=specs, max_concurrent_steps=2,
                                   init_carry=init)
        gm = _slice_ctx(ctx, c_refs, bh, start, tps * tile) + [v_ref.at[bh, pl.ds(start, tps * tile)]]
        m, l, accs = pipe(*gm)
        for p in range(cpb):
            o_smem[p] = accs[p]
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        rows = pl.ds(rb * BLOCK_R, BLOCK_R)
        for p in range(cpb):  # one 2-D copy per plane: TMA strides at most 5 dims (jax 0.12)
            plgpu.copy_smem_to_gmem(o_smem.at[p], acc_out.at[bh, sp, p, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_out.at[bh, sp, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_out.at[bh, sp, rows])
        plgpu.wait_smem_to_gmem(0)

    scratch = _scratch(ctx, cpb, tile, dp)
    out_type = (jax.ShapeDtypeStruct((b * h, splits, rp), jnp.float32),
                jax.ShapeDtypeStruct((b * h, splits, rp), jnp.float32),
                jax.ShapeDtypeStruct((b * h, splits, cpb, rp, dp), jnp.float32))
    m, l, acc = plgpu.kernel(
        kernel, out_type=out_type, grid=(b * h, nrb, splits), grid_names=("bh", "rb", "sp"),
        scratch_types=(scratch[0], plgpu.SMEM((cpb, BLOCK_R, dp), jnp.float32),
                       plgpu.SMEM((2, BLOCK_R), jnp.float32), plgpu.Barrier(num_barriers=1),
                       *scratch[1:]),
        interpret=_interpret(interpret),
    )(qf, *arrays, vf)
    m = m.reshape(b, h, splits, rp)[..., :r]
    l = l.reshape(b, h, splits, rp)[..., :r]
    acc = acc.reshape(b, h, splits, cpb, rp, dp)[:, :, :, :, :r]
    acc = jnp.moveaxis(acc, 3, -1).reshape(b, h, splits, r, d)
    return Partial(m, l, acc)


def _copy_rows(copies, rp: int, bar) -> int:
    """GMEM -> SMEM copies of `rp` rows, in chunks of <= TMA_MAX rows; returns the barriers used."""
    n = 0
    for src, dst in copies:
        for c in range(0, rp, TMA_MAX):
            rows = pl.ds(c, min(TMA_MAX, rp - c))
            plgpu.copy_gmem_to_smem(src.at[rows], dst.at[rows], bar.at[n])
            n += 1
    return n


def pass2(q_planes, ctx: Ctx, valid, lse, w, centre_p, *, tile: int, interpret=False):
    """Mass and value score per context key, see tpu.pass2 for the contract. Grid (B*Hkv,
    splits); a CTA keeps all query rows in SMEM and loops over the 64-row blocks for each KV
    tile, so every tile is read and dequantized once."""
    b, h, cpb, r, dp = q_planes.shape
    d = cpb * dp
    s_len = valid.shape[-1]
    nt = s_len // tile
    splits = default_splits(s_len, tile)
    tps = nt // splits
    scale = 1.0 / float(d) ** 0.5
    qf, arrays, vf, rp = _prepare(q_planes, ctx, valid)
    nrb = rp // BLOCK_R
    pad = ((0, 0), (0, 0), (0, rp - r))
    lw = jnp.stack([jnp.pad(lse, pad, constant_values=1e30),
                    jnp.pad(jnp.broadcast_to(w[:, None], lse.shape), pad)], axis=2)  # [B, H, 2, Rp]
    lw = _flat(lw.astype(jnp.float32))
    cf = _flat(centre_p.astype(jnp.float32))  # [B*H, cpb, Dp]
    n_arr = len(arrays)
    n_k = 1 if ctx.kind == "float" else 3
    n_barriers = (cpb + 2) * -(-rp // TMA_MAX) + 1
    in_specs = _tile_specs(ctx, tile, dp, d) + [plgpu.BlockSpec((tile,), lambda t: (t,))]
    out_specs = [plgpu.BlockSpec((tile,), lambda t: (t,))] * 2

    def kernel(q_ref, *refs):
        c_refs, v_ref, lw_ref, cen_ref = refs[:n_arr], *refs[n_arr:n_arr + 3]
        mass_out, d2_out = refs[n_arr + 3:n_arr + 5]
        q_smem, lw_smem, c_smem, bar, *kv_smem = refs[n_arr + 5:]
        kd_smem, vd_smem = kv_smem[:cpb], kv_smem[cpb:]
        bh, sp = lax.axis_index("bh"), lax.axis_index("sp")
        start = sp * (tps * tile)
        n = _copy_rows([(q_ref.at[bh, p], q_smem.at[p]) for p in range(cpb)]
                       + [(lw_ref.at[bh, j], lw_smem.at[j]) for j in range(2)], rp, bar)
        plgpu.copy_gmem_to_smem(cen_ref.at[bh], c_smem, bar.at[n])
        for i in range(n_barriers):
            plgpu.barrier_wait(bar.at[i])

        def step(_, *tile_refs):
            mass_ref, d2_ref = tile_refs[-2:]
            k_refs = _key_refs(ctx, kd_smem, tile_refs[:n_k], tile, dp, cpb)
            ok = _bcast(_load(tile_refs[n_arr], COL), (BLOCK_R, tile), 1) > 0
            mass = None
            for rb in range(nrb):
                rows = pl.ds(rb * BLOCK_R, BLOCK_R)
                s = _logits([q_smem.at[p, rows] for p in range(cpb)], k_refs, tile, scale)
                lse_b = _bcast(_load(lw_smem.at[0, rows], ROW), s.shape, 0)
                w_b = _bcast(_load(lw_smem.at[1, rows], ROW), s.shape, 0)
                p = jnp.where(ok, jnp.exp(s - lse_b), 0.0)
                mb = (p * w_b).sum(axis=0)  # [tile], pooled over rows (GQA heads x queries)
                mass = mb if mass is None else mass + mb
            if ctx.kind == "float":
                v_planes = [_load(tile_refs[n_k], WG).astype(jnp.float32)]
            else:
                v_planes = _dequant_values(*tile_refs[n_k:n_arr], ctx.bits, tile, dp)
            d2 = None
            for p, vp in enumerate(v_planes):
                diff = vp - _bcast(_load(c_smem.at[p], COL), vp.shape, 1)
                x = (diff * diff).sum(axis=1)  # [tile]
                d2 = x if d2 is None else d2 + x
            mass_ref[...] = mass
            d2_ref[...] = d2

        pipe = plgpu.emit_pipeline(step, grid=(tps,), in_specs=in_specs, out_specs=out_specs,
                                   max_concurrent_steps=2)
        span = pl.ds(start, tps * tile)
        pipe(*_slice_ctx(ctx, c_refs, bh, start, tps * tile), v_ref.at[bh, span],
             mass_out.at[bh, span], d2_out.at[bh, span])

    scratch = _scratch(ctx, cpb, tile, dp, rows=rp)
    out_type = (jax.ShapeDtypeStruct((b * h, s_len), jnp.float32),) * 2
    mass, d2 = plgpu.kernel(
        kernel, out_type=out_type, grid=(b * h, splits), grid_names=("bh", "sp"),
        scratch_types=(scratch[0], plgpu.SMEM((2, rp), jnp.float32),
                       plgpu.SMEM((cpb, dp), jnp.float32), plgpu.Barrier(num_barriers=n_barriers),
                       *scratch[1:]),
        interpret=_interpret(interpret),
    )(qf, *arrays, vf, lw, cf)
    mass = mass.reshape(b, h, s_len)
    return mass, mass * jnp.sqrt(d2.reshape(b, h, s_len))
