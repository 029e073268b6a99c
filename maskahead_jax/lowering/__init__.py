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

The package, one job per module (each re-exported here; a submodule imports its siblings, never
this __init__, so the import graph has no cycle):

    cases.py     targets, shapes and their run configs, meshes, abstract params and arguments,
                 policies, the jitted core (what every case is traced from)
    lower.py     lowering one case and counting its kernel calls (lower_case, describe)
    matrix.py    the matrix of cases, its summary lines and the known failures
    kv.py        the KV accounting and the static cache buffers (kv_accounting, cache_buffers)
    compiles.py  the plan's CPU compiles, in a child process, and their cache
    plan.py      the memory plan, the largest-batch search and the plan's tables
    __main__.py  `python -m maskahead_jax.lowering compile-worker` (the compiles' child process)

A name is looked up in the module that defines it: to monkeypatch one (e.g. `_core`), patch that
submodule (and the siblings that imported it by name), not this package.
"""
from __future__ import annotations

from ..config import GenerationConfig
from ..profile import SHAPES, shape_config
from .cases import (CAPACITY, DEFAULT_POLICIES, OUT_LEN, TARGETS, Target, abstract_args, abstract_mesh,
                    abstract_params, build_policy, case_config, default_policies, generation, mesh_label,
                    mesh_sizes_of, shape_names)
from .compiles import case_key, compile_cases, compile_memory, load_compile_cache, save_compile_cache
from .kv import cache_buffers, kv_accounting
from .lower import KERNEL_TARGET, count_kernels, describe, lower_case, lower_program
from .matrix import (lower_matrix, mark_known_failures, matrix_summary, read_known_failures, summary_line,
                     unexpected_failures)
from .plan import (HARDWARE, PLAN_MESH, PLAN_MESHES, _next_candidate, memory_plan, plan_mesh, plan_table,
                   search_max_batches)

__all__ = ["CAPACITY", "DEFAULT_POLICIES", "HARDWARE", "KERNEL_TARGET", "OUT_LEN", "PLAN_MESH", "PLAN_MESHES",
           "SHAPES", "TARGETS", "GenerationConfig", "Target", "abstract_args", "abstract_mesh", "abstract_params",
           "build_policy", "cache_buffers", "case_config", "case_key", "compile_cases", "compile_memory",
           "count_kernels", "default_policies", "describe", "generation", "kv_accounting", "load_compile_cache",
           "lower_case", "lower_matrix", "lower_program", "mark_known_failures", "matrix_summary", "memory_plan",
           "mesh_label", "mesh_sizes_of", "plan_mesh", "plan_table", "read_known_failures", "save_compile_cache",
           "search_max_batches", "shape_config", "shape_names", "summary_line", "unexpected_failures",
           "_next_candidate"]  # private, used by tests/test_lowering.py (the other private helpers: their submodules)
