"""On a device: the lowered programs compiled for real, and the kernels under a 1-device mesh.

Two checks of the device script (experiments/gpu_profile.sh, issue 52 item 6), one JSON line
per case on stdout:

  compile   every (shape, policy, prompt length) of `maskahead lower`'s matrix compiled on this
            machine's backend (lowering.compiles.compile_memory with attention="auto": the
            Pallas kernels on a GPU / TPU, bf16 abstract weights, nothing allocated or run):
            compile seconds and XLA's buffer plan (temp / argument / output bytes). CI only
            lowers them (`maskahead lower`); this is whether they compile.
  mesh      the testbed's generate under a 1-device mesh (the sharded entry point, kernels
            per shard: kernels/sharded.py) against the same run without a mesh: tokens equal.

    python experiments/device_compiles.py compile --shapes fast-dllm-v2-7b,llada-8b --prompt-lens 8192,32768
    python experiments/device_compiles.py mesh --policies dense,maskahead,q-maskahead
    (on a CPU both run with the reference attention: a smoke run, e.g. --layers 2)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def compile_rows(shapes, prompt_lens, policies, layers=None, out_len=128):
    """compile_memory of every case on this backend; a failure is a row with its error."""
    import jax

    from maskahead_jax.lowering.cases import default_policies
    from maskahead_jax.lowering.compiles import compile_memory
    from maskahead_jax.lowering.lower import describe

    attention = "auto" if jax.default_backend() in ("gpu", "tpu") else "reference"
    dtype = "bfloat16" if attention == "auto" else "float32"  # the CPU has no bf16 matmul
    for shape in shapes:
        for n in prompt_lens:
            for pol in policies or default_policies(shape):
                row = dict(check="compile", shape=shape, policy=pol, prompt_len=n, batch=1, layers=layers,
                           backend=jax.default_backend(), attention=attention)
                try:
                    row.update(compile_memory(shape, pol, n, 1, None, out_len=out_len, layers=layers,
                                              attention=attention, param_dtype=dtype))
                except Exception as e:  # noqa: BLE001  (every failure is a row)
                    row["error"] = describe(e)
                yield row


def mesh_rows(policies, new_tokens=32):
    """The testbed under a 1-device mesh vs no mesh, attention="auto", tokens compared."""
    import jax

    import maskahead_jax as mj
    from maskahead_jax.lowering.lower import describe
    from maskahead_jax.policies import make
    from maskahead_jax.sharding import make_mesh

    model = mj.load_pretrained(os.path.join(ROOT, "maskahead_jax", "testbed"))
    prompts = [[1] + list(range(10, 10 + n)) for n in (300, 170)]
    gc = mj.GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False, attention="auto")
    mesh = make_mesh("data=1")
    for name in policies:
        pol = None if name == "dense" else make(name, 10, capacity_floor=128)
        t0 = time.perf_counter()
        row = dict(check="mesh", policy=name, backend=jax.default_backend(), mesh="data=1")
        try:
            plain = mj.generate(model, prompts, gc, policy=pol).tokens
            meshed = mj.generate(model, prompts, gc, policy=pol, mesh=mesh).tokens
            row.update(equal=plain == meshed, seconds=round(time.perf_counter() - t0, 1))
        except Exception as e:  # noqa: BLE001  (every failure is a row)
            row["error"] = describe(e)
        yield row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=("compile", "mesh"))
    ap.add_argument("--shapes", default="fast-dllm-v2-7b,sdar-8b,llada-8b,llada2-mini")
    ap.add_argument("--prompt-lens", default="8192,32768")
    ap.add_argument("--policies", default="", help="comma list (compile: default = `maskahead lower`'s per shape)")
    ap.add_argument("--layers", type=int, default=0, help="compile: fewer layers (0: the shape's)")
    a = ap.parse_args(argv)
    pols = [p for p in a.policies.split(",") if p]
    if a.check == "compile":
        rows = compile_rows(a.shapes.split(","), [int(x) for x in a.prompt_lens.split(",")], pols, a.layers or None)
    else:
        rows = mesh_rows(pols or ["dense", "maskahead", "q-maskahead"])
    bad = 0
    for row in rows:
        bad += bool(row.get("error")) or row.get("equal") is False
        print(json.dumps(row), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
