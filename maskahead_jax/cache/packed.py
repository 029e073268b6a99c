"""The low-bit KV cache (Q-MaskAhead): the float KVCache's pytree axes and functional API over a
packed `quant.QuantKV` (research/maskahead.md section 4, docs/quantization.md), whose layout
operations (writes, gathers, compaction, byte accounting) are cache/packed_layout.py.

    QKVCache(q: QuantKV [L, B, Hkv] x N slots, pos, valid, acc [L, B, Hkv, N], length, seen [B])

* `append` quantizes the committed tokens once (`packed_layout.write_tokens`): they are produced
  in the forward's dtype and written as codes + fp16 metadata. Without an open group (`empty(...,
  residual=False)`, the default) writes start at `length[b]`, a multiple of 32 (blocks, prefill
  chunks and eviction budgets are whole key groups).
* The open group (`empty(..., residual=True)`: blocks / prefill chunks that are not multiples of
  32, e.g. SDAR's 4-token blocks): the tokens of each lane's trailing partial key group
  (slots [P, length), P = length - length % 32) also stay in bfloat16 in `open_k` / `open_v`
  [L, B, Hkv, 32, D], counted in `bytes_per_token`. Each append rebuilds the window [P, P + W)
  from those bf16 originals and the new tokens and quantizes it (`stage_window`), so a key group
  is quantized from its originals once it is complete (never from codes of a partial group).
  Until then its slots hold codes of the tokens present (key min/max over those): the layers and
  the gathered buffer read them like any other slot.
* `keep_top` / `gather` (eviction): survivors' keys are dequantized, gathered and requantized
  into fresh 32-token groups, values move bit-exactly (`packed_layout.requantize_survivors`;
  the documented deviation from the released code's lazy compaction). Capacities are multiples
  of 32.
  `lazy_type(need)(*empty(...))`: a cache with the released lazy compaction instead
  (packed_layout.lazy_compact; policies.storage.Packed(compaction="lazy")).
* `context()` is a `Context(k=QuantKV slice, v=None, valid)`: the layers dequantize it inside the
  layer body (model/decoder.py), so the step-0 scored pass, the probe and dense layers read the
  packed cache.
* `select_context(idx, keep, dtype)`: the selected entries gathered and dequantized into a compact
  bf16 Context (`packed_layout.gather_dequant`), read by the later steps and the commit forward.
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
from . import packed_layout as layout
from .float_cache import KVCache
from .slots import choose_slots, take_slots

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


OPEN = GROUP  # slots of the bf16 open group (one partial key group)


def stage_window(open_k, open_v, length, k_new, v_new, n_new):
    """The slots an append rewrites when the cache keeps an open group (shared with the simulated
    cache, so both quantize the same numbers).

    open_k, open_v [L, B, Hkv, 32, D] bf16: originals of slots [P, length), P = length - length % 32;
    k_new, v_new [L, B, Hkv, T, D]; length, n_new [B]. Returns (start P [B], window k, v
    [L, B, Hkv, W, D] float32 holding the open tokens then the new ones, valid [L, B, Hkv, W],
    new open_k, open_v) with W = 32 * ceil((T + 31) / 32) >= length % 32 + T.
    """
    l, b, h, t, d = k_new.shape
    w = -(-(t + OPEN - 1) // GROUP) * GROUP
    r = length % GROUP
    start = length - r
    j = jnp.arange(w)

    def place(new, old):  # [L, B, Hkv, T, D] at offset r[b], the open tokens before it
        pad = jnp.zeros((l, b, h, w, d), jnp.float32)
        put = jax.vmap(lambda buf, u, o: jax.lax.dynamic_update_slice_in_dim(buf, u, o, axis=2),
                       in_axes=(1, 1, 0), out_axes=1)(pad, new.astype(jnp.float32), r)
        old = jnp.concatenate([old.astype(jnp.float32), jnp.zeros((l, b, h, w - OPEN, d), jnp.float32)], 3)
        return jnp.where((j[None, :] < r[:, None])[None, :, None, :, None], old, put)

    kw, vw = place(k_new, open_k), place(v_new, open_v)
    total = r + n_new
    valid = jnp.broadcast_to((j[None, :] < total[:, None])[None, :, None, :], (l, b, h, w))
    r2 = total % GROUP
    off = total - r2  # the new open group starts here in the window

    def take_open(x):
        xp = jnp.concatenate([x, jnp.zeros((l, b, h, OPEN, d), x.dtype)], 3)
        o = jax.vmap(lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, OPEN, axis=2),
                     in_axes=(1, 0), out_axes=1)(xp, off)
        keep = (jnp.arange(OPEN)[None, :] < r2[:, None])[None, :, None, :, None]
        return jnp.where(keep, o, 0.0).astype(quant.RESIDUAL_DTYPE)

    return start, kw, vw, valid, take_open(kw), take_open(vw)


def scatter_rows(buf, upd, start):
    """buf [L, B, Hkv, N, X] <- upd [L, B, Hkv, W, X] at rows start[b] + [0, W) (rows past N dropped)."""
    w = upd.shape[3]

    def row(a, u, s):  # [L, Hkv, N, X]
        return a.at[:, :, s + jnp.arange(w)].set(u.astype(a.dtype), mode="drop")

    return jax.vmap(row, in_axes=(1, 1, 0), out_axes=1)(buf, upd, start)


def open_originals(open_k, open_v, length, idx, k, v):
    """k, v [L, B, Hkv, K, D] of slots idx, with the open group's slots replaced by their bf16
    originals (what an eviction regroups)."""
    r = length % GROUP
    rel = idx - (length - r)[None, :, None, None]
    in_open = ((rel >= 0) & (rel < r[None, :, None, None]))[..., None]
    ir = jnp.clip(rel, 0, OPEN - 1)
    take = lambda a: jnp.take_along_axis(a, ir[..., None], axis=3).astype(jnp.float32)
    return jnp.where(in_open, take(open_k), k), jnp.where(in_open, take(open_v), v), in_open


def new_open(k, v, length):
    """The open group of a compacted lane: slots [P, length) of k, v [L, B, Hkv, K, D] in bf16."""
    r = length % GROUP
    xs = []
    for x in (k, v):
        xp = jnp.concatenate([x, jnp.zeros(x.shape[:3] + (OPEN,) + x.shape[4:], x.dtype)], 3)
        o = jax.vmap(lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, OPEN, axis=2),
                     in_axes=(1, 0), out_axes=1)(xp, length - r)
        keep = (jnp.arange(OPEN)[None, :] < r[:, None])[None, :, None, :, None]
        xs.append(jnp.where(keep, o, 0.0).astype(quant.RESIDUAL_DTYPE))
    return xs


class QKVCache(NamedTuple):
    q: quant.QuantKV  # leading axes [L, B, Hkv], N slots, no residual
    pos: jax.Array  # [L, B, Hkv, N] int32 (-1 on empty slots)
    valid: jax.Array  # [L, B, Hkv, N] bool
    acc: jax.Array  # [L, B, Hkv, N] float32
    length: jax.Array  # [B] int32 write pointer (a multiple of 32 without an open group)
    seen: jax.Array  # [B] int32
    open_k: jax.Array = None  # [L, B, Hkv, 32 or 0, D] bf16 originals of the partial key group
    open_v: jax.Array = None

    @property
    def residual(self) -> bool:
        return self.open_k is not None and self.open_k.shape[3] > 0

    # ---------------------------------------------------------------- the KVCache API
    @property
    def capacity(self) -> int:
        return self.q.num_tokens

    @property
    def bits(self) -> int:
        return self.q.bits

    @property
    def bytes_per_token(self) -> float:
        """Payload + fp16 metadata + bf16 residual (the open group) per token per (layer, batch,
        KV head), from the arrays."""
        extra = 0.0
        if self.residual:
            lanes = self.open_k.shape[0] * self.open_k.shape[1] * self.open_k.shape[2]
            extra = (self.open_k.nbytes + self.open_v.nbytes) / (lanes * self.capacity)
        return layout.bytes_per_token(self.q) + extra

    def context(self, start: int = 0, stop: int | None = None) -> Context:
        """Layers [start, stop) as a packed Context (v=None): dequantized inside the layer body."""
        return Context(_layers(self.q, start, stop), None, self.valid[start:stop])

    def layers(self, start: int, stop: int) -> "QKVCache":
        return self._replace(q=_layers(self.q, start, stop), pos=self.pos[start:stop],
                             valid=self.valid[start:stop], acc=self.acc[start:stop],
                             open_k=self.open_k[start:stop], open_v=self.open_v[start:stop])

    def live(self) -> jax.Array:
        return self.valid.sum(-1).astype(jnp.int32)

    def _book(self) -> KVCache:
        """The bookkeeping fields as a float KVCache with zero-width K/V (reuses cache.py's ops)."""
        z = jnp.zeros(self.pos.shape + (0,), jnp.bfloat16)
        return KVCache(z, z, self.pos, self.valid, self.acc, self.length, self.seen)

    def _with_book(self, q, book: KVCache, open_k=None, open_v=None) -> "QKVCache":
        ok, ov = (self.open_k, self.open_v) if open_k is None else (open_k, open_v)
        return type(self)(q, book.pos, book.valid, book.acc, book.length, book.seen, ok, ov)

    def append(self, k_new, v_new, pos_new, n_new) -> "QKVCache":
        """Quantize and write the first n_new[b] of T new entries at slot length[b] (32-aligned
        without an open group; anywhere with one: the window [P, P + W) is requantized)."""
        book = self._book().append(k_new[..., :0], v_new[..., :0], pos_new, n_new)
        if not self.residual:
            _check_aligned(k_new.shape[3], "tokens per append (or keep an open group: residual=True)")
            return self._with_book(layout.write_tokens(self.q, k_new, v_new, self.length, n_new), book)
        start, kw, vw, valid, ok, ov = stage_window(self.open_k, self.open_v, self.length, k_new, v_new, n_new)
        new = quant.quantize_kv(kw, vw, self.bits, valid)
        q, g = self.q, start // GROUP
        w = lambda buf, upd, s=start: scatter_rows(buf, upd, s)
        q = q._replace(k_codes=w(q.k_codes, new.k_codes), k_scale=w(q.k_scale, new.k_scale, g),
                       k_zero=w(q.k_zero, new.k_zero, g), v_codes=w(q.v_codes, new.v_codes),
                       v_scale=w(q.v_scale, new.v_scale), v_zero=w(q.v_zero, new.v_zero))
        return self._with_book(q, book, ok, ov)

    def gather(self, idx, keep) -> "QKVCache":
        """Survivors idx (kept first, position order): keys requantized into fresh groups."""
        _check_aligned(idx.shape[-1], "capacity")
        book = self._book().gather(idx, keep)
        if not self.residual:
            return self._with_book(layout.requantize_survivors(self.q, idx, book.valid.sum(-1)), book)
        # open-group survivors are regrouped from their bf16 originals, their values quantized now
        q, bits = self.q, self.bits
        k, v = layout.gather_dequant(q, idx, jnp.float32)
        k, v, in_open = open_originals(self.open_k, self.open_v, self.length, idx, k, v)
        live = book.valid
        k, v = jnp.where(live[..., None], k, 0.0), jnp.where(live[..., None], v, 0.0)
        kc, ks, kz = quant.quantize_keys(k, bits, live)
        ip = jnp.clip(idx.astype(jnp.int32), 0, q.num_packed - 1)
        take = lambda a: jnp.take_along_axis(a, ip[..., None], axis=-2)
        rc, rs, rz = quant.quantize_values(v, bits)
        vc, vs, vz = (jnp.where(in_open, a, take(b)) for a, b in
                      ((rc, q.v_codes), (rs, q.v_scale), (rz, q.v_zero)))
        ok, ov = new_open(k, v, book.length)
        return self._with_book(q._replace(k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs,
                                          v_zero=vz), book, ok, ov)

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

    def keys(self) -> jax.Array:
        """[L, B, Hkv, N, D] float32 dequantized keys (Expected Attention's scores; an open group's
        slots give the codes of the tokens present, as its values do)."""
        q = self.q
        return quant.dequantize_keys(q.k_codes, q.k_scale, q.k_zero, q.bits, jnp.float32)

    def select_context(self, idx, keep, dtype=jnp.bfloat16) -> Context:
        """The compact buffer of selected entries: gathered and dequantized to `dtype`."""
        k, v = layout.gather_dequant(self.q, idx, dtype)
        return Context(k, v, jnp.take_along_axis(self.valid, idx, axis=3) & keep)


class _LazyQKVCache(QKVCache):
    """A QKVCache whose eviction is the released `compaction: lazy` (packed_layout.lazy_compact):
    key groups with at least `need` survivors stay bit-exact, the other survivors are requantized
    (keys and values) into fresh groups after the row's most kept groups. Slots are then not in
    position order: kept groups first, then the re-encoded survivors by position, and the write
    pointer `length` is the row's physical length 32 * (G1 + ceil(max re-encoded / 32))
    (released `rebuild`'s new length, per row), which the memory stats count."""
    __slots__ = ()
    need: int = GROUP

    def gather(self, idx, keep) -> "QKVCache":
        if self.residual:
            raise ValueError("lazy compaction needs a cache without the open group (residual=False)")
        live = take_slots(self.valid, idx) & keep
        q, src, valid, extent = layout.lazy_compact(self.q, idx, live, idx.shape[-1], self.need)
        book = self._book().gather(src, valid)
        return self._with_book(q, book._replace(length=extent))


_LAZY: dict = {}


def lazy_type(need: int) -> type:
    """The QKVCache subclass of lazy compaction with `need` survivors to keep a key group (one
    class per value: it is static, the cache's pytree leaves stay those of QKVCache)."""
    if not 1 <= need <= GROUP:
        raise ValueError(f"need must be in [1, {GROUP}], got {need}")
    if need not in _LAZY:
        _LAZY[need] = type(f"LazyQKVCache{need}", (_LazyQKVCache,), {"need": need, "__slots__": ()})
    return _LAZY[need]


def empty(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
          bits: int = 4, residual: bool = False) -> QKVCache:
    """An empty packed cache; residual=True keeps the bf16 open group (appends of any size)."""
    _check_aligned(capacity, "capacity")
    shape = (num_layers, batch, kv_heads, capacity)
    z = jnp.zeros(shape[:3] + (OPEN if residual else 0, head_dim), quant.RESIDUAL_DTYPE)
    return QKVCache(
        q=layout.empty(shape[:3], capacity, head_dim, bits), pos=jnp.full(shape, -1, jnp.int32),
        valid=jnp.zeros(shape, bool), acc=jnp.zeros(shape, jnp.float32),
        length=jnp.zeros((batch,), jnp.int32), seen=jnp.zeros((batch,), jnp.int32),
        open_k=z, open_v=z)
