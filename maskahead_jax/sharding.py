"""Sharded inference with JAX SPMD: a named device mesh, logical-axis rules, param / cache shardings.

The mesh always has the three named axes ``("data", "seq", "model")`` (absent ones have size 1),
so every rule can name any of them; they are ``AxisType.Auto`` axes (GSPMD-style propagation
from the input shardings and a few ``with_sharding_constraint`` hints), which keeps the model
code free of sharding annotations. ``jax.make_mesh`` defaults to ``AxisType.Explicit`` since
JAX 0.9.0, so the axis types are always passed explicitly here.

Logical axes (MaxText / EasyDeL style): every param and cache dimension has a logical name
and ``RULES`` maps logical names to mesh axes:

    batch      -> data    prompts / cache rows (data parallel)
    heads      -> model   query heads of wq / wo / bq (tensor parallel)
    kv_heads   -> model   wk / wv / bk / bv and the cache's Hkv axis (tensor parallel)
    mlp        -> model   dense and shared-expert MLP width (tensor parallel)
    experts    -> model   MoE experts (expert parallel)
    cache_seq  -> seq     the cache's slot axis (long prompts)
    everything else (layers, embed, vocab, head_dim, router, expert_mlp) replicated.

A rule only applies when the mesh axis divides the dimension and has size > 1, and a mesh
axis is used at most once per array (first dimension wins); otherwise that dimension is
replicated (the divisibility fallback). Policies score and keep per (layer, batch, kv_head),
so with batch over ``data`` and kv heads over ``model`` scoring, top-k and compaction are local.

Use::

    mesh = make_mesh("data=2,model=4")
    out = generate(model, prompts, config, policy, mesh=mesh)   # places params / inputs itself

or place params once: ``params = shard_params(params, mesh, cfg)`` (or load them straight into
their shards with ``converters.load.load_model(path, mesh=mesh)``).
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .axes import CACHE_AXES, MESH_AXES, RULES, cache_spec, logical_to_spec, mesh_sizes
from .cache.slots import take_slots, top_k  # noqa: F401  (re-exported: the seq-sharded slot ops)
from .config import ModelConfig
from .model.init import param_shapes

# logical axes of each param leaf, by leaf name (and parent for the MLP weights)
_ATTN_AXES = {
    "attn_norm": ("layers", "embed"), "mlp_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"), "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"), "k_norm": ("layers", "head_dim"),
}
_MLP_AXES = {"gate": ("layers", "embed", "mlp"), "up": ("layers", "embed", "mlp"),
             "down": ("layers", "mlp", "embed")}
_EXPERT_AXES = {"gate": ("layers", "experts", "embed", "expert_mlp"),
                "up": ("layers", "experts", "embed", "expert_mlp"),
                "down": ("layers", "experts", "expert_mlp", "embed")}
_TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab")}
_MOE_AXES = {"router": ("layers", "embed", "router"), "router_bias": ("layers", "router")}

# ----------------------------------------------------------------------------- mesh
def parse_mesh(spec: Union[str, Mapping[str, int], None]) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "seq": 1, "model": 4} (all three axes, in mesh order).

    Accepts a mapping too. One size may be -1: it takes the devices left over
    (``jax.device_count()`` divided by the other sizes).
    """
    sizes: dict[str, int] = {}
    if spec is None or spec == "":
        items: Sequence[tuple[str, int]] = []
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        items = []
        for part in str(spec).replace(" ", "").split(","):
            if not part:
                continue
            m = re.fullmatch(r"([a-z_]+)[=:](-?\d+)", part)
            if not m:
                raise ValueError(f"bad mesh spec {spec!r}: expected 'data=2,model=4' (axes {MESH_AXES})")
            items.append((m.group(1), int(m.group(2))))
    for name, n in items:
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {spec!r}; axes are {MESH_AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
        if n == 0 or n < -1:
            raise ValueError(f"mesh axis {name}={n}: sizes must be positive (or -1 for the rest)")
        sizes[name] = int(n)
    if sum(1 for n in sizes.values() if n == -1) > 1:
        raise ValueError(f"at most one mesh axis may be -1 in {spec!r}")
    if -1 in sizes.values():
        known = math.prod(n for n in sizes.values() if n != -1)
        total = jax.device_count()
        if total % known:
            raise ValueError(f"{total} devices do not split over the mesh {spec!r}")
        sizes = {k: (total // known if n == -1 else n) for k, n in sizes.items()}
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(spec: Union[str, Mapping[str, int], None] = None, devices=None,
              axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A Mesh over axes ("data", "seq", "model") from a spec such as "data=2,model=4".

    Uses the first prod(sizes) devices (``jax.devices()``, all processes) unless `devices`
    is given. Axis types default to Auto (GSPMD propagation, what the generate engine expects).
    """
    sizes = parse_mesh(spec)
    shape = tuple(sizes[a] for a in MESH_AXES)
    devs = list(devices) if devices is not None else jax.devices()
    if math.prod(shape) > len(devs):
        raise ValueError(f"mesh {sizes} needs {math.prod(shape)} devices, only {len(devs)} available "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                         "importing jax)")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES),
                         devices=devs[:math.prod(shape)])


# ----------------------------------------------------------------------------- rules
def _axes_of(path: tuple, name: str) -> tuple:
    """Logical axes of the params leaf `name` under `path` (the decoder's pytree layout)."""
    parent = path[-1] if path else None
    table = (_TOP_AXES if not path else _EXPERT_AXES if parent == "experts" else
             _MLP_AXES if parent in ("mlp", "shared") else _MOE_AXES if parent == "moe"
             else _ATTN_AXES)
    return table[name]


def _map_leaves(tree, fn, path=()):
    """{name: fn(path, name, leaf)} over a nested dict of params leaves."""
    return {name: (_map_leaves(sub, fn, path + (name,)) if isinstance(sub, dict) else fn(path, name, sub))
            for name, sub in tree.items()}


def param_logical_axes(cfg: ModelConfig) -> dict:
    """The params pytree (as `param_shapes(cfg)`) with a tuple of logical axis names per leaf."""

    def leaf(path, name, shape):
        axes = _axes_of(path, name)
        if len(axes) != len(shape):
            raise ValueError(f"param {'/'.join(path + (name,))}: logical axes {axes} vs shape {shape}")
        return axes

    return _map_leaves(param_shapes(cfg), leaf)


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def param_specs(cfg: ModelConfig, mesh, rules: Mapping[str, Optional[str]] = RULES) -> dict:
    """PartitionSpec pytree matching `param_shapes(cfg)`."""
    shapes = param_shapes(cfg)
    axes = param_logical_axes(cfg)
    return jax.tree_util.tree_map(lambda s, a: logical_to_spec(a, s, mesh, rules), shapes, axes,
                                  is_leaf=_is_shape)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Mapping[str, Optional[str]] = RULES) -> dict:
    """NamedSharding pytree matching `param_shapes(cfg)` (the params pytree layout)."""
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), param_specs(cfg, mesh, rules),
                                  is_leaf=lambda x: isinstance(x, P))


def _put(x, sharding: NamedSharding):
    """Place one array with `sharding`; host arrays go straight into their shards (each device
    receives only its slice), which also works when the mesh spans several processes."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if x.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        if not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # global -> global reshard
        x = np.asarray(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_params(params, mesh: Mesh, cfg: Optional[ModelConfig] = None,
                 rules: Mapping[str, Optional[str]] = RULES):
    """Place a params pytree (host numpy or device arrays) with the rule shardings, leaf by leaf.

    `cfg` is optional: the logical axes are found from the params' own layout (shapes are
    whatever the params hold), so any params pytree of the decoder layout works.
    """
    specs = params_specs_like(params, mesh, rules) if cfg is None else param_specs(cfg, mesh, rules)
    return jax.tree_util.tree_map(lambda x, p: _put(x, NamedSharding(mesh, p)), params, specs,
                                  is_leaf=lambda x: isinstance(x, P))


def params_specs_like(params, mesh, rules: Mapping[str, Optional[str]] = RULES) -> dict:
    """PartitionSpecs for a params pytree of the decoder layout, from its leaves' shapes."""
    return _map_leaves(params, lambda path, name, leaf: logical_to_spec(
        _axes_of(path, name), np.shape(leaf), mesh, rules))


# ----------------------------------------------------------------------------- cache / inputs
def constrain_cache(cache, rules: Mapping[str, Optional[str]] = RULES):
    """Inside a traced function run under ``jax.set_mesh(mesh)``: pin every cache field to its
    rule sharding (batch over data, kv heads over model, slots over seq). Without a mesh in
    context (the unsharded path) this returns `cache` unchanged, so callers need no branch."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.axis_sizes) == 1:
        return cache

    def pin(a):
        if not isinstance(a, jax.Array) or a.ndim not in CACHE_AXES:
            return a
        return jax.lax.with_sharding_constraint(a, cache_spec(a.shape, mesh, rules))

    return jax.tree_util.tree_map(pin, cache)


def cache_shardings(cache, mesh: Mesh, rules: Mapping[str, Optional[str]] = RULES):
    """NamedSharding pytree for a cache pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map(lambda a: NamedSharding(mesh, cache_spec(a.shape, mesh, rules)), cache)


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: Mapping[str, Optional[str]] = RULES):
    """Rows over `data` (when it divides), everything else replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_shape(shape: Sequence[int], spec: P, mesh) -> tuple[int, ...]:
    """Per-device shape of an array of `shape` laid out by `spec` on `mesh` (Mesh or AbstractMesh)."""
    sizes = mesh_sizes(mesh)
    out = list(shape)
    for i, ax in enumerate(tuple(spec)):
        for a in ((ax,) if isinstance(ax, str) else (ax or ())):
            out[i] = -(-out[i] // sizes[a])
    return tuple(out)


def abstract_mesh(spec: Union[str, Mapping[str, int]]) -> "jax.sharding.AbstractMesh":
    """A device-free AbstractMesh with the same axes as `make_mesh(spec)` (for planning)."""
    sizes = parse_mesh(spec)
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                                     axis_types=(AxisType.Auto,) * len(MESH_AXES))


def kv_bytes_per_device(cfg: ModelConfig, batch: int, capacity: int, mesh, dtype=jnp.bfloat16,
                        rules: Mapping[str, Optional[str]] = RULES) -> dict:
    """Per-device and global bytes of a float KV cache (k, v, pos, valid, acc) of `capacity`
    slots under the rule shardings (from the shard shapes; `mesh` may be an AbstractMesh)."""
    L, h, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    fields = {"k": ((L, batch, h, capacity, d), dtype), "v": ((L, batch, h, capacity, d), dtype),
              "pos": ((L, batch, h, capacity), jnp.int32), "valid": ((L, batch, h, capacity), jnp.bool_),
              "acc": ((L, batch, h, capacity), jnp.float32)}
    per = glob = 0
    for shape, dt in fields.values():
        item = jnp.dtype(dt).itemsize
        per += math.prod(shard_shape(shape, cache_spec(shape, mesh, rules), mesh)) * item
        glob += math.prod(shape) * item
    return {"per_device": int(per), "global": int(glob), "shards": glob / max(per, 1)}


def array_bytes_per_device(tree) -> int:
    """Largest per-device byte count of a pytree of (possibly sharded) jax arrays, measured from
    the arrays' own shardings."""
    per: dict = {}
    for a in jax.tree_util.tree_leaves(tree):
        if isinstance(a, jax.Array):
            for sh in a.addressable_shards:
                per[sh.device] = per.get(sh.device, 0) + sh.data.nbytes
    return max(per.values(), default=0)


# ----------------------------------------------------------------------------- generate hooks
def prepare_generate(mesh: Mesh, cfg: ModelConfig, params, prompt: np.ndarray, plen: np.ndarray,
                     key, rules: Mapping[str, Optional[str]] = RULES):
    """Place what `generate` passes to its jitted core: params by the rules, prompt / lengths
    with rows over `data`, the PRNG key replicated. Returns (params, prompt, plen, key, ctx)
    where `ctx` is the context manager to run the core in (``jax.set_mesh(mesh)``)."""
    params = shard_params(params, mesh, cfg, rules)
    prompt = _put(np.asarray(prompt), batch_sharding(mesh, np.shape(prompt), rules))
    plen = _put(np.asarray(plen), batch_sharding(mesh, np.shape(plen), rules))
    key = _put(np.asarray(jax.random.key_data(key)) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
               else np.asarray(key), replicated(mesh))
    return params, prompt, plen, key, jax.set_mesh(mesh)


def fetch(tree):
    """Device results -> host numpy, gathering arrays that span several processes."""

    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree_util.tree_map(one, tree)


def sharded_context(mesh: Optional[Mesh]):
    """``jax.set_mesh(mesh)``, or a no-op context when mesh is None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def run_sharded(mesh, fn, params, prompt, plen, key, *, jit: bool = True, **static):
    """Run a generate core `fn(params, prompt, plen, key, **static)` on `mesh` (a Mesh or a spec
    string such as "data=2,model=4"): inputs placed by the rules, the core traced under
    ``jax.set_mesh`` (so `constrain_cache` pins the cache), results fetched to host numpy."""
    if isinstance(mesh, (str, Mapping)):
        mesh = make_mesh(mesh)
    cfg = static.get("cfg")
    params, prompt, plen, key, ctx = prepare_generate(mesh, cfg, params, prompt, plen, key)
    with ctx:
        if jit:
            res = fn(params, prompt, plen, key, **static)
        else:
            with jax.disable_jit():
                res = fn(params, prompt, plen, key, **static)
        res = jax.block_until_ready(res)
    return fetch(res)
