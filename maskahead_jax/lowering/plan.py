"""The per-device memory plan of a shape on 8 chips (`memory_plan`): params, the KV accounting
and buffers, XLA's buffer plan of CPU compiles, the fit per accelerator and the largest batch
found by compiling (`search_max_batches`); and its markdown tables (`plan_table`)."""
from __future__ import annotations

import json
import math
from typing import Optional, Sequence

from .cases import CAPACITY, OUT_LEN, abstract_mesh, abstract_params, build_policy, case_config, default_policies, \
    generation, mesh_sizes_of
from .compiles import compile_cases, load_compile_cache
from .kv import cache_buffers, kv_accounting

HARDWARE = {"v5e-8": 16, "v6e-8": 32, "h100x8": 80}  # HBM per chip, GiB (nominal)
PLAN_MESHES = {1: "seq=2,model=4"}  # batch 1: slots over seq (data=2 would replicate the row)
PLAN_MESH = "data=2,model=4"


def plan_mesh(batch: int) -> str:
    """The plan's mesh for a batch (PLAN_MESHES, else PLAN_MESH)."""
    return PLAN_MESHES.get(int(batch), PLAN_MESH)


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
    from ..sharding import kv_bytes_per_device

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

    from ..sharding import param_specs, shard_shape

    shapes = abstract_params(cfg)
    specs = param_specs(cfg, mesh)
    sizes = jax.tree_util.tree_map(lambda s, p: math.prod(shard_shape(s.shape, p, mesh)) * s.dtype.itemsize,
                                   shapes, specs)
    return int(sum(jax.tree_util.tree_leaves(sizes)))


def _even_down(x: float, d: int) -> int:
    """x rounded down to a multiple of d (whole data shards)."""
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


def _gib(v) -> str:
    """Bytes as GiB with 2 decimals for the tables ("-" for None)."""
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
