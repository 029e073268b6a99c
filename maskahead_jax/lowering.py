"""Ahead-of-time checks without an accelerator: every generate program lowered for TPU / CUDA at
the real model shapes, and the per-device memory plan of a 7B model on 8 chips.

Lowering (`lower_case`, `lower_matrix`; the command line is `maskahead lower`):

    maskahead lower --platform tpu,cuda --shape all --prompt-len 8192,32768 \\
        --mesh none --mesh data=2,model=4 --json

The jitted generate core (engine/generate.py, the program `generate` runs) is traced with
abstract parameters (`jax.eval_shape` of `init_params`: ShapeDtypeStruct leaves, no weights, so
a 7B program at 32k needs no memory proportional to its weights) and lowered with
`jit(...).trace(...).lower(lowering_platforms=(platform,))`. The target is named by JAX's own
device-free mechanism: an AbstractMesh whose abstract device is a TPU v5e or an H100
(`jax.sharding.use_abstract_mesh`). Under it the engine's attention="auto" resolves to that
platform's kernels (kernels/dispatch.target_backend: Pallas TPU; Mosaic GPU for float contexts
and Triton for packed ones on CUDA, as `generate` picks them on a GPU), the Pallas TPU kernels
read the chip generation from it, and a mesh of 8 needs no 8 devices. One JSON object per case:

    platform, shape, policy, mesh (null: one device), prompt_len, batch, out_len,
    lowered (bool), error (null or one line), skipped (null or why the policy does not apply to
    the shape), stablehlo_chars, kernel_calls (custom calls of the Pallas kernels in the
    StableHLO text: Mosaic TPU `tpu_custom_call`, Mosaic GPU, Triton), custom_calls (every
    custom-call target and its count), manual_regions (shard_map regions, `sdy.manual_computation`:
    on a mesh, kernels outside one are left to the partitioner, which cannot split a Mosaic TPU
    call and replicates the operands of a GPU one), positions (what the run needs) and trained_positions
    (the shape's own max_position_embeddings: a longer run is lowered with it raised, as a
    long-context run would be), seconds (trace + lower)

Shapes: profile.SHAPES (research/models.md). Policies: block-causal shapes dense, maskahead,
q-maskahead 4 and 2 bit; bidirectional ones (llada-8b) dense and maskkv; budgets 10%.

Memory plan (`memory_plan`; `maskahead lower --plan`; docs/sharding.md "Memory plan"): per
device on 8 chips, from the sharded abstract shapes: the bf16 parameters, the KV cache as the
engine accounts it (memory.row_bytes through the policy's held_bytes: dense-equivalent, peak and
end, `kv_accounting`), the policy's static cache buffers (its `plan` capacities, `empty_cache`
evaluated abstractly) and XLA's buffer plan of the whole program (`compiled.memory_analysis()`
of a CPU compile under the same mesh on forced host devices, in a child process: the jnp
reference attention and float32 weights, `compile_memory`). The fit and the largest batch per
accelerator follow from those numbers (the largest batch by compiling candidates,
`search_max_batches`; `plan_table`).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections import Counter
from typing import NamedTuple, Optional, Sequence

from .config import GenerationConfig
from .profile import SHAPES, shape_config

CAPACITY = 10.0  # % budget of the evicting policies in the matrix and the plan
OUT_LEN = 256
DEFAULT_POLICIES = {"block_causal": ("dense", "maskahead", "q-maskahead[bits=4]", "q-maskahead[bits=2]"),
                    "bidirectional": ("dense", "maskkv")}
# custom-call targets of the Pallas kernels (Mosaic TPU, Mosaic GPU, Triton)
KERNEL_TARGET = re.compile(r"tpu_custom_call|mosaic_gpu|triton")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")


class Target(NamedTuple):
    lowering: str  # lowering_platforms name
    device_kind: str  # the abstract device's kind (what the kernels read)
    num_cores: int
    platform: str  # the abstract device's platform (jax.default_backend()'s name on that device)


TARGETS = {"tpu": Target("tpu", "TPU v5 lite", 1, "tpu"),
           "cuda": Target("cuda", "NVIDIA H100 80GB HBM3", 132, "gpu")}


# ----------------------------------------------------------------------------- shapes and inputs
def shape_names(spec: str) -> list[str]:
    """"all" or comma-separated names of profile.SHAPES."""
    names = sorted(SHAPES) if spec.strip() == "all" else [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SHAPES]
    if bad:
        raise ValueError(f"unknown shape {bad[0]!r}; choose from {', '.join(sorted(SHAPES))} or all")
    return names


def case_config(shape: str, prompt_len: int, out_len: int = OUT_LEN):
    """(ModelConfig of the shape, positions the run needs, the shape's trained positions); the
    config's max_position_embeddings is raised to what the run needs when it is shorter."""
    cfg = shape_config(shape)
    need = prompt_len + out_len + cfg.block_size
    trained = cfg.max_position_embeddings
    return cfg.replace(max_position_embeddings=max(trained, need)), need, trained


def mesh_sizes_of(spec: Optional[str]) -> dict:
    """{"data": d, "seq": s, "model": m} of a mesh spec ("none" / None / "" / "1": one device)."""
    from .axes import MESH_AXES
    from .sharding import parse_mesh

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
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from .axes import MESH_AXES

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

    from .model.init import init_params
    from .sharding import param_specs

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

    from .engine.generate import prompt_bucket
    from .sharding import batch_sharding

    pb = prompt_bucket(prompt_len, max(64, gen.block_size))
    return (abstract_params(cfg, mesh, param_dtype),
            jax.ShapeDtypeStruct((batch, pb), jnp.int32, sharding=batch_sharding(mesh, (batch, pb))),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding(mesh, (batch,))),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())))


def build_policy(label: str, cfg, gen, capacity: float = CAPACITY):
    """A policy from "name" or "name[knob=value,...]" with `capacity`% where it takes a budget,
    validated against the shape (PolicyError when it does not apply)."""
    from .evaluation.policies import make_policy, takes_budget, validate_policy
    from .evaluation.presets import parse_variant

    name, kw = parse_variant(label)
    pol = make_policy(name, capacity if takes_budget(name) else None, **kw)
    validate_policy(pol, cfg, gen, label)
    return pol


def generation(cfg, out_len: int = OUT_LEN, attention: str = "auto"):
    """The resolved generation config of every case: out_len new tokens, no stop at EOS."""
    return GenerationConfig(max_new_tokens=out_len, stop_at_eos=False, attention=attention).resolve(cfg)


def _core(cfg):
    # the jitted core `generate` runs (engine/generate.py; its package re-exports the function
    # `generate` under the module's name, hence importlib)
    return importlib.import_module("maskahead_jax.engine.generate")._core_fn(cfg, True).jitted


def lower_program(cfg, gen, policy, prompt_len: int, batch: int, platform: str, mesh: Optional[str] = None):
    """The generate core lowered for `platform` ("tpu" / "cuda") on `mesh` (abstract): jax Lowered."""
    import jax
    import jax.numpy as jnp

    target = TARGETS[platform]
    am = abstract_mesh(mesh, target)
    args = abstract_args(cfg, gen, prompt_len, batch, am)
    with jax.sharding.use_abstract_mesh(am):
        traced = _core(cfg).trace(*args, cfg=cfg, gen=gen, policy=policy, cache_dtype=jnp.dtype(jnp.bfloat16))
        return traced.lower(lowering_platforms=(target.lowering,))


def count_kernels(text: str) -> tuple[int, dict]:
    """(custom calls of the Pallas kernels, {custom-call target: count}) in a StableHLO text."""
    calls = Counter(_CUSTOM_CALL.findall(text))
    return sum(n for t, n in calls.items() if KERNEL_TARGET.search(t)), dict(sorted(calls.items()))


def describe(e: BaseException) -> str:
    """One line: the exception's type and first line, and the deepest library frame it was traced
    or raised at (JAX keeps the trace-time stack of a lowering error in the cause chain)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    where, seen, x = None, set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        for fr in traceback.extract_tb(x.__traceback__):
            f = fr.filename.replace(os.sep, "/")
            if "/maskahead_jax/" in f and not f.endswith("/lowering.py"):
                where = f"{f.split('/maskahead_jax/')[-1]}:{fr.lineno}"
        x = x.__cause__ or x.__context__
    msg = f"{type(e).__name__}: {first[:400]}"
    return msg + (f" (at maskahead_jax/{where})" if where else "")


# ----------------------------------------------------------------------------- lowering
def lower_case(shape: str, platform: str, policy: str = "dense", prompt_len: int = 8192,
               mesh: Optional[str] = None, batch: Optional[int] = None, out_len: int = OUT_LEN,
               capacity: float = CAPACITY) -> dict:
    """Lower one case (module docstring); errors are reported in the row, never raised."""
    from .policies import PolicyError

    if platform not in TARGETS:
        raise ValueError(f"unknown platform {platform!r}; choose from {', '.join(TARGETS)}")
    sizes = mesh_sizes_of(mesh)
    batch = int(batch or sizes["data"])
    cfg, need, trained = case_config(shape, prompt_len, out_len)
    row = dict(platform=platform, shape=shape, policy=policy, mesh=mesh_label(mesh), prompt_len=int(prompt_len),
               batch=batch, out_len=int(out_len), lowered=False, error=None, skipped=None, stablehlo_chars=0,
               kernel_calls=0, custom_calls={}, manual_regions=0, positions=need, trained_positions=trained,
               seconds=0.0)
    gen = generation(cfg, out_len)
    try:
        pol = build_policy(policy, cfg, gen, capacity)
    except PolicyError as e:
        row["skipped"] = str(e).splitlines()[0]
        return row
    t0 = time.perf_counter()
    try:
        text = lower_program(cfg, gen, pol, prompt_len, batch, platform, mesh).as_text()
        n, calls = count_kernels(text)
        row.update(lowered=True, stablehlo_chars=len(text), kernel_calls=n, custom_calls=calls,
                   manual_regions=text.count("sdy.manual_computation"))
    except Exception as e:  # noqa: BLE001  (every failure is a row: the matrix goes on)
        row["error"] = describe(e)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def default_policies(shape: str) -> tuple:
    return DEFAULT_POLICIES[shape_config(shape).attention]


def lower_matrix(platforms: Sequence[str], shapes: Sequence[str], prompt_lens: Sequence[int],
                 policies: Optional[Sequence[str]] = None, meshes: Sequence[Optional[str]] = (None,),
                 batch: Optional[int] = None, out_len: int = OUT_LEN, capacity: float = CAPACITY,
                 log=None) -> list[dict]:
    """Every (platform, shape, prompt length, policy, mesh) case lowered (lower_case); policies
    None: each shape's DEFAULT_POLICIES."""
    rows = []
    for shape in shapes:
        for n in prompt_lens:
            for mesh in meshes:
                for pol in (policies or default_policies(shape)):
                    for plat in platforms:
                        row = lower_case(shape, plat, pol, n, mesh, batch, out_len, capacity)
                        rows.append(row)
                        if log is not None:
                            print(f"[lower] {summary_line(row)}", file=log, flush=True)
    return rows


def summary_line(r: dict) -> str:
    head = f"{r['platform']:4s} {r['shape']:15s} {r['policy']:20s} {r['mesh'] or '1 device':15s} {r['prompt_len']:6d}"
    if r["skipped"]:
        return f"{head}  skipped: {r['skipped']}"
    if r["lowered"]:
        return (f"{head}  lowered  {r['kernel_calls']:3d} kernel calls  {r['stablehlo_chars'] / 1e6:6.2f} M chars  "
                f"{r['seconds']:6.1f} s")
    return f"{head}  FAILED   {r['error']}"


def matrix_summary(rows: Sequence[dict]) -> str:
    ok = [r for r in rows if r["lowered"]]
    bad = [r for r in rows if not r["lowered"] and not r["skipped"]]
    skip = [r for r in rows if r["skipped"]]
    known = [r for r in bad if r.get("known_failure")]
    fixed = [r for r in ok if r.get("known_failure_fixed")]
    no_kernels = [r for r in ok if r["kernel_calls"] == 0]
    return (f"{len(ok)} of {len(rows) - len(skip)} cases lowered ({len(bad)} failed, {len(known)} of them known; "
            f"{len(skip)} skipped), {len(no_kernels)} lowered without a kernel call, "
            f"{sum(r['seconds'] for r in rows):.0f} s" + (f"; {len(fixed)} known failures now lower" if fixed else ""))


def read_known_failures(path: str) -> list[tuple]:
    """Lines "platform shape policy mesh  reason" (fnmatch patterns; mesh "none": one device;
    # comments) -> [(patterns, reason)]."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 4)
            if len(parts) < 5:
                raise ValueError(f"{path}:{i}: expected 'platform shape policy mesh reason', got {line!r}")
            out.append((tuple(parts[:4]), parts[4]))
    return out


def mark_known_failures(rows: Sequence[dict], known: Sequence[tuple]) -> None:
    """Set row["known_failure"] (the reason) on the failed rows a known-failure line matches, and
    row["known_failure_fixed"] on the lowered ones it matches (the line can go)."""
    from fnmatch import fnmatchcase

    for r in rows:
        key = (r["platform"], r["shape"], r["policy"], r["mesh"] or "none")
        for pats, why in known:
            if all(fnmatchcase(k, p) for k, p in zip(key, pats)):
                if r["lowered"]:
                    r["known_failure_fixed"] = why
                elif not r["skipped"]:
                    r["known_failure"] = why
                break


def unexpected_failures(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if not r["lowered"] and not r["skipped"] and not r.get("known_failure")]


# ----------------------------------------------------------------------------- KV accounting
def _bytes_per_token(policy, cfg, dtype="bfloat16") -> float:
    """The policy's cache format's bytes per token per (layer, KV head) (`cache.bytes_per_token`,
    read from a small concrete empty cache of the same format)."""
    import jax.numpy as jnp

    return float(policy.empty_cache(1, 1, 1, 64, cfg.head_dim, jnp.dtype(dtype), group_size=cfg.group_size).bytes_per_token)


def _for_run(policy, cfg, gen):
    """The policy as the block-causal core runs it (its automatic knobs fixed: Policy.for_run)."""
    return policy.for_run(cfg, gen) if cfg.attention != "bidirectional" and hasattr(policy, "for_run") else policy


def _schedule_kind(policy) -> str:
    """"dense" | "evict" (deferred evictions of a composed policy) | "maskkv"; NotImplementedError
    for the policies whose schedule the plan does not model."""
    from .policies import ComposedPolicy, Dense, MaskKV

    if type(policy) is Dense:
        return "dense"
    if isinstance(policy, MaskKV) and policy.voters == "mask" and not policy.block_causal:
        return "maskkv"
    if isinstance(policy, ComposedPolicy) and policy.draft_pass(None) is None \
            and getattr(policy, "compaction", "requantize") == "requantize" \
            and not getattr(policy, "residual", False):
        ev = policy.eviction
        if ev is None:
            return "dense"
        if ev.deferred and not ev.bounded_prefill and not ev.allocation.ragged:
            return "evict"
    raise NotImplementedError(f"the memory plan does not model {policy.name}'s schedule "
                              f"(dense, maskahead, q-maskahead and maskkv only)")


def kv_accounting(cfg, gen, policy, prompt_len: int, cache_dtype="bfloat16") -> dict:
    """Per-row KV bytes of one prompt of `prompt_len` tokens decoding gen.max_new_tokens (no EOS)
    as the engine accounts them (memory.row_bytes through policy.held_bytes): `dense` (bf16 of
    every token seen, at the end), `peak` (and its parts: `peak_prefill` in the prefill buffer,
    `peak_decode` in the decode buffer), `end`, and entries per lane at the end. Follows the
    engine's schedule: the block-aligned prompt prefix stored by prefill, deferred evictions to
    C(seen) at step 0 of a block (after the prompt and every interval_blocks blocks), each block
    appended whole; MaskKV: the prompt cut to its per-head budgets (an upper bound: head budgets
    clipped at the prompt length keep less), peak with one layer's whole prompt (layer by layer)
    or every layer's (online). tests/test_lowering.py checks it against generate's stats."""
    from .memory import EVICTION_STATE_BYTES

    policy = _for_run(policy, cfg, gen)
    kind = _schedule_kind(policy)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    bpt = _bytes_per_token(policy, cfg, cache_dtype)
    lanes = L * H
    bf16 = 4.0 * D  # memory.bf16_dense_bytes per token per lane
    p, bs = int(prompt_len), gen.block_size
    if cfg.attention == "bidirectional":
        full = p * lanes * bpt
        if kind == "dense":
            return dict(dense=p * lanes * bf16, peak=full, peak_prefill=full, peak_decode=full, end=full, entries=p)
        if kind != "maskkv":
            raise NotImplementedError(f"the memory plan does not model {policy.name} on a bidirectional model")
        kept = min(policy.per_head_budget(p), p)
        end = kept * lanes * bpt
        peak = end + p * H * bpt if policy.prompt_layerwise else max(end, full)
        return dict(dense=p * lanes * bf16, peak=peak, peak_prefill=peak, peak_decode=end, end=end, entries=kept)
    if kind == "maskkv":
        raise NotImplementedError("the memory plan does not model maskkv-blockcausal")
    state = EVICTION_STATE_BYTES if policy.keeps_state else 0.0
    held = lambda n: n * lanes * (bpt + state)  # noqa: E731  (compacted lanes: extent = kept)
    ev = policy.eviction if kind == "evict" else None
    cap = ev.budget.capacity if ev is not None else None
    length = seen = (p // bs) * bs
    peak_prefill, peak = held(length), 0.0
    due = ev is not None and length > cap(seen)
    nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
    blocks = max(1, min(nblk, math.ceil((p + gen.max_new_tokens - seen) / bs)))
    for j in range(blocks):
        if due:
            length = min(length, cap(seen))
        length, seen = length + bs, seen + bs
        peak = max(peak, held(length))
        due = (ev is not None and bool(ev.interval_blocks) and (j + 1) % ev.interval_blocks == 0
               and length > cap(seen) and j < blocks - 1)
    return dict(dense=seen * lanes * bf16, peak=max(peak_prefill, peak), peak_prefill=peak_prefill,
                peak_decode=peak, end=held(length), entries=length)


def cache_buffers(cfg, gen, policy, prompt_len: int, batch: int, mesh) -> dict:
    """Per-device bytes of the policy's static cache buffers ({"prefill": .., "decode": ..}): the
    capacities of its `plan` (block-causal) / the prompt buffer and MaskKV's buffer_size
    (bidirectional), `empty_cache` evaluated abstractly, laid out by the cache rules on `mesh`."""
    import jax
    import jax.numpy as jnp

    from .axes import cache_spec
    from .engine.generate import prompt_bucket
    from .sharding import shard_shape

    policy = _for_run(policy, cfg, gen)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    pb = prompt_bucket(prompt_len, max(64, gen.block_size))
    bs, chunk = gen.block_size, gen.prefill_chunk
    if cfg.attention == "bidirectional":
        cap1 = policy.buffer_size(pb, L, H) if _schedule_kind(policy) == "maskkv" else pb
        caps = dict(prefill=pb, decode=cap1)
    else:
        nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
        prompt_cap = max(1, math.ceil(pb / chunk)) * chunk
        total_cap = max(prompt_cap, pb + (nblk + 1) * bs)
        c0, c1 = policy.plan(prompt_cap, total_cap, bs, chunk)
        caps = dict(prefill=c0, decode=c1)

    def per_device(cap):
        tree = jax.eval_shape(lambda: policy.empty_cache(L, batch, H, cap, D, jnp.bfloat16, group_size=cfg.group_size))
        return sum(math.prod(shard_shape(a.shape, cache_spec(a.shape, mesh), mesh)) * a.dtype.itemsize
                   for a in jax.tree_util.tree_leaves(tree))

    return {k: int(per_device(c)) for k, c in caps.items()} | {f"{k}_slots": int(c) for k, c in caps.items()}


# ----------------------------------------------------------------------------- memory plan
HARDWARE = {"v5e-8": 16, "v6e-8": 32, "h100x8": 80}  # HBM per chip, GiB (nominal)
PLAN_MESHES = {1: "seq=2,model=4"}  # batch 1: slots over seq (data=2 would replicate the row)
PLAN_MESH = "data=2,model=4"


def plan_mesh(batch: int) -> str:
    return PLAN_MESHES.get(int(batch), PLAN_MESH)


def compile_memory(shape: str, policy: str, prompt_len: int, batch: int, mesh: str,
                   out_len: int = OUT_LEN, capacity: float = CAPACITY) -> dict:
    """XLA's per-device buffer plan of the generate core compiled for this machine's CPU under
    `mesh` (needs that many devices: forced host devices), jnp reference attention:
    {argument, output, temp} bytes (memory_analysis) and compile seconds. Abstract inputs: no
    weights are allocated, nothing runs. The weights are given as float32 (the KV cache stays
    bf16): XLA's CPU backend has no bf16 matmul, and with bf16 weights its temporaries are
    mostly float32 copies of them (the LM head's 2 GiB, twice, at the 7B shape), which a TPU or
    GPU program does not make; in exchange the activations are float32 here, where a device
    keeps some in bf16 (an upper estimate for those)."""
    import jax
    import jax.numpy as jnp

    from .sharding import make_mesh

    cfg, _, _ = case_config(shape, prompt_len, out_len)
    gen = generation(cfg, out_len, attention="reference")
    pol = build_policy(policy, cfg, gen, capacity)
    m = make_mesh(mesh_label(mesh) or "")
    args = abstract_args(cfg, gen, prompt_len, batch, m, param_dtype="float32")
    t0 = time.perf_counter()
    with jax.set_mesh(m):
        lowered = _core(cfg).trace(*args, cfg=cfg, gen=gen, policy=pol, cache_dtype=jnp.dtype(jnp.bfloat16)).lower()
    ma = lowered.compile().memory_analysis()
    out = dict(argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
               temp=int(ma.temp_size_in_bytes), alias=int(ma.alias_size_in_bytes),
               compile_s=round(time.perf_counter() - t0, 1))
    jax.clear_caches()
    return out


def _compile_in_subprocess(cases: list[dict], devices: int, log=None, on_result=None) -> list[dict]:
    """compile_memory of every case in one child process with `devices` forced CPU devices (they
    must be set before JAX initialises). Returns one dict per case (an `error` on failure)."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "maskahead_jax.lowering", "compile-worker"], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdin.write(json.dumps(cases))
    p.stdin.close()
    out = []
    for line in p.stdout:
        if line.startswith("{"):
            res = json.loads(line)
            out.append(res)
            if on_result is not None:
                on_result(cases[len(out) - 1], res)
            if log is not None:
                c = res["case"]
                what = (f"temp {res['temp'] / 2**30:.2f} GiB, compile {res['compile_s']} s" if "temp" in res
                        else res.get("error"))
                print(f"[plan] {c['shape']} {c['policy']} {c['prompt_len']} batch {c['batch']} {c['mesh']}: {what}",
                      file=log, flush=True)
    err = p.stderr.read()
    if p.wait() != 0 and len(out) < len(cases):
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
        raise RuntimeError(f"the compile worker stopped after {len(out)} of {len(cases)} cases: {tail}")
    return out


def _compile_worker() -> int:
    """`python -m maskahead_jax.lowering compile-worker`: cases (JSON list) on stdin, one JSON line
    per case on stdout."""
    for c in json.loads(sys.stdin.read()):
        try:
            res = compile_memory(c["shape"], c["policy"], c["prompt_len"], c["batch"], c["mesh"],
                                 c.get("out_len", OUT_LEN), c.get("capacity", CAPACITY))
        except Exception as e:  # noqa: BLE001
            res = dict(error=describe(e))
        print(json.dumps(dict(case=c, **res)), flush=True)
    return 0


def memory_plan(shape: str = "fast-dllm-v2-7b", prompt_lens: Sequence[int] = (8192, 32768, 131072),
                batches: Sequence[int] = (1, 8, 32), policies: Optional[Sequence[str]] = None,
                out_len: int = OUT_LEN, capacity: float = CAPACITY, compile_temps: bool = True,
                search_rounds: int = 4, cache: Optional[dict] = None, cache_file: Optional[str] = None,
                log=None) -> dict:
    """Per-device memory of every (prompt length, batch, policy) on an 8-chip mesh (plan_mesh):
    rows with params (bf16), kv_dense / kv_peak / kv_end (the engine's accounting, per device),
    kv_buffer_prefill / kv_buffer_decode (static buffers), xla_temp / xla_output (CPU compile,
    when compile_temps: `compile_memory`; the temporaries hold the cache, which lives inside the
    program) and need (= params + xla_output + xla_temp, else params + the larger KV buffer);
    then `fits`, and `max_batch` per accelerator (HARDWARE) found by compiling
    (`search_max_batches`, search_rounds rounds). cache: {case_key: compile result}, reused and
    filled; cache_file: a JSON-lines file of them (read, and appended as compiles finish)."""
    cache = {**(load_compile_cache(cache_file) if cache_file else {}), **(cache or {})}
    from .sharding import kv_bytes_per_device

    policies = list(policies or default_policies(shape))
    rows, cases = [], []
    for n in prompt_lens:
        cfg, need_pos, trained = case_config(shape, n, out_len)
        gen = generation(cfg, out_len)
        for b in batches:
            mesh = plan_mesh(b)
            am = abstract_mesh(mesh)
            params = _params_per_device(cfg, am)
            for label in policies:
                pol = build_policy(label, cfg, gen, capacity)
                acc = kv_accounting(cfg, gen, pol, n)
                buf = cache_buffers(cfg, gen, pol, n, b, am)
                # each buffer's share per device (the slot axis splits over seq only when it divides)
                s0, s1 = (kv_bytes_per_device(cfg, b, buf[f"{k}_slots"], am)["shards"] for k in ("prefill", "decode"))
                rows.append(dict(shape=shape, prompt_len=n, batch=b, policy=label, mesh=mesh, params=params,
                                 kv_dense=acc["dense"] * b / s0,
                                 kv_peak=max(acc["peak_prefill"] / s0, acc["peak_decode"] / s1) * b,
                                 kv_end=acc["end"] * b / s1, kv_entries_end=acc["entries"],
                                 kv_buffer_prefill=buf["prefill"], kv_buffer_decode=buf["decode"],
                                 positions=need_pos, trained_positions=trained))
                cases.append(dict(shape=shape, policy=label, prompt_len=n, batch=b, mesh=mesh, out_len=out_len,
                                  capacity=capacity))
    if compile_temps:
        for row, res in zip(rows, compile_cases(cases, cache, log, cache_file)):
            if "error" in res:
                row["xla_error"] = res["error"]
                continue
            row.update(xla_argument=res["argument"], xla_output=res["output"], xla_temp=res["temp"],
                       compile_s=res["compile_s"])
    for row in rows:
        row["need"] = row["params"] + (row["xla_output"] + row["xla_temp"] if "xla_temp" in row
                                       else max(row["kv_buffer_prefill"], row["kv_buffer_decode"]))
        row["fits"] = {hw: row["need"] <= gb * 2**30 for hw, gb in HARDWARE.items()}
    plan = dict(shape=shape, out_len=out_len, capacity_pct=capacity, hardware_gib=dict(HARDWARE),
                rows=rows, max_batch=[])
    if compile_temps and search_rounds:
        search_max_batches(plan, search_rounds, cache, log, cache_file)
    return plan


def _params_per_device(cfg, mesh) -> int:
    """Per-device bytes of the bf16 params under the rule shardings (from the shard shapes)."""
    import jax

    from .sharding import param_specs, shard_shape

    shapes = abstract_params(cfg)
    specs = param_specs(cfg, mesh)
    sizes = jax.tree_util.tree_map(lambda s, p: math.prod(shard_shape(s.shape, p, mesh)) * s.dtype.itemsize,
                                   shapes, specs)
    return int(sum(jax.tree_util.tree_leaves(sizes)))


def _even_down(x: float, d: int) -> int:
    return int(x // d * d)


def _next_candidate(pts: dict, hbm: float, d: int) -> Optional[int]:
    """The next batch to compile in the search for the largest that fits `hbm`, from the needs
    measured so far (pts {batch: need}), or None when the bracket is closed (or nothing fits)."""
    fit = [b for b, need in pts.items() if need <= hbm]
    if not fit:
        return None
    lo = max(fit)
    over = [b for b in pts if b > lo]
    if not over:  # extrapolate from the two largest batches
        (b1, n1), (b2, n2) = sorted(pts.items())[-2:]
        slope = (n2 - n1) / (b2 - b1)
        c = _even_down(b2 + (hbm - n2) / slope, d) if slope > 0 else None
        return c if c is not None and c > lo else None
    hi = min(over)
    if hi - lo <= max(d, lo // 20):  # within 5% (or one data shard)
        return None
    c = _even_down(lo + (hbm - pts[lo]) * (hi - lo) / (pts[hi] - pts[lo]), d)
    c = min(max(c, lo + d - lo % d), hi - d)  # whole data shards
    return c if lo < c < hi and c not in pts else None


def search_max_batches(plan: dict, rounds: int = 4, cache: Optional[dict] = None, log=None,
                       cache_file: Optional[str] = None) -> None:
    """The largest batch that fits each accelerator per (prompt length, policy), found by
    compiling: starting from the plan's rows, each round compiles one candidate per open search
    (linear interpolation between the largest batch that fits and the smallest that does not,
    extrapolation past the largest measured; mesh data=2,model=4, whole data shards) until the
    bracket is within 5%. plan["max_batch"]: per (prompt length, policy) and accelerator the
    largest batch measured to fit (0: none) and `{hw}_over`, the smallest measured that does not."""
    d = mesh_sizes_of(PLAN_MESH)["data"]
    order = list(dict.fromkeys(r["policy"] for r in plan["rows"]))
    keys = sorted({(r["prompt_len"], r["policy"]) for r in plan["rows"]}, key=lambda k: (k[0], order.index(k[1])))
    params = {r["prompt_len"]: r["params"] for r in plan["rows"]}
    pts = {k: {r["batch"]: r["need"] for r in plan["rows"] if (r["prompt_len"], r["policy"]) == k} for k in keys}
    for key, res in (cache or {}).items():  # batches compiled before (an earlier search): more points
        shape, pol, n, b, mesh, out_len, cap = json.loads(key)
        if (shape, mesh, out_len, cap) == (plan["shape"], PLAN_MESH, plan["out_len"], plan["capacity_pct"]) \
                and (n, pol) in pts and b not in pts[(n, pol)] and b % d == 0 and "temp" in res:
            pts[(n, pol)][b] = params[n] + res["output"] + res["temp"]
    for _ in range(rounds):
        todo = sorted({(k, c) for k in keys for gb in HARDWARE.values()
                       for c in [_next_candidate(pts[k], gb * 2**30, d)] if c is not None})
        if not todo:
            break
        cases = [dict(shape=plan["shape"], policy=pol, prompt_len=n, batch=b, mesh=PLAN_MESH, out_len=plan["out_len"],
                      capacity=plan["capacity_pct"]) for (n, pol), b in todo]
        for ((n, pol), b), res in zip(todo, compile_cases(cases, cache, log, cache_file)):
            if "temp" not in res:
                raise RuntimeError(f"compile of {pol} at {n} tokens, batch {b} failed: {res.get('error')}")
            pts[(n, pol)][b] = params[n] + res["output"] + res["temp"]
    plan["max_batch"] = []
    for n, pol in keys:
        rec = dict(prompt_len=n, policy=pol)
        for hw, gb in HARDWARE.items():
            fit = [b for b, need in pts[(n, pol)].items() if need <= gb * 2**30]
            rec[hw] = max(fit, default=0)
            rec[f"{hw}_over"] = min((b for b in pts[(n, pol)] if b > rec[hw]), default=None)
        rec["needs"] = {str(b): v for b, v in sorted(pts[(n, pol)].items())}
        plan["max_batch"].append(rec)


def case_key(c: dict) -> str:
    return json.dumps([c["shape"], c["policy"], c["prompt_len"], c["batch"], mesh_label(c["mesh"]),
                       c.get("out_len", OUT_LEN), c.get("capacity", CAPACITY)])


def load_compile_cache(path: str) -> dict:
    """{case_key: result} from a JSON-lines file of {"key", "result"} ({} when it does not exist)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {d["key"]: d["result"] for d in map(json.loads, filter(str.strip, f))}


def save_compile_cache(path: str, cache: dict) -> None:
    with open(path, "w") as f:
        for k, v in cache.items():
            f.write(json.dumps(dict(key=k, result=v)) + "\n")


def compile_cases(cases: list[dict], cache: Optional[dict] = None, log=None, cache_file: Optional[str] = None) -> list[dict]:
    """compile_memory of each case (in a child process with enough forced devices), reusing and
    filling `cache` ({case_key: result}: the buffer plans are deterministic); each new result is
    also appended to `cache_file` as it arrives."""
    cache = {} if cache is None else cache
    todo = [c for c in cases if case_key(c) not in cache]
    failed = {}
    if todo:
        devices = max(math.prod(mesh_sizes_of(c["mesh"]).values()) for c in todo)

        def keep(c, res):
            res = {k: v for k, v in res.items() if k != "case"}
            if "temp" not in res:
                failed[case_key(c)] = res
                return
            cache[case_key(c)] = res
            if cache_file:
                with open(cache_file, "a") as f:
                    f.write(json.dumps(dict(key=case_key(c), result=res)) + "\n")

        _compile_in_subprocess(todo, devices, log, on_result=keep)
    return [cache.get(case_key(c)) or failed.get(case_key(c), {"error": "not compiled"}) for c in cases]


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def plan_table(plan: dict) -> str:
    """The plan as two markdown tables: per device per case, and the largest batch per policy."""
    hws = list(plan["hardware_gib"])
    head = ["prompt", "batch", "mesh", "policy", "params", "KV dense", "KV peak", "KV end", "KV buffers (prefill / decode)",
            "XLA temp", "need"] + [f"fits {hw}" for hw in hws]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in plan["rows"]:
        cells = [f"{r['prompt_len'] // 1024}k", str(r["batch"]), r["mesh"], r["policy"], _gib(r["params"]),
                 _gib(r["kv_dense"]), _gib(r["kv_peak"]), _gib(r["kv_end"]),
                 f"{_gib(r['kv_buffer_prefill'])} / {_gib(r['kv_buffer_decode'])}",
                 _gib(r.get("xla_temp")) if "xla_error" not in r else "error", _gib(r["need"])]
        cells += ["yes" if r["fits"][hw] else "no" for hw in hws]
        lines.append("| " + " | ".join(cells) + " |")
    if not plan["max_batch"]:
        return "\n".join(lines)
    lines += ["", "| prompt | policy | " + " | ".join(f"max batch {hw} ({plan['hardware_gib'][hw]} GiB)" for hw in hws)
              + " |", "|---|---|" + "---|" * len(hws)]

    def cell(m, hw):
        over = m.get(f"{hw}_over")
        return f"{m[hw]}" + (f" (not {over})" if over is not None else "")

    for m in plan["max_batch"]:
        lines.append(f"| {m['prompt_len'] // 1024}k | {m['policy']} | " + " | ".join(cell(m, hw) for hw in hws) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # the plan's compile worker (memory_plan runs it in a child process)
    if sys.argv[1:] == ["compile-worker"]:
        sys.exit(_compile_worker())
    sys.exit("usage: python -m maskahead_jax.lowering compile-worker  (or: maskahead lower ...)")
