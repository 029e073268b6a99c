"""Pallas TPU (Mosaic) kernels of the two-pass scored attention (see splitk.py).

Grid: pass 1 (B, Hkv, splits, tiles per split), the last axis sequential with the online
softmax state in VMEM scratch; pass 2 (B, Hkv, tiles), all parallel.  Blocks respect the TPU
tiling rule (last two block dims multiples of (8, 128) or the full array dims): a KV tile is
`tile` tokens (default 256, so a tile holds 8 key groups of metadata rows), and the rows R,
the head dim and the packed width are always whole.

Context operands come in two kinds that share the kernels through a tile loader (tiles.py):
  float:  k, v [B, Hkv, S, D]
  packed: k_codes [B, Hkv, S, Dp] uint8, k_scale/k_zero [B, Hkv, cpb, S/32, Dp] (planes),
          v_codes [B, Hkv, S, Dp] uint8, v_scale/v_zero [B, Hkv, S, D/32]
On CPU run with interpret=True (-> pltpu.InterpretParams()) or an InterpretParams.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import splitk, tiles
from .reference import NEG_INF
from .splitk import Partial

NT = (((1,), (1,)), ((), ()))  # contract the last dims: a [m, k] . b [n, k] -> [m, n]
DEFAULT_TILE = 256  # tokens per KV tile: 8 key groups, a lane-dense multiple of 128


def plan(n: int, tile=None, splits=None) -> tuple[int, int, int]:
    """(tile, splits, padded length) for n context tokens.

    One split by default: (B, Hkv) already feed the parallel grid axes of the TensorCores.
    A context that fits one tile is a single whole-array block (always a legal TPU block).
    """
    tile, splits = tile or DEFAULT_TILE, splits or 1
    if n <= tile and splits == 1:
        return n, 1, n
    step = tile * splits
    return tile, splits, -(-n // step) * step


class Ctx(NamedTuple):
    """Context operands of one kind, with how to tile and load them."""

    arrays: tuple  # all [B, Hkv, ...] with a token axis
    token_axes: tuple  # index of the token axis of each array
    per_group: tuple  # True where the token axis counts 32-token groups (key metadata)
    n_k: int  # the first n_k arrays hold keys, the rest values
    load_k: Callable  # (key refs) -> cpb planes [tile, Dp] float32
    load_v: Callable  # (value refs) -> cpb planes [tile, Dp] float32


def float_ctx(k, v) -> Ctx:
    ld = lambda refs: [refs[0][...].astype(jnp.float32)]
    return Ctx((k, v), (2, 2), (False, False), 1, ld, ld)


def packed_ctx(k_codes, k_scale_p, k_zero_p, v_codes, v_scale, v_zero, bits: int) -> Ctx:
    lk = lambda r: tiles.dequant_key_tile(r[0][...], r[1][...], r[2][...], bits)
    lv = lambda r: tiles.dequant_value_tile(r[0][...], r[1][...], r[2][...], bits)
    return Ctx((k_codes, k_scale_p, k_zero_p, v_codes, v_scale, v_zero), (2, 3, 3, 2, 2, 2),
               (False, True, True, False, False, False), 3, lk, lv)


def _interpret(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _ctx_specs(ctx: Ctx, tile: int, tile_of: Callable) -> list:
    specs = []
    for a, ax, grp in zip(ctx.arrays, ctx.token_axes, ctx.per_group):
        block = [None, None] + list(a.shape[2:])
        block[ax] = tile // tiles.GROUP if grp else tile

        def index_map(*g, ax=ax, nd=a.ndim):
            idx = [g[0], g[1]] + [0] * (nd - 2)
            idx[ax] = tile_of(*g)
            return tuple(idx)

        specs.append(pl.BlockSpec(tuple(block), index_map))
    return specs


def _logits(q_ref, k_planes, scale):
    s = None
    for p, kp in enumerate(k_planes):
        qp = q_ref[p]
        d = lax.dot_general(qp, kp.astype(qp.dtype), NT, preferred_element_type=jnp.float32)
        s = d if s is None else s + d
    return s * scale


def _dist2(v_planes, c_ref):
    """[1, tile] squared distance of the tile's values (cpb planes [tile, Dp]) to the centre
    c_ref [cpb, 1, Dp]."""
    ones = jnp.ones((1, v_planes[0].shape[1]), jnp.float32)
    d2 = None
    for i, vp in enumerate(v_planes):
        diff = vp - c_ref[i]  # [tile, Dp]
        x = lax.dot_general(ones, diff * diff, NT, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)  # [1, tile]
        d2 = x if d2 is None else d2 + x
    return d2


def pass1(q_planes, ctx: Ctx, valid, *, tile: int, splits: int, interpret=False) -> Partial:
    """Partial softmax states over the context.  q_planes [B, Hkv, cpb, R, Dp]; valid [B, Hkv, S].

    Returns Partial: m, l [B, Hkv, splits, R]; acc [B, Hkv, splits, R, D] (planes interleaved).
    """
    b, h, cpb, r, dp = q_planes.shape
    s_len = valid.shape[-1]
    nt = s_len // tile
    tps = nt // splits
    scale = 1.0 / float(cpb * dp) ** 0.5
    n_ctx = len(ctx.arrays)
    tile_of = lambda b_, h_, s_, t_: s_ * tps + t_

    def kernel(q_ref, *refs):
        c_refs, valid_ref = refs[:n_ctx], refs[n_ctx]
        m_o, l_o, acc_o, m_sc, l_sc, acc_sc = refs[n_ctx + 1:]
        t = pl.program_id(3)

        @pl.when(t == 0)
        def _init():
            m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        vr = valid_ref[...] != 0  # [1, tile]
        s = jnp.where(vr, _logits(q_ref, ctx.load_k(c_refs[:ctx.n_k]), scale), NEG_INF)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # [R, 1]
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vr, jnp.exp(s - m_new), 0.0)  # [R, tile]
        l_sc[...] = alpha * l_sc[...] + p.sum(axis=1, keepdims=True)
        m_sc[...] = m_new
        for i, vp in enumerate(ctx.load_v(c_refs[ctx.n_k:])):
            pv = jnp.dot(p.astype(q_ref.dtype), vp.astype(q_ref.dtype),
                         preferred_element_type=jnp.float32)
            acc_sc[i] = alpha * acc_sc[i] + pv

        @pl.when(t == tps - 1)
        def _out():
            m_o[...] = m_sc[...]
            l_o[...] = l_sc[...]
            acc_o[...] = acc_sc[...]

    grid = (b, h, splits, tps)
    in_specs = ([pl.BlockSpec((None, None, cpb, r, dp), lambda b_, h_, s_, t_: (b_, h_, 0, 0, 0))]
                + _ctx_specs(ctx, tile, tile_of)
                + [pl.BlockSpec((None, None, 1, tile), lambda b_, h_, s_, t_: (b_, h_, 0, tile_of(b_, h_, s_, t_)))])
    st_spec = pl.BlockSpec((None, None, None, r, 1), lambda b_, h_, s_, t_: (b_, h_, s_, 0, 0))
    out_specs = [st_spec, st_spec,
                 pl.BlockSpec((None, None, None, cpb, r, dp), lambda b_, h_, s_, t_: (b_, h_, s_, 0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, splits, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, splits, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, splits, cpb, r, dp), jnp.float32)]
    m, l, acc = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                        pltpu.VMEM((cpb, r, dp), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret), name="scored_attention_pass1",
    )(q_planes, *ctx.arrays, valid.astype(jnp.int32)[:, :, None, :])
    acc = jnp.moveaxis(acc, 3, -1).reshape(b, h, splits, r, dp * cpb)
    return Partial(m[..., 0], l[..., 0], acc)


def pass2(q_planes, ctx: Ctx, valid, lse, w, centre_p, *, tile: int, interpret=False):
    """Mass and value score per context key.

    q_planes [B, Hkv, cpb, R, Dp]; valid [B, Hkv, S]; lse [B, Hkv, R]; w [B, R];
    centre_p [B, Hkv, cpb, Dp].  Returns (mass, score) [B, Hkv, S] float32.
    """
    b, h, cpb, r, dp = q_planes.shape
    s_len = valid.shape[-1]
    nt = s_len // tile
    scale = 1.0 / float(cpb * dp) ** 0.5
    n_ctx = len(ctx.arrays)

    def kernel(q_ref, *refs):
        c_refs, valid_ref, lse_ref, w_ref, c_ref = refs[:n_ctx], *refs[n_ctx:n_ctx + 4]
        mass_o, score_o = refs[n_ctx + 4:]
        vr = valid_ref[...] != 0  # [1, tile]
        s = _logits(q_ref, ctx.load_k(c_refs[:ctx.n_k]), scale)
        p = jnp.where(vr, jnp.exp(s - lse_ref[...]), 0.0)  # [R, tile]
        mass = jnp.sum(w_ref[...] * p, axis=0, keepdims=True)  # [1, tile]
        mass_o[...] = mass
        score_o[...] = mass * jnp.sqrt(_dist2(ctx.load_v(c_refs[ctx.n_k:]), c_ref))

    tile_of = lambda b_, h_, t_: t_
    row = lambda b_, h_, t_: (b_, h_, 0, t_)
    in_specs = ([pl.BlockSpec((None, None, cpb, r, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))]
                + _ctx_specs(ctx, tile, tile_of)
                + [pl.BlockSpec((None, None, 1, tile), row),
                   pl.BlockSpec((None, None, r, 1), lambda b_, h_, t_: (b_, h_, 0, 0)),
                   pl.BlockSpec((None, r, 1), lambda b_, h_, t_: (b_, 0, 0)),
                   pl.BlockSpec((None, None, cpb, 1, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))])
    out_shape = [jax.ShapeDtypeStruct((b, h, 1, s_len), jnp.float32)] * 2
    mass, score = pl.pallas_call(
        kernel, grid=(b, h, nt), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, 1, tile), row)] * 2, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_interpret(interpret), name="scored_attention_pass2",
    )(q_planes, *ctx.arrays, valid.astype(jnp.int32)[:, :, None, :], lse[..., None],
      w[..., None], centre_p[:, :, :, None, :])
    return mass[:, :, 0], score[:, :, 0]



def pass2_pool(q_planes, ctx: Ctx, valid, lse, w, *, tile: int, interpret=False):
    """Pass 2 of a pooling other than the mean (splitk.pool_mass): per context key the
    mean-pooled mass and the largest probability a selected row (w > 0) gives it, and the
    max's value sum.  Arguments as `pass2` (lse: the prefix or the joint normaliser).

    Returns (mass_sum, mass_max [B, Hkv, S], vsum_max [B, Hkv, D]) float32.
    """
    b, h, cpb, r, dp = q_planes.shape
    s_len = valid.shape[-1]
    nt = s_len // tile
    scale = 1.0 / float(cpb * dp) ** 0.5
    n_ctx = len(ctx.arrays)
    nn = (((1,), (0,)), ((), ()))  # a [m, k] . b [k, n]

    def kernel(q_ref, *refs):
        c_refs, valid_ref, lse_ref, w_ref = refs[:n_ctx], *refs[n_ctx:n_ctx + 3]
        sum_o, max_o, vsum_o = refs[n_ctx + 3:]
        vr = valid_ref[...] != 0  # [1, tile]
        s = _logits(q_ref, ctx.load_k(c_refs[:ctx.n_k]), scale)
        p = jnp.where(vr, jnp.exp(s - lse_ref[...]), 0.0)  # [R, tile]
        wr = w_ref[...]  # [R, 1]
        sum_o[...] = jnp.sum(wr * p, axis=0, keepdims=True)
        mx = jnp.max(jnp.where(wr > 0, p, 0.0), axis=0, keepdims=True)  # [1, tile]
        max_o[...] = mx
        for i, vp in enumerate(ctx.load_v(c_refs[ctx.n_k:])):
            vsum_o[i] = lax.dot_general(mx, vp, nn, precision=lax.Precision.HIGHEST,
                                        preferred_element_type=jnp.float32)  # [1, Dp]

    tile_of = lambda b_, h_, t_: t_
    row = lambda b_, h_, t_: (b_, h_, 0, t_)
    in_specs = ([pl.BlockSpec((None, None, cpb, r, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))]
                + _ctx_specs(ctx, tile, tile_of)
                + [pl.BlockSpec((None, None, 1, tile), row),
                   pl.BlockSpec((None, None, r, 1), lambda b_, h_, t_: (b_, h_, 0, 0)),
                   pl.BlockSpec((None, r, 1), lambda b_, h_, t_: (b_, 0, 0))])
    out_specs = [pl.BlockSpec((None, None, 1, tile), row)] * 2 + [
        pl.BlockSpec((None, None, None, cpb, 1, dp), lambda b_, h_, t_: (b_, h_, t_, 0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, 1, s_len), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((b, h, nt, cpb, 1, dp), jnp.float32)]
    msum, mmax, vsum = pl.pallas_call(
        kernel, grid=(b, h, nt), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_interpret(interpret), name="scored_attention_pass2_pool",
    )(q_planes, *ctx.arrays, valid.astype(jnp.int32)[:, :, None, :], lse[..., None], w[..., None])
    return msum[:, :, 0], mmax[:, :, 0], splitk.planes_to_channels(vsum[:, :, :, :, 0].sum(2))


def distance(ctx: Ctx, centre_p, *, tile: int, interpret=False):
    """Squared distance ||v_i - c||^2 [B, Hkv, S] of every context value to the centre
    (centre_p [B, Hkv, cpb, Dp]): the value score of a non-mean pooling, whose centre needs
    the pooled mass first (pass 3; reads the values only)."""
    b, h, cpb, dp = centre_p.shape
    vals = ctx.arrays[ctx.n_k:]
    s_len = vals[0].shape[2]
    n_v = len(vals)

    def kernel(*refs):
        d2_o = refs[n_v + 1]
        d2_o[...] = _dist2(ctx.load_v(refs[:n_v]), refs[n_v])

    row = lambda b_, h_, t_: (b_, h_, 0, t_)
    in_specs = (_ctx_specs(ctx, tile, lambda b_, h_, t_: t_)[ctx.n_k:]
                + [pl.BlockSpec((None, None, cpb, 1, dp), lambda b_, h_, t_: (b_, h_, 0, 0, 0))])
    d2 = pl.pallas_call(
        kernel, grid=(b, h, s_len // tile), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, 1, tile), row),
        out_shape=jax.ShapeDtypeStruct((b, h, 1, s_len), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_interpret(interpret), name="scored_attention_distance",
    )(*vals, centre_p.astype(jnp.float32)[:, :, :, None, :])
    return d2[:, :, 0]
