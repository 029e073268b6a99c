"""Low-bit KV formats: KIVI-style asymmetric int4 / int2 codes packed into uint8.

Format (research/maskahead.md section 4, the released Q-MaskAhead code):

* Asymmetric min/max per group: scale = max((max - min) / (2**bits - 1), 1e-8), zero = min;
  code = clip(floor((x - min) / scale + 0.5), 0, 2**bits - 1) from the float32 min and scale
  (IEEE division, `div_rn`), which are only then stored as float16, as the released Triton
  kernels do; x ~ code * scale16 + zero16.  (`rounding="stored"`: codes against the float16
  metadata with round-half-even, our rule before issue 37; docs/quantization.md.)
* Keys: per channel over groups of 32 consecutive tokens (KIVI keys have outlier channels, so
  the scale follows the channel).  Metadata k_scale / k_zero [..., N/32, D].
* Values: per token over groups of 32 consecutive channels.  Metadata [..., N, D/32].
* Packing along the channel axis, adjacent codes share a byte: 4-bit puts channel 2j in the
  low nibble and 2j+1 in the high nibble; 2-bit puts channel 4j+p in bits [2p, 2p+2).  Codes
  are token-major ([..., N, D*bits/8]) for keys and values alike, so a token is one row of
  bytes and gathers by token index move whole rows.
* A trailing partial key group (N % 32 tokens) stays in bfloat16 in a residual buffer
  (k_res / v_res [..., N % 32, D]); its length is static, so shapes stay static under jit.

Bytes per token per (layer, KV head) at D = 128, 4-bit: keys 64 payload + 16 metadata
(2 x fp16 per channel per 32 tokens), values 64 + 16 (2 x fp16 per 32 channels) = 160,
against 512 in bfloat16 (3.2x).  2-bit: 32 + 16 + 32 + 16 = 96.

Deviation from the released code (its `compaction: lazy`), by default: on eviction we
requantize the keys of *every* survivor into fresh 32-token groups (dequantize -> gather ->
quantize), while the released code copies fully surviving groups bit-exactly and pads every
lane to the most scattered lane's group count. The released rule is `lazy_compact`
(QMaskAhead(compaction="lazy", repack_below=1.0), tested against numpy): groups keeping
>= repack_below of their entries copied bit-exactly, the other survivors' keys *and values*
requantized from their dequantized values into fresh groups after the row's most kept groups.  Why: full requantization keeps every (layer, batch, KV head)
lane rectangular with a static capacity, so eviction is one gather + one quantize under jit
with no ragged group bookkeeping and no padding slots to pay for in memory.  The cost is one
more rounding of the surviving keys (bounded by half a step of their new group).  Values
are quantized per token, so their codes and metadata move with the token bit-exactly and are
never requantized.

We hand-write the packing instead of using `jnp.int4` / qwix: Pallas TPU kernels cannot hold
int4 arrays and the kernels need the exact byte layout to unpack with shifts and masks;
the fp16 zero point of KIVI (zero = min, not an integer code) is also not qwix's convention.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

GROUP = 32  # tokens per key group, channels per value group
SCALE_EPS = 1e-8  # smallest scale before the fp16 cast (released code: clamp >= 1e-8)
META_DTYPE = jnp.float16
SUPPORTED_BITS = (2, 4)


def codes_per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 8 // bits


# --------------------------------------------------------------------------- packing

def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack codes [..., M] (integers in [0, 2**bits)) into uint8 [..., M * bits / 8].

    Code j*cpb + p goes to bits [p*bits, (p+1)*bits) of byte j (lowest bits first).
    """
    cpb = codes_per_byte(bits)
    m = codes.shape[-1]
    if m % cpb:
        raise ValueError(f"last axis {m} is not a multiple of {cpb}")
    c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (m // cpb, cpb))
    out = c[..., 0]
    for p in range(1, cpb):
        out = out | (c[..., p] << jnp.uint8(p * bits))
    return out


def unpack_planes(packed: jax.Array, bits: int) -> list[jax.Array]:
    """Split packed bytes [..., M'] into cpb planes of codes [..., M'] (uint8).

    Plane p holds the codes at positions j*cpb + p; this is what the kernels use, since it
    needs only shifts and masks and no interleave.
    """
    cpb = codes_per_byte(bits)
    mask = jnp.uint8(2 ** bits - 1)
    return [(packed >> jnp.uint8(p * bits)) & mask for p in range(cpb)]


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack`: uint8 [..., M'] -> codes uint8 [..., M' * 8 / bits]."""
    planes = unpack_planes(packed, bits)
    out = jnp.stack(planes, axis=-1)
    return out.reshape(packed.shape[:-1] + (packed.shape[-1] * len(planes),))


# --------------------------------------------------------------------------- group quantization

ROUNDINGS = ("released", "stored")
# default of quantize_keys / quantize_values / quantize_kv / write_tokens (read at trace time).
# "stored" by default: with "released" a sharded run (data=2, model=4) and the unsharded one give
# different q-maskahead tokens (tests/test_sharding.py::test_mp_policies_data2_model4_match_unsharded
# fails on 2 of 4 rows), with "stored" they are identical, and both rules reconstruct K/V with the
# same error (docs/quantization.md §1a). Set quant.ROUNDING = "released" for the released codes.
ROUNDING = "stored"


def _f32_parts(x):
    """Positive normal float32 x -> (m, e) int32 with x = m * 2**(e - 150), m in [2**23, 2**24)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return (bits & 0x7FFFFF) | 0x800000, (bits >> 23) & 0xFF


def _wide_shift(m, s):
    """m * 2**s (m < 2**24, 0 <= s <= 30) as (hi, lo) limbs in base 2**24 (int32 throughout)."""
    big = s >= 24
    hi = jnp.where(big, m << jnp.clip(s - 24, 0, 6), m >> jnp.clip(24 - s, 1, 24))
    lo = jnp.where(big, 0, (m << jnp.clip(s, 0, 23)) & 0xFFFFFF)  # low bits survive the wraparound
    return hi, lo


def _wide_mul(n, m):
    """n * m (n < 2**27, m < 2**24) as (hi, lo) limbs in base 2**24 (int32 throughout)."""
    n1, n0, m1, m0 = n >> 12, n & 0xFFF, m >> 12, m & 0xFFF
    mid = n1 * m0 + n0 * m1
    lo = n0 * m0 + ((mid & 0xFFF) << 12)
    return n1 * m1 + (mid >> 12) + (lo >> 24), lo & 0xFFFFFF


def _gt(a, b):
    return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] > b[1]))


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 a / b rounded to nearest (IEEE), whatever the backend's division does.

    XLA rewrites a division by a broadcast divisor (a constant, a per-group scale) as a
    multiplication by its reciprocal, which is not correctly rounded: on CPU with jax 0.10.2,
    a / 15 is one ulp off for 63% of random operands and a per-row divisor for 26%. A code
    changes whenever such an ulp moves t across k + 1/2 in floor(t + 0.5). The backend quotient
    is corrected here, for normal a and b (on their magnitudes), by exact midpoint tests in
    24-bit integer limbs: q moves up one ulp while a > (q + ulp/2) * b and down while
    a < (q - ulp/2) * b (two rounds: the backend quotient is within two ulps). Other operands
    (zeros, subnormals, inf, nan) keep the backend quotient.
    """
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    q = a / b
    return jnp.copysign(_nearest_quotient(jnp.abs(a), jnp.abs(b), jnp.abs(q)), q)


def _nearest_quotient(a, b, q):
    """Move q (within two ulps of a / b) to the float32 nearest to a / b (see `div_rn`)."""
    tiny = jnp.finfo(jnp.float32).tiny
    ma, ea = _f32_parts(a)
    mb, eb = _f32_parts(b)
    for _ in range(2):
        ok = (a >= tiny) & (b >= tiny) & (q >= tiny) & jnp.isfinite(a) & jnp.isfinite(b) & jnp.isfinite(q)
        mq, eq = _f32_parts(q)
        s = ea - eq - eb + 152  # a vs N * 2**(eq - 152) * b  <=>  ma * 2**s vs N * mb
        ok &= (s >= 0) & (s <= 30)
        lhs = _wide_shift(ma, jnp.clip(s, 0, 30))
        up = _gt(lhs, _wide_mul(4 * mq + 2, mb))  # above the midpoint to the next float
        down = _gt(_wide_mul(4 * mq - jnp.where(mq > 0x800000, 2, 1), mb), lhs)  # below the one under
        step = jnp.where(ok & up, 1, jnp.where(ok & down, -1, 0))
        q = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q, jnp.int32) + step, jnp.float32)
    return q


def _minmax_quant(x, axis: int, bits: int, valid=None, rounding: Optional[str] = None):
    """Asymmetric min/max quantization of float32 x, reducing over `axis`.

    Returns (codes uint8 like x, scale fp16, zero fp16) with the reduced axis kept (size 1).
    `valid` (broadcastable to x) excludes elements from the min/max (their codes are clipped).

    rounding "released" (default; the released Triton kernels quantize_key_groups_kernel /
    quantize_values_kernel): scale = max((max - min) / qmax, 1e-8) and the codes
    clip(floor((x - min) / scale + 0.5), 0, qmax) are computed in float32 from the unrounded
    min and scale, which are only then stored as float16. rounding "stored" (ours before
    issue 37): codes = clip(round_half_even((x - zero16) / scale16)) against the stored float16
    metadata. They differ by one step on ~0.2% (int4) / ~0.05% (int2) of the codes; the mean
    squared reconstruction error is the same to 1e-4 relative (docs/quantization.md).
    """
    rounding = rounding or ROUNDING
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    qmax = 2 ** bits - 1
    if valid is None:
        lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    else:
        lo = jnp.where(valid, x, jnp.inf).min(axis, keepdims=True)
        hi = jnp.where(valid, x, -jnp.inf).max(axis, keepdims=True)
        empty = lo > hi  # no valid element in the group
        lo, hi = jnp.where(empty, 0.0, lo), jnp.where(empty, 0.0, hi)
    s32 = jnp.maximum(div_rn(hi - lo, jnp.float32(qmax)), SCALE_EPS)
    scale, zero = s32.astype(META_DTYPE), lo.astype(META_DTYPE)
    if rounding == "released":
        codes = jnp.floor(div_rn(x - lo, s32) + 0.5)
    else:
        s16 = jnp.maximum(scale.astype(jnp.float32), SCALE_EPS)  # fp16 may flush 1e-8 to 0
        codes = jnp.round((x - zero.astype(jnp.float32)) / s16)
    return jnp.clip(codes, 0, qmax).astype(jnp.uint8), scale, zero


def quantize_keys(k: jax.Array, bits: int, valid: Optional[jax.Array] = None, rounding: Optional[str] = None):
    """Keys [..., N, D] (N % 32 == 0) -> (codes uint8 [..., N, D*bits/8], scale, zero fp16 [..., N/32, D]).

    Per-channel groups over 32 tokens.  `valid` [..., N] leaves tokens out of the group range.
    rounding: "released" (default) | "stored" (see `_minmax_quant`).
    """
    *lead, n, d = k.shape
    if n % GROUP:
        raise ValueError(f"token axis {n} is not a multiple of {GROUP}")
    x = k.astype(jnp.float32).reshape(*lead, n // GROUP, GROUP, d)
    vm = None if valid is None else valid.reshape(*lead, n // GROUP, GROUP, 1)
    codes, scale, zero = _minmax_quant(x, -2, bits, vm, rounding)
    codes = codes.reshape(*lead, n, d)
    return pack(codes, bits), scale[..., 0, :], zero[..., 0, :]


def dequantize_keys(codes, scale, zero, bits: int, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_keys` -> [..., N, D] in dtype."""
    c = unpack(codes, bits).astype(jnp.float32)
    *lead, n, d = c.shape
    c = c.reshape(*lead, n // GROUP, GROUP, d)
    x = c * scale[..., None, :].astype(jnp.float32) + zero[..., None, :].astype(jnp.float32)
    return x.reshape(*lead, n, d).astype(dtype)


def quantize_values(v: jax.Array, bits: int, rounding: Optional[str] = None):
    """Values [..., N, D] (D % 32 == 0) -> (codes uint8 [..., N, D*bits/8], scale, zero fp16 [..., N, D/32])."""
    *lead, n, d = v.shape
    if d % GROUP:
        raise ValueError(f"head dim {d} is not a multiple of {GROUP}")
    x = v.astype(jnp.float32).reshape(*lead, n, d // GROUP, GROUP)
    codes, scale, zero = _minmax_quant(x, -1, bits, None, rounding)
    return pack(codes.reshape(*lead, n, d), bits), scale[..., 0], zero[..., 0]


def dequantize_values(codes, scale, zero, bits: int, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_values` -> [..., N, D] in dtype."""
    c = unpack(codes, bits).astype(jnp.float32)
    *lead, n, d = c.shape
    c = c.reshape(*lead, n, d // GROUP, GROUP)
    x = c * scale[..., None].astype(jnp.float32) + zero[..., None].astype(jnp.float32)
    return x.reshape(*lead, n, d).astype(dtype)


# --------------------------------------------------------------------------- cache container

class QuantKV(NamedTuple):
    """A packed K/V cache (or one layer of it).  Leading axes `...` are e.g. [L, B, Hkv].

    Tokens [0, Nq) are packed (Nq % 32 == 0); tokens [Nq, Nq + R) sit in the bf16 residual
    (R < 32, static).  Bit width and head dim are derived from the shapes.
    """

    k_codes: jax.Array  # uint8 [..., Nq, D*bits/8]
    k_scale: jax.Array  # fp16 [..., Nq/32, D]
    k_zero: jax.Array  # fp16 [..., Nq/32, D]
    v_codes: jax.Array  # uint8 [..., Nq, D*bits/8]
    v_scale: jax.Array  # fp16 [..., Nq, D/32]
    v_zero: jax.Array  # fp16 [..., Nq, D/32]
    k_res: jax.Array  # bf16 [..., R, D]
    v_res: jax.Array  # bf16 [..., R, D]

    @property
    def head_dim(self) -> int:
        return self.k_scale.shape[-1]

    @property
    def bits(self) -> int:
        return 8 * self.k_codes.shape[-1] // self.head_dim

    @property
    def num_packed(self) -> int:
        return self.k_codes.shape[-2]

    @property
    def num_tokens(self) -> int:
        return self.k_codes.shape[-2] + self.k_res.shape[-2]

    @property
    def lead_shape(self) -> tuple:
        return self.k_codes.shape[:-2]


RESIDUAL_DTYPE = jnp.bfloat16


def quantize_kv(k: jax.Array, v: jax.Array, bits: int, valid: Optional[jax.Array] = None,
                rounding: Optional[str] = None) -> QuantKV:
    """k, v [..., N, D] -> QuantKV.  The last N % 32 tokens stay bf16 in the residual.

    `valid` [..., N] (optional) leaves dead slots out of the key-group ranges.
    """
    n = k.shape[-2]
    nq = n - n % GROUP
    kv_valid = None if valid is None else valid[..., :nq]
    kc, ks, kz = quantize_keys(k[..., :nq, :], bits, kv_valid, rounding)
    vc, vs, vz = quantize_values(v[..., :nq, :], bits, rounding)
    return QuantKV(kc, ks, kz, vc, vs, vz,
                   k[..., nq:, :].astype(RESIDUAL_DTYPE), v[..., nq:, :].astype(RESIDUAL_DTYPE))


def dequantize_kv(q: QuantKV, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """QuantKV -> (k, v) [..., N, D] in dtype (residual tokens appended as they are)."""
    b = q.bits
    k = dequantize_keys(q.k_codes, q.k_scale, q.k_zero, b, jnp.float32)
    v = dequantize_values(q.v_codes, q.v_scale, q.v_zero, b, jnp.float32)
    k = jnp.concatenate([k, q.k_res.astype(jnp.float32)], axis=-2)
    v = jnp.concatenate([v, q.v_res.astype(jnp.float32)], axis=-2)
    return k.astype(dtype), v.astype(dtype)


def _take_rows(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [..., N, X], idx [..., K] -> [..., K, X]."""
    return jnp.take_along_axis(a, idx[..., None], axis=-2)


def gather_dequant(q: QuantKV, idx: jax.Array, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Gather token indices idx [..., K] (into [0, N)) and dequantize -> (k, v) [..., K, D].

    Only the K gathered rows are unpacked (this builds the compact bf16 buffer of the
    selected entries that steps >= 1 attend to).
    """
    b, nq = q.bits, q.num_packed
    idx = idx.astype(jnp.int32)
    ip = jnp.clip(idx, 0, max(nq - 1, 0))
    # keys: one code row per token; scale/zero of the token's group, broadcast over channels
    kc = unpack(_take_rows(q.k_codes, ip), b).astype(jnp.float32)
    grp = ip // GROUP
    k = kc * _take_rows(q.k_scale, grp).astype(jnp.float32) + _take_rows(q.k_zero, grp).astype(jnp.float32)
    vc = unpack(_take_rows(q.v_codes, ip), b).astype(jnp.float32)
    *lead, kk, d = vc.shape
    vc = vc.reshape(*lead, kk, d // GROUP, GROUP)
    v = vc * _take_rows(q.v_scale, ip).astype(jnp.float32)[..., None] \
        + _take_rows(q.v_zero, ip).astype(jnp.float32)[..., None]
    v = v.reshape(*lead, kk, d)
    r = q.k_res.shape[-2]
    if r:
        ir = jnp.clip(idx - nq, 0, r - 1)
        in_res = (idx >= nq)[..., None]
        k = jnp.where(in_res, _take_rows(q.k_res, ir).astype(jnp.float32), k)
        v = jnp.where(in_res, _take_rows(q.v_res, ir).astype(jnp.float32), v)
    return k.astype(dtype), v.astype(dtype)


def requantize_survivors(q: QuantKV, idx: jax.Array, count: Optional[jax.Array] = None) -> QuantKV:
    """Keep token indices idx [..., K] (sorted by position) -> a QuantKV of K tokens.

    Keys of the survivors are dequantized, gathered and requantized into fresh 32-token
    groups (see the module docstring for why); values move bit-exactly (per-token groups).
    count [...] (optional): only the first count entries of each lane are live; the padded
    slots are left out of the new key-group ranges and hold zeros (keys) / stale codes (values).
    """
    kk = idx.shape[-1]
    kq = kk - kk % GROUP
    live = None if count is None else jnp.arange(kk) < count[..., None]  # [..., K]
    k, v = gather_dequant(q, idx, jnp.float32)  # [..., K, D]
    if live is not None:
        k = jnp.where(live[..., None], k, 0.0)
        v = jnp.where(live[..., None], v, 0.0)
    kc, ks, kz = quantize_keys(k[..., :kq, :], q.bits, None if live is None else live[..., :kq])
    nq, r = q.num_packed, q.k_res.shape[-2]
    ip = jnp.clip(idx[..., :kq].astype(jnp.int32), 0, max(nq - 1, 0))
    vc, vs, vz = _take_rows(q.v_codes, ip), _take_rows(q.v_scale, ip), _take_rows(q.v_zero, ip)
    if r:  # survivors that came from the bf16 residual get their values quantized now
        from_res = (idx[..., :kq] >= nq)[..., None]
        rc, rs, rz = quantize_values(v[..., :kq, :], q.bits)
        vc, vs, vz = (jnp.where(from_res, a, b) for a, b in ((rc, vc), (rs, vs), (rz, vz)))
    # survivors past the last full group form the new bf16 residual
    return QuantKV(kc, ks, kz, vc, vs, vz,
                   k[..., kq:, :].astype(RESIDUAL_DTYPE), v[..., kq:, :].astype(RESIDUAL_DTYPE))


def _lane_index(shape):
    """Broadcastable iotas over the leading [L, B, Hkv] axes of a [L, B, Hkv, K] array."""
    return tuple(jnp.arange(n).reshape((-1,) + (1,) * (len(shape) - 1 - i)) for i, n in enumerate(shape[:-1]))


def lazy_layout(idx: jax.Array, live: jax.Array, num_old: int, capacity: int, need: int):
    """The released `compaction: lazy` layout of the survivors idx [L, B, Hkv, K] (live marks
    them) of a packed cache of `num_old` slots, in a buffer of `capacity` slots, per lane:

      [ key groups with >= `need` survivors, copied whole in group order (their dead slots stay,
        masked) | padding up to the row's most kept groups (G1) | the other survivors in idx
        order (position order), to be quantized into fresh groups ]

    (released session._evict_to -> PackedKVCache.rebuild: groups_before, then encode; the
    released pads every lane to the largest kept-group count over all lanes, we over the lanes
    of a row). Returns (src, valid, kept, encoded) [L, B, Hkv, capacity]: the old slot of each
    new slot, which new slots hold survivors, which lie in the kept groups / the re-encoded
    region; old_group [L, B, Hkv, capacity / 32]: the old group of each kept new group; and
    n_kept [L, B, Hkv] kept groups, n_enc [L, B, Hkv] re-encoded survivors, g1 [B]. The caller
    sizes `capacity` >= 32 * G1 + max n_enc (QMaskAhead.plan)."""
    L, B, H, K = idx.shape
    ng = num_old // GROUP
    ix = _lane_index(idx.shape)
    idx = idx.astype(jnp.int32)
    g = jnp.where(live, idx // GROUP, ng)  # ng: not counted
    counts = jnp.zeros((L, B, H, ng + 1), jnp.int32).at[ix + (g,)].add(live.astype(jnp.int32))[..., :ng]
    full = counts >= need  # [L, B, H, NG]
    n_kept = full.sum(-1).astype(jnp.int32)
    g1 = n_kept.max(axis=(0, 2))  # [B]
    order = jnp.argsort(jnp.logical_not(full), axis=-1, stable=True).astype(jnp.int32)  # kept groups first
    surv = jnp.zeros((L, B, H, num_old + 1), bool).at[ix + (jnp.where(live, idx, num_old),)].set(True)
    in_full = live & jnp.take_along_axis(full, jnp.clip(g, 0, ng - 1), axis=-1) & (g < ng)
    enc = live & jnp.logical_not(in_full)
    rank = jnp.cumsum(enc, axis=-1) - 1
    n_enc = enc.sum(-1).astype(jnp.int32)
    enc_src = jnp.zeros((L, B, H, K + 1), jnp.int32).at[ix + (jnp.where(enc, rank, K),)].set(idx)[..., :K]
    j = jnp.arange(capacity)
    kept = j < GROUP * n_kept[..., None]
    tg = jnp.clip(j // GROUP, 0, ng - 1)
    old_slot = jnp.take_along_axis(order, jnp.broadcast_to(tg, idx.shape[:3] + (capacity,)), axis=-1) * GROUP \
        + j % GROUP
    e = j - GROUP * g1[None, :, None, None]
    encoded = (e >= 0) & (e < n_enc[..., None])
    from_enc = jnp.take_along_axis(enc_src, jnp.clip(e, 0, K - 1), axis=-1)
    src = jnp.where(kept, old_slot, jnp.where(encoded, from_enc, 0))
    valid = jnp.where(kept, jnp.take_along_axis(surv, jnp.clip(old_slot, 0, num_old), axis=-1), encoded)
    ngn = capacity // GROUP
    old_group = jnp.take_along_axis(order, jnp.broadcast_to(jnp.clip(jnp.arange(ngn), 0, ng - 1),
                                                            idx.shape[:3] + (ngn,)), axis=-1)
    return src, valid, kept, encoded, old_group, n_kept, n_enc, g1


def lazy_compact(q: QuantKV, idx: jax.Array, live: jax.Array, capacity: int, need: int):
    """The released lazy compaction of a packed cache (no residual) to survivors idx / live
    [L, B, Hkv, K]: key groups with >= `need` survivors keep their codes and fp16 scale / zero
    bit-exactly (keys and values); the other survivors are dequantized and quantized into fresh
    groups, keys *and* values (released `rebuild`: quantize_key_groups_into /
    quantize_values_into on the dequantized survivors, a partial last group padded with zeros
    that take part in its min / max). Returns (QuantKV of `capacity` slots, src, valid,
    extent [B]: 32 * (G1 + ceil(max re-encoded / 32)), the row's physical length)."""
    if q.k_res.shape[-2]:
        raise ValueError("lazy compaction needs a packed cache without a residual")
    if capacity % GROUP:
        raise ValueError(f"capacity {capacity} must be a multiple of {GROUP}")
    src, valid, kept, encoded, old_group, n_kept, n_enc, g1 = lazy_layout(idx, live, q.num_packed, capacity, need)
    k, v = gather_dequant(q, src, jnp.float32)
    k = jnp.where(encoded[..., None], k, 0.0)
    v = jnp.where(encoded[..., None], v, 0.0)
    kc, ks, kz = quantize_keys(k, q.bits)
    vc, vs, vz = quantize_values(v, q.bits)
    ip = jnp.clip(src, 0, q.num_packed - 1)
    kr = kept[..., None]
    kc = jnp.where(kr, _take_rows(q.k_codes, ip), kc)
    vc, vs, vz = (jnp.where(kr, _take_rows(a, ip), b) for a, b in ((q.v_codes, vc), (q.v_scale, vs), (q.v_zero, vz)))
    kg = (jnp.arange(capacity // GROUP) < n_kept[..., None])[..., None]
    ks = jnp.where(kg, _take_rows(q.k_scale, old_group), ks)
    kz = jnp.where(kg, _take_rows(q.k_zero, old_group), kz)
    g2 = -(-n_enc.max(axis=(0, 2)) // GROUP)
    extent = (GROUP * (g1 + g2)).astype(jnp.int32)
    return q._replace(k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz), src, valid, extent


def write_tokens(q: QuantKV, k_new: jax.Array, v_new: jax.Array, start: jax.Array,
                 n_new: Optional[jax.Array] = None) -> QuantKV:
    """Quantize and write T new tokens of each batch row at slot start[b] of a fixed-capacity cache.

    q has leading axes [L, B, Hkv] and no residual; k_new, v_new [L, B, Hkv, T, D] with
    T % 32 == 0; start [B] int32, multiples of 32 (blocks are 32-aligned); n_new [B]
    (optional) marks how many of the T tokens are real, the rest stay out of the key ranges.
    """
    if q.k_res.shape[-2]:
        raise ValueError("write_tokens needs a cache without a residual (capacity % 32 == 0)")
    l, b, h, t, _ = k_new.shape
    valid = None
    if n_new is not None:
        valid = jnp.broadcast_to((jnp.arange(t)[None, :] < n_new[:, None])[None, :, None, :], (l, b, h, t))
    new = quantize_kv(k_new, v_new, q.bits, valid)

    def row(buf, upd, s, per_group):  # buf [L, Hkv, N, X], one batch row
        off = s // GROUP if per_group else s
        return jax.lax.dynamic_update_slice_in_dim(buf, upd, off, axis=2)

    def write(buf, upd, per_group=False):
        return jax.vmap(lambda a, u, s: row(a, u, s, per_group), in_axes=(1, 1, 0), out_axes=1)(buf, upd, start)

    return q._replace(
        k_codes=write(q.k_codes, new.k_codes), k_scale=write(q.k_scale, new.k_scale, True),
        k_zero=write(q.k_zero, new.k_zero, True), v_codes=write(q.v_codes, new.v_codes),
        v_scale=write(q.v_scale, new.v_scale), v_zero=write(q.v_zero, new.v_zero))


def empty(lead_shape: tuple, capacity: int, head_dim: int, bits: int) -> QuantKV:
    """An all-zero QuantKV of `capacity` tokens (capacity % 32 == 0) and leading axes lead_shape."""
    if capacity % GROUP or head_dim % GROUP:
        raise ValueError("capacity and head_dim must be multiples of 32")
    cb = head_dim * bits // 8
    codes_per_byte(bits)
    z = lambda *s, dt: jnp.zeros(tuple(lead_shape) + s, dt)
    return QuantKV(z(capacity, cb, dt=jnp.uint8), z(capacity // GROUP, head_dim, dt=META_DTYPE),
                   z(capacity // GROUP, head_dim, dt=META_DTYPE), z(capacity, cb, dt=jnp.uint8),
                   z(capacity, head_dim // GROUP, dt=META_DTYPE),
                   z(capacity, head_dim // GROUP, dt=META_DTYPE),
                   z(0, head_dim, dt=RESIDUAL_DTYPE), z(0, head_dim, dt=RESIDUAL_DTYPE))


# --------------------------------------------------------------------------- memory accounting

def _bytes(a) -> int:
    return int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def nbytes_breakdown(q: QuantKV) -> dict:
    """Bytes held by each part of the container, from the arrays' shapes and dtypes."""
    return {
        "key_payload": _bytes(q.k_codes),
        "key_metadata": _bytes(q.k_scale) + _bytes(q.k_zero),
        "value_payload": _bytes(q.v_codes),
        "value_metadata": _bytes(q.v_scale) + _bytes(q.v_zero),
        "residual": _bytes(q.k_res) + _bytes(q.v_res),
    }


def nbytes(q: QuantKV) -> int:
    """Total bytes: payload + metadata + bf16 residual."""
    return sum(nbytes_breakdown(q).values())


def bytes_per_token(q: QuantKV) -> float:
    """Bytes per token per lane (one lane = one (layer, batch, KV head) when lead is [L, B, Hkv])."""
    lanes = int(math.prod(q.lead_shape))
    return nbytes(q) / (lanes * q.num_tokens)


def dense_bytes_per_token(head_dim: int, dtype=jnp.bfloat16) -> int:
    """K + V bytes per token per lane of an unquantized cache (512 at D = 128 in bf16)."""
    return 2 * head_dim * jnp.dtype(dtype).itemsize
