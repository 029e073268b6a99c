"""Q-MaskAhead: MaskAhead over a 4-bit (or 2-bit) K/V cache (research/maskahead.md section 4).

Selection and eviction are MaskAhead's; only the storage differs (cache.packed.QKVCache):

* committed blocks (and prefill chunks) are produced in the forward's dtype and quantized once on
  append (KIVI: keys per channel over 32 tokens, values per token over 32 channels, fp16 metadata);
* the step-0 scored pass (output, prefix mass, value score), the eviction probe and the dense
  layers read the packed cache, dequantized inside each layer's body;
* the selected entries are gathered and dequantized into a compact `compact_dtype` (bf16) buffer
  that the later steps and the commit forward read;
* eviction ranks by A_i * ||v_i - c|| with v the dequantized values, and requantizes the
  survivors' keys into fresh groups (cache/packed_layout.requantize_survivors: the documented
  deviation). compaction="lazy" (the released default, `compaction: lazy, repack_below: 1.0`):
  a key group keeping >= repack_below of its 32 entries is copied bit-exactly, the other
  survivors are requantized (keys and values) into fresh groups placed after the row's most kept
  groups (cache/packed_layout.lazy_compact, cache.packed.lazy_type); memory counts that padded
  physical length, as released. Ours stays the default: one rectangular requantize, no padding slots to pay for
  (more reduction at the same budget), values never requantized.

Whole key groups: capacities and eviction budgets C(seen) are rounded *up* to multiples of 32.
Blocks and prefill chunks that are multiples of 32 start every append on a group boundary.
Other sizes (SDAR's 4-token blocks, 8 / 16; head sizes 64 / 96 / 128 all work) take the open
group: the cache keeps each lane's trailing partial key group in bf16 as well (cache/packed.py,
counted in memory) and quantizes a group from those originals once it is complete; until then
its slots hold codes of the tokens present. `residual=None` (the default) turns it on exactly
when the block size or the prefill chunk is not a multiple of 32 (`for_run` fixes it per run);
True / False force it (False with such sizes is a PolicyError). Ragged per-lane budgets
(head_alloc / layer_importance, q-maskahead-qa's default AdaKV) and lazy compaction work on whole
groups only, so with such sizes they are a PolicyError that says so.

Memory: generate's stats use the cache's `bytes_per_token` (payload + fp16 metadata + bf16
residual, from the arrays) plus 10 B eviction state per kept entry, against a bf16 cache of every
token seen.

`bitsieve-v1` (released configs/bitsieve_v1.yaml, "BitSieve v1"): the same K4V4 cache with
selection by the step-0 mass alone (every masked query, top k = max(256, 5%)) and no eviction:
QMaskAhead(select_ranking="mass", evict_ranking="none").

`q-maskahead-qa` (ours, issue 40, docs/results.md "Beyond the paper"): `maskahead-qa`'s eviction
(the question probe at every eviction, bounded prefill) over this packed cache, with AdaKV's head
budgets: the question-aware ranking decides what is kept, the low-bit storage makes each kept entry
2.6x (head_dim 32) to ~3.5x (128) cheaper, so the same end memory affords a larger C.

`simulate=True` keeps a float cache whose appended K/V (and requantized survivor keys) take the
same quantize -> dequantize round trip: the float reference the tests compare the packed run to.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from .. import quant
from ..cache import packed, simulated
from .eviction import Budget, budget_of
from .maskahead import MaskAhead, QuestionAwareMaskAhead
from .protocol import PolicyError
from .selection import Selector


COMPACTIONS = ("requantize", "lazy")


def _round_up(x: int, m: int = quant.GROUP) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class QMaskAhead(MaskAhead):
    name = "q-maskahead"
    bits: int = 4
    compact_dtype: str = "bfloat16"  # dtype of the gathered buffer of selected entries
    simulate: bool = False  # test reference: float cache on quantize -> dequantize values
    # keep the bf16 open group (blocks / prefill chunks of any size): None = exactly when the
    # block size or the prefill chunk is not a multiple of 32 (`for_run`); True / False force it
    residual: Optional[bool] = None
    compaction: str = "requantize"  # eviction: requantize (ours) | lazy (released default)
    repack_below: float = 1.0  # lazy: a key group keeping >= this share of its entries stays bit-exact

    @staticmethod
    def unaligned(gen) -> list[str]:
        """The append sizes of `gen` that are not whole key groups, e.g. ["block_size=4"]."""
        return [f"{what}={n}" for what, n in (("block_size", gen.block_size),
                                                ("prefill_chunk", gen.prefill_chunk)) if n % quant.GROUP]

    def open_group(self, gen) -> bool:
        """Whether this run keeps the bf16 open group: `residual`, or when it is None whether
        a block or a prefill chunk is not a whole number of key groups."""
        return bool(self.unaligned(gen)) if self.residual is None else bool(self.residual)

    def for_run(self, cfg, gen) -> "QMaskAhead":
        """This policy with `residual` decided for the run's block size and prefill chunk."""
        return self if self.residual is not None else dataclasses.replace(self, residual=self.open_group(gen))

    def validate(self, cfg, gen) -> None:
        super().validate(cfg, gen)
        if self.bits not in quant.SUPPORTED_BITS:
            raise PolicyError(f"bits must be one of {quant.SUPPORTED_BITS}, got {self.bits}")
        if cfg.attention != "block_causal":
            raise PolicyError("q-maskahead needs a block-causal family (its packed cache is the "
                              "block-causal core's; the bidirectional core keeps a float cache)")
        g = quant.GROUP
        ev = self.eviction
        res = self.open_group(gen)
        why = ("residual=True" if self.residual else
               f"{', '.join(self.unaligned(gen))}: not multiples of {g}, so the bf16 open group (residual) is on")
        if ev is not None and ev.allocation.ragged and (self.compaction == "lazy" or res):
            raise PolicyError("layer_importance / head_alloc (ragged per-lane budgets, whole key groups per "
                              "lane) need compaction='requantize' and no open group"
                              + (f" ({why}); use head_alloc='uniform' or block_size / prefill_chunk "
                                 f"multiples of {g}" if res else ""))
        if self.compaction not in COMPACTIONS:
            raise PolicyError(f"compaction must be one of {'|'.join(COMPACTIONS)}, got {self.compaction!r}")
        if not 0.0 < float(self.repack_below) <= 1.0:
            raise PolicyError(f"repack_below must be in (0, 1], got {self.repack_below}")
        if self.compaction == "lazy":
            bad = [w for w, on in ((why, res), ("simulate=True", self.simulate)) if on]
            if bad:
                raise PolicyError(f"compaction='lazy' works on the packed cache without the open group; "
                                  f"{' and '.join(bad)}")
            if self.recent and self.interval_blocks * gen.block_size < self.recent:
                raise PolicyError(f"compaction='lazy' leaves slots out of position order, so the recent "
                                  f"window ({self.recent}) must be refilled by the interval_blocks * block_size "
                                  f"= {self.interval_blocks * gen.block_size} entries appended between evictions")
        if cfg.head_dim % g:
            raise PolicyError(f"q-maskahead needs head_dim to be a multiple of {g} (value groups "
                              f"of {g} channels), got {cfg.head_dim}")
        if self.residual is False and self.unaligned(gen):
            raise PolicyError(f"q-maskahead with residual=False needs block_size and prefill_chunk to be "
                              f"multiples of {g}, got {', '.join(self.unaligned(gen))}; leave residual "
                              f"unset (or True) to keep the partial key group in bf16 (any size)")

    # ------------------------------------------------------------------ parts (whole key groups)
    def budget(self) -> Budget:
        return budget_of(self, multiple=quant.GROUP)

    @property
    def selector(self) -> Optional[Selector]:
        sel = super().selector
        return None if sel is None else dataclasses.replace(sel, compact_dtype=self.compact_dtype)

    def plan(self, prompt_cap: int, total_cap: int, block_size: int, chunk: int = 512) -> tuple[int, int]:
        c0, c1 = super().plan(prompt_cap, total_cap, block_size, chunk)
        if self.compaction == "lazy" and self.eviction is not None:
            # room for the lazy layout: kept groups padded to the row's most (<= C * 32 / need
            # slots), then up to C re-encoded survivors, then the blocks until the next eviction
            ev = self.eviction
            cap = self.budget().capacity(total_cap)
            c1 += _round_up(-(-cap * quant.GROUP // self.need))
            if ev.bounded_prefill:  # q-maskahead-qa: the prefill buffer is compacted the same way
                c0 += _round_up(-(-ev.prefill_capacity(prompt_cap) * quant.GROUP // self.need))
        return _round_up(c0), _round_up(c1)

    @property
    def need(self) -> int:
        """Survivors a key group must keep to stay bit-exact under lazy compaction."""
        return max(1, math.ceil(float(self.repack_below) * quant.GROUP))

    # ------------------------------------------------------------------ storage
    def empty_cache(self, num_layers, batch, kv_heads, capacity, head_dim, dtype=jnp.bfloat16, group_size=1):
        res = bool(self.residual)  # None (automatic) is decided by for_run before the engine runs
        if self.simulate:
            return simulated.sim_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype, self.bits, res)
        c = packed.empty(num_layers, batch, kv_heads, capacity, head_dim, self.bits, res)
        return packed.lazy_type(self.need)(*c) if self.compaction == "lazy" else c


@dataclasses.dataclass(frozen=True)
class QuestionAwareQMaskAhead(QMaskAhead, QuestionAwareMaskAhead):
    """`maskahead-qa` on the packed low-bit cache (ours): QuestionAwareMaskAhead's eviction parts
    (its `eviction` property, through the MRO) with QMaskAhead's storage, whole-key-group budgets
    and checks, and AdaKV's head budgets by default (head_alloc="uniform": one C per lane). AdaKV's
    ragged lanes need whole key groups: blocks and (bounded prefill's) chunks that are multiples
    of 32, or head_alloc="uniform" for other sizes (the open group, QMaskAhead.residual)."""

    name = "q-maskahead-qa"
    # dataclass fields merge along the MRO with QMaskAhead's (MaskAhead's) defaults last, so
    # maskahead-qa's own defaults are restated here
    question_tokens: int = 128
    pin_question: bool = False
    # AdaKV's head budgets (eviction.Allocation, whole key groups per lane): 92.0 against 90.9 at
    # 10% (13 / 4, p = 0.05), 94.8 against 94.8 at 20% (11 / 9, n.s.) on the testbed suite
    head_alloc: str = "adakv"


@dataclasses.dataclass(frozen=True)
class DraftedQMaskAhead(QuestionAwareQMaskAhead):
    """`q-maskahead-qa` with the drafted probe and max-pooled question rows (ours, issue 40's best
    row, docs/results.md §2c-4): generate first runs the policy without a draft for draft_tokens
    new tokens (at most the run's max_new_tokens), and bounded prefill's question probe then reads
    that answer instead of mask blocks, its rows pooled by mean + max. The same memory as
    q-maskahead-qa (each pass is bounded); about twice the forwards (a second prefill and the
    drafted tokens); with attention kernels the probe forwards pool by mean + max in the kernels'
    statistics pass (on a GPU the Triton ones: dispatch.pool_impl). 96 = three blocks of 32 (the testbed's and Fast-dLLM v2's block size)."""

    name = "q-maskahead-draft"
    draft_tokens: int = 96
    question_pool: str = "mean+max"
