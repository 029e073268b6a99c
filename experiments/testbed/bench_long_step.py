"""Seconds and peak memory of one real long training step per prefix-gradient mode (issue 53).

    python -m experiments.testbed.bench_long_step --model runs/stage40_step2402 --modes kv,full

A real long row (--real-long 8192:512, the long rows' flags of stages 39-41) trained from MODEL's
float32 weights: `none` (the prefix a cache without gradient, stages 37-39), `kv` (its keys /
values through their own layer's projections, stage 40), `full` (the whole prefix pass, stage 41).
Each mode runs in its own process (the peak resident memory is that process's) for --steps steps
on the same rows; one JSON line per mode, then one with the ratios to the first mode. Stop a
training run beside it first (kill -STOP), or the seconds are its leftovers.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_ROW_FLAGS = ("--pose-tail-blocks 24 --hard-keys 0.5 --real-long-task-weights 0.05,0.45,0.05,0.3,0.15 "
                  "--real-long-edge-depths 0.6 --real-long-most-distractors 0.5 --pose-target 32768 "
                  "--pose-prob 0.75 --pose-min-len 2048 --pose-chunks 3 --max-positions 33280 --edge-depths 0.3")


def one_mode(model: str, mode: str, length: int, tail: int, steps: int) -> dict:
    """Train `steps` long rows with prefix gradient `mode`; the first step (compilation) apart."""
    import jax.numpy as jnp

    import experiments.train_testbed as tt
    from experiments.testbed import real_long as RL
    from experiments.testbed.objective import make_optimizer
    from maskahead_jax import load_pretrained, tasks as T

    m = load_pretrained(model, dtype=jnp.float32, max_position_embeddings=33280)
    params = m.params
    args = tt.build_parser().parse_args(shlex.split(LONG_ROW_FLAGS) + ["--real-long", f"{length}:{tail}:3"])
    spec = RL.parse_real_long(args.real_long)
    tok = T.build_tokenizer()
    opt = make_optimizer(1e-5)
    state = opt.init(params)
    step = RL.make_long_step(m.config, opt, mode)
    secs = []
    for i in range(steps + 1):
        batch = RL.make_long_batch(3 * i + 2, 34, tok, args, spec)
        t = time.perf_counter()
        params, state, loss, _ = step(params, state, *batch)
        float(loss)
        secs.append(time.perf_counter() - t)
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return {"mode": mode, "length": length, "tail": tail, "first_step_s": round(secs[0], 1),
            "step_s": round(sum(secs[1:]) / steps, 2), "peak_rss_gb": round(rss_gb, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export folder (config.json, model.safetensors)")
    ap.add_argument("--modes", default="kv,full", help="comma list of none, kv, full")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one mode
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in ("none", "kv", "full")]
    if bad or a.steps < 1:
        raise SystemExit(f"bad --modes {a.modes!r} / --steps {a.steps}: modes from none, kv, full; steps >= 1")
    if a.one:
        print(json.dumps(one_mode(a.model, modes[0], a.length, a.tail, a.steps)))
        return 0
    rows = []
    for mode in modes:
        cmd = [sys.executable, "-m", "experiments.testbed.bench_long_step", "--one", "--model", a.model,
               "--modes", mode, "--length", str(a.length), "--tail", str(a.tail), "--steps", str(a.steps)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(json.dumps({"relative_to": base["mode"], **{
        r["mode"]: {"step_s": round(r["step_s"] / base["step_s"], 2),
                    "peak_rss_gb": round(r["peak_rss_gb"] / base["peak_rss_gb"], 2)} for r in rows[1:]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
