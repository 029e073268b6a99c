"""Logical axis names and the rules that map them onto mesh axes (maxtext-style).

Low level on purpose: the cache's slot operations and the sharding runtime both read these,
and neither depends on the other. `logical_to_spec` turns logical names into a PartitionSpec.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "seq", "model")  # outermost .. innermost (model: the most traffic)

RULES: Mapping[str, Optional[str]] = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": "model",
    "cache_seq": "seq",
    "layers": None,
    "embed": None,
    "vocab": None,
    "head_dim": None,
    "router": None,
    "expert_mlp": None,
}

# cache fields (maskahead_jax.cache's caches): rank -> logical axes
CACHE_AXES = {
    5: ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),  # k, v [L, B, Hkv, N, D]
    4: ("layers", "batch", "kv_heads", "cache_seq"),  # pos, valid, acc [L, B, Hkv, N]
    1: ("batch",),  # length, seen [B]
}


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis name -> size, for a Mesh or an AbstractMesh."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def logical_to_spec(logical: Sequence[Optional[str]], shape: Sequence[int], mesh,
                    rules: Mapping[str, Optional[str]] = RULES) -> P:
    """PartitionSpec for an array of `shape` with logical axis names, under `rules`.

    A dimension is sharded only if its mesh axis exists, has size > 1, divides the dimension
    and is not already used by an earlier dimension; otherwise it is replicated.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {tuple(shape)}")
    sizes = mesh_sizes(mesh)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        ax = rules.get(name) if name is not None else None
        if ax is None or sizes.get(ax, 1) <= 1 or dim % sizes[ax] or ax in used:
            out.append(None)
        else:
            used.add(ax)
            out.append(ax)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def cache_spec(shape: Sequence[int], mesh, rules: Mapping[str, Optional[str]] = RULES) -> P:
    """PartitionSpec of one cache field (by rank: [L,B,Hkv,N,D], [L,B,Hkv,N] or [B])."""
    axes = CACHE_AXES.get(len(shape))
    if axes is None:
        return P()
    return logical_to_spec(axes, shape, mesh, rules)
