"""The cases of the lowering matrix and the memory plan, as abstract inputs: the targets, the
model shapes and their run configs, meshes, abstract params and arguments, the policies and the
jitted generate core. Shared by lowering (lower.py) and the CPU compiles of the plan (compiles.py)
so both trace the very program `generate` runs, with no weights and no devices."""
from __future__ import annotations

import importlib
from typing import NamedTuple, Optional

from ..config import GenerationConfig
from ..profile import SHAPES, shape_config

CAPACITY = 10.0  # % budget of the evicting policies in the matrix and the plan
OUT_LEN = 256
DEFAULT_POLICIES = {"block_causal": ("dense", "maskahead", "q-maskahead[bits=4]", "q-maskahead[bits=2]"),
                    "bidirectional": ("dense", "maskkv")}


class Target(NamedTuple):
    """A lowering target named without a device: the platform to lower for and the abstract device
    the kernels read their chip from."""

    lowering: str  # lowering_platforms name
    device_kind: str  # the abstract device's kind (what the kernels read)
    num_cores: int
    platform: str  # the abstract device's platform (jax.default_backend()'s name on that device)


TARGETS = {"tpu": Target("tpu", "TPU v5 lite", 1, "tpu"),
           "cuda": Target("cuda", "NVIDIA H100 80GB HBM3", 132, "gpu")}


def shape_names(spec: str) -> list[str]:
    """"all" or comma-separated names of profile.SHAPES."""
    names = sorted(SHAPES) if spec.strip() == "all" else [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SHAPES]
    if bad:
        raise ValueError(f"unknown shape {bad[0]!r}; choose from {', '.join(sorted(SHAPES))} or all")
    return names


def case_config(shape: str, prompt_len: int, out_len: int = OUT_LEN, layers: Optional[int] = None):
    """(ModelConfig of the shape, positions the run needs, the shape's trained positions); the
    config's max_position_embeddings is raised to what the run needs when it is shorter.
    layers: fewer layers than the shape has (a smaller program, e.g. a memory measurement)."""
    cfg = shape_config(shape, layers)
    need = prompt_len + out_len + cfg.block_size
    trained = cfg.max_position_embeddings
    return cfg.replace(max_position_embeddings=max(trained, need)), need, trained


def mesh_sizes_of(spec: Optional[str]) -> dict:
    """{"data": d, "seq": s, "model": m} of a mesh spec ("none" / None / "" / "1": one device)."""
    from ..axes import MESH_AXES
    from ..sharding import parse_mesh

    if spec is None or str(spec).strip().lower() in ("", "none", "1"):
        return {a: 1 for a in MESH_AXES}
    if "-1" in str(spec):
        raise ValueError(f"mesh {spec!r}: give every axis size (no -1: there are no devices to count)")
    return parse_mesh(spec)


def mesh_label(spec: Optional[str]) -> Optional[str]:
    """"data=2,model=4" (the axes over 1), or None for one device."""
    sizes = mesh_sizes_of(spec)
    parts = [f"{a}={n}" for a, n in sizes.items() if n > 1]
    return ",".join(parts) or None


def abstract_mesh(spec: Optional[str], target: Optional[Target] = None):
    """A device-free AbstractMesh over ("data", "seq", "model") whose abstract device is the
    target's (None: no device named, e.g. a CPU compile's mesh)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from ..axes import MESH_AXES

    sizes = mesh_sizes_of(spec)
    dev = None if target is None else AbstractDevice(target.device_kind, target.num_cores, target.platform)
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES), abstract_device=dev)


def abstract_params(cfg, mesh=None, dtype="bfloat16"):
    """The params pytree as ShapeDtypeStructs (`jax.eval_shape` of init_params: no weights), with
    the rule shardings of `mesh` (a Mesh or AbstractMesh) when given."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from ..model.init import init_params
    from ..sharding import param_specs

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(dtype)))
    if mesh is None:
        return shapes
    specs = param_specs(cfg, mesh)
    return jax.tree_util.tree_map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)), shapes, specs)


def abstract_args(cfg, gen, prompt_len: int, batch: int, mesh, param_dtype="bfloat16"):
    """(params, prompt [B, Pb], lengths [B], PRNG key) as the core receives them from `generate`
    (prompt padded to its length bucket), abstract and laid out by the rules on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ..engine.generate import prompt_bucket
    from ..sharding import batch_sharding

    pb = prompt_bucket(prompt_len, max(64, gen.block_size))
    return (abstract_params(cfg, mesh, param_dtype),
            jax.ShapeDtypeStruct((batch, pb), jnp.int32, sharding=batch_sharding(mesh, (batch, pb))),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding(mesh, (batch,))),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())))


def build_policy(label: str, cfg, gen, capacity: float = CAPACITY):
    """A policy from "name" or "name[knob=value,...]" with `capacity`% where it takes a budget,
    validated against the shape (PolicyError when it does not apply)."""
    from ..evaluation.policies import make_policy, takes_budget, validate_policy
    from ..evaluation.presets import parse_variant

    name, kw = parse_variant(label)
    pol = make_policy(name, capacity if takes_budget(name) else None, **kw)
    validate_policy(pol, cfg, gen, label)
    return pol


def generation(cfg, out_len: int = OUT_LEN, attention: str = "auto"):
    """The resolved generation config of every case: out_len new tokens, no stop at EOS."""
    return GenerationConfig(max_new_tokens=out_len, stop_at_eos=False, attention=attention).resolve(cfg)


def _core(cfg):
    """The jitted core `generate` runs (engine/generate.py; its package re-exports the function
    `generate` under the module's name, hence importlib)."""
    return importlib.import_module("maskahead_jax.engine.generate")._core_fn(cfg, True).jitted


def default_policies(shape: str) -> tuple:
    """The shape's DEFAULT_POLICIES (by its attention: block-causal or bidirectional)."""
    return DEFAULT_POLICIES[shape_config(shape).attention]
