"""The low-bit KV cache (Q-MaskAhead): the float KVCache's pytree axes and functional API over a
packed `quant.QuantKV` (research/maskahead.md section 4, docs/quantization.md).

    QKVCache(q: QuantKV [L, B, Hkv] x N slots, pos, valid, acc [L, B, Hkv, N], length, seen [B])

* `append` quantizes the committed tokens once (`quant.write_tokens`): they are produced in the
  forward's dtype and written as codes + fp16 metadata. Writes start at `length[b]`, which must
  stay a multiple of 32 (blocks, prefill chunks and eviction budgets are whole key groups; the
  policy guarantees it), so the cache never holds a bf16 residual.
* `keep_top` / `gather` (eviction): survivors' keys are dequantized, gathered and requantized
  into fresh 32-token groups, values move bit-exactly (`quant.requantize_survivors`; the
  documented deviation from the released code's lazy compaction). Capacities are multiples of 32.
* `context()` is a `Context(k=QuantKV slice, v=None, valid)`: the layers dequantize it inside the
  layer body (model/decoder.py), so the step-0 scored pass, the probe and dense layers read the
  packed cache.
* `select_context(idx, keep, dtype)`: the selected entries gathered and dequantized into a compact
  bf16 Context (`quant.gather_dequant`), read by the later steps and the commit forward.
* `bytes_per_token`: payload + metadata + residual per token per lane, from the arrays.

It implements the Cache protocol (cache/protocol.py) as methods, so the engine and the policies
never ask which cache they hold. Its float reference is cache/simulated.py.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import quant
from ..model import Context
from .float_cache import KVCache
from .slots import choose_slots

GROUP = quant.GROUP


def _check_aligned(n: int, what: str) -> None:
    if n % GROUP:
        raise ValueError(f"{what} = {n} must be a multiple of {GROUP} (whole key groups)")


def _slice_tokens(q: quant.QuantKV, n: int) -> quant.QuantKV:
    g = n // GROUP
    return q._replace(k_codes=q.k_codes[..., :n, :], k_scale=q.k_scale[..., :g, :],
                      k_zero=q.k_zero[..., :g, :], v_codes=q.v_codes[..., :n, :],
                      v_scale=q.v_scale[..., :n, :], v_zero=q.v_zero[..., :n, :])


def _pad_tokens(q: quant.QuantKV, n: int) -> quant.QuantKV:
    extra = n - q.num_packed

    def pad(a, m):
        return jnp.concatenate([a, jnp.zeros(a.shape[:-2] + (m,) + a.shape[-1:], a.dtype)], axis=-2)

    g = extra // GROUP
    return q._replace(k_codes=pad(q.k_codes, extra), k_scale=pad(q.k_scale, g), k_zero=pad(q.k_zero, g),
                      v_codes=pad(q.v_codes, extra), v_scale=pad(q.v_scale, extra),
                      v_zero=pad(q.v_zero, extra))


def _layers(tree, start, stop):
    return jax.tree_util.tree_map(lambda a: a[start:stop], tree)


class QKVCache(NamedTuple):
    q: quant.QuantKV  # leading axes [L, B, Hkv], N slots, no residual
    pos: jax.Array  # [L, B, Hkv, N] int32 (-1 on empty slots)
    valid: jax.Array  # [L, B, Hkv, N] bool
    acc: jax.Array  # [L, B, Hkv, N] float32
    length: jax.Array  # [B] int32 write pointer (a multiple of 32)
    seen: jax.Array  # [B] int32

    # ---------------------------------------------------------------- the KVCache API
    @property
    def capacity(self) -> int:
        return self.q.num_tokens

    @property
    def bits(self) -> int:
        return self.q.bits

    @property
    def bytes_per_token(self) -> float:
        """Payload + fp16 metadata + bf16 residual per token per (layer, batch, KV head), from the arrays."""
        return quant.bytes_per_token(self.q)

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        """Layers [start, stop) as a packed Context (v=None): dequantized inside the layer body."""
        return Context(_layers(self.q, start, stop), None, self.valid[start:stop])

    def layers(self, start: int, stop: int) -> "QKVCache":
        return self._replace(q=_layers(self.q, start, stop), pos=self.pos[start:stop],
                             valid=self.valid[start:stop], acc=self.acc[start:stop])

    def live(self) -> jax.Array:
        return self.valid.sum(-1).astype(jnp.int32)

    def _book(self) -> KVCache:
        """The bookkeeping fields as a float KVCache with zero-width K/V (reuses cache.py's ops)."""
        z = jnp.zeros(self.pos.shape + (0,), jnp.bfloat16)
        return KVCache(z, z, self.pos, self.valid, self.acc, self.length, self.seen)

    def _with_book(self, q, book: KVCache) -> "QKVCache":
        return QKVCache(q, book.pos, book.valid, book.acc, book.length, book.seen)

    def append(self, k_new, v_new, pos_new, n_new) -> "QKVCache":
        """Quantize and write the first n_new[b] of T new entries at slot length[b] (32-aligned)."""
        _check_aligned(k_new.shape[3], "tokens per append")
        q = quant.write_tokens(self.q, k_new, v_new, self.length, n_new)
        book = self._book().append( k_new[..., :0], v_new[..., :0], pos_new, n_new)
        return self._with_book(q, book)

    def gather(self, idx, keep) -> "QKVCache":
        """Survivors idx (kept first, position order): keys requantized into fresh groups."""
        _check_aligned(idx.shape[-1], "capacity")
        book = self._book().gather(idx, keep)
        q = quant.requantize_survivors(self.q, idx, book.valid.sum(-1))
        return self._with_book(q, book)

    def keep_top(self, scores, keep_count, capacity: int) -> "QKVCache":
        return self.gather(*choose_slots(self.valid, self.pos, scores, keep_count, capacity))

    def resize(self, capacity: int) -> "QKVCache":
        if capacity == self.capacity:
            return self
        _check_aligned(capacity, "capacity")
        q = _slice_tokens(self.q, capacity) if capacity < self.capacity else _pad_tokens(self.q, capacity)
        return self._with_book(q, self._book().resize(capacity))

    # ---------------------------------------------------------------- policy helpers
    def values(self) -> jax.Array:
        """[L, B, Hkv, N, D] float32 dequantized values (for the eviction value score)."""
        q = self.q
        return quant.dequantize_values(q.v_codes, q.v_scale, q.v_zero, q.bits, jnp.float32)

    def select_context(self, idx, keep, dtype=jnp.bfloat16) -> Context:
        """The compact buffer of selected entries: gathered and dequantized to `dtype`."""
        k, v = quant.gather_dequant(self.q, idx, dtype)
        return Context(k, v, jnp.take_along_axis(self.valid, idx, axis=3) & keep)


def empty(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
          bits: int = 4) -> QKVCache:
    _check_aligned(capacity, "capacity")
    shape = (num_layers, batch, kv_heads, capacity)
    return QKVCache(
        q=quant.empty(shape[:3], capacity, head_dim, bits), pos=jnp.full(shape, -1, jnp.int32),
        valid=jnp.zeros(shape, bool), acc=jnp.zeros(shape, jnp.float32),
        length=jnp.zeros((batch,), jnp.int32), seen=jnp.zeros((batch,), jnp.int32))
