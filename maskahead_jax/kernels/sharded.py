"""The Pallas kernels under a device mesh: each device runs them on its own shard.

A `pallas_call` is not partitioned by GSPMD, so under a mesh (`jax.set_mesh`, or an abstract
mesh while lowering for a TPU / GPU) the kernel calls go through `jax.shard_map` over the
library's mesh axes (axes.RULES): rows of the batch over "data", KV heads over "model" (each
device attends its own rows and heads, nothing to merge), and a float context split over "seq"
(each device runs pass 1 over its slice of the cache; the per-split softmax states (max, sum,
output) of every device are gathered and merged, flash-decoding across devices, and pass 2
gives each device the statistics of its own slice). A dimension the mesh axis does not divide
stays whole on every device. Kept whole along "seq" (gathered onto each device by shard_map):
packed contexts and statistics pooled by anything but the mean (their pooled centre needs every
key's statistics at once).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

from .. import axes
from .reference import ScoredStats


def active_mesh():
    """The mesh of the current trace (concrete or abstract) when it has more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names or math.prod(mesh.axis_sizes) <= 1:
        return None
    return mesh


def _axis(mesh, logical: str, dim: int) -> Optional[str]:
    ax = axes.RULES.get(logical)
    size = axes.mesh_sizes(mesh).get(ax, 1) if ax else 1
    return ax if size > 1 and dim % size == 0 else None


def run(call: Callable, q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, *, split_seq: bool):
    """`call(q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, seq_axis)` -> (out, stats or
    None), per shard under the current mesh (or once, without one). split_seq: the call may take
    its context split over "seq" (a float context, mean-pooled statistics)."""
    mesh = active_mesh()
    if mesh is None:
        return call(q, kc, vc, valid, k_blk, v_blk, blk_mask, stat_rows, None)
    b, h, s = valid.shape
    bx, hx = _axis(mesh, "batch", b), _axis(mesh, "kv_heads", h)
    sx = _axis(mesh, "cache_seq", s) if split_seq else None
    lead, ctx = P(bx, hx), P(bx, hx, sx)
    rows = P(bx)
    args = [q, kc, vc, valid, k_blk, v_blk, blk_mask]
    specs = [lead, jax.tree.map(lambda _: ctx if sx else lead, kc), None if vc is None else ctx,
             ctx, lead, lead, rows]
    if vc is None:
        args.pop(2), specs.pop(2)
    if stat_rows is not None:
        args.append(stat_rows), specs.append(rows)

    def shard(*a):
        a = list(a)
        if vc is None:
            a.insert(2, None)
        if stat_rows is None:
            a.append(None)
        return call(*a, sx)

    out_specs = (lead, None if stat_rows is None else ScoredStats(ctx, ctx))
    return jax.shard_map(shard, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs,
                         check_vma=False)(*args)
