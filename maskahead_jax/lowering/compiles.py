"""XLA's buffer plan of a case compiled for this CPU under a forced-device mesh
(`compile_memory`), run in a child process (`python -m maskahead_jax.lowering compile-worker`:
the forced devices must be set before JAX initialises) and cached per case (the plans are
deterministic, so a JSON-lines file of them is reused across runs)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Optional

from .cases import (CAPACITY, OUT_LEN, _core, abstract_args, build_policy, case_config, generation, mesh_label,
                    mesh_sizes_of)
from .lower import describe

def compile_memory(shape: str, policy, prompt_len: int, batch: int, mesh: str,
                   out_len: int = OUT_LEN, capacity: float = CAPACITY, layers: Optional[int] = None,
                   attention: str = "reference", param_dtype: str = "float32") -> dict:
    """XLA's per-device buffer plan of the generate core compiled for this machine's CPU under
    `mesh` (needs that many devices: forced host devices), jnp reference attention:
    {argument, output, temp} bytes (memory_analysis) and compile seconds. Abstract inputs: no
    weights are allocated, nothing runs. The weights are given as float32 (the KV cache stays
    bf16): XLA's CPU backend has no bf16 matmul, and with bf16 weights its temporaries are
    mostly float32 copies of them (the LM head's 2 GiB, twice, at the 7B shape), which a TPU or
    GPU program does not make; in exchange the activations are float32 here, where a device
    keeps some in bf16 (an upper estimate for those). policy: a label (build_policy, at
    `capacity`%) or a Policy (None: dense); layers: fewer than the shape's. On a device
    (experiments/device_compiles.py): attention="auto" (the kernels) and bf16 weights, the
    program `generate` compiles there."""
    import jax
    import jax.numpy as jnp

    from ..sharding import make_mesh

    cfg, _, _ = case_config(shape, prompt_len, out_len, layers)
    gen = generation(cfg, out_len, attention=attention)
    pol = build_policy(policy, cfg, gen, capacity) if isinstance(policy, str) else policy
    if pol is None:
        from ..policies import Dense

        pol = Dense()
    pol.check_run(cfg, gen)
    m = make_mesh(mesh_label(mesh) or "")
    args = abstract_args(cfg, gen, prompt_len, batch, m, param_dtype=param_dtype)
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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
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


def case_key(c: dict) -> str:
    """A case's key in the compile cache: JSON of every field its buffer plan depends on."""
    return json.dumps([c["shape"], c["policy"], c["prompt_len"], c["batch"], mesh_label(c["mesh"]),
                       c.get("out_len", OUT_LEN), c.get("capacity", CAPACITY)])


def load_compile_cache(path: str) -> dict:
    """{case_key: result} from a JSON-lines file of {"key", "result"} ({} when it does not exist)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {d["key"]: d["result"] for d in map(json.loads, filter(str.strip, f))}


def save_compile_cache(path: str, cache: dict) -> None:
    """Write `cache` as the JSON lines load_compile_cache reads."""
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
