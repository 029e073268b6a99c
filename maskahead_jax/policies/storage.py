"""Where a policy's KV entries live: a part any policy composes (its `storage` field).

    Float()          the forward's dtype (cache/float_cache.KVCache): every policy's default
    Packed(bits=4)   KIVI-style 4-bit (or 2-bit) keys and values (cache/packed.QKVCache),
                     scored and attended from low bits: research/maskahead.md section 4

`make(name, pct, bits=4)` (CLI: `name[bits=4]`) puts any policy on the packed cache, with
`residual`, `compaction`, `repack_below`, `compact_dtype` and `simulate` as further knobs; the
`q-` names are presets (`q-maskahead` = MaskAhead + Packed(4)), and a packed policy reports its
name with a `q-` prefix (Policy.label). What the packed cache changes for the policy it holds:

* budgets and capacities are whole key groups (rounded up to multiples of 32);
* selection gathers its entries into a `compact_dtype` (bf16) buffer that later steps read;
* `compaction="lazy"` (the released default) needs room for its padded layout (`plan`);
* `check` refuses what the layout cannot hold (a bidirectional family, head sizes that are not
  whole value groups, ragged per-lane budgets with the open group or lazy compaction, ...).

`simulate=True` keeps a float cache on the packed round trip (cache/simulated.py): the reference
the tests compare a packed run to.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional, Union

from .. import quant
from ..cache import empty as float_empty, packed, simulated
from .errors import PolicyError

COMPACTIONS = ("requantize", "lazy")
# the knobs `make` routes into the storage part rather than the policy
KNOBS = ("bits", "residual", "compaction", "repack_below", "compact_dtype", "simulate")


def _round_up(x: int, m: int = quant.GROUP) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Float:
    """The cache in the forward's dtype; nothing to round, nothing to refuse."""

    prefix: ClassVar[str] = ""
    multiple: ClassVar[int] = 1
    compact_dtype: ClassVar[Optional[str]] = None

    def empty(self, num_layers, batch, kv_heads, capacity, head_dim, dtype):
        return float_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype)

    def for_run(self, gen) -> "Float":
        return self

    def check(self, policy, cfg, gen) -> None:
        return None

    def plan(self, policy, caps: tuple[int, int], prompt_cap: int, total_cap: int) -> tuple[int, int]:
        return caps


@dataclasses.dataclass(frozen=True)
class Packed:
    """Low-bit K/V: keys per channel over 32-token groups, values per token over 32 channels.

    residual      keep the bf16 open group (blocks / prefill chunks of any size): None = exactly
                  when the block size or the prefill chunk is not a multiple of 32 (`for_run`)
    compaction    eviction: "requantize" (ours: survivors' keys requantized into fresh groups) or
                  "lazy" (released: key groups keeping >= repack_below of their entries are
                  copied bit-exactly, padded layout)
    compact_dtype the dtype of selection's gathered buffer
    simulate      test reference: a float cache on the quantize -> dequantize round trip
    """

    bits: int = 4
    residual: Optional[bool] = None
    compaction: str = "requantize"
    repack_below: float = 1.0
    compact_dtype: str = "bfloat16"
    simulate: bool = False

    prefix: ClassVar[str] = "q-"
    multiple: ClassVar[int] = quant.GROUP

    @property
    def need(self) -> int:
        """Survivors a key group must keep to stay bit-exact under lazy compaction."""
        return max(1, math.ceil(float(self.repack_below) * quant.GROUP))

    @staticmethod
    def unaligned(gen) -> list[str]:
        """The append sizes of `gen` that are not whole key groups, e.g. ["block_size=4"]."""
        return [f"{what}={n}" for what, n in (("block_size", gen.block_size),
                                                ("prefill_chunk", gen.prefill_chunk)) if n % quant.GROUP]

    def open_group(self, gen) -> bool:
        """Whether this run keeps the bf16 open group (`residual`, or automatic when None)."""
        return bool(self.unaligned(gen)) if self.residual is None else bool(self.residual)

    def for_run(self, gen) -> "Packed":
        """This storage with `residual` decided for the run's block size and prefill chunk."""
        return self if self.residual is not None else dataclasses.replace(self, residual=self.open_group(gen))

    def empty(self, num_layers, batch, kv_heads, capacity, head_dim, dtype):
        res = bool(self.residual)  # None (automatic) is decided by for_run before the engine runs
        if self.simulate:
            return simulated.sim_empty(num_layers, batch, kv_heads, capacity, head_dim, dtype, self.bits, res)
        c = packed.empty(num_layers, batch, kv_heads, capacity, head_dim, self.bits, res)
        return packed.lazy_type(self.need)(*c) if self.compaction == "lazy" else c

    def plan(self, policy, caps: tuple[int, int], prompt_cap: int, total_cap: int) -> tuple[int, int]:
        """Whole key groups; with lazy compaction, room for its layout: kept groups padded to the
        row's most (<= C * 32 / need slots), then up to C re-encoded survivors."""
        c0, c1 = caps
        ev = getattr(policy, "eviction", None)
        if self.compaction == "lazy" and ev is not None:
            c1 += _round_up(-(-ev.budget.capacity(total_cap) * quant.GROUP // self.need))
            if ev.bounded_prefill:  # the prefill buffer is compacted the same way
                c0 += _round_up(-(-ev.prefill_capacity(prompt_cap) * quant.GROUP // self.need))
        return _round_up(c0), _round_up(c1)

    def check(self, policy, cfg, gen) -> None:
        g, label = quant.GROUP, policy.label
        if self.bits not in quant.SUPPORTED_BITS:
            raise PolicyError(f"bits must be one of {quant.SUPPORTED_BITS}, got {self.bits}")
        if self.compaction not in COMPACTIONS:
            raise PolicyError(f"compaction must be one of {'|'.join(COMPACTIONS)}, got {self.compaction!r}")
        if not 0.0 < float(self.repack_below) <= 1.0:
            raise PolicyError(f"repack_below must be in (0, 1], got {self.repack_below}")
        if cfg.attention != "block_causal":
            raise PolicyError(f"{label} needs a block-causal family (its packed cache is the "
                              "block-causal core's; the bidirectional core keeps a float cache)")
        if cfg.head_dim % g:
            raise PolicyError(f"{label} needs head_dim to be a multiple of {g} (value groups "
                              f"of {g} channels), got {cfg.head_dim}")
        if self.residual is False and self.unaligned(gen):
            raise PolicyError(f"{label} with residual=False needs block_size and prefill_chunk to be "
                              f"multiples of {g}, got {', '.join(self.unaligned(gen))}; leave residual "
                              f"unset (or True) to keep the partial key group in bf16 (any size)")
        self._check_with_eviction(policy, gen)

    def _check_with_eviction(self, policy, gen) -> None:
        g = quant.GROUP
        ev = getattr(policy, "eviction", None)
        ragged = ev is not None and ev.allocation.ragged
        res = self.open_group(gen)
        why = ("residual=True" if self.residual else
               f"{', '.join(self.unaligned(gen))}: not multiples of {g}, so the bf16 open group (residual) is on")
        if ragged and (self.compaction == "lazy" or res):
            raise PolicyError("ragged per-lane budgets (layer_importance / head_alloc, whole key groups per "
                              "lane) need compaction='requantize' and no open group"
                              + (f" ({why}); use head_alloc='uniform' or block_size / prefill_chunk "
                                 f"multiples of {g}" if res else ""))
        if self.compaction != "lazy":
            return
        bad = [w for w, on in ((why, res), ("simulate=True", self.simulate)) if on]
        if bad:
            raise PolicyError(f"compaction='lazy' works on the packed cache without the open group; "
                              f"{' and '.join(bad)}")
        recent = ev.keeps.recent if ev is not None else 0
        if ev is not None and recent and ev.interval_blocks * gen.block_size < recent:
            raise PolicyError(f"compaction='lazy' leaves slots out of position order, so the recent "
                              f"window ({recent}) must be refilled by the interval_blocks * block_size "
                              f"= {ev.interval_blocks * gen.block_size} entries appended between evictions")


Storage = Union[Float, Packed]


def from_knobs(base: Storage, knobs: dict) -> Storage:
    """`base` with the storage knobs of a `make` call applied: `bits` moves a float policy onto
    the packed cache; the other knobs refine a packed one (on a float one they are an error)."""
    if not knobs:
        return base
    if isinstance(base, Float):
        if "bits" not in knobs:
            raise PolicyError(f"{', '.join(sorted(knobs))}: knobs of the packed cache; give bits=4 "
                              f"(or bits=2) to store this policy's KV in low bits")
        return Packed(**knobs)
    return dataclasses.replace(base, **knobs)
