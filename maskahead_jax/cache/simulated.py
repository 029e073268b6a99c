"""The simulated low-bit cache: a float cache whose K/V take the packed cache's quantize ->
dequantize round trip (on append, and for the survivors' keys on eviction).

It is the float reference the packed cache (cache/packed.py) is tested against: the same keep
sets and the same attention inputs, with no bit packing. A policy with `storage=Packed(simulate=True)` runs on it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import quant
from ..model import Context
from .float_cache import KVCache, empty as float_empty
from .packed import OPEN, new_open, open_originals, scatter_rows, stage_window
from .slots import choose_slots


def roundtrip_kv(k, v, bits: int, valid=None):
    """quantize -> dequantize (in k's dtype), as one append of QKVCache stores it."""
    k2, v2 = quant.dequantize_kv(quant.quantize_kv(k, v, bits, valid), jnp.float32)
    return k2.astype(k.dtype), v2.astype(v.dtype)


class SimQuantKVCache(NamedTuple):
    """A float cache (KVCache's fields) that stores K/V after the quantize -> dequantize round trip
    of QKVCache: on append, and for the survivors' keys on eviction. Test reference only.
    The bit width is a class attribute: use `sim_cache_type(bits)`."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    valid: jax.Array
    acc: jax.Array
    length: jax.Array
    seen: jax.Array
    open_k: jax.Array = None  # the packed cache's bf16 open group (width 0: none)
    open_v: jax.Array = None

    bits = 4

    @property
    def residual(self) -> bool:
        return self.open_k is not None and self.open_k.shape[3] > 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> float:
        return self._f().bytes_per_token

    def _f(self) -> KVCache:
        return KVCache(*self[:7])

    def _wrap(self, c: KVCache, open_k=None, open_v=None):
        ok, ov = (self.open_k, self.open_v) if open_k is None else (open_k, open_v)
        return type(self)(*c, ok, ov)

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        return self._f().context(start, stop)

    def layers(self, start: int, stop: int):
        c = self._f().layers(start, stop)
        return type(self)(*c, self.open_k[start:stop], self.open_v[start:stop])

    def live(self):
        return self._f().live()

    def append(self, k_new, v_new, pos_new, n_new):
        if self.residual:  # the packed cache's window, quantize -> dequantize, written back
            start, kw, vw, valid, ok, ov = stage_window(self.open_k, self.open_v, self.length,
                                                        k_new, v_new, n_new)
            kw, vw = quant.dequantize_kv(quant.quantize_kv(kw, vw, self.bits, valid), jnp.float32)
            c = self._f().append(k_new, v_new, pos_new, n_new)
            c = c._replace(k=scatter_rows(c.k, kw, start), v=scatter_rows(c.v, vw, start))
            return self._wrap(c, ok, ov)
        t = k_new.shape[3]
        ok = jnp.arange(t)[None, :] < n_new[:, None]
        valid = jnp.broadcast_to(ok[None, :, None, :], k_new.shape[:4])
        k_new, v_new = roundtrip_kv(k_new.astype(self.k.dtype), v_new.astype(self.v.dtype), self.bits, valid)
        return self._wrap(self._f().append(k_new, v_new, pos_new, n_new))

    def gather(self, idx, keep):
        c = self._f().gather(idx, keep)
        live = c.valid
        if self.residual:  # as QKVCache.gather: open-group survivors regrouped from their originals
            k, v, in_open = open_originals(self.open_k, self.open_v, self.length, idx,
                                           c.k.astype(jnp.float32), c.v.astype(jnp.float32))
            k, v = jnp.where(live[..., None], k, 0.0), jnp.where(live[..., None], v, 0.0)
            codes, scale, zero = quant.quantize_keys(k, self.bits, live)
            k2 = quant.dequantize_keys(codes, scale, zero, self.bits, jnp.float32)
            v2 = quant.dequantize_values(*quant.quantize_values(v, self.bits), self.bits, jnp.float32)
            v2 = jnp.where(in_open, v2, c.v.astype(jnp.float32))
            ok, ov = new_open(k, v, c.length)
            return self._wrap(c._replace(k=k2.astype(c.k.dtype), v=v2.astype(c.v.dtype)), ok, ov)
        k = jnp.where(live[..., None], c.k.astype(jnp.float32), 0.0)
        codes, scale, zero = quant.quantize_keys(k, self.bits, live)
        k = quant.dequantize_keys(codes, scale, zero, self.bits, jnp.float32)
        return self._wrap(c._replace(k=k.astype(c.k.dtype)))

    def keep_top(self, scores, keep_count, capacity: int):
        return self.gather(*choose_slots(self.valid, self.pos, scores, keep_count, capacity))

    def resize(self, capacity: int):
        return self._wrap(self._f().resize(capacity))

    def values(self):
        return self.v.astype(jnp.float32)

    def keys(self):
        return self.k.astype(jnp.float32)

    def select_context(self, idx, keep, dtype=None) -> Context:
        take = lambda a: jnp.take_along_axis(a, idx[..., None], axis=3)
        k, v = take(self.k), take(self.v)
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        return Context(k, v, jnp.take_along_axis(self.valid, idx, axis=3) & keep)


_SIM_TYPES: dict = {}


def sim_cache_type(bits: int):
    quant.codes_per_byte(bits)
    if bits not in _SIM_TYPES:
        _SIM_TYPES[bits] = type(f"SimQuant{bits}KVCache", (SimQuantKVCache,), {"bits": bits, "__slots__": ()})
    return _SIM_TYPES[bits]


def sim_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype=jnp.float32, bits: int = 4,
              residual: bool = False):
    z = jnp.zeros((num_layers, batch, kv_heads, OPEN if residual else 0, head_dim), quant.RESIDUAL_DTYPE)
    return sim_cache_type(bits)(*float_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype), z, z)
