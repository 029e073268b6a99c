"""Q-MaskAhead: MaskAhead over a 4-bit (or 2-bit) K/V cache (research/maskahead.md section 4).

Selection and eviction are MaskAhead's; only the storage differs (qcache.QKVCache):

* committed blocks (and prefill chunks) are produced in the forward's dtype and quantized once on
  append (KIVI: keys per channel over 32 tokens, values per token over 32 channels, fp16 metadata);
* the step-0 scored pass (output, prefix mass, value score), the eviction probe and the dense
  layers read the packed cache, dequantized inside each layer's body;
* the selected entries are gathered and dequantized into a compact `compact_dtype` (bf16) buffer
  that the later steps and the commit forward read;
* eviction ranks by A_i * ||v_i - c|| with v the dequantized values, and requantizes the
  survivors' keys into fresh groups (quant.requantize_survivors: the documented deviation).

Whole key groups: capacities and eviction budgets C(seen) are rounded *up* to multiples of 32 so
that every append starts on a group boundary (blocks and prefill chunks must be multiples of 32).

Memory: generate's stats use the cache's `bytes_per_token` (payload + fp16 metadata + bf16
residual, from the arrays) plus 10 B eviction state per kept entry, against a bf16 cache of every
token seen.

`simulate=True` keeps a float cache whose appended K/V (and requantized survivor keys) take the
same quantize -> dequantize round trip: the float reference the tests compare the packed run to.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .. import qcache, quant
from ..kernels.reference import value_score
from . import register
from .maskahead import MaskAhead, PolicyError


def _round_up(x, m: int = quant.GROUP):
    if isinstance(x, int):
        return -(-x // m) * m
    return ((x + (m - 1)) // m) * m


@dataclasses.dataclass(frozen=True)
class QMaskAhead(MaskAhead):
    name = "q-maskahead"
    bits: int = 4
    compact_dtype: str = "bfloat16"  # dtype of the gathered buffer of selected entries
    simulate: bool = False  # test reference: float cache on quantize -> dequantize values

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if self.bits not in quant.SUPPORTED_BITS:
            raise PolicyError(f"bits must be one of {quant.SUPPORTED_BITS}, got {self.bits}")
        if cfg.attention != "block_causal":
            raise PolicyError("q-maskahead needs a block-causal family (its packed cache is the "
                              "block-causal core's; the bidirectional core keeps a float cache)")
        g = quant.GROUP
        for what, n in (("head_dim", cfg.head_dim), ("block_size", gen.block_size),
                        ("prefill_chunk", gen.prefill_chunk)):
            if n % g:
                raise PolicyError(f"q-maskahead needs {what} to be a multiple of {g}, got {n}")

    # ------------------------------------------------------------------ budgets (whole key groups)
    def capacity(self, seen):
        return _round_up(super().capacity(seen))

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, *rest) -> tuple[int, int]:
        c0, c1 = super().plan(prompt_cap, total_cap, block_size, *rest)
        return _round_up(c0), _round_up(c1)

    # ------------------------------------------------------------------ storage
    def empty_cache(self, num_layers, batch, kv_heads, capacity, head_dim, dtype=jnp.bfloat16):
        if self.simulate:
            return qcache.sim_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype, self.bits)
        return qcache.empty(num_layers, batch, kv_heads, capacity, head_dim, self.bits)

    # ------------------------------------------------------------------ hooks
    def select(self, cache, num_layers: int, mass, score):
        """Top-k per lane as in MaskAhead, gathered and dequantized into a compact buffer."""
        nd = min(self.dense_layers, num_layers)
        if self.select_ranking == "none" or nd >= num_layers:
            return None
        n = cache.capacity
        kmax = self.topk(n)
        if kmax >= n:
            return None
        sub = cache.layers(nd, num_layers)
        ranks = self.selection_scores(mass, score)[nd:]
        idx, keep = qcache.top_indices(sub.valid, sub.pos, ranks, self.topk(sub.length), kmax)
        return nd, sub.select_context(idx, keep, jnp.dtype(self.compact_dtype))

    def eviction_scores(self, cache, mass0, probe_mass):
        a = mass0 if probe_mass is None else mass0 + probe_mass
        if self.evict_ranking == "mass":
            return a
        return value_score(a, cache.values())  # dequantized V


register("q-maskahead", lambda **kw: QMaskAhead(**kw))
