"""The KIVI-style int4 / int2 KV format (quant.py: packing, error bounds) and the packed cache's
layout ops on it (cache/packed_layout.py: gathers, compaction, writes, bytes)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import quant as Q
from maskahead_jax.cache import packed_layout as PL

BITS = (2, 4)


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_exact_for_every_code(bits):
    cpb = 8 // bits
    # every combination of cpb codes = every byte value, each code value at each position
    combos = np.array(list(itertools.product(range(2 ** bits), repeat=cpb)), np.uint8)  # [256, cpb]
    packed = Q.pack(jnp.asarray(combos), bits)
    assert packed.shape == (256, 1) and packed.dtype == jnp.uint8
    assert sorted(np.asarray(packed)[:, 0].tolist()) == list(range(256))
    np.testing.assert_array_equal(np.asarray(Q.unpack(packed, bits)), combos)
    all_bytes = jnp.arange(256, dtype=jnp.uint8)[:, None]
    np.testing.assert_array_equal(np.asarray(Q.pack(Q.unpack(all_bytes, bits), bits)), all_bytes)


def test_pack_bit_order_lowest_bits_first():
    assert int(Q.pack(jnp.array([1, 2], jnp.uint8), 4)[0]) == 0x21  # low nibble = first code
    assert int(Q.pack(jnp.array([1, 2, 3, 0], jnp.uint8), 2)[0]) == 1 | 2 << 2 | 3 << 4


def _bound(scale, zero, bits):
    """scale/2 plus the fp16 rounding of the group's range (zero and qmax * scale).

    Released rule: codes from the float32 scale s and min z, so |x - (c s16 + z16)| <=
    s/2 + c |s - s16| + |z - z16| with s <= s16 (1 + 2**-11): the s16 * 2**-12 term is s/2 - s16/2."""
    s = scale.astype(jnp.float32)
    slack = 2.0 ** -11 * (jnp.abs(zero.astype(jnp.float32)) + (2 ** bits - 1) * s) * 1.01 + 2.0 ** -12 * s
    return s / 2 + slack + 1e-6


@pytest.mark.parametrize("bits", BITS)
def test_key_roundtrip_error_within_half_step(bits):
    k = _rand(0, (2, 3, 96, 64)) + _rand(1, (2, 3, 1, 64), 4.0)  # channel offsets like real keys
    codes, scale, zero = Q.quantize_keys(k, bits)
    assert codes.shape == (2, 3, 96, 64 * bits // 8) and scale.dtype == jnp.float16
    assert scale.shape == zero.shape == (2, 3, 3, 64)
    err = jnp.abs(Q.dequantize_keys(codes, scale, zero, bits) - k)
    per_elem = jnp.repeat(_bound(scale, zero, bits), 32, axis=-2)  # group -> its 32 tokens
    assert bool(jnp.all(err <= per_elem)), float(jnp.max(err - per_elem))


@pytest.mark.parametrize("bits", BITS)
def test_value_roundtrip_error_within_half_step(bits):
    v = _rand(2, (2, 3, 40, 128), 3.0)
    codes, scale, zero = Q.quantize_values(v, bits)
    assert scale.shape == (2, 3, 40, 4)
    err = jnp.abs(Q.dequantize_values(codes, scale, zero, bits) - v)
    per_elem = jnp.repeat(_bound(scale, zero, bits), 32, axis=-1)  # group -> its 32 channels
    assert bool(jnp.all(err <= per_elem)), float(jnp.max(err - per_elem))


def test_constant_group_is_exact_and_finite():
    k = jnp.full((1, 32, 32), 0.75)
    codes, scale, zero = Q.quantize_keys(k, 4)
    np.testing.assert_allclose(Q.dequantize_keys(codes, scale, zero, 4), k, atol=1e-6)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_kv_residual_and_dequantize(bits):
    k, v = _rand(3, (2, 2, 70, 64)), _rand(4, (2, 2, 70, 64))
    q = Q.quantize_kv(k, v, bits)
    assert (q.bits, q.head_dim, q.num_packed, q.num_tokens) == (bits, 64, 64, 70)
    assert q.k_res.shape == (2, 2, 6, 64) and q.k_res.dtype == jnp.bfloat16
    kd, vd = Q.dequantize_kv(q, jnp.float32)
    assert kd.shape == k.shape
    np.testing.assert_array_equal(kd[..., 64:, :], k[..., 64:, :].astype(jnp.bfloat16).astype(jnp.float32))
    kc, ks, kz = Q.quantize_keys(k[..., :64, :], bits)
    np.testing.assert_array_equal(kd[..., :64, :], Q.dequantize_keys(kc, ks, kz, bits))


def test_gather_dequant_matches_full_dequantize():
    k, v = _rand(5, (2, 2, 70, 64)), _rand(6, (2, 2, 70, 64))
    q = Q.quantize_kv(k, v, 4)
    kd, vd = Q.dequantize_kv(q, jnp.float32)
    idx = jnp.broadcast_to(jnp.array([0, 31, 32, 45, 63, 64, 69]), (2, 2, 7))  # packed + residual
    kg, vg = PL.gather_dequant(q, idx, jnp.float32)
    np.testing.assert_array_equal(kg, jnp.take_along_axis(kd, idx[..., None], axis=-2))
    np.testing.assert_array_equal(vg, jnp.take_along_axis(vd, idx[..., None], axis=-2))
    kb, _ = PL.gather_dequant(q, idx)
    assert kb.dtype == jnp.bfloat16


def test_requantize_survivors():
    k, v = _rand(7, (1, 2, 128, 64)) + 5.0, _rand(8, (1, 2, 128, 64))  # keys far from 0
    q = Q.quantize_kv(k, v, 4)
    idx = jnp.broadcast_to(jnp.arange(0, 128, 2), (1, 2, 64))  # every other token survives
    count = jnp.array([[64, 40]])  # the second lane keeps only 40 (the rest is padding)
    r = PL.requantize_survivors(q, idx, count)
    assert r.num_tokens == 64 and r.num_packed == 64
    kg, vg = PL.gather_dequant(q, idx, jnp.float32)
    kr, vr = Q.dequantize_kv(r, jnp.float32)
    # values move bit-exactly (per-token groups)
    np.testing.assert_array_equal(r.v_codes, jnp.take_along_axis(q.v_codes, idx[..., None], axis=-2))
    np.testing.assert_array_equal(vr, vg)
    # keys: one more rounding, within half a step of the new groups
    live = jnp.arange(64) < count[..., None]
    bound = jnp.repeat(_bound(r.k_scale, r.k_zero, 4), 32, axis=-2)
    err = jnp.where(live[..., None], jnp.abs(kr - kg), 0.0)
    assert bool(jnp.all(err <= bound))
    # padded slots (zeroed) do not widen the ranges: lane 1, group 1 holds survivors 32..39 only
    kg1 = kg[0, 1, 32:40]
    np.testing.assert_allclose(r.k_zero[0, 1, 1].astype(jnp.float32), kg1.min(0), rtol=1e-3)
    np.testing.assert_allclose(r.k_scale[0, 1, 1].astype(jnp.float32),
                               (kg1.max(0) - kg1.min(0)) / 15, rtol=1e-3, atol=1e-6)


def test_requantize_survivors_leaves_partial_group_in_residual():
    k, v = _rand(9, (1, 1, 64, 32)), _rand(10, (1, 1, 64, 32))
    q = Q.quantize_kv(k, v, 2)
    idx = jnp.arange(40)[None, None]
    r = PL.requantize_survivors(q, idx)
    assert (r.num_packed, r.k_res.shape[-2]) == (32, 8)
    kg, _ = PL.gather_dequant(q, idx[..., 32:], jnp.float32)
    np.testing.assert_allclose(r.k_res.astype(jnp.float32), kg, rtol=1e-2)


def test_write_tokens_into_fixed_capacity_cache():
    l, b, h, d = 2, 2, 1, 64
    cache = PL.empty((l, b, h), 96, d, 4)
    k, v = _rand(11, (l, b, h, 32, d)), _rand(12, (l, b, h, 32, d))
    start = jnp.array([0, 64], jnp.int32)
    out = jax.jit(PL.write_tokens)(cache, k, v, start)
    kd, vd = Q.dequantize_kv(out, jnp.float32)
    blk_k, blk_v = Q.dequantize_kv(Q.quantize_kv(k, v, 4), jnp.float32)
    np.testing.assert_array_equal(kd[:, 0, :, :32], blk_k[:, 0])
    np.testing.assert_array_equal(kd[:, 1, :, 64:], blk_k[:, 1])
    np.testing.assert_array_equal(vd[:, 1, :, 64:], blk_v[:, 1])
    assert bool(jnp.all(kd[:, 0, :, 32:] == 0)) and bool(jnp.all(kd[:, 1, :, :64] == 0))


def test_quantkv_is_a_jittable_pytree_sliceable_per_layer():
    k, v = _rand(13, (3, 1, 2, 64, 32)), _rand(14, (3, 1, 2, 64, 32))
    q = jax.jit(Q.quantize_kv, static_argnums=2)(k, v, 4)
    layer = jax.tree.map(lambda a: a[1], q)
    assert layer.lead_shape == (1, 2) and layer.bits == 4

    def body(c, x):
        return c, Q.dequantize_kv(x, jnp.float32)[0].sum()

    _, sums = jax.lax.scan(body, 0, q)
    assert sums.shape == (3,)


@pytest.mark.parametrize("bits,expected", [(4, 160), (2, 96)])
def test_bytes_per_token_at_head_dim_128(bits, expected):
    z = jnp.zeros((2, 3, 4, 256, 128), jnp.bfloat16)  # [L, B, Hkv, N, D]
    q = Q.quantize_kv(z, z, bits)
    assert PL.bytes_per_token(q) == expected
    parts = {k: v / (2 * 3 * 4 * 256) for k, v in PL.nbytes_breakdown(q).items()}
    payload = 128 * bits // 8
    assert parts == {"key_payload": payload, "key_metadata": 16, "value_payload": payload,
                     "value_metadata": 16, "residual": 0}
    dense = z.size * z.dtype.itemsize * 2 / (2 * 3 * 4 * 256)  # k + v arrays, bf16
    assert dense == PL.dense_bytes_per_token(128) == 512
    if bits == 4:
        assert dense / PL.bytes_per_token(q) == 3.2


def test_residual_counts_in_bytes():
    z = jnp.zeros((1, 1, 40, 128))
    q = Q.quantize_kv(z, z, 4)
    assert PL.nbytes(q) == 32 * 160 + 8 * 512


# --------------------------------------------------------------------------- the released rounding rule


def _released_numpy(x, axis, bits):
    """The released Triton kernels (quantize_key_groups_kernel / quantize_values_kernel), in numpy:
    float32 min and scale = max((max - min) / qmax, 1e-8), codes clip(floor((x - min) / scale + 0.5)),
    and only then float16 storage of scale and min. x [..., groups over `axis`]."""
    x = np.asarray(x, np.float32)
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    qmax = np.float32(2 ** bits - 1)
    scale = np.maximum((hi - lo) / qmax, np.float32(1e-8))
    codes = np.clip(np.floor((x - lo) / scale + np.float32(0.5)), 0, qmax).astype(np.uint8)
    return codes, np.squeeze(scale, axis).astype(np.float16), np.squeeze(lo, axis).astype(np.float16)


def _awkward(seed, shape):
    """Random K/V: per-channel offsets, spreads over six decades (fp16 metadata far from the fp32 one)."""
    rng = np.random.default_rng(seed)
    per_channel = shape[:-2] + (1, shape[-1])
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, per_channel) + 3 * rng.standard_normal(per_channel)
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", BITS)
def test_codes_and_metadata_equal_the_released_rule(bits, monkeypatch):
    monkeypatch.setattr(Q, "ROUNDING", "released")  # the released codes, selected (not the default)
    x = _awkward(20 + bits, (2, 4, 512, 128))
    kc, ks, kz = jax.jit(Q.quantize_keys, static_argnums=1)(jnp.asarray(x), bits)
    n = x.shape[-2]
    rc, rs, rz = _released_numpy(x.reshape(2, 4, n // 32, 32, 128), -2, bits)
    np.testing.assert_array_equal(np.asarray(Q.unpack(kc, bits)), rc.reshape(x.shape))
    np.testing.assert_array_equal(np.asarray(ks), rs)
    np.testing.assert_array_equal(np.asarray(kz), rz)
    vc, vs, vz = jax.jit(Q.quantize_values, static_argnums=1)(jnp.asarray(x), bits)
    rc, rs, rz = _released_numpy(x.reshape(2, 4, n, 4, 32), -1, bits)
    np.testing.assert_array_equal(np.asarray(Q.unpack(vc, bits)), rc.reshape(x.shape))
    np.testing.assert_array_equal(np.asarray(vs), rs)
    np.testing.assert_array_equal(np.asarray(vz), rz)
    # the fixed-capacity write of the engine takes the same codes
    cache = PL.empty((1, 2, 4), 512, 128, bits)
    out = jax.jit(PL.write_tokens)(cache, jnp.asarray(x)[None, :, :, :256], jnp.asarray(x)[None, :, :, :256],
                                   jnp.array([0, 256], jnp.int32))
    rc, _, _ = _released_numpy(x[1, :, :256].reshape(4, 8, 32, 128), -2, bits)
    got = np.asarray(Q.unpack(out.k_codes[0, 1, :, 256:], bits))
    np.testing.assert_array_equal(got, rc.reshape(4, 256, 128))


def test_the_stored_rule_differs_from_the_released_one_by_one_step():
    """rounding="stored" (ours, the default): codes against the fp16 metadata, half to even.
    On keys like real ones (unit noise on channel offsets) a small share of codes moves one step;
    where the offset dwarfs the group's range the fp16 zero is off by several steps."""
    x = _rand(30, (2, 4, 512, 128)) + _rand(31, (2, 4, 1, 128), 3.0)
    for bits, most in ((4, 0.005), (2, 0.002)):
        rel = Q.unpack(Q.quantize_keys(x, bits, rounding="released")[0], bits).astype(jnp.int32)
        sto = Q.unpack(Q.quantize_keys(x, bits, rounding="stored")[0], bits).astype(jnp.int32)
        diff = np.abs(np.asarray(rel - sto))
        assert diff.max() == 1 and 0 < diff.mean() < most, diff.mean()
    far = jnp.asarray(_awkward(32, (1, 2, 64, 128)))
    assert int(jnp.abs(Q.unpack(Q.quantize_keys(far, 4, rounding="released")[0], 4).astype(jnp.int32)
                       - Q.unpack(Q.quantize_keys(far, 4, rounding="stored")[0], 4)).max()) > 1
    with pytest.raises(ValueError, match="rounding must be one of"):
        Q.quantize_values(x, 4, rounding="nearest")


@pytest.mark.parametrize("bits", BITS)
def test_ties_round_half_up_like_floor_x_plus_half(bits):
    """Hand-worked: a group spanning [0, qmax] has scale 1 (exact), so x = k + 1/2 is a tie:
    floor(x + 0.5) takes k + 1 where round-half-even takes the even neighbour."""
    qmax = 2 ** bits - 1
    ties = [0.5, 1.5, 2.5][:qmax]
    row = np.zeros(32, np.float32)
    row[1], row[2:2 + len(ties)] = qmax, ties  # min 0, max qmax
    v = jnp.asarray(row)[None]
    codes = np.asarray(Q.unpack(Q.quantize_values(v, bits, rounding="released")[0], bits))[0, 2:2 + len(ties)]
    assert codes.tolist() == [1, 2, 3][:len(ties)]
    even = np.asarray(Q.unpack(Q.quantize_values(v, bits, rounding="stored")[0], bits))[0, 2:2 + len(ties)]
    assert even.tolist() == [0, 2, 2][:len(ties)]


def test_div_rn_is_ieee_division_even_by_a_broadcast_divisor():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-6, 6, 1 << 18)).astype(np.float32)
    b = (rng.standard_normal(1 << 13) * 10.0 ** rng.uniform(-6, 6, 1 << 13)).astype(np.float32)
    a2, b2 = a.reshape(-1, 32), b[:, None]
    np.testing.assert_array_equal(np.asarray(jax.jit(Q.div_rn)(a2, b2)), a2 / b2)  # per-row divisor
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: Q.div_rn(a, 15.0))(a)), a / np.float32(15))
    # the correction itself: from two ulps either side back to the nearest float
    a, b = np.abs(a[:1 << 14]) + np.float32(1e-3), np.abs(b[:1 << 13]).repeat(2) + np.float32(1e-3)
    ref = a / b
    for d in (-2, -1, 1, 2):
        q0 = (ref.view(np.int32) + d).view(np.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(Q._nearest_quotient)(a, b, q0)), ref)
