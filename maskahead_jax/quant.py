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

The packed cache's layout operations on a QuantKV (gather + dequantize, eviction compaction,
fixed-capacity writes, the empty container, byte accounting) live in cache/packed_layout.py,
with the documented deviation of our eviction from the released lazy compaction; this module
is the quantizer's numerics and the QuantKV container they produce, and imports no cache code.

We hand-write the packing instead of using `jnp.int4` / qwix: Pallas TPU kernels cannot hold
int4 arrays and the kernels need the exact byte layout to unpack with shifts and masks;
the fp16 zero point of KIVI (zero = min, not an integer code) is also not qwix's convention.
"""
from __future__ import annotations

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
# default of quantize_keys / quantize_values / quantize_kv and of cache/packed_layout.write_tokens
# (read at trace time).
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


# --------------------------------------------------------------------------- the container

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
