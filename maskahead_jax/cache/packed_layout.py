"""The packed cache's layout operations on a `quant.QuantKV`: gather + dequantize, eviction
compaction (full requantization and the released lazy one), the fixed-capacity writes, the empty
container and its byte accounting. cache/packed.py (QKVCache) is built on them; the quantizer's
numerics (pack / unpack, min-max groups, quantize_kv / dequantize_kv) stay in quant.py, which
imports nothing from the cache layer.

Deviation from the released code (its `compaction: lazy`), by default: on eviction we
requantize the keys of *every* survivor into fresh 32-token groups (dequantize -> gather ->
quantize), while the released code copies fully surviving groups bit-exactly and pads every
lane to the most scattered lane's group count. The released rule is `lazy_compact`
(storage Packed(compaction="lazy", repack_below=1.0), tested against numpy): groups keeping
>= repack_below of their entries copied bit-exactly, the other survivors' keys *and values*
requantized from their dequantized values into fresh groups after the row's most kept groups.
Why: full requantization keeps every (layer, batch, KV head) lane rectangular with a static
capacity, so eviction is one gather + one quantize under jit with no ragged group bookkeeping
and no padding slots to pay for in memory. The cost is one more rounding of the surviving keys
(bounded by half a step of their new group). Values are quantized per token, so their codes
and metadata move with the token bit-exactly and are never requantized.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from ..quant import (GROUP, META_DTYPE, RESIDUAL_DTYPE, QuantKV, codes_per_byte, quantize_keys,
                     quantize_kv, quantize_values, unpack)

# --------------------------------------------------------------------------- gather and compaction

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
    sizes `capacity` >= 32 * G1 + max n_enc (policies.storage.Packed.plan)."""
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
