"""Long prompts on this CPU: memory and time of the engine at 2k-32k tokens, side by side.

Each case (model, policy, prompt length) runs in its own process, so that the peak resident
memory (`ru_maxrss`) is that case's alone; the parent collects one JSON line per case, fits the
growth exponent of each column between lengths (log-log slope), and writes everything as one
JSON (--out) plus a markdown table on stdout.

Per case (random prompt tokens, fixed output of --out-len tokens, stop at EOS off), by --measure
(memory: the first six fields and e2e_s; decode: prefill_s and the decode fields):
  rss_gb           peak resident memory of the process (model, compile and run included)
  rss_base_gb      resident memory after loading the model, before compiling
  xla_temp_gb      XLA's temporary buffers of the whole generate program (memory_analysis)
  prefill_s        the prefill program alone (builds the cache: time to the first block), its
                   second run (the first, untimed, pays the buffers' first touch)
  e2e_s            the whole program (prefill + decoding --out-len tokens), compiled beforehand, its
                   second run
  decode_s         the decode alone: a program that starts from the prefill program's state
                   (engine.generate.lower(phase="decode")), its second run; decode_s_per_block
                   over the blocks decoded, decode_tok_s = out_len / decode_s
  steady_s_per_block  (--measure steady) the decode per block after the first: the decode
                   program at --out-len and at --steady-from new tokens (each from its own
                   prefill), (decode_s - decode_s_short) / (blocks - blocks_short). The first
                   block's step 0 reads the whole prompt and its eviction ranks it (O(T) once);
                   the blocks after it read the kept budget only
  kv_peak_mb, kv_end_mb   the engine's KV accounting (stats of generate)
  forwards         forwards of the whole run

  (--table shape) xla_temp_gb of a real model's shape compiled for this CPU (abstract weights:
  nothing allocated or run; kv_dense_gb: a bf16 cache of the whole prompt)

Tables (--table):
  memory     the block-causal testbed (dense, maskahead, q-maskahead) and the bidirectional twin
             (dense, maskkv-online, maskkv = layer by layer) at --lengths
  throughput the twin with LLaDA's fixed schedule (commit_rule llada, 2 tokens per step) with no
             cache (prompt_refresh=1: every step recomputes the whole sequence), the prompt cache,
             and MaskKV at 256 pairs per head: decoded tokens per second and the ratios
  shape      --shape (default LLaDA-8B), batch 1: dense, maskkv-online, maskkv layer by layer
  all        every registered policy that applies to the family (the testbed: block-causal ones;
             the twin: the prompt compressors), dense included (q-maskahead-draft without its
             drafting pass: lower() runs the core alone)

  python experiments/bench_long_context.py --table memory --lengths 2048,4096,8192,16384,32768 \
      --out docs/long_context/memory.json
  python experiments/bench_long_context.py --table throughput --lengths 1024,4096,8192,16384,32768 \
      --derive-from 16384 --out docs/long_context/throughput.json
  python experiments/bench_long_context.py --table memory --measure decode --pct 1 \
      --only testbed:dense,testbed:maskahead,testbed:q-maskahead --out docs/long_context/decode.json
      (decode per block: --pct 1 is the floor's 512 entries at every length, a budget flat in T)
  python experiments/bench_long_context.py --table shape --shape llada-8b --lengths 8192,16384,32768 \
      --out docs/long_context/shape_llada8b.json
      (MaskKV's memory claim where the KV dominates: LLaDA-8B's shape compiled, not run)
  python experiments/bench_long_context.py --table memory --measure steady --pct 1 --schedule llada \
      --out-len 576 --steady-from 64 --decode-repeats 7 --lengths 2048,32768 \
      --only testbed:maskahead,testbed:q-maskahead --out docs/long_context/steady.json
      (the steady state: is an evicting policy's decode per block flat in the prompt length?)
  python experiments/bench_long_context.py --table all --once --lengths 32768 --out docs/long_context/all_32k.json
      (every policy at 32k: peak RSS and XLA temporaries)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"testbed": os.path.join(ROOT, "maskahead_jax", "testbed"),
          "twin": os.path.join(ROOT, "maskahead_jax", "testbed_bidir")}
TABLES = {
    "memory": [("testbed", "dense", {}), ("testbed", "maskahead", {}), ("testbed", "q-maskahead", {}),
               ("twin", "dense", {}), ("twin", "maskkv-online", {}), ("twin", "maskkv", {})],
    # LLaDA's own schedule, no cache: every step a full forward of [prompt | response]
    "throughput": [("twin", "dense", {"prompt_refresh": 1}), ("twin", "dense", {}),
                   ("twin", "maskkv", {})],
    # every registered policy that runs on the family (dense included), --once at 32k: do they all run?
    "all": [("testbed", p, {}) for p in (
        "dense", "maskahead", "maskahead-bounded", "maskahead-qa", "q-maskahead", "q-maskahead-qa",
        "q-maskahead-draft", "dapq", "snapkv", "h2o", "caote", "ea", "streaming", "streaming-bounded",
        "maskkv-blockcausal")] + [("twin", p, {}) for p in (
        "dense", "maskkv", "maskkv-online", "snapkv", "pyramidkv", "adakv")],
    # a real bidirectional model's shape (--shape), compiled, not run: where the KV dominates
    "shape": [("shape", "dense", {}), ("shape", "maskkv-online", {}), ("shape", "maskkv", {})],
}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def _takes_pct(policy: str) -> bool:
    """Whether --pct is the case's budget: the block-causal evicting policies (MaskKV has 256 per head)."""
    return policy != "dense" and not policy.startswith("maskkv")


def _timed(fn, args, repeats: int = 1, warm: bool = True):
    """(result, the median seconds of `repeats` runs after a first, untimed one: the first run of
    a program pays its buffers' first touch; warm=False: no untimed run)."""
    import jax

    if warm:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[len(times) // 2]


def _policy(policy: str, pct: float):
    """The case's policy: None (dense), MaskKV at 256 pairs per head, or `policy` at pct%."""
    from maskahead_jax.policies import make

    if policy == "dense":
        return None
    if policy.startswith("maskkv"):
        return make(policy, None, budget_per_head=256, budget_pct=None)
    return make(policy, pct)


def compile_case(shape: str, policy: str, n: int, out_len: int, pct: float, layers: int = 0) -> dict:
    """A real model's shape (profile.SHAPES, random abstract weights: nothing is allocated or
    run), batch 1: XLA's buffer plan of the whole generate program compiled for this CPU
    (lowering.compiles.compile_memory: float32 weights, bf16 cache, jnp attention). The
    temporaries hold the KV cache (it lives inside the program) and the activations, which is
    what MaskKV's layer-by-layer pass cuts; kv_dense_gb is a bf16 cache of the whole prompt."""
    import jax

    from maskahead_jax.lowering.cases import case_config
    from maskahead_jax.lowering.compiles import compile_memory

    mem = compile_memory(shape, _policy(policy, pct), n, 1, None, out_len=out_len, layers=layers or None)
    cfg = case_config(shape, n, out_len, layers=layers or None)[0]
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * n * 2
    return dict(model=shape, policy=policy, gen={}, prompt_len=n, out_len=out_len, measure="compile",
                layers=cfg.num_layers, xla_temp_gb=mem["temp"] / 2 ** 30, xla_args_gb=mem["argument"] / 2 ** 30,
                compile_s=mem["compile_s"], kv_dense_gb=kv / 2 ** 30, jax=jax.__version__)


def run_case(model_name: str, policy: str, n: int, out_len: int, gen_kw: dict, pct: float,
             schedule: str, measure: str = "memory", decode_repeats: int = 1, warm: bool = True,
             steady_from: int = 64) -> dict:
    """One case in this process (see the module docstring for the fields). measure: "memory"
    (prefill, then the whole program: peak RSS, XLA's buffers, time to first token, end to end),
    "decode" (prefill, then the decode program from its state: decode time; the RSS then holds
    that state twice, not a memory figure), "steady" (the decode program at --steady-from and at
    --out-len new tokens, each from its own prefill: the blocks after the first, whose step 0
    reads the whole prompt and whose eviction ranks it, cost the difference), "prefill" (the prefill program alone: the no-cache
    schedule at lengths where every step's full forward would take hours; the parent derives
    its decode time)."""
    import jax
    import numpy as np

    import maskahead_jax as mj
    from maskahead_jax.engine.generate import lower

    model = mj.load_pretrained(MODELS[model_name], max_position_embeddings=n + out_len + 512)
    cfg = model.config
    rng = np.random.RandomState(0)
    prompt = [1] + rng.randint(5, cfg.vocab_size - 10, size=n - 1).tolist()
    kw = dict(max_new_tokens=out_len, stop_at_eos=False, max_prompt_len=n + 64, **gen_kw)
    if schedule == "llada":  # a fixed number of tokens per step (LLaDA's schedule): 2 per step
        kw.update(commit_rule="llada", steps_per_block=cfg.block_size // 2)
    gen = mj.GenerationConfig(**kw)
    evicting = _takes_pct(policy)
    pol = _policy(policy, pct)
    row = dict(model=model_name, policy=policy, gen=gen_kw, schedule=schedule, prompt_len=n, out_len=out_len,
               pct=pct if evicting else None, measure=measure, warm=warm, rss_base_gb=_rss_gb())
    pre, args = lower(model, [prompt], gen, pol, phase="prefill")
    pre = pre.compile()
    out, row["prefill_s"] = _timed(pre, args, warm=warm)
    if measure == "prefill":
        mem = pre.memory_analysis()
        return dict(row, rss_gb=_rss_gb(), xla_temp_gb=getattr(mem, "temp_size_in_bytes", 0) / 2 ** 30,
                    jax=jax.__version__, cpus=os.cpu_count())
    if measure == "decode":  # the rest of the run from the prefill's state
        dec, dargs = lower(model, [prompt], gen, pol, phase="decode", prefilled=out["state"])
        res, decode_s = _timed(dec.compile(), dargs, decode_repeats)
        res = jax.tree_util.tree_map(np.asarray, res)
        blocks = max(1, int(res["blocks"]))
        row.update(decode_s=decode_s, decode_repeats=decode_repeats, blocks=blocks, decode_s_per_block=decode_s / blocks,
                   decode_tok_s=out_len / decode_s)
    elif measure == "steady":  # the blocks after the first: two decode lengths, the difference
        del out
        short = mj.GenerationConfig(**dict(kw, max_new_tokens=steady_from))
        times, blocks = {}, {}
        for name, g in (("short", short), ("long", gen)):
            p, pargs = lower(model, [prompt], g, pol, phase="prefill")
            state = p.compile()(*pargs)["state"]
            dec, dargs = lower(model, [prompt], g, pol, phase="decode", prefilled=state)
            res, times[name] = _timed(dec.compile(), dargs, decode_repeats)
            res = jax.tree_util.tree_map(np.asarray, res)
            blocks[name] = int(res["blocks"])
            del state, dargs
        if blocks["long"] <= blocks["short"]:
            raise ValueError(f"--out-len {out_len} decodes no more blocks than --steady-from {steady_from}")
        row.update(decode_s_short=times["short"], decode_s=times["long"], blocks_short=blocks["short"],
                   blocks=blocks["long"], decode_repeats=decode_repeats, steady_from=steady_from,
                   decode_s_per_block=times["long"] / blocks["long"],
                   steady_s_per_block=(times["long"] - times["short"]) / (blocks["long"] - blocks["short"]))
    else:
        del out
        t0 = time.perf_counter()
        full = lower(model, [prompt], gen, pol)[0].compile()
        row["compile_s"] = time.perf_counter() - t0
        mem = full.memory_analysis()
        res, row["e2e_s"] = _timed(full, args, warm=warm)
        res = jax.tree_util.tree_map(np.asarray, res)
        row.update(rss_gb=_rss_gb(), xla_temp_gb=getattr(mem, "temp_size_in_bytes", 0) / 2 ** 30,
                   xla_args_gb=getattr(mem, "argument_size_in_bytes", 0) / 2 ** 30)
    return dict(row, kv_peak_mb=float(np.max(res["kv_peak"])) / 2 ** 20,
                kv_end_mb=float(np.max(res["kv_bytes"])) / 2 ** 20,
                forwards=int(res["nfe_batch"]), jax=jax.__version__, cpus=os.cpu_count())


def slope(rows: list, key: str, lo: int, hi: int):
    """Growth exponent of `key` between prompt lengths lo and hi (log-log), or None."""
    a = {r["prompt_len"]: r.get(key) for r in rows}
    if not a.get(lo) or not a.get(hi):
        return None
    return math.log(a[hi] / a[lo]) / math.log(hi / lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=sorted(TABLES), default="memory")
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--pct", type=float, default=10.0, help="budget of the block-causal evicting policies")
    ap.add_argument("--only", default="", help="comma list of model:policy to run (default: the whole table)")
    ap.add_argument("--out", default=None, help="JSON file; cases already in it are kept (resume)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, JSON: the child process
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per case")
    ap.add_argument("--measure", choices=("memory", "decode", "steady"), default=None,
                    help="memory: prefill + the whole program (peak RSS, XLA buffers, TTFT, end to end; the "
                         "memory table's default); decode: prefill + the decode program (the throughput "
                         "table's default); steady: the decode per block after the first (--steady-from)")
    ap.add_argument("--steady-from", type=int, default=64,
                    help="--measure steady: the shorter run's new tokens; steady_s_per_block = (decode at --out-len - "
                         "decode at this) / (their blocks' difference)")
    ap.add_argument("--decode-repeats", type=int, default=1, help="--measure decode: the median of this many runs")
    ap.add_argument("--schedule", choices=("model", "llada"), default=None,
                    help="model: the model's commit rule (the memory table's default); llada: a fixed 2 tokens per "
                         "step (the throughput table's), the same forwards at every length")
    ap.add_argument("--once", action="store_true",
                    help="run each program once (no untimed first run): memory only, e.g. beside other jobs; "
                         "its times include the buffers' first touch (rows say warm: false)")
    ap.add_argument("--derive-from", type=int, default=0,
                    help="throughput table: from this prompt length on, the no-cache schedule "
                         "(prompt_refresh=1) runs its full forward once and its decode time is derived: "
                         "(forwards - 1) x that forward x the longest measured run's decode / ((forwards - 1) "
                         "x its prefill) (the schedule is fixed); such rows say derived: true")
    ap.add_argument("--shape", default="llada-8b", help="--table shape: the model shape (profile.SHAPES)")
    ap.add_argument("--layers", type=int, default=0, help="--table shape: fewer layers than the shape's (0: all)")
    a = ap.parse_args(argv)
    if a.case:
        c = json.loads(a.case)
        if c.pop("compile", False):
            c.pop("measure")
            row = compile_case(**c)
        else:
            row = run_case(**c)
        print("CASE " + json.dumps(row), flush=True)
        return 0
    lengths = [int(x) for x in a.lengths.split(",")]
    schedule = a.schedule or ("llada" if a.table == "throughput" else "model")
    measure = a.measure or {"throughput": "decode", "shape": "compile"}.get(a.table, "memory")
    done = []
    if a.out and os.path.exists(a.out):
        done = json.load(open(a.out)).get("cases", [])
    key = lambda r: (r["model"], r["policy"], json.dumps(r["gen"], sort_keys=True), r["prompt_len"],
                     r.get("measure", "memory"), r.get("pct"), r.get("out_len", 64),
                     r.get("decode_repeats", 1), r.get("schedule", "model"), r.get("steady_from"))
    have = {key(r) for r in done}
    only = set(filter(None, a.only.split(",")))
    for model_name, policy, gen_kw in TABLES[a.table]:
        if only and f"{model_name}:{policy}" not in only:
            continue
        if model_name == "shape":
            model_name = a.shape
        for n in lengths:
            if measure == "compile":  # compile_case in the child
                c = dict(compile=True, shape=model_name, policy=policy, n=n, out_len=a.out_len, pct=a.pct,
                         layers=a.layers, measure="compile")
            else:
                c = dict(model_name=model_name, policy=policy, n=n, out_len=a.out_len, gen_kw=gen_kw, pct=a.pct,
                         schedule=schedule,
                         measure="prefill" if (a.derive_from and n >= a.derive_from
                                               and gen_kw.get("prompt_refresh") == 1) else measure,
                         decode_repeats=a.decode_repeats, warm=not a.once,
                         **(dict(steady_from=a.steady_from) if measure == "steady" else {}))
            evicting = _takes_pct(policy)
            if (model_name, policy, json.dumps(gen_kw, sort_keys=True), n, c["measure"],
                    a.pct if evicting else None, a.out_len,
                    a.decode_repeats if c["measure"] in ("decode", "steady") else 1, schedule,
                    a.steady_from if c["measure"] == "steady" else None) in have:
                continue
            t0 = time.time()
            load_before = os.getloadavg()[0]
            try:
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", json.dumps(c)],
                                   capture_output=True, text=True, timeout=a.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("CASE ")]
                row = json.loads(lines[-1][5:]) if lines else dict(
                    model=model_name, policy=policy, gen=gen_kw, prompt_len=n, measure=c["measure"],
                    error=(p.stderr.strip().splitlines() or ["no output"])[-1])
            except subprocess.TimeoutExpired:
                row = dict(model=model_name, policy=policy, gen=gen_kw, prompt_len=n, measure=c["measure"],
                           error=f"over {a.timeout} s")
            row["wall_s"] = time.time() - t0
            row["load_avg_1m"] = [load_before, os.getloadavg()[0]]  # idle cores: about 1 (this case) or less
            print(json.dumps(row), file=sys.stderr, flush=True)
            done.append(row)
            if a.out:  # appended as it goes: an interrupted table resumes
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                json.dump(dict(table=a.table, cases=done), open(a.out, "w"), indent=1)
    for r in done:  # the no-cache schedule's derived rows
        if r.get("measure") == "prefill" and "error" not in r:
            ref = [x for x in done if x["model"] == r["model"] and x["gen"] == r["gen"] and x.get("decode_s")
                   and not x.get("derived")]
            if ref:  # the longest measured run: its forwards, and its decode time per (forwards - 1) prefills
                x = max(ref, key=lambda x: x["prompt_len"])
                fw = x["forwards"]
                factor = x["decode_s"] / ((fw - 1) * x["prefill_s"])
                dec = factor * (fw - 1) * r["prefill_s"]
                r.update(derived=True, derived_from=x["prompt_len"], derive_factor=factor, forwards=fw,
                         decode_s=dec, decode_s_per_block=dec / max(1, math.ceil(r["out_len"] / 32)),
                         decode_tok_s=r["out_len"] / dec)
    fits = []
    series = {}  # one growth fit per series: the same case but its prompt length
    for r in done:
        if "error" not in r:
            series.setdefault(key(r)[:3] + key(r)[4:], []).append(r)
    for rows in series.values():
        rows.sort(key=lambda r: r["prompt_len"])
        if len(rows) >= 2:
            r0 = rows[0]
            lo, hi = rows[0]["prompt_len"], rows[-1]["prompt_len"]
            mid = 8192 if any(r["prompt_len"] == 8192 for r in rows) and hi > 8192 else lo
            fits.append(dict(model=r0["model"], policy=r0["policy"], gen=r0["gen"], measure=r0.get("measure", "memory"),
                             pct=r0.get("pct"), out_len=r0.get("out_len"), lo=mid, hi=hi, **{
                f"exp_{k}": slope(rows, k, mid, hi) for k in
                ("rss_gb", "xla_temp_gb", "prefill_s", "e2e_s", "decode_s_per_block", "steady_s_per_block",
                 "kv_peak_mb")}))
    if a.out:
        json.dump(dict(table=a.table, cases=done, fits=fits), open(a.out, "w"), indent=1)
    cols = ("prompt_len", "rss_gb", "xla_temp_gb", "kv_dense_gb", "prefill_s", "e2e_s", "decode_s_per_block", "steady_s_per_block",
            "decode_tok_s", "kv_peak_mb", "kv_end_mb", "forwards")
    print("| model | policy | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 2))
    for r in done:
        if "error" in r:
            print(f"| {r['model']} | {r['policy']} {r['gen'] or ''} | {r['prompt_len']} | error: {r['error']} |")
            continue
        f = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
        print(f"| {r['model']} | {r['policy']} {r['gen'] or ''} | " + " | ".join(f(r.get(c)) for c in cols) + " |")
    for x in fits:
        print(json.dumps(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
